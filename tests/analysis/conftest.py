"""Fixtures the analysis tests share: one synthetic WSD sweep (tests/sweeps.py) and its fits, made once per
session, and the recipes/ scripts that read analyses (fit_es.py, schedule_from_probe.py) loaded as modules."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from sweeps import SEQ_LEN, WSD_TARGETS, recorded, write_sweep

from lit_cbs.analysis.curves import find_crossings, read_sweep
from lit_cbs.analysis.fits import fit_targets


@pytest.fixture(scope="session")
def wsd_sweep(tmp_path_factory) -> Path:
    """The 13 runs of the WSD family (batches WSD_BATCHES samples), each logging a noise scale of 250 samples."""
    return write_sweep(tmp_path_factory.mktemp("wsd_sweep"), gns=250.0)


@pytest.fixture(scope="session")
def wsd_fits(wsd_sweep):
    """(the TargetFits of WSD_TARGETS in samples, the messages of the warnings fitting raised) on the unsmoothed
    sweep."""
    crossings, _ = recorded(find_crossings, read_sweep(wsd_sweep), WSD_TARGETS, window=None)
    return recorded(fit_targets, crossings, tokens_per_sample=SEQ_LEN)


@pytest.fixture(scope="session")
def recipe_script() -> Callable[[str], ModuleType]:
    """``recipe_script(name)``: recipes/<name>.py loaded as a module, to call its ``main(argv)`` in-process
    (a subprocess pays a Python start per case)."""
    from recipe_runs import (
        load_script,
    )  # here: recipe_runs loads train.py (Lightning), which a conftest must not import early

    return load_script
