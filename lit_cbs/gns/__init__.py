"""The gradient noise scale (McCandlish et al. 2018), measured online as a baseline for the CBS probe.

``estimator`` holds the math (torch only), ``groups`` which parameters are measured together (no
Lightning), ``config`` the checked settings and ``callback`` the Lightning callback with its three
measuring modes. What each mode costs and when to pick it: docs/guides/gns_cost.md.
"""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports

_EXPORTS = {
    "GNSConfig": "lit_cbs.gns.config",
    "GROUP_PRESETS": "lit_cbs.gns.groups",
    "GradientNoiseScale": "lit_cbs.gns.callback",
    "NoiseAverages": "lit_cbs.gns.estimator",
    "NoiseMeasurement": "lit_cbs.gns.estimator",
    "block_groups": "lit_cbs.gns.groups",
    "regex_groups": "lit_cbs.gns.groups",
    "two_batch_estimates": "lit_cbs.gns.estimator",
}

__all__ = sorted(_EXPORTS)

# What type checkers and editors see (`X as X`: exported); at run time each name loads on first use.
if TYPE_CHECKING:
    from lit_cbs.gns.callback import GradientNoiseScale as GradientNoiseScale
    from lit_cbs.gns.config import GNSConfig as GNSConfig
    from lit_cbs.gns.estimator import NoiseAverages as NoiseAverages
    from lit_cbs.gns.estimator import NoiseMeasurement as NoiseMeasurement
    from lit_cbs.gns.estimator import two_batch_estimates as two_batch_estimates
    from lit_cbs.gns.groups import GROUP_PRESETS as GROUP_PRESETS
    from lit_cbs.gns.groups import block_groups as block_groups
    from lit_cbs.gns.groups import regex_groups as regex_groups

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
