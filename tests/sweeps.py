"""Synthetic constant-batch sweeps whose E(S) is known exactly, for the tests of lit_cbs.analysis and
recipes/fit_es.py.

A synthetic sweep is a Hydra-multirun-like folder of constant-batch runs, each with a
CSVLogger-style metrics.csv. Its loss curves are built backwards from a known E(S) per target
loss: the run with a batch of b tokens per step reaches loss l at the step S where E_l(S) / S = b
(E_l(S) / S, the batch size along the curve, falls monotonically from infinity at S_min to B_min).
The WSD family scales one base curve of Zhou et al.'s shape (Zhou et al. 2026):
E_l(S) = kappa(l) E_base(S / sigma(l)), so S_min, S_opt scale with sigma, E_min with kappa and
B_min, B_opt with kappa / sigma. The McCandlish family has S = S_min(l) + E_min(l) / b
(McCandlish et al. 2018's (S / S_min - 1)(E / E_min - 1) = 1 solved for S at E = b S).
"""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path

import numpy as np
import yaml

from lit_cbs.analysis.fits import WSDFit

SEQ_LEN = 100  # tokens per sample
MAX_STEPS = 10_000
LOSS_GRID = np.linspace(3.6, 2.4, 1201)  # the losses each synthetic curve passes through, 0.001 apart

# Base E(S) of Zhou et al.'s shape, continuous at S_1 and S_2: B_opt = E_min / S_opt = 1e5 and
# B_min = A_1 = 4e4 tokens per step (1000 and 400 samples of SEQ_LEN tokens).
BASE = WSDFit(
    s_min=100.0,
    b_minus1=3e8,
    b_0=4e7,
    s_1=200.0,
    c=75.0,
    s_opt=400.0,
    e_min=4e7,
    s_2=800.0,
    a_1=4e4,
    a_0=2e7,
    points_per_segment=(0, 0, 0),
    rms_log_residual=0.0,
)
LOSS_REF, KAPPA, SIGMA = 3.0, 1.5, 0.5  # kappa(l) = exp(KAPPA (LOSS_REF - l)), sigma(l) = exp(SIGMA (LOSS_REF - l))
WSD_BATCHES = [450, 520, 600, 700, 800, 900, 1000, 1200, 1500, 2000, 3000, 5000, 10000]  # samples
WSD_TARGETS = [3.0, 2.9, 2.8]


def wsd_truth(loss: float) -> WSDFit:
    """The WSD parameters of the target ``loss`` in the synthetic family."""
    kappa, sigma = math.exp(KAPPA * (LOSS_REF - loss)), math.exp(SIGMA * (LOSS_REF - loss))
    return WSDFit(
        s_min=BASE.s_min * sigma,
        b_minus1=BASE.b_minus1 * kappa * sigma,
        b_0=BASE.b_0 * kappa,
        s_1=BASE.s_1 * sigma,
        c=BASE.c * kappa / sigma**2,
        s_opt=BASE.s_opt * sigma,
        e_min=BASE.e_min * kappa,
        s_2=BASE.s_2 * sigma,
        a_1=BASE.a_1 * kappa / sigma,
        a_0=BASE.a_0 * kappa,
        points_per_segment=(0, 0, 0),
        rms_log_residual=0.0,
    )


_BASE_STEPS = np.geomspace(BASE.s_min * (1 + 1e-9), 1e8, 200_000)
_BASE_BATCH = BASE.tokens(_BASE_STEPS) / _BASE_STEPS  # decreasing from ~inf to B_min


def wsd_crossing_steps(tokens_per_step: float, losses: np.ndarray) -> np.ndarray:
    """Steps at which the run with this batch (tokens per step) reaches each loss; inf where it never does."""
    kappa, sigma = np.exp(KAPPA * (LOSS_REF - losses)), np.exp(SIGMA * (LOSS_REF - losses))
    base_batch = tokens_per_step * sigma / kappa
    base_steps = np.interp(base_batch, _BASE_BATCH[::-1], _BASE_STEPS[::-1], left=np.inf, right=np.nan)
    return np.where(base_batch > BASE.a_1, sigma * base_steps, np.inf)


def mccandlish_truth(loss: float) -> tuple[float, float]:
    """(S_min steps, E_min tokens) of the McCandlish family at ``loss``: B_crit = 4e5 tokens at loss 3, growing."""
    u = LOSS_REF - loss
    return 50.0 * math.exp(0.5 * u), 2e7 * math.exp(1.5 * u)


def mccandlish_crossing_steps(tokens_per_step: float, losses: np.ndarray) -> np.ndarray:
    s_min, e_min = np.vectorize(mccandlish_truth)(losses)
    return s_min + e_min / tokens_per_step


def write_run(
    folder: Path, batch_size: int, crossing_steps, *, seq_len=SEQ_LEN, gns=None, lowest_target=2.8, val_every=50
):
    """A CSVLogger-style metrics.csv: Lightning logs row ``step`` = s - 1 with the tokens seen after s steps."""
    tokens_per_step = batch_size * seq_len
    reach = crossing_steps(tokens_per_step, LOSS_GRID)
    finite = np.isfinite(reach)
    end = reach[np.searchsorted(-LOSS_GRID, -lowest_target)]
    last_step = MAX_STEPS if not np.isfinite(end) else min(MAX_STEPS, int(end * 1.3) + 20)
    steps = np.arange(1, last_step + 1)
    loss = np.interp(steps, reach[finite], LOSS_GRID[finite], left=LOSS_GRID[0], right=LOSS_GRID[finite][-1])
    folder.mkdir(parents=True)
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"batch.schedule.batch_size={batch_size}"]))
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["epoch", "step", "train/loss", "tokens_seen", "batch/global_size", "gns/b_simple", "val/loss"])
        for s, value in zip(steps, loss):
            gns_cell = (gns(value) if callable(gns) else gns) if gns is not None and s % 10 == 0 else ""
            writer.writerow([0, s - 1, value, tokens_per_step * s, batch_size, gns_cell, ""])
            if s % val_every == 0:
                writer.writerow([0, s - 1, "", "", "", "", value])
    return folder


def write_sweep(root: Path, batches=WSD_BATCHES, crossing_steps=wsd_crossing_steps, **kwargs) -> Path:
    for i, batch in enumerate(batches):
        write_run(root / f"{i}_es_b{batch}", batch, crossing_steps, **kwargs)
    return root


def recorded(call, *args, **kwargs):
    """``call``'s result and the messages of every warning it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call(*args, **kwargs)
    return result, [str(w.message) for w in caught]
