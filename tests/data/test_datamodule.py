import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from litdata import StreamingDataset, TokensLoader

from lit_cbs.data import ByteTokenizer, HFTokenizer, TokenDataModule, load_tokenizer, prepare, resolve_data
from lit_cbs.data.corpus import SKIPPED_DIRS, stdlib_python_files, stdlib_root
from lit_cbs.data.prepare import read_metadata, split_pieces, text_files
from lit_cbs.data.synthetic import RandomTokenData
from lit_cbs.errors import LitCBSConfigError

DOCUMENTS = {
    "a.txt": "def add(a, b):\n    return a + b\n" * 40,
    "b.txt": "Grüße aus Köln — naïve café ☕ " * 60,  # multi-byte UTF-8 characters
    "sub/c.md": "# heading\n\nsome text that is long enough to fill a few blocks.\n" * 30,
}


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    for name, text in DOCUMENTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / ".hidden").write_text("never read")
    return root


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def prepared(text_dir, cache_dir) -> Path:
    return resolve_data(input_dir=text_dir, cache_dir=cache_dir, val_fraction=0.2)


def source_stream(text_dir: Path) -> bytes:
    """The token stream the byte tokenizer should produce: each file's bytes then NUL, in sorted path order."""
    return b"".join(path.read_bytes() + b"\0" for path in text_files(text_dir))


def read_tokens(split_dir: Path) -> bytes:
    dataset = StreamingDataset(str(split_dir), item_loader=TokensLoader(block_size=1), shuffle=False)
    return bytes(int(token[0]) for token in dataset)


def make_datamodule(text_dir, cache_dir, **changes) -> TokenDataModule:
    arguments = dict(input_dir=text_dir, cache_dir=cache_dir, seq_len=15, batch_size=4, val_fraction=0.2)
    arguments.update(changes)
    datamodule = TokenDataModule(**arguments)
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


# ------------------------------------------------------------------ preparation


def test_text_files_are_sorted_and_skip_hidden(text_dir):
    assert [p.relative_to(text_dir).as_posix() for p in text_files(text_dir)] == ["a.txt", "b.txt", "sub/c.md"]


def test_token_counts_match_byte_counts(prepared, text_dir):
    metadata = read_metadata(prepared)
    source_bytes = sum(len(text.encode("utf-8")) for text in DOCUMENTS.values())
    assert metadata["source_bytes"] == source_bytes
    assert metadata["num_documents"] == 3
    # one token per byte plus one separator per document
    assert metadata["train_tokens"] + metadata["val_tokens"] == source_bytes + 3
    assert metadata["val_tokens"] == pytest.approx(0.2 * source_bytes, abs=4)
    assert (metadata["tokenizer"], metadata["vocab_size"], metadata["eos_id"]) == ("bytes", 256, 0)


def test_train_and_val_are_disjoint_and_cover_the_stream_in_order(prepared, text_dir):
    train, val = read_tokens(prepared / "train"), read_tokens(prepared / "val")
    assert train + val == source_stream(text_dir)
    val.decode("utf-8")  # the cut fell on a character boundary


def test_split_cut_moves_back_to_a_character_start(tmp_path):
    path = tmp_path / "one.txt"
    path.write_bytes("abcé".encode())  # 61 62 63 c3 a9: the last byte continues 'é'
    train, val = split_pieces([path], val_fraction=0.2)
    assert train == [(str(path), 0, 3, False)]
    assert val == [(str(path), 3, 5, True)]


def test_cache_is_reused_and_a_changed_source_is_prepared_afresh(tmp_path):
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


def test_prepare_writes_several_chunks_in_stream_order(tmp_path, text_dir):
    metadata = prepare(text_files(text_dir), tmp_path / "out", ByteTokenizer(), val_fraction=0.2, chunk_tokens=500)
    index = json.loads((tmp_path / "out" / "train" / "index.json").read_text())
    assert len(index["chunks"]) > 3
    assert max(chunk["dim"] for chunk in index["chunks"]) <= 500
    assert sum(chunk["dim"] for chunk in index["chunks"]) == metadata["train_tokens"]
    assert read_tokens(tmp_path / "out" / "train") + read_tokens(tmp_path / "out" / "val") == source_stream(text_dir)


def test_preparing_leaves_the_global_random_generators_alone(tmp_path, text_dir):
    # A run seeds, then prepares its data, then initialises its model: the first draws after
    # preparing must be those the seed gives, as in a run that finds its data prepared.
    def draws() -> tuple:
        return torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)]

    seed_everything(1234)
    expected = draws()
    seed_everything(1234)
    prepare(text_files(text_dir), tmp_path / "out", ByteTokenizer(), val_fraction=0.2)
    assert draws() == expected


