"""E(S) analysis of constant-batch sweeps: loss curves from metrics CSVs, McCandlish et al. 2018 and
Zhou et al. 2026 fits, a B_opt-following batch schedule, the fits side by side with the noise scale
and the probe's CBS, a warmup schedule from a measured CBS curve, a CBS forecast fitted to probe
brackets, and plots. Pure numpy/scipy/matplotlib:
no Lightning."""

from lit_cbs.analysis.compare import SideBySide, side_by_side, side_by_side_markdown
from lit_cbs.analysis.curves import (
    Crossing,
    ProbePoint,
    RunCurve,
    default_targets,
    ema,
    find_crossings,
    read_probe,
    read_run,
    read_sweep,
    rolling_mean,
    smooth,
)
from lit_cbs.analysis.fits import (
    McCandlishFit,
    TargetFit,
    WSDFit,
    batch_group_yaml,
    fit_mccandlish,
    fit_targets,
    fit_wsd,
    propose_schedule,
    schedule_yaml,
    write_schedule_yaml,
)
from lit_cbs.analysis.forecast import Bracket, CBSForecast, brackets_from_records, forecast_cbs, supported_interval
from lit_cbs.analysis.plots import plot_batch_sizes, plot_es, plot_forecast
from lit_cbs.analysis.probe_schedule import read_probe_records, schedule_from_probe

__all__ = [
    "batch_group_yaml",
    "Bracket",
    "brackets_from_records",
    "CBSForecast",
    "forecast_cbs",
    "plot_forecast",
    "supported_interval",
    "Crossing",
    "McCandlishFit",
    "ProbePoint",
    "RunCurve",
    "SideBySide",
    "TargetFit",
    "WSDFit",
    "default_targets",
    "ema",
    "find_crossings",
    "fit_mccandlish",
    "fit_targets",
    "fit_wsd",
    "plot_batch_sizes",
    "plot_es",
    "propose_schedule",
    "read_probe",
    "read_probe_records",
    "read_run",
    "read_sweep",
    "rolling_mean",
    "schedule_from_probe",
    "schedule_yaml",
    "side_by_side",
    "side_by_side_markdown",
    "smooth",
    "write_schedule_yaml",
]
