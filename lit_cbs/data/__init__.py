"""Token data: tokenizers, the embedded stdlib corpus, litdata preparation, the datamodule, the
train loader whose micro-batches are cut from one global sample order (``GlobalOrderLoader``), and
random tokens for speed and memory runs (``RandomTokenData``). The names load on first use, but for
``prepare`` and ``resolve_data``: imported here, the function ``prepare`` is what ``lit_cbs.data.prepare``
names from the start, not the module of the same name once something imports it."""

from lit_cbs._lazy import lazy_exports
from lit_cbs.data.prepare import prepare as prepare
from lit_cbs.data.prepare import resolve_data as resolve_data

_EXPORTS = {
    "ByteTokenizer": "lit_cbs.data.tokenizers",
    "GlobalOrderLoader": "lit_cbs.data.loader",
    "HFTokenizer": "lit_cbs.data.tokenizers",
    "RandomTokenData": "lit_cbs.data.synthetic",
    "TokenDataModule": "lit_cbs.data.datamodule",
    "load_tokenizer": "lit_cbs.data.tokenizers",
    "stdlib_python_files": "lit_cbs.data.corpus",
}

__all__ = sorted([*_EXPORTS, "prepare", "resolve_data"])

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
