"""What a run leaves in its folder (lit_cbs.recipes.run_report: summary.json and the lines a run ends with), and
``python -m lit_cbs.recipes.report RUN_DIR``: one self-contained HTML page per run, opened in a real headless
Chromium (Debian's package; `.ci/run` installs it where it can, and the test says why it skips otherwise)."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger
from toys import RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, CBSProbeCallback, GradientNoiseScale, PiecewiseBatch
from lit_cbs.analysis.curves import read_metrics_csv
from lit_cbs.recipes.report import main as report_main
from lit_cbs.recipes.report import write_report
from lit_cbs.recipes.run_report import batch_lr_figure, loss_figure, summary_text, write_run_summary

# One pytest-xdist worker: its tests share a module fixture's runs.
pytestmark = pytest.mark.xdist_group("recipes_report")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder as a user's Trainer leaves it (CSVLogger's metrics.csv, the probe's JSONL) with what
    recipes/train.py adds (batch_history.json, summary.json), and the lines the run ended with."""
    folder = tmp_path_factory.mktemp("run")
    pl.seed_everything(0, verbose=False)
    warmup = BatchWarmup(PiecewiseBatch([2, 4], [0, 160], unit="tokens"), seq_len=4)
    probe = CBSProbeCallback(every_tokens=80, multipliers=(1, 2), window_tokens=64, output_dir=folder)
    logger = CSVLogger(folder, name="", version="")
    trainer = pl.Trainer(
        callbacks=[warmup, probe, GradientNoiseScale()], **trainer_kwargs(max_epochs=2, logger=logger, log_every_n_steps=1)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(RegressionModule(optimizer="adam"), RegressionData(n=48, batch_size=2))
    _, ending = write_run_summary(folder, "toy", trainer, warmup, fit_seconds=2.0, plots=False)
    (folder / "ending.txt").write_text(ending)
    return folder


def test_the_summary_says_what_the_run_did(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    history = json.loads((run_dir / "batch_history.json").read_text())
    readings = [json.loads(line) for line in (run_dir / "cbs_probe.jsonl").read_text().splitlines()]
    assert summary["tokens"] == summary["tokens_this_fit"] == history["final"]["tokens_seen"] > 0
    assert (summary["first_batch"], summary["final_batch"], summary["seq_len"]) == (2, 4, 4)
    (change,) = history["changes"]
    assert summary["batch_changes"] == [
        {
            "step": change["step"],
            "tokens": change["tokens_seen"],
            "old": 2,
            "new": 4,
            "lr_factor": change["lr_factor"],
            "micro_batch_size": change["new_micro_batch_size"],
            "accumulate": change["new_accumulate"],
        }
    ]
    assert [r["k_star"] for r in summary["probe"]["readings"]] == [r["k_star"] for r in readings] and readings
    lines = (run_dir / "ending.txt").read_text().splitlines()
    assert lines[0] == "lit_cbs: toy done" and lines[-1] == f"outputs          {run_dir}"
    assert [line.split("  ")[0] for line in lines[1:-1]] == [
        "tokens",
        "optimizer steps",
        "batch changes",
        "CBS (samples)",
        "final val/loss",
        "wall time",
    ]
    assert f"2 -> 4 after step {change['step']} ({change['tokens_seen']:,} tokens" in lines[3]

    # Each reading with its own token count and mark; an open bracket (the top of the grid) as ">= lower".
    def mark(r: dict) -> str:
        bracket = f"[{r['cbs_lower']:g}, {r['cbs_upper']:g}]" if r["cbs_upper"] else f">= {r['cbs_lower']:g}"
        return f"{bracket} at {r['tokens']:,} tokens, {'' if r['determined'] else 'un'}determined"

    probe = summary["probe"]
    cost = f"{probe['tokens']:,} tokens ({probe['tokens'] / summary['tokens']:.0%} of training)"
    steps = f"{probe['optimizer_steps']} optimizer steps"
    assert lines[4] == f"CBS (samples)    {'; '.join(map(mark, readings))}; probes trained {cost} in {steps}"
    readings[0]["determined"] = probe["readings"][0]["determined"] = not readings[0]["determined"]
    first, *_ = summary_text(summary).splitlines()[3].removeprefix("CBS (samples)").strip().split("; ")
    assert first == mark(readings[0])  # the mark follows its own reading
    assert lines[-2] == "wall time        2.0 s (trainer.fit, setup included)"  # one fit: no earlier fit's time


def test_the_page_holds_every_figure_and_table_inline(run_dir):
    page = write_report(run_dir).read_text()
    assert page.count('<img alt="') == 4 and 'data-figures="4"' in page  # loss, wall clock + noise scale, batch/LR, CBS
    assert 'src="http' not in page and "<link" not in page  # nothing fetched: readable offline
    assert "Loss against wall-clock seconds; the gradient noise scale against tokens" in page
    assert "<h2>Batch changes</h2>" in page and "2 -&gt; 4" in page and "<h2>CBS readings</h2>" in page


def test_the_pages_summary_is_written_for_people(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    page = write_report(run_dir).read_text()
    table = page.split("<h2>Summary</h2>")[1].split("</table>")[0]
    rows = dict(re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td></tr>", table))
    # The lines the run ended with, one row each: counts with thousands separators, a unit on each number, no
    # None and no float printed to its last digit.
    ending = (run_dir / "ending.txt").read_text().splitlines()[1:-1]
    assert [f"{label:<17}{html.unescape(value)}" for label, value in rows.items()] == ending
    assert summary["final_val_loss"] is None and rows["final val/loss"] == "(not evaluated)"
    assert "None" not in table and not re.search(r"\d\.\d{5}", table)
    assert rows["wall time"] == "2.0 s (trainer.fit, setup included)"


def test_the_command_refuses_a_folder_without_metrics(tmp_path, capsys):
    with pytest.raises(SystemExit):
        report_main([str(tmp_path)])
    assert "has no metrics.csv: give the folder of a run logged with the CSV logger" in capsys.readouterr().err


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (.ci/run installs Debian's chromium package where apt-get can)")
def test_a_headless_browser_loads_the_page_without_errors_and_shows_each_figure(run_dir, tmp_path):
    path = write_report(run_dir, tmp_path / "report.html")
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", path.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    body = re.search(r"<body[^>]*>", done.stdout).group(0)
    assert 'data-figures="4"' in body and 'data-figures-loaded="4"' in body, body  # every image decoded, with a size
    assert "data-error" not in body, body


def test_the_plots_mark_a_batch_change_at_the_tokens_where_it_took_effect(run_dir):
    (change,) = json.loads((run_dir / "batch_history.json").read_text())["changes"]
    metrics = read_metrics_csv(run_dir / "metrics.csv")
    (ax,) = loss_figure(metrics).axes
    assert [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":"] == [change["tokens_seen"]]
    batch_panel = batch_lr_figure(metrics).axes[0]
    # The drawn staircase rises from the old batch to the new one at the change's token count.
    x, y = batch_panel.lines[0].get_path().vertices.T
    step_up = (change["old_global_batch"], change["new_global_batch"])
    (rise,) = [i for i in range(1, len(y)) if (y[i - 1], y[i]) == step_up]
    assert x[rise - 1] == x[rise] == change["tokens_seen"]
