"""lit_cbs: batch size warmup and critical-batch-size tools for PyTorch Lightning."""

from lit_cbs.probe import CBSProbeCallback
from lit_cbs.lr_schedules import CosineSchedule, TokenLRScheduler, WarmupStableDecay
from lit_cbs.schedules import CBSAdaptive, ConstantBatch, ExponentialRamp, LinearRamp, PiecewiseBatch
from lit_cbs.warmup import BatchChange, BatchWarmup

__version__ = "0.1.0"

__all__ = [
    "BatchChange",
    "BatchWarmup",
    "CBSAdaptive",
    "CBSProbeCallback",
    "ConstantBatch",
    "CosineSchedule",
    "ExponentialRamp",
    "LinearRamp",
    "PiecewiseBatch",
    "TokenLRScheduler",
    "WarmupStableDecay",
]
