"""lit_cbs.data.prepare's tokenizers: the byte tokenizer and a Hugging Face tokenizer.json."""

import sys

import pytest

from lit_cbs.data import resolve_data
from lit_cbs.data.prepare import HFTokenizer, load_tokenizer, read_metadata


def test_byte_tokenizer():
    tokenizer = load_tokenizer("bytes")
    ids = tokenizer.encode("né\n")
    assert ids == [110, 195, 169, 10]
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (256, 0)


def test_hf_tokenizer_without_the_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        HFTokenizer(tmp_path / "tokenizer.json")


def test_hf_tokenizer_from_a_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocabulary = {"<unk>": 0, "hello": 1, "world": 2, "</s>": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, "<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert loaded.encode("hello world") == [1, 2]
    assert (loaded.vocab_size, loaded.eos_id) == (4, 3)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "d.txt").write_text("hello world " * 50)
    data_dir = resolve_data(
        input_dir=tmp_path / "docs", cache_dir=tmp_path / "cache", tokenizer=tmp_path / "tokenizer.json"
    )
    metadata = read_metadata(data_dir)
    assert metadata["train_tokens"] + metadata["val_tokens"] == 101
    assert metadata["token_dtype"] == "uint8"
