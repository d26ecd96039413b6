"""Token data: tokenizers, the embedded stdlib corpus, litdata preparation, the datamodule, and the
train loader whose micro-batches are cut from one global sample order (``GlobalOrderLoader``)."""

from lit_cbs.data.corpus import stdlib_python_files
from lit_cbs.data.datamodule import TokenDataModule
from lit_cbs.data.prepare import prepare, resolve_data
from lit_cbs.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer
from lit_cbs.loader import GlobalOrderLoader

__all__ = [
    "ByteTokenizer",
    "GlobalOrderLoader",
    "HFTokenizer",
    "TokenDataModule",
    "load_tokenizer",
    "prepare",
    "resolve_data",
    "stdlib_python_files",
]
