"""benchmarks/side_probe.py: its runs are the configurations it names, and its verdicts read the runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from recipe_runs import compose_config
from toys import probe_reading

from benchmarks import side_probe


@pytest.mark.parametrize("key", [*side_probe.PART1, *side_probe.PART2])
@pytest.mark.parametrize("budget", [side_probe.BUDGET, side_probe.BUDGET // 16])
def test_every_run_composes_with_the_probe_it_names(key, budget, tmp_path):
    overrides = [o for o in side_probe.overrides(key, 5, budget, tmp_path) if not o.startswith("hydra.")]
    cfg = compose_config(*overrides)
    assert (cfg.seed, cfg.max_tokens) == (5, budget)
    probe = cfg.callbacks.get("cbs_probe")
    assert (probe is None) == (key in ("none", "control"))
    if probe is not None:
        assert (probe.side_jobs is not None) == key.endswith("side_jobs")
        assert probe.replicates == (2 if key.startswith("adaptive") else 1)


def test_readings_are_the_same_only_branch_loss_for_branch_loss():
    reading = probe_reading(1, 16, 32, losses={"1": 2.0, "2": 2.1})
    assert side_probe.same_readings([reading], [dataclasses.replace(reading)])
    assert not side_probe.same_readings([reading], [dataclasses.replace(reading, losses={"1": 2.0, "2": 2.1000001})])
    assert not side_probe.same_readings([reading], [])


def test_an_adaptive_run_is_no_slower_where_it_reaches_the_target_no_later_than_the_hand_warmup():
    assert side_probe.no_slower(0.8, 0.85) and side_probe.no_slower(0.8, None)
    assert not side_probe.no_slower(0.9, 0.85) and not side_probe.no_slower(None, 0.85)


def test_the_default_runs_are_the_default_job():
    assert side_probe.overrides("in_process", 1, side_probe.BUDGET, Path("/x"))[:1] == ["seed=1"]
