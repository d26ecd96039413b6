"""Token data: litdata preparation, the datamodule, the global-order train loader, random tokens."""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports
from lit_cbs.data.prepare import prepare as prepare  # eager: lit_cbs.data.prepare is the function, not the module
from lit_cbs.data.prepare import resolve_data as resolve_data

_EXPORTS = {
    "GlobalOrderLoader": "lit_cbs.data.loader",
    "RandomTokenData": "lit_cbs.data.synthetic",
    "TokenDataModule": "lit_cbs.data.datamodule",
}

__all__ = sorted([*_EXPORTS, "prepare", "resolve_data"])

if TYPE_CHECKING:
    from lit_cbs.data.datamodule import TokenDataModule as TokenDataModule
    from lit_cbs.data.loader import GlobalOrderLoader as GlobalOrderLoader
    from lit_cbs.data.synthetic import RandomTokenData as RandomTokenData

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
