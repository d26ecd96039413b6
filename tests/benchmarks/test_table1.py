"""benchmarks/table1.py end to end at a small budget: it runs train.py, and its table, JSON,
plot and markdown agree with what the runs wrote."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from benchmarks import table1

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow
BUDGET = 262_144  # 128 steps at batch 16: the smallest budget table1 accepts
ADAPTIVE_PROBE_EVERY = BUDGET // 2


def held_out_losses(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("table1")
    markdown = out / "RESULTS.md"
    markdown.write_text("# Results\n\nkept\n")
    # The runs share the default data cache (as benchmarks/transfer.py's test does): the embedded
    # corpus is tokenized once per machine, not once per test session.
    outcome = table1.main(
        [
            "--tokens",
            str(BUDGET),
            "--seeds",
            "1",
            "--configs",
            "small,warmup,adaptive",
            "--jobs",
            "2",
            "--out",
            str(out / "runs"),
            "--markdown",
            str(markdown),
            "--override",
            "trainer.limit_val_batches=1",  # the table must agree with the runs' numbers, however noisy
            # The adaptive run probes once (at half the budget, not every 32,768 tokens: six probes whose
            # branches trained more tokens than the run), on fewer held-out batches: the table's probe
            # columns need a probe, not many.
            "--override",
            f"adaptive:callbacks.cbs_probe.every_tokens={ADAPTIVE_PROBE_EVERY}",
            "--override",
            "adaptive:callbacks.cbs_probe.heldout_batches=4",
            # The table reports an adaptive run only if its batch changed: tolerant enough that the one reading acts.
            "--override",
            "adaptive:callbacks.cbs_probe.epsilon=0.45",
            "--override",
            "adaptive:callbacks.cbs_probe.confidence=0.5",
        ]
    )
    return out, outcome


def test_numbers_come_from_the_runs(result):
    out, outcome = result
    rows = outcome["rows"]
    assert list(rows) == ["small", "warmup", "adaptive"]
    small = outcome["runs"]["small"][0]
    assert small["tokens"] == BUDGET and small["optimizer_steps"] == BUDGET // (16 * 128)
    for key, row in rows.items():
        (run,) = outcome["runs"][key]
        losses = held_out_losses(Path(run["run_dir"]))
        assert len(losses) == 16  # one evaluation every 8 micro-batches of 16 x 128 tokens
        assert row["loss_mean"] == pytest.approx(sum(losses[-2:]) / 2)
        summary = json.loads((Path(run["run_dir"]) / "summary.json").read_text())
        assert row["steps"] == summary["optimizer_steps"] and row["tokens"] == BUDGET
        assert row["steps_saved"] == pytest.approx(1 - summary["optimizer_steps"] / small["optimizer_steps"])
    # The thresholds scale with the budget: 16 -> 32 -> 64 within it, so fewer steps than at 16.
    assert [c["new"] for c in outcome["runs"]["warmup"][0]["batch_changes"]] == [32, 64]
    assert 0 < rows["warmup"]["steps_saved"] < 0.75
    adaptive = outcome["runs"]["adaptive"][0]
    # The adaptive run's own overrides reached it alone (the others have no probe to set).
    probe_every = f"callbacks.cbs_probe.every_tokens={ADAPTIVE_PROBE_EVERY}"
    assert probe_every in outcome["commands"]["adaptive"]
    assert not any(probe_every in outcome["commands"][key] for key in ("small", "warmup"))
    assert [r["tokens"] for r in adaptive["probe"]["readings"]] == [ADAPTIVE_PROBE_EVERY]
    assert adaptive["probe"]["tokens"] > 0 and rows["adaptive"]["probe_tokens"] == adaptive["probe"]["tokens"]
    assert rows["adaptive"]["steps_with_probes"] == adaptive["optimizer_steps"] + adaptive["probe"]["optimizer_steps"]
    assert rows["adaptive"]["steps_with_probes"] > rows["adaptive"]["steps"]
    assert [c["new"] for c in adaptive["batch_changes"]] == [32]


def test_writes_json_plot_and_its_own_markdown_section(result):
    out, outcome = result
    saved = json.loads((out / "runs" / "table1.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(outcome["rows"]))
    assert (out / "table1.png").read_bytes()[:4] == b"\x89PNG"
    text = (out / "RESULTS.md").read_text()
    assert text.startswith("# Results\n\nkept\n")
    section = text.split("<!-- table1:start -->")[1].split("<!-- table1:end -->")[0]
    assert "| small batch (16) |" in section and "| CBS-adaptive warmup |" in section
    assert f"{outcome['rows']['small']['loss_mean']:.4f}" in section
    assert "![held-out loss vs tokens and vs steps](table1.png)" in section


def test_bad_arguments_are_refused_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        table1.main(["--tokens", "1000", "--out", str(tmp_path)])
    assert "--tokens=1000 must be >= 262144" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        table1.main(["--configs", "small,huge", "--out", str(tmp_path)])
    assert "unknown ['huge']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        table1.main(["--override", "huge:trainer.limit_val_batches=1", "--out", str(tmp_path)])
    assert "unknown configuration 'huge'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("key", [config.key for config in table1.CONFIGS])
def test_gpu_variant_composes_a_25m_model_with_thresholds_at_the_same_share(key, tmp_path):
    # No GPU here: compose each --gpu run's config as train.py would and build its model on meta.
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from lit_cbs.run.resolvers import register_resolvers

    register_resolvers()

    config = next(c for c in table1.CONFIGS if c.key == key)
    command = table1.run_command(config, 1, table1.GPU_TOKENS, tmp_path / key, gpu=True)
    overrides = [arg for arg in command[2:] if not arg.startswith("hydra.")]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"output_dir={tmp_path}", *overrides])
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "bf16-mixed"
    assert cfg.data.seq_len == table1.GPU_SEQ_LEN and cfg.max_tokens == table1.GPU_TOKENS
    model = instantiate(cfg.model, lr_schedule=instantiate(cfg.lr_schedule))
    with torch.device("meta"):
        model.configure_model()
    assert 20e6 < model.num_parameters() < 30e6
    assert cfg.val_check_tokens * 16 == table1.GPU_TOKENS  # 16 evaluations
    schedule = instantiate(cfg.batch.schedule)
    if key == "warmup":  # 16 -> 32 -> 64 at about 30% and 60% of the budget, on whole batches of 64
        assert schedule.thresholds[1] / table1.GPU_TOKENS == pytest.approx(1_245_184 / 4_194_304, abs=0.01)
        assert all(t % (64 * table1.GPU_SEQ_LEN) == 0 for t in schedule.thresholds)


def test_from_json_redoes_the_report_without_training(result, tmp_path):
    out, outcome = result
    again = table1.main(
        [
            "--from-json",
            str(out / "runs" / "table1.json"),
            "--markdown",
            str(tmp_path / "R.md"),
            "--plot",
            str(tmp_path / "t.png"),
            "--out",
            str(tmp_path / "runs"),
        ]
    )
    assert again["rows"] == json.loads(json.dumps(outcome["rows"]))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").glob("*_seed*"))  # nothing trained

    def section(path):
        return path.read_text().split("<!-- table1:start -->")[1].split("<!-- table1:end -->")[0]

    # The same report, but for the plot's path (relative to each markdown file).
    assert section(tmp_path / "R.md").replace("(t.png)", "(table1.png)") == section(out / "RESULTS.md")
