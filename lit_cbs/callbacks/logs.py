"""Writing lit_cbs's per-step metrics and its figures to the trainer's loggers."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl

from lit_cbs._internals import logging_step


def log_to_loggers(
    trainer: pl.Trainer,
    metrics: Callable[[pl.Trainer], dict[str, float]],
    every_step: bool = False,
    step: int | None = None,
) -> None:
    """Write ``metrics(trainer)`` straight to the loggers in the row of the optimizer step just taken (``step``:
    an earlier row), on logging steps only unless ``every_step``, as LearningRateMonitor does: ``self.log`` costs
    more than a small model's step. ``metrics`` is called only when something is written."""
    if not trainer.loggers or not (every_step or trainer._logger_connector.should_update_logs):
        return
    values = metrics(trainer)
    step = logging_step(trainer) if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


def log_figures(loggers: Iterable[Any], paths: Iterable[str | os.PathLike[str]], step: int) -> None:
    """Send each PNG in ``paths`` to every logger that takes images (TensorBoard, MLflow, W&B), at ``step``."""
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
