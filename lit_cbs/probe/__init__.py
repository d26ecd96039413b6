"""Measure the critical batch size (CBS) online by branched training (Merrill et al. 2025, arXiv 2505.23971).

- ``reading``: the k* rule, the CBS interval and ``ProbeReading`` (one measurement); no Lightning.
- ``snapshot``: ``TrainingSnapshot``, the in-memory copy of the training state a branch starts from.
- ``branch``: trains batch k*B on the main run's recorded window and scores it.
- ``callback``: ``CBSProbeCallback``, which schedules the probes in a Trainer and reports them.
- ``plot``: ``plot_cbs_curve``, the readings against tokens.
"""

from lit_cbs.probe.branch import BranchFailed, ProbeAborted, RecordedWindow
from lit_cbs.probe.callback import CBSProbeCallback
from lit_cbs.probe.plot import plot_cbs_curve
from lit_cbs.probe.reading import (
    ProbeReading,
    cbs_interval,
    critical_multiplier,
    ema_last,
    is_admissible,
    max_branches,
    measure_losses,
)
from lit_cbs.probe.snapshot import TrainingSnapshot

__all__ = [
    "BranchFailed",
    "CBSProbeCallback",
    "ProbeAborted",
    "ProbeReading",
    "RecordedWindow",
    "TrainingSnapshot",
    "cbs_interval",
    "critical_multiplier",
    "ema_last",
    "is_admissible",
    "max_branches",
    "measure_losses",
    "plot_cbs_curve",
]
