"""Writing lit_cbs's per-step metrics to the trainer's loggers."""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl

from lit_cbs._internals import logging_step, logs_this_step


def log_to_loggers(trainer: pl.Trainer, metrics: Callable[[pl.Trainer], dict[str, float]], every_step: bool = False) -> None:
    """Write ``metrics(trainer)`` straight to the trainer's loggers, in the row of the optimizer step
    just taken, on logging steps only (``log_every_n_steps``) unless ``every_step`` (for rare events
    that must not be lost between logging steps); call it after an optimizer step.

    This is what LearningRateMonitor does: ``self.log`` per metric and step goes through Lightning's
    result collection, which costs more than the step of a small model can afford at every step.
    ``metrics`` is called only when something is written.
    """
    if not trainer.loggers or not (every_step or logs_this_step(trainer)):
        return
    values = metrics(trainer)
    step = logging_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)
