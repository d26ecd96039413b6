"""The embedded corpora a run prepares when given no data: the standard library's Python files, the King James Bible."""

import pytest

from lit_cbs.data import TokenDataModule, resolve_data
from lit_cbs.data.prepare import SKIPPED_DIRS, kjv_source, read_metadata, stdlib_python_files, stdlib_root
from lit_cbs.errors import LitCBSConfigError


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


def test_the_king_james_bible_is_a_second_corpus_a_document_per_book(tmp_path):
    data_dir = resolve_data(cache_dir=tmp_path, corpus="kjv")
    metadata = read_metadata(data_dir)
    (books,) = tmp_path.glob("kjv-text-*")
    files = sorted(books.iterdir())
    assert data_dir.name.startswith("kjv-") and metadata["num_documents"] == len(files) == 66
    assert files[0].name == "01 Genesis.txt" and files[-1].name == "66 Revelation.txt"
    assert files[0].read_text().startswith("1:1 In the beginning God created the heaven and the earth.\n")
    assert metadata["train_tokens"] + metadata["val_tokens"] == sum(f.stat().st_size for f in files) + 66
    verses = kjv_source().read_text().count("\n")
    assert sum(f.read_text().count("\n") for f in files) == verses == 31103
    assert resolve_data(cache_dir=tmp_path, corpus="kjv") == data_dir


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"corpus": "wiki"}, r"data.corpus='wiki' is not supported; use one of \('stdlib', 'kjv'\)"),
        (
            {"corpus": "kjv", "input_dir": "texts"},
            "data.corpus='kjv' is read when data.path and data.input_dir are unset",
        ),
    ],
)
def test_an_unknown_corpus_or_one_beside_your_own_data_is_refused_before_any_work(settings, message):
    with pytest.raises(LitCBSConfigError, match=message):
        TokenDataModule(**settings)
