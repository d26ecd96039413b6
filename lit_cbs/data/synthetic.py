"""``RandomTokenData``: uniform random token batches, for runs that measure speed and memory (no litdata)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lit_cbs.errors import LitCBSConfigError, positive_int

__all__ = ["RandomTokenData"]


class RandomTokenData(pl.LightningDataModule):
    """``samples`` sequences of ``seq_len + 1`` token ids uniform in [0, ``vocab_size``), seeded, in batches of
    ``batch_size`` (the micro-batch, read when the loader is built) in a fixed order, the incomplete last dropped.

    Examples:
        >>> from lit_cbs.data import RandomTokenData
        >>> data = RandomTokenData(vocab_size=50, seq_len=8, batch_size=4, samples=10)
        >>> batches = list(data.train_dataloader())
        >>> len(batches), batches[0].shape, batches[0].dtype  # 10 samples: 2 whole batches, the rest dropped
        (2, torch.Size([4, 9]), torch.int64)
    """

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, samples: int, seed: int = 0):
        super().__init__()
        positive_int("vocab_size", vocab_size, "token ids")
        positive_int("seq_len", seq_len, "tokens per sample")
        positive_int("batch_size", batch_size, "samples")
        positive_int("samples", samples, "sequences")
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        if samples < batch_size:
            raise LitCBSConfigError(f"samples={samples} must be >= batch_size={batch_size} (one whole batch)")
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (samples, seq_len + 1), generator=generator)

    def train_dataloader(self) -> DataLoader[torch.Tensor]:
        # A tensor is a map-style dataset (__getitem__ and __len__ over dim 0), which torch's annotation omits.
        return DataLoader(self.tokens, batch_size=self.batch_size, drop_last=True)  # type: ignore[arg-type]
