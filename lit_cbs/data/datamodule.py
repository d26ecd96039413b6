"""``TokenDataModule``: a LightningDataModule over litdata token chunks."""

from __future__ import annotations

import os

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

from lit_cbs.data.loader import GlobalOrderLoader
from lit_cbs.data.prepare import CORPORA, kjv_source, load_tokenizer, read_metadata, resolve_data
from lit_cbs.errors import LitCBSConfigError, one_of, positive_int

__all__ = ["TokenDataModule"]


def _stack_as_int64(samples: list[np.ndarray]) -> torch.Tensor:
    """Collate token blocks (stored as uint8/uint16/int32) into int64 ids."""
    return torch.from_numpy(np.stack(samples).astype(np.int64))


class TokenDataModule(LightningDataModule):
    """Token batches [batch_size, seq_len + 1] (int64) from a prepared folder, a folder of text files, or (default)
    an embedded ``corpus`` (``"stdlib"``, the default, or ``"kjv"``; ``resolve_data``): train through a
    ``GlobalOrderLoader``, validation in order.

    Args:
        seq_len: tokens the model reads per sample (a sample holds ``seq_len + 1`` ids).
        batch_size: the micro-batch, samples per rank; validation keeps the one given here.
        tokenizer: ``"bytes"`` or a tokenizer.json path.

    Examples:
        Nothing is read or prepared before ``prepare_data`` and ``setup`` (Lightning calls them):

        >>> from lit_cbs.data import TokenDataModule
        >>> data = TokenDataModule(seq_len=64, batch_size=8)
        >>> data.seq_len, data.vocab_size  # byte tokens
        (64, 256)
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        input_dir: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        seq_len: int = 128,
        batch_size: int = 16,
        num_workers: int = 0,
        seed: int = 42,
        shuffle: bool = True,
        tokenizer: str | os.PathLike[str] = "bytes",
        val_fraction: float = 0.01,
        corpus: str = "stdlib",
    ):
        super().__init__()
        if one_of("data.corpus", corpus, tuple(CORPORA)) != "stdlib" and (path, input_dir) != (None, None):
            raise LitCBSConfigError(f"data.corpus={corpus!r} is read when data.path and data.input_dir are unset")
        if corpus == "kjv":
            kjv_source()  # refuses a missing package now, not when the data is prepared
        positive_int("data.seq_len", seq_len, "tokens per sample")
        positive_int("data.batch_size", batch_size, "samples per device")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise LitCBSConfigError(f"data.num_workers={num_workers!r} must be an int >= 0 (worker processes)")
        self.path, self.input_dir, self.cache_dir, self.tokenizer = path, input_dir, cache_dir, tokenizer
        self.seq_len, self.batch_size, self.val_batch_size = seq_len, batch_size, batch_size
        self.num_workers, self.seed, self.shuffle, self.val_fraction = num_workers, seed, shuffle, val_fraction
        self.corpus = corpus
        self.train_dataset: StreamingDataset | None = None
        self.val_dataset: StreamingDataset | None = None

    @property
    def vocab_size(self) -> int:
        """Token ids lie in [0, vocab_size): a prepared folder's metadata, else the tokenizer's."""
        metadata = read_metadata(self.path) if self.path is not None else None
        return int(metadata["vocab_size"]) if metadata is not None else load_tokenizer(self.tokenizer).vocab_size

    def check_context(self, context_length: int) -> None:
        """ValueError if samples are longer than a model's ``context_length`` (tokens)."""
        if self.seq_len > context_length:
            raise ValueError(
                f"data.seq_len={self.seq_len} exceeds the model's context_length={context_length}; "
                f"set data.seq_len <= {context_length} or use a model with a longer context"
            )

    def prepare_data(self) -> None:
        resolve_data(self.path, self.input_dir, self.cache_dir, self.tokenizer, self.val_fraction, corpus=self.corpus)

    def setup(self, stage: str | None = None) -> None:
        """Open the prepared splits (preparing them first if need be); ValueError where one is too small."""
        data_dir = resolve_data(
            self.path, self.input_dir, self.cache_dir, self.tokenizer, self.val_fraction, corpus=self.corpus
        )
        # In litdata's order (no shuffle): GlobalOrderLoader orders the train split, by index.
        self.train_dataset, self.val_dataset = (
            StreamingDataset(str(data_dir / split), item_loader=TokensLoader(block_size=self.seq_len + 1))
            for split in ("train", "val")
        )
        for split, dataset, needed in (("train", self.train_dataset, self.batch_size), ("val", self.val_dataset, 1)):
            if len(dataset) < needed:
                raise ValueError(
                    f"the {split} split of {str(data_dir)!r} holds {len(dataset)} samples of seq_len+1="
                    f"{self.seq_len + 1} tokens, fewer than {needed}; lower data.seq_len or data.batch_size, "
                    "or give more text"
                )

    def train_dataloader(self) -> GlobalOrderLoader:
        # Under Lightning, the strategy's data-parallel ranks (under tensor parallelism, not every process's).
        ranks = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        assert self.train_dataset is not None, "call setup('fit') first"
        return GlobalOrderLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            num_workers=self.num_workers,
            collate_fn=_stack_as_int64,
            **(ranks or {}),
        )

    def val_dataloader(self) -> StreamingDataLoader:
        return StreamingDataLoader(
            self.val_dataset, batch_size=self.val_batch_size, num_workers=self.num_workers, collate_fn=_stack_as_int64
        )