def test_prepare_reports_a_tokenizer_failure(tmp_path, text_dir):
    class FailingTokenizer(ByteTokenizer):
        def encode(self, text):
            raise UnicodeError("cannot tokenize this")

    with pytest.raises(RuntimeError, match="cannot tokenize this"):
        prepare(text_files(text_dir), tmp_path / "out", FailingTokenizer(), val_fraction=0.2)


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


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    from lit_cbs.data.prepare import default_cache_dir

    monkeypatch.setenv("LIT_CBS_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("LIT_CBS_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "lit_cbs"


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


def test_path_and_input_dir_together_rejected(tmp_path, prepared):
    with pytest.raises(ValueError, match="set only one"):
        resolve_data(path=prepared, input_dir=tmp_path)


def test_bad_val_fraction_rejected(tmp_path, text_dir):
    with pytest.raises(ValueError, match=r"val_fraction=1\.0 must be in \(0, 1\)"):
        prepare(text_files(text_dir), tmp_path / "out", ByteTokenizer(), val_fraction=1.0)


def test_batch_larger_than_the_train_split_rejected(text_dir, cache_dir, prepared):
    with pytest.raises(ValueError, match="train split .* fewer than 10000"):
        make_datamodule(text_dir, cache_dir, batch_size=10_000)


@pytest.mark.parametrize("field, value", [("seq_len", 0), ("batch_size", 2.5), ("num_workers", -1)])
def test_bad_datamodule_arguments_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"data\.{field}={value}"):
        TokenDataModule(**{field: value})


# ------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trip():
    tokenizer = load_tokenizer("bytes")
    ids = tokenizer.encode("né\n")
    assert ids == [110, 195, 169, 10]
    assert tokenizer.decode(ids) == "né\n"
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
    data_dir = resolve_data(input_dir=tmp_path / "docs", cache_dir=tmp_path / "cache", tokenizer=tmp_path / "tokenizer.json")
    metadata = read_metadata(data_dir)
    assert metadata["train_tokens"] + metadata["val_tokens"] == 101
    assert metadata["token_dtype"] == "uint8"


# ------------------------------------------------------------------ datamodule


def test_batches_are_int64_blocks_of_seq_len_plus_one(text_dir, cache_dir, prepared):
    datamodule = make_datamodule(text_dir, cache_dir)
    batch = next(iter(datamodule.train_dataloader()))
    assert batch.shape == (4, 16) and batch.dtype == torch.int64
    assert datamodule.tokens_per_sample == 15
    assert datamodule.vocab_size == 256
    stream = source_stream(text_dir)
    assert bytes(batch[0].tolist()) in stream  # a contiguous slice of the token stream


def test_train_loader_drops_the_incomplete_last_batch(text_dir, cache_dir, prepared):
    datamodule = make_datamodule(text_dir, cache_dir, batch_size=7)
    batches = list(datamodule.train_dataloader())
    samples = read_metadata(prepared)["train_tokens"] // 16
    assert len(batches) == samples // 7
    assert all(len(batch) == 7 for batch in batches)


def test_val_loader_reads_the_val_split_in_order(text_dir, cache_dir, prepared):
    datamodule = make_datamodule(text_dir, cache_dir)
    val = torch.cat(list(datamodule.val_dataloader())).flatten()
    stream = read_tokens(prepared / "val")
    assert bytes(val.tolist()) == stream[: len(val)] and len(stream) - len(val) < 16


def test_limit_val_batches_validates_on_the_same_first_batches_every_time(text_dir, cache_dir, prepared):
    class RecordsValidation(RecordingModule):
        def validation_step(self, batch, batch_idx):
            self.seen.append(batch.clone())

    datamodule, module = make_datamodule(text_dir, cache_dir), RecordsValidation()
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2)
    trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.validate(module, datamodule=datamodule, verbose=False)
    first_two = [batch for batch, _ in zip(datamodule.val_dataloader(), range(2))]
    assert len(module.seen) == 4 and all(torch.equal(a, b) for a, b in zip(module.seen, first_two + first_two))


def test_val_batch_size_stays_when_the_micro_batch_changes(text_dir, cache_dir, prepared):
    datamodule = make_datamodule(text_dir, cache_dir)
    datamodule.batch_size = 8
    assert len(next(iter(datamodule.train_dataloader()))) == 8
    assert len(next(iter(datamodule.val_dataloader()))) == 4


def train_order(datamodule: TokenDataModule) -> list[list[int]]:
    return [batch[:, 0].tolist() for batch in datamodule.train_dataloader()]


def test_same_seed_same_order_different_seed_different_order(text_dir, cache_dir, prepared):
    first = train_order(make_datamodule(text_dir, cache_dir, seed=1))
    assert train_order(make_datamodule(text_dir, cache_dir, seed=1)) == first
    assert train_order(make_datamodule(text_dir, cache_dir, seed=2)) != first
    unshuffled = make_datamodule(text_dir, cache_dir, shuffle=False)
    stream = read_tokens(prepared / "train")
    assert train_order(unshuffled)[0] == [stream[0], stream[16], stream[32], stream[48]]


