"""E(S) analysis of constant-batch sweeps: loss curves from metrics CSVs, McCandlish et al. 2018 and
Zhou et al. 2026 fits, a B_opt-following batch schedule, the fits side by side with the noise scale
and the probe's CBS, a warmup schedule from a measured CBS curve, a CBS forecast fitted to probe
brackets, and plots. They all read the probe's readings as ``ProbeReading`` objects, from a
``cbs_probe.jsonl`` through ``read_readings`` (both from ``lit_cbs.probe.reading``, also exported here).

The fits and readers (``curves``, ``fits``, ``forecast``, ``compare``, ``probe_schedule``) import only
numpy and scipy (``run_config_value`` reads a run's saved YAML with omegaconf when called); ``plots``
imports matplotlib. Every name below loads on first use, so the fits never pay for (or need) a plotting
stack.
"""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

_MODULES = {
    "lit_cbs.analysis.compare": ["SideBySide", "side_by_side", "side_by_side_markdown"],
    "lit_cbs.analysis.curves": [
        "Crossing", "RunCurve", "default_targets", "ema", "find_crossings", "read_run", "read_sweep",
        "rolling_mean", "smooth",
    ],
    "lit_cbs.analysis.fits": [
        "McCandlishFit", "TargetFit", "WSDFit", "batch_group_yaml", "fit_mccandlish", "fit_targets",
        "fit_wsd", "propose_schedule", "schedule_yaml", "write_schedule_yaml",
    ],
    "lit_cbs.analysis.forecast": [
        "Bracket", "CBSForecast", "brackets_from_records", "forecast_cbs", "supported_interval",
    ],
    "lit_cbs.analysis.plots": ["plot_batch_sizes", "plot_es", "plot_forecast"],
    "lit_cbs.analysis.probe_schedule": ["run_config_value", "schedule_from_probe"],
    "lit_cbs.probe.reading": ["ProbeReading", "read_readings"],
}  # fmt: skip
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)

# What type checkers and editors see (`X as X`: exported); at run time each name loads on first use.
if TYPE_CHECKING:
    from lit_cbs.analysis.compare import SideBySide as SideBySide
    from lit_cbs.analysis.compare import side_by_side as side_by_side
    from lit_cbs.analysis.compare import side_by_side_markdown as side_by_side_markdown
    from lit_cbs.analysis.curves import Crossing as Crossing
    from lit_cbs.analysis.curves import RunCurve as RunCurve
    from lit_cbs.analysis.curves import default_targets as default_targets
    from lit_cbs.analysis.curves import ema as ema
    from lit_cbs.analysis.curves import find_crossings as find_crossings
    from lit_cbs.analysis.curves import read_run as read_run
    from lit_cbs.analysis.curves import read_sweep as read_sweep
    from lit_cbs.analysis.curves import rolling_mean as rolling_mean
    from lit_cbs.analysis.curves import smooth as smooth
    from lit_cbs.analysis.fits import McCandlishFit as McCandlishFit
    from lit_cbs.analysis.fits import TargetFit as TargetFit
    from lit_cbs.analysis.fits import WSDFit as WSDFit
    from lit_cbs.analysis.fits import batch_group_yaml as batch_group_yaml
    from lit_cbs.analysis.fits import fit_mccandlish as fit_mccandlish
    from lit_cbs.analysis.fits import fit_targets as fit_targets
    from lit_cbs.analysis.fits import fit_wsd as fit_wsd
    from lit_cbs.analysis.fits import propose_schedule as propose_schedule
    from lit_cbs.analysis.fits import schedule_yaml as schedule_yaml
    from lit_cbs.analysis.fits import write_schedule_yaml as write_schedule_yaml
    from lit_cbs.analysis.forecast import Bracket as Bracket
    from lit_cbs.analysis.forecast import CBSForecast as CBSForecast
    from lit_cbs.analysis.forecast import brackets_from_records as brackets_from_records
    from lit_cbs.analysis.forecast import forecast_cbs as forecast_cbs
    from lit_cbs.analysis.forecast import supported_interval as supported_interval
    from lit_cbs.analysis.plots import plot_batch_sizes as plot_batch_sizes
    from lit_cbs.analysis.plots import plot_es as plot_es
    from lit_cbs.analysis.plots import plot_forecast as plot_forecast
    from lit_cbs.analysis.probe_schedule import run_config_value as run_config_value
    from lit_cbs.analysis.probe_schedule import schedule_from_probe as schedule_from_probe
    from lit_cbs.probe.reading import ProbeReading as ProbeReading
    from lit_cbs.probe.reading import read_readings as read_readings

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
