"""Token data: tokenizers, the embedded stdlib corpus, litdata preparation, the datamodule, the
train loader whose micro-batches are cut from one global sample order (``GlobalOrderLoader``), and
random tokens for speed and memory runs (``RandomTokenData``). The names load on first use."""

from lit_cbs._lazy import lazy_exports

_EXPORTS = {
    "ByteTokenizer": "lit_cbs.data.tokenizers",
    "GlobalOrderLoader": "lit_cbs.data.loader",
    "HFTokenizer": "lit_cbs.data.tokenizers",
    "RandomTokenData": "lit_cbs.data.synthetic",
    "TokenDataModule": "lit_cbs.data.datamodule",
    "load_tokenizer": "lit_cbs.data.tokenizers",
    "prepare": "lit_cbs.data.prepare",
    "resolve_data": "lit_cbs.data.prepare",
    "stdlib_python_files": "lit_cbs.data.corpus",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
