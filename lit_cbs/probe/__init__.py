"""Measure the critical batch size online by branched training (arXiv 2505.23971); names load on first use."""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

_EXPORTS = {
    "CBSProbeCallback": "lit_cbs.probe.callback",
    "LocalLauncher": "lit_cbs.probe.side_jobs.launchers",
    "ProbeReading": "lit_cbs.probe.reading",
    "RunParts": "lit_cbs.probe.from_checkpoint",
    "SideJobs": "lit_cbs.probe.side_jobs.launchers",
    "SlurmLauncher": "lit_cbs.probe.side_jobs.launchers",
    "decide": "lit_cbs.probe.reading",
    "probe_checkpoint": "lit_cbs.probe.from_checkpoint",
    "read_readings": "lit_cbs.probe.reading",
}

__all__ = sorted(_EXPORTS)

# What type checkers and editors see (`X as X`: exported); at run time each name loads on first use.
if TYPE_CHECKING:
    from lit_cbs.probe.callback import CBSProbeCallback as CBSProbeCallback
    from lit_cbs.probe.from_checkpoint import RunParts as RunParts
    from lit_cbs.probe.from_checkpoint import probe_checkpoint as probe_checkpoint
    from lit_cbs.probe.reading import ProbeReading as ProbeReading
    from lit_cbs.probe.reading import decide as decide
    from lit_cbs.probe.reading import read_readings as read_readings
    from lit_cbs.probe.side_jobs.launchers import LocalLauncher as LocalLauncher
    from lit_cbs.probe.side_jobs.launchers import SideJobs as SideJobs
    from lit_cbs.probe.side_jobs.launchers import SlurmLauncher as SlurmLauncher

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
