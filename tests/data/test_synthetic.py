"""lit_cbs.data.synthetic: seeded random token batches for runs that measure speed, not learning."""

import pytest
import torch

from lit_cbs.data.synthetic import RandomTokenData
from lit_cbs.errors import LitCBSConfigError


def test_random_token_data_is_seeded_whole_batches_of_token_ids():
    data = RandomTokenData(vocab_size=50, seq_len=8, batch_size=4, samples=10, seed=3)
    batches = list(data.train_dataloader())
    assert [tuple(b.shape) for b in batches] == [(4, 9), (4, 9)]  # the incomplete last batch is dropped
    assert all(b.dtype == torch.int64 and b.min() >= 0 and b.max() < 50 for b in batches)
    again = RandomTokenData(vocab_size=50, seq_len=8, batch_size=4, samples=10, seed=3)
    assert torch.equal(torch.cat(batches), torch.cat(list(again.train_dataloader())))
    with pytest.raises(LitCBSConfigError, match="samples=2 must be >= batch_size=4"):
        RandomTokenData(vocab_size=50, seq_len=8, batch_size=4, samples=2)
