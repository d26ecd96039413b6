"""lit_cbs.data.prepare: text files tokenized into litdata chunks, split into train and val, cached,
and bad inputs named."""

import json
import math
import random

import numpy as np
import pytest
import torch
from lightning.pytorch import seed_everything

from lit_cbs.data import resolve_data
from lit_cbs.data.prepare import ByteTokenizer, prepare, read_metadata, split_pieces, text_files


def test_the_package_export_prepare_is_the_function_after_its_module_loaded():
    # The package imports the function eagerly, so the submodule of the same name never replaces it.
    import lit_cbs.data
    import lit_cbs.data.prepare  # noqa: F401  what importing TokenDataModule or resolve_data does

    assert lit_cbs.data.prepare is prepare


def test_text_files_are_sorted_and_skip_hidden(documents_dir):
    assert [p.relative_to(documents_dir).as_posix() for p in text_files(documents_dir)] == [
        "a.txt",
        "b.txt",
        "sub/c.md",
    ]


def test_token_counts_match_byte_counts(prepared_documents, documents):
    metadata = read_metadata(prepared_documents)
    source_bytes = sum(len(text.encode("utf-8")) for text in documents.values())
    assert metadata["source_bytes"] == source_bytes
    assert metadata["num_documents"] == 3
    # one token per byte plus one separator per document
    assert metadata["train_tokens"] + metadata["val_tokens"] == source_bytes + 3
    assert metadata["val_tokens"] == pytest.approx(0.2 * source_bytes, abs=4)
    assert (metadata["tokenizer"], metadata["vocab_size"], metadata["eos_id"]) == ("bytes", 256, 0)


def test_train_and_val_are_disjoint_and_cover_the_stream_in_order(prepared_documents, documents_stream, read_tokens):
    train, val = read_tokens(prepared_documents / "train"), read_tokens(prepared_documents / "val")
    assert train + val == documents_stream
    val.decode("utf-8")  # the cut fell on a character boundary


def test_split_cut_moves_back_to_a_character_start(tmp_path):
    path = tmp_path / "one.txt"
    path.write_bytes("abcé".encode())  # 61 62 63 c3 a9: the last byte continues 'é'
    train, val = split_pieces([path], val_fraction=0.2)
    assert train == [(str(path), 0, 3, False)]
    assert val == [(str(path), 3, 5, True)]


def test_cache_is_reused_and_a_changed_source_is_prepared_afresh(tmp_path, read_tokens):
    source = tmp_path / "source"
    source.mkdir()
    (source / "doc.txt").write_text("first version of the text\n" * 20)
    cache = tmp_path / "cache"
    first = resolve_data(input_dir=source, cache_dir=cache, val_fraction=0.1)
    stamp = (first / "lit_cbs.json").stat().st_mtime_ns
    assert resolve_data(input_dir=source, cache_dir=cache, val_fraction=0.1) == first
    assert (first / "lit_cbs.json").stat().st_mtime_ns == stamp
    (source / "doc.txt").write_text("second, longer version of the text\n" * 20)
    second = resolve_data(input_dir=source, cache_dir=cache, val_fraction=0.1)
    assert second != first
    assert read_tokens(second / "train").startswith(b"second")
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_prepare_writes_several_chunks_in_stream_order(tmp_path, documents_dir, documents_stream, read_tokens):
    metadata = prepare(text_files(documents_dir), tmp_path / "out", ByteTokenizer(), val_fraction=0.2, chunk_tokens=500)
    index = json.loads((tmp_path / "out" / "train" / "index.json").read_text())
    assert len(index["chunks"]) > 3
    assert max(chunk["dim"] for chunk in index["chunks"]) <= 500
    assert sum(chunk["dim"] for chunk in index["chunks"]) == metadata["train_tokens"]
    assert read_tokens(tmp_path / "out" / "train") + read_tokens(tmp_path / "out" / "val") == documents_stream


def test_preparing_leaves_the_global_random_generators_alone(tmp_path, documents_dir):
    # A run seeds, then prepares its data, then initialises its model: the first draws after
    # preparing must be those the seed gives, as in a run that finds its data prepared.
    def draws() -> tuple:
        return torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)]

    seed_everything(1234)
    expected = draws()
    seed_everything(1234)
    prepare(text_files(documents_dir), tmp_path / "out", ByteTokenizer(), val_fraction=0.2)
    assert draws() == expected


def test_prepare_reports_a_tokenizer_failure(tmp_path, documents_dir):
    class FailingTokenizer(ByteTokenizer):
        def encode(self, text):
            raise UnicodeError("cannot tokenize this")

    with pytest.raises(RuntimeError, match="cannot tokenize this"):
        prepare(text_files(documents_dir), tmp_path / "out", FailingTokenizer(), val_fraction=0.2)


def test_the_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "doc.txt").write_text("some text\n" * 20)
    monkeypatch.setenv("LIT_CBS_CACHE", str(tmp_path / "cache"))
    assert resolve_data(input_dir=source, val_fraction=0.1).parent == tmp_path / "cache"
    monkeypatch.delenv("LIT_CBS_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_data(input_dir=source, val_fraction=0.1).parent == tmp_path / "home" / ".cache" / "lit_cbs"


def test_token_dtype_widens_with_the_vocabulary():
    from lit_cbs.data.prepare import token_dtype

    assert [token_dtype(v) for v in (256, 257, 50304, 100_000)] == [np.uint8, np.uint16, np.uint16, np.int32]
    assert math.log2(np.iinfo(np.uint16).max + 1) == 16


# ------------------------------------------------------------------ bad inputs


def test_missing_path_names_data_path(tmp_path):
    with pytest.raises(ValueError, match=r"data\.path=.*is not a folder"):
        resolve_data(path=tmp_path / "nowhere")


def test_folder_without_index_names_data_path(tmp_path):
    (tmp_path / "train").mkdir()
    with pytest.raises(ValueError, match=r"data\.path=.*has no litdata index train/index\.json, val/index\.json"):
        resolve_data(path=tmp_path)


def test_empty_input_dir_names_data_input_dir(tmp_path):
    with pytest.raises(ValueError, match=r"data\.input_dir=.*holds no files"):
        resolve_data(input_dir=tmp_path, cache_dir=tmp_path / "cache")


def test_path_and_input_dir_together_rejected(tmp_path, prepared_documents):
    with pytest.raises(ValueError, match="set only one"):
        resolve_data(path=prepared_documents, input_dir=tmp_path)


def test_bad_val_fraction_rejected(tmp_path, documents_dir):
    with pytest.raises(ValueError, match=r"val_fraction=1\.0 must be in \(0, 1\)"):
        prepare(text_files(documents_dir), tmp_path / "out", ByteTokenizer(), val_fraction=1.0)
