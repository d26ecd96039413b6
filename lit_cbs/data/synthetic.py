"""``RandomTokenData``: uniform random token batches, for runs that measure speed and memory, not learning.

A smoke test of a training stack on a GPU (``CausalLM`` + ``BatchWarmup`` + ``CBSProbeCallback``)
or a benchmark of the callbacks' cost needs token batches of the right shape, not a prepared
dataset. Imports only torch and Lightning (no litdata), so it runs where only those are installed.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lit_cbs.errors import LitCBSConfigError, positive_int

__all__ = ["RandomTokenData"]


class RandomTokenData(pl.LightningDataModule):
    """``samples`` sequences of ``seq_len + 1`` token ids drawn uniformly from [0, ``vocab_size``), seeded.

    A batch is an int64 tensor [``batch_size``, ``seq_len + 1``] (inputs ``[:, :-1]``, targets
    ``[:, 1:]``), in a fixed order; an incomplete last batch is dropped. ``batch_size`` (the
    micro-batch, samples) and ``seq_len`` (tokens per sample) are public, as ``BatchWarmup`` reads
    them. Training past ``samples`` starts another epoch over the same sequences.

    Args:
        vocab_size: token ids are drawn from [0, vocab_size).
        seq_len: tokens per sample the model reads (a sample holds ``seq_len + 1`` ids).
        batch_size: the micro-batch (samples per rank), read when the loader is built.
        samples: sequences in the dataset (at least one batch).
        seed: the seed of the token ids.

    Raises:
        LitCBSConfigError: ``vocab_size``, ``seq_len``, ``batch_size`` or ``samples`` not an int >= 1, or
            ``samples`` < ``batch_size``.

    Examples:
        >>> from lit_cbs.data import RandomTokenData
        >>> data = RandomTokenData(vocab_size=50, seq_len=8, batch_size=4, samples=10)
        >>> batches = list(data.train_dataloader())
        >>> len(batches), batches[0].shape, batches[0].dtype  # 10 samples: 2 whole batches, the rest dropped
        (2, torch.Size([4, 9]), torch.int64)
        >>> bool(batches[0].max() < 50), data.tokens.shape
        (True, torch.Size([10, 9]))
        >>> RandomTokenData(vocab_size=50, seq_len=8, batch_size=4, samples=3)
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: samples=3 must be >= batch_size=4 (one whole batch)
    """

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, samples: int, seed: int = 0):
        super().__init__()
        # Each LitCBSConfigError unless an int >= 1.
        positive_int("vocab_size", vocab_size, "token ids")
        positive_int("seq_len", seq_len, "tokens per sample")
        positive_int("batch_size", batch_size, "samples")
        positive_int("samples", samples, "sequences")
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        if samples < batch_size:
            raise LitCBSConfigError(f"samples={samples} must be >= batch_size={batch_size} (one whole batch)")
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (samples, seq_len + 1), generator=generator)

    def train_dataloader(self) -> DataLoader:
        """Batches of ``batch_size`` samples (int64 [``batch_size``, ``seq_len + 1``]) in a fixed order,
        the last incomplete one dropped."""
        # A tensor is a map-style dataset (__getitem__ and __len__ over dim 0), which torch's annotation omits.
        return DataLoader(self.tokens, batch_size=self.batch_size, drop_last=True)  # type: ignore[arg-type]
