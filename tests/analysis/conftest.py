"""Fixtures the analysis tests share: one synthetic WSD sweep (tests/sweeps.py) and its fits, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from sweeps import SEQ_LEN, WSD_TARGETS, recorded, write_sweep

from lit_cbs.analysis import find_crossings, fit_targets, read_sweep


@pytest.fixture(scope="session")
def wsd_sweep(tmp_path_factory) -> Path:
    """The 13 runs of the WSD family (batches WSD_BATCHES samples), each logging a noise scale of 250 samples."""
    return write_sweep(tmp_path_factory.mktemp("wsd_sweep"), gns=250.0)


@pytest.fixture(scope="session")
def wsd_fits(wsd_sweep):
    """(the TargetFits of WSD_TARGETS in samples, the messages of the warnings fitting raised) on the unsmoothed sweep."""
    crossings, _ = recorded(find_crossings, read_sweep(wsd_sweep), WSD_TARGETS, smoothing=None)
    return recorded(fit_targets, crossings, tokens_per_sample=SEQ_LEN)
