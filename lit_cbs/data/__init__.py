"""Token data: tokenizers, the embedded stdlib corpus, litdata preparation and the datamodule."""

from lit_cbs.data.corpus import stdlib_python_files
from lit_cbs.data.datamodule import TokenDataModule
from lit_cbs.data.prepare import prepare, resolve_data
from lit_cbs.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "TokenDataModule",
    "load_tokenizer",
    "prepare",
    "resolve_data",
    "stdlib_python_files",
]
