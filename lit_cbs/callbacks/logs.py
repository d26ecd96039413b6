"""Writing lit_cbs's per-step metrics and its figures to the trainer's loggers."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import lightning.pytorch as pl

from lit_cbs._internals import logging_step, logs_this_step

__all__: list[str] = []  # internal: what other lit_cbs modules use, nothing a user calls


def log_to_loggers(
    trainer: pl.Trainer,
    metrics: Callable[[pl.Trainer], dict[str, float]],
    every_step: bool = False,
    step: int | None = None,
) -> None:
    """Write ``metrics(trainer)`` straight to the trainer's loggers, in the row of the optimizer step
    just taken, on logging steps only (``log_every_n_steps``) unless ``every_step`` (for rare events
    that must not be lost between logging steps); call it after an optimizer step. ``step``: the row of an
    earlier step instead (a side-job probe's reading, logged at the step its window ended).

    This is what LearningRateMonitor does: ``self.log`` per metric and step goes through Lightning's
    result collection, which costs more than the step of a small model can afford at every step.
    ``metrics`` is called only when something is written.
    """
    if not trainer.loggers or not (every_step or logs_this_step(trainer)):
        return
    values = metrics(trainer)
    step = logging_step(trainer) if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


def log_figures(loggers: Iterable, paths: Iterable[str | os.PathLike[str]], step: int) -> None:
    """Send each PNG in ``paths`` (named by its file name, without ``.png``) to every logger that takes
    images, at ``step``: TensorBoard as an image summary, MLflow as an artifact under ``figures/``,
    W&B as an image. The CSV logger needs nothing: the PNGs are in the run folder beside metrics.csv."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    files = [os.fspath(path) for path in paths]
    for logger in loggers:
        for path in files:
            name = os.path.splitext(os.path.basename(path))[0]
            if isinstance(logger, TensorBoardLogger):
                from matplotlib.image import imread

                logger.experiment.add_image(name, imread(path)[..., :3], global_step=step, dataformats="HWC")
            elif isinstance(logger, MLFlowLogger):
                logger.experiment.log_artifact(logger.run_id, path, artifact_path="figures")
            elif isinstance(logger, WandbLogger):
                logger.log_image(key=name, images=[path], step=step)