def test_a_batch_draws_from_the_whole_split_not_from_neighbouring_samples(tmp_path):
    # 4,000 numbered lines of 8 bytes: every 16-byte sample is unique, so its position is known.
    text_dir = tmp_path / "numbers"
    text_dir.mkdir()
    (text_dir / "lines.txt").write_text("".join(f"{index:07d}\n" for index in range(4000)))
    datamodule = make_datamodule(text_dir, tmp_path / "cache", val_fraction=0.05, batch_size=16)
    in_order = StreamingDataset(str(datamodule._data_dir() / "train"), item_loader=TokensLoader(block_size=16), shuffle=False)
    position = {bytes(np.asarray(sample, dtype=np.uint8)): index for index, sample in enumerate(in_order)}
    assert len(position) == len(in_order) > 1500
    batches = iter(datamodule.train_dataloader())
    spans = []
    for _ in range(8):
        batch = next(batches)
        rows = [position[bytes(row.to(torch.uint8).tolist())] for row in batch]
        spans.append(max(rows) - min(rows))
    # A uniform draw of 16 from ~1,900 spans ~90% of them; litdata's default 256-sample window
    # would keep every batch within 256 neighbouring samples.
    assert min(spans) > len(position) // 2


def test_loader_state_dict_resumes_at_the_next_batch(text_dir, cache_dir, prepared):
    loader = make_datamodule(text_dir, cache_dir, seed=3).train_dataloader()
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    state = loader.state_dict()
    expected = [next(iterator) for _ in range(3)]

    resumed = make_datamodule(text_dir, cache_dir, seed=3).train_dataloader()
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    for batch in expected:
        torch.testing.assert_close(next(iterator), batch)


class RecordingModule(LightningModule):
    """Records every training batch; its one weight makes a loss for Lightning to step on."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.clone())
        return self.weight * batch.float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(datamodule, root, ckpt_path=None, **trainer_args) -> RecordingModule:
    module = RecordingModule()
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        **trainer_args,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return module


def test_lightning_checkpoint_restores_the_data_position(text_dir, cache_dir, prepared, tmp_path):
    datamodule = make_datamodule(text_dir, cache_dir, seed=4)
    assert isinstance(datamodule.train_dataloader(), _Stateful)  # what Lightning's fit loop saves
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    full = fit(datamodule, tmp_path, max_steps=7, callbacks=[checkpoints])
    resumed = fit(make_datamodule(text_dir, cache_dir, seed=4), tmp_path, tmp_path / "epoch=0-step=3.ckpt", max_steps=7)
    assert len(resumed.seen) == 4
    for expected, actual in zip(full.seen[3:], resumed.seen):
        torch.testing.assert_close(actual, expected)


def test_reloaded_train_loader_continues_the_epoch_order(text_dir, cache_dir, prepared, tmp_path):
    steps_per_epoch = len(make_datamodule(text_dir, cache_dir).train_dataloader())
    continuous = fit(make_datamodule(text_dir, cache_dir, seed=5), tmp_path, max_epochs=2)
    reloaded = fit(make_datamodule(text_dir, cache_dir, seed=5), tmp_path, max_epochs=2, reload_dataloaders_every_n_epochs=1)
    assert len(continuous.seen) == 2 * steps_per_epoch
    first_epoch = torch.cat(continuous.seen[:steps_per_epoch])
    second_epoch = torch.cat(continuous.seen[steps_per_epoch:])
    assert not torch.equal(first_epoch, second_epoch)
    torch.testing.assert_close(torch.cat(reloaded.seen), torch.cat(continuous.seen))


def test_path_to_a_prepared_folder_is_used_as_is(prepared):
    datamodule = TokenDataModule(path=prepared, seq_len=15, batch_size=4, tokenizer="unused-because-metadata-says.json")
    assert datamodule.vocab_size == 256
    datamodule.setup("fit")
    assert len(next(iter(datamodule.train_dataloader()))) == 4


def test_check_context(text_dir, cache_dir):
    datamodule = TokenDataModule(input_dir=text_dir, cache_dir=cache_dir, seq_len=256)
    datamodule.check_context(256)
    with pytest.raises(ValueError, match=r"data\.seq_len=256 exceeds the model's context_length=128"):
        datamodule.check_context(128)


def test_token_dtype_widens_with_the_vocabulary():
    from lit_cbs.data.prepare import token_dtype

    assert [token_dtype(v) for v in (256, 257, 50304, 100_000)] == [np.uint8, np.uint16, np.uint16, np.int32]
    assert math.log2(np.iinfo(np.uint16).max + 1) == 16


# ------------------------------------------------------------------ random tokens


def test_random_token_data_is_seeded_whole_batches_of_token_ids():
    data = RandomTokenData(vocab_size=50, seq_len=8, batch_size=4, samples=10, seed=3)
    batches = list(data.train_dataloader())
    assert [tuple(b.shape) for b in batches] == [(4, 9), (4, 9)]  # the incomplete last batch is dropped
    assert all(b.dtype == torch.int64 and b.min() >= 0 and b.max() < 50 for b in batches)
    again = RandomTokenData(vocab_size=50, seq_len=8, batch_size=4, samples=10, seed=3)
    assert torch.equal(torch.cat(batches), torch.cat(list(again.train_dataloader())))
    with pytest.raises(LitCBSConfigError, match="samples=2 must be >= batch_size=4"):
        RandomTokenData(vocab_size=50, seq_len=8, batch_size=4, samples=2)
