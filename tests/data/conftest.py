"""Fixtures the data tests share: three small documents, prepared once per session with the byte
tokenizer, and a reader of a prepared split's token stream."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

# lit_cbs.data and litdata are imported inside the fixtures: a conftest loads before pytest's log capture
# is set up, and Lightning, imported then (litdata imports it), stops propagating its log records to the
# root logger, where caplog reads them (tests/callbacks/test_checkpoint*.py assert on them).

DOCUMENTS = {
    "a.txt": "def add(a, b):\n    return a + b\n" * 40,
    "b.txt": "Grüße aus Köln — naïve café ☕ " * 60,  # multi-byte UTF-8 characters
    "sub/c.md": "# heading\n\nsome text that is long enough to fill a few blocks.\n" * 30,
}


@pytest.fixture(scope="session")
def documents() -> dict[str, str]:
    """Three documents by relative path, one in a subfolder."""
    return DOCUMENTS


@pytest.fixture(scope="session")
def documents_dir(tmp_path_factory, documents) -> Path:
    """The documents written out as UTF-8 (5,510 bytes), beside a hidden file that preparing skips."""
    root = tmp_path_factory.mktemp("documents")
    for name, text in documents.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / ".hidden").write_text("never read")
    return root


@pytest.fixture(scope="session")
def documents_cache(tmp_path_factory) -> Path:
    """The cache folder ``prepared_documents`` and the datamodules built on the documents use."""
    return tmp_path_factory.mktemp("documents_cache")


@pytest.fixture(scope="session")
def prepared_documents(documents_dir, documents_cache) -> Path:
    """The documents tokenized byte by byte, the last 20% of the bytes the val split."""
    from lit_cbs.data import resolve_data

    return resolve_data(input_dir=documents_dir, cache_dir=documents_cache, val_fraction=0.2)


@pytest.fixture(scope="session")
def documents_stream(documents_dir) -> bytes:
    """The token stream the byte tokenizer should produce: each file's bytes then NUL, in sorted path order."""
    from lit_cbs.data.prepare import text_files

    return b"".join(path.read_bytes() + b"\0" for path in text_files(documents_dir))


def _read_tokens(split_dir: Path) -> bytes:
    from litdata import StreamingDataset, TokensLoader

    dataset = StreamingDataset(str(split_dir), item_loader=TokensLoader(block_size=1), shuffle=False)
    return bytes(int(token[0]) for token in dataset)


@pytest.fixture(scope="session")
def read_tokens() -> Callable[[Path], bytes]:
    """``read_tokens(split_dir)``: the token ids of a prepared byte-tokenizer split, in order, as bytes."""
    return _read_tokens
