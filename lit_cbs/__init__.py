"""lit_cbs: batch size warmup and critical-batch-size tools for PyTorch Lightning.

The names below load on first use (PEP 562), so ``import lit_cbs.analysis`` or
``lit_cbs.schedules`` does not pay for importing Lightning.
"""

from lit_cbs._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "BatchAccounting": "lit_cbs.accounting",
    "BatchChange": "lit_cbs.warmup",
    "BatchWarmup": "lit_cbs.warmup",
    "CBSAdaptive": "lit_cbs.schedules",
    "CBSProbeCallback": "lit_cbs.probe",
    "ConstantBatch": "lit_cbs.schedules",
    "CosineSchedule": "lit_cbs.lr_schedules",
    "ExponentialRamp": "lit_cbs.schedules",
    "FinalStateCheckpoint": "lit_cbs.checkpoint",
    "GlobalOrderLoader": "lit_cbs.loader",
    "GradientNoiseScale": "lit_cbs.gns",
    "LinearRamp": "lit_cbs.schedules",
    "LitCBSConfigError": "lit_cbs.errors",
    "OneCycle": "lit_cbs.lr_schedules",
    "PiecewiseBatch": "lit_cbs.schedules",
    "RunProgressBar": "lit_cbs.progress",
    "Seesaw": "lit_cbs.schedules",
    "StepDecay": "lit_cbs.lr_schedules",
    "TokenLRScheduler": "lit_cbs.lr_schedules",
    "TokenValidation": "lit_cbs.validation",
    "WarmupStableDecay": "lit_cbs.lr_schedules",
    "token_mean_loss": "lit_cbs.token_loss",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
