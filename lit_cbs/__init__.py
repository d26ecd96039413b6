"""lit_cbs: batch size warmup and critical-batch-size tools for PyTorch Lightning.

What a training script names is here; each subpackage exports what its guide uses. Names load on first use, so
``import lit_cbs.rules`` does not import Lightning.
"""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

__version__ = "0.2.0"

_EXPORTS = {
    "BatchWarmup": "lit_cbs.callbacks.warmup",
    "CBSAdaptive": "lit_cbs.rules.batch_schedules",
    "CBSProbeCallback": "lit_cbs.probe",
    "ConstantBatch": "lit_cbs.rules.batch_schedules",
    "ExponentialRamp": "lit_cbs.rules.batch_schedules",
    "FinalStateCheckpoint": "lit_cbs.callbacks.checkpoint",
    "GlobalOrderLoader": "lit_cbs.data.loader",
    "GradientNoiseScale": "lit_cbs.gns",
    "LinearRamp": "lit_cbs.rules.batch_schedules",
    "LitCBSConfigError": "lit_cbs.errors",
    "PiecewiseBatch": "lit_cbs.rules.batch_schedules",
    "TokenLRScheduler": "lit_cbs.rules.lr_schedules",
    "TokenValidation": "lit_cbs.callbacks.validation",
    "WarmupStableDecay": "lit_cbs.rules.lr_schedules",
    "token_mean_loss": "lit_cbs.models.token_loss",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from lit_cbs.callbacks.checkpoint import FinalStateCheckpoint as FinalStateCheckpoint
    from lit_cbs.callbacks.validation import TokenValidation as TokenValidation
    from lit_cbs.callbacks.warmup import BatchWarmup as BatchWarmup
    from lit_cbs.data.loader import GlobalOrderLoader as GlobalOrderLoader
    from lit_cbs.errors import LitCBSConfigError as LitCBSConfigError
    from lit_cbs.gns import GradientNoiseScale as GradientNoiseScale
    from lit_cbs.models.token_loss import token_mean_loss as token_mean_loss
    from lit_cbs.probe import CBSProbeCallback as CBSProbeCallback
    from lit_cbs.rules.batch_schedules import CBSAdaptive as CBSAdaptive
    from lit_cbs.rules.batch_schedules import ConstantBatch as ConstantBatch
    from lit_cbs.rules.batch_schedules import ExponentialRamp as ExponentialRamp
    from lit_cbs.rules.batch_schedules import LinearRamp as LinearRamp
    from lit_cbs.rules.batch_schedules import PiecewiseBatch as PiecewiseBatch
    from lit_cbs.rules.lr_schedules import TokenLRScheduler as TokenLRScheduler
    from lit_cbs.rules.lr_schedules import WarmupStableDecay as WarmupStableDecay

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
