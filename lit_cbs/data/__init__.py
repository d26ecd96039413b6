"""Token data: litdata preparation, the datamodule, the global-order train loader, random tokens, the tokenizers.
``prepare`` is imported eagerly, so that ``lit_cbs.data.prepare`` is the function, not the module."""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports
from lit_cbs.data.prepare import prepare as prepare
from lit_cbs.data.prepare import resolve_data as resolve_data

_EXPORTS = {
    "ByteTokenizer": "lit_cbs.data.tokenizers",
    "GlobalOrderLoader": "lit_cbs.data.loader",
    "RandomTokenData": "lit_cbs.data.synthetic",
    "TokenDataModule": "lit_cbs.data.datamodule",
    "load_tokenizer": "lit_cbs.data.tokenizers",
}

__all__ = sorted([*_EXPORTS, "prepare", "resolve_data"])

if TYPE_CHECKING:
    from lit_cbs.data.datamodule import TokenDataModule as TokenDataModule
    from lit_cbs.data.loader import GlobalOrderLoader as GlobalOrderLoader
    from lit_cbs.data.synthetic import RandomTokenData as RandomTokenData
    from lit_cbs.data.tokenizers import ByteTokenizer as ByteTokenizer
    from lit_cbs.data.tokenizers import load_tokenizer as load_tokenizer

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
