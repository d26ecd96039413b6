"""What a run leaves in its folder (lit_cbs.run.report: summary.json and the lines a run ends with), and
``python -m lit_cbs.run.report RUN_DIR``: one self-contained HTML page per run, opened in a real headless
Chromium (Debian's package; `.ci/run` installs it where it can, and the test says why it skips otherwise)."""

from __future__ import annotations

import base64
import collections
import html
import json
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger
from matplotlib.figure import Figure
from toys import RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, CBSProbeCallback, GradientNoiseScale, PiecewiseBatch
from lit_cbs.analysis.curves import read_metrics_csv
from lit_cbs.run.report import (
    RUN_FIGURES,
    WALL_CLOCK_FILE,
    batch_lr_figure,
    loss_figure,
    summary_text,
    write_report,
    write_run_summary,
)
from lit_cbs.run.report import main as report_main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def fit_a_run(folder: Path) -> tuple[pl.Trainer, BatchWarmup]:
    """A run folder as a user's Trainer leaves it: CSVLogger's metrics.csv, the probe's JSONL and CBS curve."""
    pl.seed_everything(0, verbose=False)
    warmup = BatchWarmup(PiecewiseBatch([2, 4], [0, 160], unit="tokens"), seq_len=4)
    probe = CBSProbeCallback(every_tokens=80, multipliers=(1, 2), window_tokens=64, output_dir=folder)
    logger = CSVLogger(folder, name="", version="")
    trainer = pl.Trainer(
        callbacks=[warmup, probe, GradientNoiseScale()],
        **trainer_kwargs(max_epochs=2, logger=logger, log_every_n_steps=1),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(RegressionModule(optimizer="adam"), RegressionData(n=48, batch_size=2))
    return trainer, warmup


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """``fit_a_run``'s folder with what recipes/train.py adds (batch_history.json, summary.json) with plots=false,
    and the lines the run ended with."""
    folder = tmp_path_factory.mktemp("run")
    trainer, warmup = fit_a_run(folder)
    _, ending = write_run_summary(folder, "toy", trainer, warmup, fit_seconds=2.0, plots=False)
    (folder / "ending.txt").write_text(ending)
    return folder


def pngs_written(monkeypatch) -> collections.Counter:
    """Counts, by file name, every PNG matplotlib writes from here on (each still written, by the real savefig)."""
    written = collections.Counter()
    savefig = Figure.savefig

    def counted(figure, path, *args, **kwargs):
        written[Path(path).name] += 1
        return savefig(figure, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", counted)
    return written


def embedded_images(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


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
        "probe points",
        "final val/loss",
        "wall time",
    ]
    determined = sum(r["determined"] for r in readings)
    assert lines[5] == f"probe points     {len(readings)} read ({determined} determined), 0 failed, 0 pending"
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


@pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium here (.ci/run installs Debian's chromium package where apt-get can)"
)
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


def test_a_run_draws_each_figure_once_and_its_page_embeds_those_files(tmp_path, monkeypatch):
    written = pngs_written(monkeypatch)
    trainer, warmup = fit_a_run(tmp_path)
    write_run_summary(tmp_path, "toy", trainer, warmup, fit_seconds=2.0, plots=True)
    page = write_report(tmp_path).read_text()  # as recipes/train.py writes it after the summary
    # The probe's curve, the run's plots, and the page's own wall-clock figure: each once, into the run folder.
    assert written == {"cbs_curve.png": 1, "loss_vs_tokens.png": 1, "batch_lr_vs_tokens.png": 1, WALL_CLOCK_FILE: 1}
    shown = ["loss_vs_tokens.png", WALL_CLOCK_FILE, "batch_lr_vs_tokens.png", "cbs_curve.png"]
    assert embedded_images(page) == [(tmp_path / name).read_bytes() for name in shown]
    write_report(tmp_path)
    assert sum(written.values()) == 4  # another page of the same run draws nothing


def test_a_page_of_a_run_without_plots_draws_them_once_into_its_folder(run_dir, tmp_path, monkeypatch):
    folder = shutil.copytree(run_dir, tmp_path / "run")  # with the files' times
    for name in [*RUN_FIGURES, WALL_CLOCK_FILE]:
        (folder / name).unlink(missing_ok=True)  # as the run left it (plots=false), before any page drew them
    written = pngs_written(monkeypatch)
    report_main([str(folder)])  # python -m lit_cbs.run.report RUN_DIR
    # cbs_curve.png is the probe's, drawn when the run ended.
    assert written == {"loss_vs_tokens.png": 1, "batch_lr_vs_tokens.png": 1, WALL_CLOCK_FILE: 1}
    assert all((folder / name).is_file() for name in written)
    report_main([str(folder)])
    assert sum(written.values()) == 3
    # A metrics.csv newer than the figures (the run went on): those drawn from it are drawn again, the CBS curve not.
    later = max((folder / name).stat().st_mtime_ns for name in written) + 10**9
    os.utime(folder / "metrics.csv", ns=(later, later))
    report_main([str(folder)])
    assert written == {"loss_vs_tokens.png": 2, "batch_lr_vs_tokens.png": 2, WALL_CLOCK_FILE: 2}
