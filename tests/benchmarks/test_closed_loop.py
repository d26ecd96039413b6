"""benchmarks/closed_loop.py: its runs are the configurations it names, its small mode runs all four and reports them,
and a run that did not do what its row claims (a failed probe, a batch that never changed) stops it with no table."""

from __future__ import annotations

import json
import shutil

import pytest
from recipe_runs import compose_config

from benchmarks import closed_loop

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("key", closed_loop.CONFIGS)
@pytest.mark.parametrize("budget", [closed_loop.BUDGET, closed_loop.QUICK_BUDGET])
def test_every_run_composes_with_the_probe_it_names(key, budget, tmp_path):
    overrides = [o for o in closed_loop.overrides(key, 11, budget, tmp_path) if not o.startswith("hydra.")]
    cfg = compose_config(*overrides)
    assert (cfg.seed, cfg.max_tokens) == (11, budget)
    probe = cfg.callbacks.get("cbs_probe")
    assert (probe is None) == (key in ("control", "hand"))
    if probe is not None:
        assert (probe.side_jobs is not None) == key.endswith("side_jobs")
        assert cfg.batch.schedule._target_.endswith("CBSAdaptive")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("closed_loop")
    return out, closed_loop.main(["--quick", "--out", str(out)])


def test_the_small_mode_runs_and_reports_the_four_runs(quick):
    out, result = quick
    assert set(result["rows"]) == set(closed_loop.CONFIGS)
    side = json.loads((out / "closed_loop.json").read_text())["runs"]
    (run,) = [r for r in side if r["key"] == "adaptive_side_jobs"]
    assert run["side_jobs"] and run["batch_changes"] and run["readings"][0]["mode"] == "side_jobs"
    for label in closed_loop.LABELS.values():
        assert f"| {label} |" in result["text"]
    assert "side jobs' CPU seconds over the main run's seconds" in result["text"]


def test_a_run_whose_probe_failed_stops_the_benchmark_before_it_writes(quick, tmp_path):
    out, _ = quick
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    summary_path = next(copy.glob("adaptive_side_jobs_*")) / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["probe"]["points"]["failed"] = [{"tokens": 16384, "step": 8, "reason": "side job failed: killed"}]
    summary_path.write_text(json.dumps(summary))
    markdown = tmp_path / "RESULTS.md"
    with pytest.raises(SystemExit, match=r"closed_loop: no table written: 1 run\(s\) did not do what their rows claim"):
        closed_loop.main(["--quick", "--out", str(copy), "--markdown", str(markdown)])
    assert not markdown.exists()
