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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
