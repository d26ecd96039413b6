"""lit_cbs.data.datamodule: TokenDataModule's loaders (shapes, order, seeds, resumption) on prepared documents."""

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from litdata import StreamingDataset, TokensLoader

from lit_cbs.data import TokenDataModule, resolve_data
from lit_cbs.data.prepare import read_metadata


def make_datamodule(input_dir, cache_dir, **changes) -> TokenDataModule:
    """A TokenDataModule of ``input_dir`` set up for fitting: samples of 15 + 1 tokens, micro-batches of 4."""
    arguments = dict(input_dir=input_dir, cache_dir=cache_dir, seq_len=15, batch_size=4, val_fraction=0.2)
    arguments.update(changes)
    datamodule = TokenDataModule(**arguments)
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


@pytest.fixture
def documents_datamodule(documents_dir, documents_cache, prepared_documents):
    """``documents_datamodule(**changes)``: make_datamodule on the documents, already prepared."""
    return lambda **changes: make_datamodule(documents_dir, documents_cache, **changes)


def test_batch_larger_than_the_train_split_rejected(documents_datamodule):
    with pytest.raises(ValueError, match="train split .* fewer than 10000"):
        documents_datamodule(batch_size=10_000)


@pytest.mark.parametrize("field, value", [("seq_len", 0), ("batch_size", 2.5), ("num_workers", -1)])
def test_bad_datamodule_arguments_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"data\.{field}={value}"):
        TokenDataModule(**{field: value})


def test_batches_are_int64_blocks_of_seq_len_plus_one(documents_datamodule, documents_stream):
    datamodule = documents_datamodule()
    batch = next(iter(datamodule.train_dataloader()))
    assert batch.shape == (4, 16) and batch.dtype == torch.int64
    assert datamodule.seq_len == 15
    assert datamodule.vocab_size == 256
    assert bytes(batch[0].tolist()) in documents_stream  # a contiguous slice of the token stream


def test_train_loader_yields_every_sample_the_last_batch_short(documents_datamodule, prepared_documents):
    datamodule = documents_datamodule(batch_size=7)
    batches = list(datamodule.train_dataloader())
    samples = read_metadata(prepared_documents)["train_tokens"] // 16
    assert samples % 7 and len(batches) == samples // 7 + 1
    assert [len(batch) for batch in batches] == [7] * (samples // 7) + [samples % 7]


def test_val_loader_reads_the_val_split_in_order(documents_datamodule, prepared_documents, read_tokens):
    datamodule = documents_datamodule()
    val = torch.cat(list(datamodule.val_dataloader())).flatten()
    stream = read_tokens(prepared_documents / "val")
    assert bytes(val.tolist()) == stream[: len(val)] and len(stream) - len(val) < 16


def test_limit_val_batches_validates_on_the_same_first_batches_every_time(documents_datamodule):
    class RecordsValidation(RecordingModule):
        def validation_step(self, batch, batch_idx):
            self.seen.append(batch.clone())

    datamodule, module = documents_datamodule(), RecordsValidation()
    trainer = Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2
    )
    trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.validate(module, datamodule=datamodule, verbose=False)
    first_two = [batch for batch, _ in zip(datamodule.val_dataloader(), range(2))]
    assert len(module.seen) == 4 and all(torch.equal(a, b) for a, b in zip(module.seen, first_two + first_two))


def test_val_batch_size_stays_when_the_micro_batch_changes(documents_datamodule):
    datamodule = documents_datamodule()
    datamodule.batch_size = 8
    assert len(next(iter(datamodule.train_dataloader()))) == 8
    assert len(next(iter(datamodule.val_dataloader()))) == 4


def train_order(datamodule: TokenDataModule) -> list[list[int]]:
    return [batch[:, 0].tolist() for batch in datamodule.train_dataloader()]


def test_same_seed_same_order_different_seed_different_order(documents_datamodule, prepared_documents, read_tokens):
    first = train_order(documents_datamodule(seed=1))
    assert train_order(documents_datamodule(seed=1)) == first
    assert train_order(documents_datamodule(seed=2)) != first
    unshuffled = documents_datamodule(shuffle=False)
    stream = read_tokens(prepared_documents / "train")
    assert train_order(unshuffled)[0] == [stream[0], stream[16], stream[32], stream[48]]


def test_a_batch_draws_from_the_whole_split_not_from_neighbouring_samples(tmp_path):
    # 4,000 numbered lines of 8 bytes: every 16-byte sample is unique, so its position is known.
    numbers_dir = tmp_path / "numbers"
    numbers_dir.mkdir()
    (numbers_dir / "lines.txt").write_text("".join(f"{index:07d}\n" for index in range(4000)))
    datamodule = make_datamodule(numbers_dir, tmp_path / "cache", val_fraction=0.05, batch_size=16)
    in_order = StreamingDataset(
        str(resolve_data(input_dir=numbers_dir, cache_dir=tmp_path / "cache", val_fraction=0.05) / "train"),
        item_loader=TokensLoader(block_size=16),
        shuffle=False,
    )
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


def test_loader_state_dict_resumes_at_the_next_batch(documents_datamodule):
    loader = documents_datamodule(seed=3).train_dataloader()
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    state = loader.state_dict()
    expected = [next(iterator) for _ in range(3)]

    resumed = documents_datamodule(seed=3).train_dataloader()
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


def test_lightning_checkpoint_restores_the_data_position(documents_datamodule, tmp_path):
    datamodule = documents_datamodule(seed=4)
    assert isinstance(datamodule.train_dataloader(), _Stateful)  # what Lightning's fit loop saves
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    full = fit(datamodule, tmp_path, max_steps=7, callbacks=[checkpoints])
    resumed = fit(documents_datamodule(seed=4), tmp_path, tmp_path / "epoch=0-step=3.ckpt", max_steps=7)
    assert len(resumed.seen) == 4
    for expected, actual in zip(full.seen[3:], resumed.seen):
        torch.testing.assert_close(actual, expected)


def test_reloaded_train_loader_continues_the_epoch_order(documents_datamodule, tmp_path):
    steps_per_epoch = len(documents_datamodule().train_dataloader())
    continuous = fit(documents_datamodule(seed=5), tmp_path, max_epochs=2)
    reloaded = fit(documents_datamodule(seed=5), tmp_path, max_epochs=2, reload_dataloaders_every_n_epochs=1)
    assert len(continuous.seen) == 2 * steps_per_epoch
    first_epoch = torch.cat(continuous.seen[:steps_per_epoch])
    second_epoch = torch.cat(continuous.seen[steps_per_epoch:])
    assert not torch.equal(first_epoch, second_epoch)
    torch.testing.assert_close(torch.cat(reloaded.seen), torch.cat(continuous.seen))


def test_path_to_a_prepared_folder_is_used_as_is(prepared_documents):
    datamodule = TokenDataModule(
        path=prepared_documents, seq_len=15, batch_size=4, tokenizer="unused-because-metadata-says.json"
    )
    assert datamodule.vocab_size == 256
    datamodule.setup("fit")
    assert len(next(iter(datamodule.train_dataloader()))) == 4


def test_check_context(documents_dir, documents_cache):
    datamodule = TokenDataModule(input_dir=documents_dir, cache_dir=documents_cache, seq_len=256)
    datamodule.check_context(256)
    with pytest.raises(ValueError, match=r"data\.seq_len=256 exceeds the model's context_length=128"):
        datamodule.check_context(128)
