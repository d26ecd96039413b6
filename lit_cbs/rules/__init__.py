"""Pure rules, no Lightning: batch and LR schedules, optimizer scaling, the guard, the loss smoothing."""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

_EXPORTS = {
    "CBSAdaptive": "lit_cbs.rules.batch_schedules",
    "ConstantBatch": "lit_cbs.rules.batch_schedules",
    "ExponentialRamp": "lit_cbs.rules.batch_schedules",
    "LinearRamp": "lit_cbs.rules.batch_schedules",
    "PiecewiseBatch": "lit_cbs.rules.batch_schedules",
    "Seesaw": "lit_cbs.rules.batch_schedules",
    "CosineSchedule": "lit_cbs.rules.lr_schedules",
    "OneCycle": "lit_cbs.rules.lr_schedules",
    "StepDecay": "lit_cbs.rules.lr_schedules",
    "TokenLRScheduler": "lit_cbs.rules.lr_schedules",
    "WarmupStableDecay": "lit_cbs.rules.lr_schedules",
    "WarmupCore": "lit_cbs.rules.warmup_core",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from lit_cbs.rules.batch_schedules import CBSAdaptive as CBSAdaptive
    from lit_cbs.rules.batch_schedules import ConstantBatch as ConstantBatch
    from lit_cbs.rules.batch_schedules import ExponentialRamp as ExponentialRamp
    from lit_cbs.rules.batch_schedules import LinearRamp as LinearRamp
    from lit_cbs.rules.batch_schedules import PiecewiseBatch as PiecewiseBatch
    from lit_cbs.rules.batch_schedules import Seesaw as Seesaw
    from lit_cbs.rules.lr_schedules import CosineSchedule as CosineSchedule
    from lit_cbs.rules.lr_schedules import OneCycle as OneCycle
    from lit_cbs.rules.lr_schedules import StepDecay as StepDecay
    from lit_cbs.rules.lr_schedules import TokenLRScheduler as TokenLRScheduler
    from lit_cbs.rules.lr_schedules import WarmupStableDecay as WarmupStableDecay
    from lit_cbs.rules.warmup_core import WarmupCore as WarmupCore

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
