"""The gradient noise scale (McCandlish et al. 2018), measured online as a baseline for the CBS probe."""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

_EXPORTS = {"GradientNoiseScale": "lit_cbs.gns.callback"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from lit_cbs.gns.callback import GradientNoiseScale as GradientNoiseScale

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
