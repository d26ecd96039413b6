"""The Lightning callbacks a user adds to ``Trainer(callbacks=[...])`` to change and count the batch.

- ``warmup``: ``BatchWarmup``, which changes the global batch, the micro-batch and the LR by a schedule.
- ``accounting``: ``BatchAccounting``, the batch's three factors and the samples/tokens trained on.
- ``checkpoint``: ``FinalStateCheckpoint``, checkpoints that resume exactly, on any signal.
- ``validation``: ``TokenValidation``, validation every so many tokens.
- ``progress``: ``RunProgressBar``, a bar counting the run's real steps or tokens.
- ``logs``: writing metrics and figures to the trainer's loggers.

The CBS probe (``lit_cbs.probe``) and the noise scale (``lit_cbs.gns``) are callbacks too, in
packages of their own because each has parts that are not.
"""

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
