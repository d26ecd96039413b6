"""benchmarks/guard.py --quick end to end: it trains each configuration once (short runs, two at a time) and
reports from them."""

from __future__ import annotations

import json

import pytest

from benchmarks import guard

pytestmark = pytest.mark.slow


def test_guard_quick_trains_each_configuration_once_and_reports(tmp_path):
    result = guard.main(["--quick", "--out", str(tmp_path)])
    runs = result["runs"]
    assert sorted(runs) == ["control_seed1", "default_job_guarded", "guarded_seed1", "premature_seed1"]
    assert (
        runs["control_seed1"]["tokens"] == guard.QUICK.tokens
        and runs["default_job_guarded"]["tokens"] == guard.QUICK.default_job_tokens
    )
    # The premature schedule jumps 16 -> 128 at 8,192 tokens, so it takes fewer steps than the control.
    assert runs["premature_seed1"]["optimizer_steps"] < runs["control_seed1"]["optimizer_steps"]
    # The guard fits a trend to the 16 steps before that increase and judges it over the 8 steps after.
    (verdict,) = runs["guarded_seed1"]["verdicts"]
    assert (verdict["old_global_batch"], verdict["new_global_batch"]) == (16, 128)
    assert list(result["rows"]) == ["premature", "guarded", "control"] and len(result["goals"]) == 3
    assert json.loads((tmp_path / "guard.json").read_text())["rows"].keys() == result["rows"].keys()
    assert (tmp_path / "guard.png").read_bytes()[:4] == b"\x89PNG"
