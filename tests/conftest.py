"""Fixtures several test modules share."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """A few standard-library files (about 140 kB), tokenized once per session: a prepared data folder."""
    from lit_cbs.data.prepare import resolve_data

    folder = tmp_path_factory.mktemp("texts")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "textwrap.py", "string.py"):
        (folder / name).write_bytes((stdlib / name).read_bytes())
    return resolve_data(input_dir=folder, cache_dir=tmp_path_factory.mktemp("cache"), val_fraction=0.1)
