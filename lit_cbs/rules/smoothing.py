"""``ema``: the one exponential moving average of lit_cbs (the probe's train_ema score, the analysis' smoothing)."""

from __future__ import annotations

from typing import cast

import numpy as np
from scipy.signal import lfilter

__all__ = ["ema"]


def ema(values: np.ndarray, decay: float) -> np.ndarray:
    """s_t = decay * s_(t-1) + (1 - decay) * x_t, s_0 = x_0, ``decay`` in [0, 1): lags ~decay / (1 - decay) points."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay={decay} must be in [0, 1)")
    values = np.asarray(values, dtype=float)
    if not len(values):
        return values
    return cast(np.ndarray, lfilter([1.0 - decay], [1.0, -decay], values, zi=[decay * values[0]])[0])
