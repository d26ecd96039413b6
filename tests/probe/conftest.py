"""Fixtures of the probe's tests; the toy fits they share are in tests/toys.py."""

import pytest


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Without a logger the probe writes its JSONL and plot to the trainer's root dir, the cwd."""
    monkeypatch.chdir(tmp_path)
