"""LightningDataModule over litdata token chunks.

A sample is ``seq_len + 1`` consecutive tokens (litdata's TokensLoader cuts the stream into
non-overlapping blocks); a batch is an int64 tensor [batch_size, seq_len + 1]. The model
reads ``batch[:, :-1]`` and is trained to predict ``batch[:, 1:]``, so each sample gives
``seq_len`` predictions (``tokens_per_sample``).

Training samples are read by index from litdata's ``StreamingDataset`` in the order of a
``GlobalOrderLoader``: one permutation of the whole split per epoch, the same for any number of
ranks, so the micro-batch can change between optimizer steps and a run can resume on other ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

from lit_cbs.data.loader import GlobalOrderLoader
from lit_cbs.data.prepare import read_metadata, resolve_data
from lit_cbs.data.tokenizers import load_tokenizer
from lit_cbs.errors import LitCBSConfigError, positive_int

__all__ = ["TokenDataModule"]


def stack_as_int64(samples: list[np.ndarray]) -> torch.Tensor:
    """Collate token blocks (stored as uint8/uint16/int32) into the int64 ids embeddings take."""
    return torch.from_numpy(np.stack(samples).astype(np.int64))


class TokenDataModule(LightningDataModule):
    """Token batches for language-model training, from a prepared folder, a folder of text
    files, or (default) the embedded stdlib corpus; see ``lit_cbs.data.prepare.resolve_data``.

    The validation loader reads the held-out split in order, so ``Trainer(limit_val_batches=N)``
    validates on its first N batches (per process) every time.

    Args:
        path: a folder already prepared (``train/`` and ``val/``, by ``lit_cbs.data.prepare`` or litgpt).
        input_dir: a folder of text files, prepared on first use into ``cache_dir``. Neither ``path``
            nor ``input_dir``: the embedded stdlib corpus (``stdlib_python_files``).
        cache_dir: where a prepared ``input_dir`` or the stdlib corpus is kept (default:
            ``lit_cbs.data.prepare.default_cache_dir()``).
        seq_len: tokens the model reads per sample (a sample holds ``seq_len + 1`` ids).
        batch_size: the micro-batch, in samples (sequences) per rank; public and mutable: change it,
            then have the trainer reload the train loader (only the train loader follows it;
            validation keeps the batch size given here so the validation set stays the same).
            ``BatchWarmup`` resizes the ``GlobalOrderLoader`` between steps instead.
        num_workers: DataLoader worker processes.
        seed: the train order's seed: a permutation of the whole split drawn afresh each epoch from
            (seed, epoch) (``GlobalOrderLoader``), so a batch draws from the whole split rather than from
            a few neighbouring files, and the order does not depend on the number of ranks.
        shuffle: permute the train split each epoch (False: the files' order).
        tokenizer: ``"bytes"`` or a tokenizer.json path.
        val_fraction: share of the text held out when preparing.

    Raises:
        LitCBSConfigError: ``seq_len`` or ``batch_size`` not an int >= 1, or ``num_workers`` not an int >= 0.

    Examples:
        Nothing is read or prepared before ``prepare_data`` and ``setup`` (Lightning calls them):

        >>> from lit_cbs.data import TokenDataModule
        >>> data = TokenDataModule(seq_len=64, batch_size=8)
        >>> data.tokens_per_sample, data.vocab_size  # byte tokens
        (64, 256)
        >>> data.check_context(32)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: data.seq_len=64 exceeds the model's context_length=32; set data.seq_len <= 32 or use a ...
        >>> TokenDataModule(batch_size=0)
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: data.batch_size=0 must be a positive int (samples per device)
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        input_dir: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        seq_len: int = 128,
        batch_size: int = 16,
        num_workers: int = 0,
        seed: int = 42,
        shuffle: bool = True,
        tokenizer: str | os.PathLike = "bytes",
        val_fraction: float = 0.01,
    ):
        super().__init__()
        positive_int("data.seq_len", seq_len, "tokens per sample")
        positive_int("data.batch_size", batch_size, "samples per device")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise LitCBSConfigError(f"data.num_workers={num_workers!r} must be an int >= 0 (worker processes)")
        self.path = path
        self.input_dir = input_dir
        self.cache_dir = cache_dir
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.shuffle = shuffle
        self.tokenizer = tokenizer
        self.val_fraction = val_fraction
        self.train_dataset: StreamingDataset | None = None
        self.val_dataset: StreamingDataset | None = None

    @property
    def tokens_per_sample(self) -> int:
        """Tokens each sample is trained on (predictions per sample): ``seq_len``."""
        return self.seq_len

    @property
    def vocab_size(self) -> int:
        """Token ids lie in [0, vocab_size): from a prepared folder's metadata, else the tokenizer's."""
        metadata = read_metadata(self.path) if self.path is not None else None
        if metadata is not None:
            return metadata["vocab_size"]
        return load_tokenizer(self.tokenizer).vocab_size

    def check_context(self, context_length: int) -> None:
        """Raise if samples are longer than a model's ``context_length`` (tokens).

        Args:
            context_length: the longest sequence the model reads (tokens).

        Raises:
            ValueError: ``seq_len`` > ``context_length``.
        """
        if self.seq_len > context_length:
            raise ValueError(
                f"data.seq_len={self.seq_len} exceeds the model's context_length={context_length}; "
                f"set data.seq_len <= {context_length} or use a model with a longer context"
            )

    def _data_dir(self) -> Path:
        return resolve_data(self.path, self.input_dir, self.cache_dir, self.tokenizer, self.val_fraction)

    def prepare_data(self) -> None:
        """Build the token cache (Lightning calls this on one process per node)."""
        self._data_dir()

    def setup(self, stage: str | None = None) -> None:
        """Open the prepared splits (preparing them first if need be).

        Raises:
            ValueError: the train split holds fewer than ``batch_size`` samples of ``seq_len + 1`` tokens, or
                the validation split none.
        """
        data_dir = self._data_dir()
        # Read by index (GlobalOrderLoader orders and splits the samples), so litdata's own order is unused.
        self.train_dataset = StreamingDataset(
            str(data_dir / "train"), item_loader=TokensLoader(block_size=self.seq_len + 1)
        )
        self.val_dataset = StreamingDataset(
            str(data_dir / "val"), item_loader=TokensLoader(block_size=self.seq_len + 1), shuffle=False
        )
        for split, dataset, needed in (("train", self.train_dataset, self.batch_size), ("val", self.val_dataset, 1)):
            if len(dataset) < needed:
                raise ValueError(
                    f"the {split} split of {str(data_dir)!r} holds {len(dataset)} samples of seq_len+1="
                    f"{self.seq_len + 1} tokens, fewer than {needed}; lower data.seq_len or data.batch_size, "
                    "or give more text"
                )

    def train_dataloader(self) -> GlobalOrderLoader:
        """Micro-batches of ``batch_size`` samples per rank; every sample of an epoch once, its last few
        dealt to the ranks as evenly as can be (``GlobalOrderLoader``)."""
        # Under Lightning, the strategy's data-parallel ranks (under tensor parallelism, not every process's).
        ranks = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if self.train_dataset is None:
            raise RuntimeError("TokenDataModule.train_dataloader() before setup(): call setup('fit') first")
        return GlobalOrderLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            num_workers=self.num_workers,
            collate_fn=stack_as_int64,
            **(ranks or {}),
        )

    def val_dataloader(self) -> StreamingDataLoader:
        """The held-out split in order, in batches of the ``batch_size`` given at construction."""
        return StreamingDataLoader(
            self.val_dataset, batch_size=self.val_batch_size, num_workers=self.num_workers, collate_fn=stack_as_int64
        )
