"""benchmarks/hparam_rules.py: --quick trains the hyperparameter rules and seesaw through the recipes; its
aggregation pairs each run with its reference seed by seed."""

from __future__ import annotations

import pytest

from benchmarks import hparam_rules

pytestmark = pytest.mark.slow


def test_hparam_rules_quick_trains_the_rules_and_seesaw_through_the_recipes(tmp_path):
    result = hparam_rules.main(["--quick", "--configs", "both,seesaw", "--out", str(tmp_path)])
    (both,), (seesaw,) = result["runs"]["both"], result["runs"]["seesaw"]
    assert (
        "batch.weight_decay_rule=timescale" in both["overrides"] and "batch.beta2_rule=half_life" in both["overrides"]
    )
    # Seesaw doubles where the cosine halves the LR: 16 -> 32 -> 64 in the run's own record.
    assert [change["new"] for change in seesaw["batch_changes"]] == [32, 64] and both["tokens"] == seesaw["tokens"]
    assert result["comparisons"] == {} and result["goals"] == []  # no reference trained: nothing compared
    assert (tmp_path / "hparam_rules.png").read_bytes()[:4] == b"\x89PNG"


def test_hparam_rules_pairs_each_run_with_its_reference_seed_by_seed():
    def run(key, seed, loss, steps):
        return {
            "key": key,
            "seed": seed,
            "val_curve": [{"val_loss": loss}],
            "optimizer_steps": steps,
            "fit_seconds": 1.0,
        }

    runs = {
        "lr_only": [run("lr_only", s, 1.30 + 0.01 * s, 100) for s in (1, 2, 3)],
        "both": [run("both", s, 1.33 + 0.01 * s + 0.001 * s * s, 100) for s in (1, 2, 3)],
        "cosine": [run("cosine", s, 1.20, 200) for s in (1, 2, 3)],
        "seesaw": [run("seesaw", s, 1.205, 130) for s in (1, 2, 3)],
    }
    result = hparam_rules.aggregate(runs)
    both = result["comparisons"]["both"]
    assert both["differences"] == pytest.approx([0.031, 0.034, 0.039]) and both["beyond_spread"]
    low, high = both["interval"]
    assert low == pytest.approx(0.0346667 - 4.302653 * 0.0023333, abs=1e-5) and high > 0.04  # t(2) x SE of 3
    assert result["comparisons"]["seesaw"]["steps_saved"] == pytest.approx(0.35)
    ((text, met),) = hparam_rules.goals(result)
    assert met and text.startswith("seesaw: final held-out loss +0.0050 nats") and "35% fewer" in text
