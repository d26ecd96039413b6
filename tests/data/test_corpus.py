"""The standard library's Python files, the corpus a run prepares when given no data."""

import pytest

from lit_cbs.data import resolve_data
from lit_cbs.data.prepare import SKIPPED_DIRS, read_metadata, stdlib_python_files, stdlib_root


def test_default_corpus_is_the_stdlib_prepared_once(tmp_path):
    files = stdlib_python_files()
    data_dir = resolve_data(cache_dir=tmp_path)
    metadata = read_metadata(data_dir)
    assert metadata["num_documents"] == len(files)
    assert metadata["train_tokens"] + metadata["val_tokens"] == sum(f.stat().st_size for f in files) + len(files)
    assert metadata["val_tokens"] == pytest.approx(0.01 * metadata["source_bytes"], rel=0.01)
    assert resolve_data(cache_dir=tmp_path) == data_dir
    assert data_dir.name.startswith("stdlib-")


def test_stdlib_corpus_file_list():
    files = stdlib_python_files()
    assert len(files) > 100
    assert files == sorted(files)
    assert all(f.suffix == ".py" for f in files)
    relative_dirs = {part for f in files for part in f.relative_to(stdlib_root()).parts[:-1]}
    assert not relative_dirs & SKIPPED_DIRS
    assert stdlib_root() / "json" / "decoder.py" in files
