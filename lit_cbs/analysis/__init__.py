"""E(S) fits, schedules, a CBS forecast and a CBS law from probe readings, and their plots (only ``plots`` imports
matplotlib)."""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

_EXPORTS = {
    "CBSLaw": "lit_cbs.analysis.law",
    "brackets_from_records": "lit_cbs.analysis.forecast",
    "fit_law": "lit_cbs.analysis.law",
    "law_points": "lit_cbs.analysis.law",
    "forecast_cbs": "lit_cbs.analysis.forecast",
    "plot_forecast": "lit_cbs.analysis.plots",
    "read_readings": "lit_cbs.probe.reading",
    "schedule_from_law": "lit_cbs.analysis.law",
    "schedule_from_probe": "lit_cbs.analysis.probe_schedule",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from lit_cbs.analysis.forecast import brackets_from_records as brackets_from_records
    from lit_cbs.analysis.forecast import forecast_cbs as forecast_cbs
    from lit_cbs.analysis.law import CBSLaw as CBSLaw
    from lit_cbs.analysis.law import fit_law as fit_law
    from lit_cbs.analysis.law import law_points as law_points
    from lit_cbs.analysis.law import schedule_from_law as schedule_from_law
    from lit_cbs.analysis.plots import plot_forecast as plot_forecast
    from lit_cbs.analysis.probe_schedule import schedule_from_probe as schedule_from_probe
    from lit_cbs.probe.reading import read_readings as read_readings

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
