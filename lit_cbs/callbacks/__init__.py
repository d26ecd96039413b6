"""The Lightning callbacks that change and count the batch (the CBS probe and the noise scale have packages)."""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

_EXPORTS = {
    "BatchAccounting": "lit_cbs.callbacks.accounting",
    "BatchChange": "lit_cbs.rules.warmup_core",
    "BatchWarmup": "lit_cbs.callbacks.warmup",
    "FinalStateCheckpoint": "lit_cbs.callbacks.checkpoint",
    "RunProgressBar": "lit_cbs.callbacks.progress",
    "TokenValidation": "lit_cbs.callbacks.validation",
}

__all__ = sorted(_EXPORTS)

# What type checkers and editors see (`X as X`: exported); at run time each name loads on first use.
if TYPE_CHECKING:
    from lit_cbs.callbacks.accounting import BatchAccounting as BatchAccounting
    from lit_cbs.callbacks.checkpoint import FinalStateCheckpoint as FinalStateCheckpoint
    from lit_cbs.callbacks.progress import RunProgressBar as RunProgressBar
    from lit_cbs.callbacks.validation import TokenValidation as TokenValidation
    from lit_cbs.callbacks.warmup import BatchWarmup as BatchWarmup
    from lit_cbs.rules.warmup_core import BatchChange as BatchChange

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
