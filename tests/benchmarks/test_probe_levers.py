"""benchmarks/probe_levers.py's small mode: readings of a run's checkpoints, each lever judged on part of their data."""

from __future__ import annotations

import json

import pytest

from benchmarks import probe_levers
from lit_cbs.probe.reading import read_readings

pytestmark = pytest.mark.slow


def test_each_lever_is_read_off_the_same_readings(tmp_path):
    outcome = probe_levers.main(["--quick", "--out", str(tmp_path)])
    rows = {row["lever"]: row for row in outcome["rows"]}
    short = read_readings(tmp_path / "window16384" / "cbs_probe.jsonl")
    assert short and all(len(r.replicate_batch_losses["1"]) == 4 for r in short)
    # One window of 16,384 tokens: k = 2 trains on it, k = 1 is the main run's; two add k = 2 and k = 1 again.
    assert rows["32 held-out batches"]["branch_tokens"] == 16384 and rows["2 data windows"]["branch_tokens"] == 49152
    for row in outcome["rows"]:  # every row judged every reading
        assert 0 <= row["determined"] <= 1 and f"| {row['lever']} | {row['branch_tokens']:,} |" in outcome["text"]
    assert json.loads((tmp_path / "probe_levers.json").read_text()) == outcome["rows"]
