"""E(S) fits of constant-batch sweeps, schedules and a CBS forecast from probe readings, and their plots. Every
name loads on first use; only ``plots`` imports matplotlib."""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

_MODULES = {
    "lit_cbs.analysis.compare": ["side_by_side", "side_by_side_markdown"],
    "lit_cbs.analysis.curves": ["default_targets", "find_crossings", "read_sweep"],
    "lit_cbs.analysis.fits": ["batch_group_yaml", "fit_targets", "propose_schedule", "write_schedule_yaml"],
    "lit_cbs.analysis.forecast": ["brackets_from_records", "forecast_cbs"],
    "lit_cbs.analysis.plots": ["plot_batch_sizes", "plot_cbs_curve", "plot_es", "plot_forecast"],
    "lit_cbs.analysis.probe_schedule": ["run_config_value", "schedule_from_probe"],
    "lit_cbs.probe.reading": ["read_readings"],
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from lit_cbs.analysis.compare import side_by_side as side_by_side
    from lit_cbs.analysis.compare import side_by_side_markdown as side_by_side_markdown
    from lit_cbs.analysis.curves import default_targets as default_targets
    from lit_cbs.analysis.curves import find_crossings as find_crossings
    from lit_cbs.analysis.curves import read_sweep as read_sweep
    from lit_cbs.analysis.fits import batch_group_yaml as batch_group_yaml
    from lit_cbs.analysis.fits import fit_targets as fit_targets
    from lit_cbs.analysis.fits import propose_schedule as propose_schedule
    from lit_cbs.analysis.fits import write_schedule_yaml as write_schedule_yaml
    from lit_cbs.analysis.forecast import brackets_from_records as brackets_from_records
    from lit_cbs.analysis.forecast import forecast_cbs as forecast_cbs
    from lit_cbs.analysis.plots import plot_batch_sizes as plot_batch_sizes
    from lit_cbs.analysis.plots import plot_cbs_curve as plot_cbs_curve
    from lit_cbs.analysis.plots import plot_es as plot_es
    from lit_cbs.analysis.plots import plot_forecast as plot_forecast
    from lit_cbs.analysis.probe_schedule import run_config_value as run_config_value
    from lit_cbs.analysis.probe_schedule import schedule_from_probe as schedule_from_probe
    from lit_cbs.probe.reading import read_readings as read_readings

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
