"""lit_cbs: batch size warmup and critical-batch-size tools for PyTorch Lightning.

The names below load on first use (PEP 562), so ``import lit_cbs.analysis`` or
``lit_cbs.rules.batch_schedules`` does not pay for importing Lightning.

The folders say what they hold: ``callbacks`` (what a Trainer is given), ``rules`` (pure functions
of the amount trained), ``probe`` and ``gns`` (the two measurements), ``analysis`` (fits and plots
from a run's logs), ``models``, ``data``, and ``recipes`` (what only ``recipes/train.py`` needs).
"""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

__version__ = "0.2.0"

_EXPORTS = {
    "BatchAccounting": "lit_cbs.callbacks.accounting",
    "BatchChange": "lit_cbs.callbacks.batch_change",
    "BatchWarmup": "lit_cbs.callbacks.warmup",
    "CBSAdaptive": "lit_cbs.rules.batch_schedules",
    "CBSProbeCallback": "lit_cbs.probe",
    "ConstantBatch": "lit_cbs.rules.batch_schedules",
    "CosineSchedule": "lit_cbs.rules.lr_schedules",
    "ExponentialRamp": "lit_cbs.rules.batch_schedules",
    "FinalStateCheckpoint": "lit_cbs.callbacks.checkpoint",
    "GNSConfig": "lit_cbs.gns",
    "GuardConfig": "lit_cbs.rules.guard",
    "GlobalOrderLoader": "lit_cbs.data.loader",
    "GradientNoiseScale": "lit_cbs.gns",
    "LinearRamp": "lit_cbs.rules.batch_schedules",
    "LitCBSConfigError": "lit_cbs.errors",
    "LitCBSConfigWarning": "lit_cbs.errors",
    "OneCycle": "lit_cbs.rules.lr_schedules",
    "PiecewiseBatch": "lit_cbs.rules.batch_schedules",
    "ProbeConfig": "lit_cbs.probe",
    "RunProgressBar": "lit_cbs.callbacks.progress",
    "Seesaw": "lit_cbs.rules.batch_schedules",
    "StepDecay": "lit_cbs.rules.lr_schedules",
    "TokenLRScheduler": "lit_cbs.rules.lr_schedules",
    "TokenValidation": "lit_cbs.callbacks.validation",
    "WarmupStableDecay": "lit_cbs.rules.lr_schedules",
    "token_mean_loss": "lit_cbs.models.token_loss",
}

__all__ = sorted(_EXPORTS)

# What type checkers and editors see (`X as X`: exported); at run time each name loads on first use.
if TYPE_CHECKING:
    from lit_cbs.callbacks.accounting import BatchAccounting as BatchAccounting
    from lit_cbs.callbacks.batch_change import BatchChange as BatchChange
    from lit_cbs.callbacks.checkpoint import FinalStateCheckpoint as FinalStateCheckpoint
    from lit_cbs.callbacks.progress import RunProgressBar as RunProgressBar
    from lit_cbs.callbacks.validation import TokenValidation as TokenValidation
    from lit_cbs.callbacks.warmup import BatchWarmup as BatchWarmup
    from lit_cbs.data.loader import GlobalOrderLoader as GlobalOrderLoader
    from lit_cbs.errors import LitCBSConfigError as LitCBSConfigError
    from lit_cbs.errors import LitCBSConfigWarning as LitCBSConfigWarning
    from lit_cbs.gns import GNSConfig as GNSConfig
    from lit_cbs.gns import GradientNoiseScale as GradientNoiseScale
    from lit_cbs.models.token_loss import token_mean_loss as token_mean_loss
    from lit_cbs.probe import CBSProbeCallback as CBSProbeCallback
    from lit_cbs.probe import ProbeConfig as ProbeConfig
    from lit_cbs.rules.batch_schedules import CBSAdaptive as CBSAdaptive
    from lit_cbs.rules.batch_schedules import ConstantBatch as ConstantBatch
    from lit_cbs.rules.batch_schedules import ExponentialRamp as ExponentialRamp
    from lit_cbs.rules.batch_schedules import LinearRamp as LinearRamp
    from lit_cbs.rules.batch_schedules import PiecewiseBatch as PiecewiseBatch
    from lit_cbs.rules.batch_schedules import Seesaw as Seesaw
    from lit_cbs.rules.guard import GuardConfig as GuardConfig
    from lit_cbs.rules.lr_schedules import CosineSchedule as CosineSchedule
    from lit_cbs.rules.lr_schedules import OneCycle as OneCycle
    from lit_cbs.rules.lr_schedules import StepDecay as StepDecay
    from lit_cbs.rules.lr_schedules import TokenLRScheduler as TokenLRScheduler
    from lit_cbs.rules.lr_schedules import WarmupStableDecay as WarmupStableDecay

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
