"""``ema``: the one exponential moving average of lit_cbs, over a series of losses (or any values) in logged order.

The probe scores a branch by it (``evaluate="train_ema"``: the EMA of its step losses at the window's end) and the
analysis smooths loss curves with it (``lit_cbs.analysis.curves.smooth``). numpy and scipy only.
"""

from __future__ import annotations

import numpy as np
from scipy.signal import lfilter

__all__ = [
    "ema",
]


def ema(values: np.ndarray, decay: float) -> np.ndarray:
    """Exponential moving average s_t = decay * s_(t-1) + (1 - decay) * x_t with s_0 = x_0, in the unit of
    ``values`` (nats for losses); ``decay`` is the previous average's weight per point, in [0, 1).

    Lags a trend by about decay / (1 - decay) logged points, which shifts every crossing later.

    Args:
        values: the series, in logged order.
        decay: the previous average's weight per point, in [0, 1) (0: no smoothing).

    Returns:
        The smoothed series, as long as ``values`` (float).

    Raises:
        ValueError: ``decay`` outside [0, 1).

    Examples:
        >>> ema([4.0, 2.0, 2.0, 2.0], decay=0.5).tolist()
        [4.0, 3.0, 2.5, 2.25]
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay={decay} must be in [0, 1)")
    values = np.asarray(values, dtype=float)
    if not len(values):
        return values
    smoothed, _ = lfilter([1.0 - decay], [1.0, -decay], values, zi=[decay * values[0]])
    return smoothed
