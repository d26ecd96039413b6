"""Fixtures the analysis tests share: one synthetic WSD sweep (tests/sweeps.py) and its fits, made once per
session, and the recipes/ scripts that read analyses (fit_es.py, schedule_from_probe.py) loaded as modules."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

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


def _load_recipe_script(name: str) -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "recipes" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def recipe_script() -> Callable[[str], ModuleType]:
    """``recipe_script(name)``: recipes/<name>.py loaded as a module, to call its ``main(argv)`` in-process
    (a subprocess pays a Python start per case)."""
    return _load_recipe_script
