"""Measure the critical batch size (CBS) online by branched training (Merrill et al. 2025, arXiv 2505.23971).

- ``config``: ``ProbeConfig``, the probe's settings, each with its unit, checked when made.
- ``reading``: the k* rule, the CBS interval, bisection, the paired standard errors and the
  determined/undetermined judgement, and ``ProbeReading`` (one measurement); no Lightning.
- ``snapshot``: ``TrainingSnapshot``, the in-memory copy of the training state a branch starts from.
- ``branch``: ``BranchTrainer`` trains batch k*B on the main run's ``RecordedWindow`` and scores it.
- ``callback``: ``CBSProbeCallback``, which places the probes in a Trainer and reports them.
- ``heldout``: ``load_heldout_batches``, the validation batches held-out scores use.
- ``limits``: ``run_end``, where the run ends in tokens, so probes and windows fit inside it.
- ``start``: ``plan_probe``, whether a due probe starts and on what (pure).
- ``from_checkpoint``: ``probe_checkpoint``, the CBS of a saved checkpoint (``CheckpointProbe``, ``RunParts``).
- ``launchers``: ``LocalLauncher``, ``SlurmLauncher`` and ``SideJobs``, where side-job probes run (pure).
- ``side_jobs``: the main run's side of side-job probes, and the job itself (``python -m lit_cbs.probe.side_jobs``).

The names below load on first use (PEP 562), so ``lit_cbs.probe.reading`` does not pay for Lightning.
"""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

_EXPORTS = {
    "BranchError": "lit_cbs.probe.branch",
    "BranchFailed": "lit_cbs.probe.branch",
    "BranchScore": "lit_cbs.probe.reading",
    "BranchTrainer": "lit_cbs.probe.branch",
    "CBSProbeCallback": "lit_cbs.probe.callback",
    "CheckpointProbe": "lit_cbs.probe.from_checkpoint",
    "LocalLauncher": "lit_cbs.probe.launchers",
    "DecisionRule": "lit_cbs.probe.reading",
    "ProbeAborted": "lit_cbs.probe.branch",
    "ProbeConfig": "lit_cbs.probe.config",
    "ProbeReading": "lit_cbs.probe.reading",
    "RecordedWindow": "lit_cbs.probe.branch",
    "RunParts": "lit_cbs.probe.from_checkpoint",
    "SideJobs": "lit_cbs.probe.launchers",
    "SlurmLauncher": "lit_cbs.probe.launchers",
    "TrainingSnapshot": "lit_cbs.probe.snapshot",
    "cbs_interval": "lit_cbs.probe.reading",
    "critical_multiplier": "lit_cbs.probe.reading",
    "decide": "lit_cbs.probe.reading",
    "difference": "lit_cbs.probe.reading",
    "ema_last": "lit_cbs.probe.reading",
    "is_admissible": "lit_cbs.probe.reading",
    "max_branches": "lit_cbs.probe.reading",
    "measure_losses": "lit_cbs.probe.reading",
    "probe_checkpoint": "lit_cbs.probe.from_checkpoint",
    "read_readings": "lit_cbs.probe.reading",
}

__all__ = sorted(_EXPORTS)

# What type checkers and editors see (`X as X`: exported); at run time each name loads on first use.
if TYPE_CHECKING:
    from lit_cbs.probe.branch import BranchError as BranchError
    from lit_cbs.probe.branch import BranchFailed as BranchFailed
    from lit_cbs.probe.branch import BranchTrainer as BranchTrainer
    from lit_cbs.probe.branch import ProbeAborted as ProbeAborted
    from lit_cbs.probe.branch import RecordedWindow as RecordedWindow
    from lit_cbs.probe.callback import CBSProbeCallback as CBSProbeCallback
    from lit_cbs.probe.config import ProbeConfig as ProbeConfig
    from lit_cbs.probe.from_checkpoint import CheckpointProbe as CheckpointProbe
    from lit_cbs.probe.from_checkpoint import RunParts as RunParts
    from lit_cbs.probe.from_checkpoint import probe_checkpoint as probe_checkpoint
    from lit_cbs.probe.launchers import LocalLauncher as LocalLauncher
    from lit_cbs.probe.launchers import SideJobs as SideJobs
    from lit_cbs.probe.launchers import SlurmLauncher as SlurmLauncher
    from lit_cbs.probe.reading import BranchScore as BranchScore
    from lit_cbs.probe.reading import DecisionRule as DecisionRule
    from lit_cbs.probe.reading import ProbeReading as ProbeReading
    from lit_cbs.probe.reading import cbs_interval as cbs_interval
    from lit_cbs.probe.reading import critical_multiplier as critical_multiplier
    from lit_cbs.probe.reading import decide as decide
    from lit_cbs.probe.reading import difference as difference
    from lit_cbs.probe.reading import ema_last as ema_last
    from lit_cbs.probe.reading import is_admissible as is_admissible
    from lit_cbs.probe.reading import max_branches as max_branches
    from lit_cbs.probe.reading import measure_losses as measure_losses
    from lit_cbs.probe.reading import read_readings as read_readings
    from lit_cbs.probe.snapshot import TrainingSnapshot as TrainingSnapshot

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
