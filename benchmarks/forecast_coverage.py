"""Does the CBS forecast's band hold what it says? Its coverage on real probe readings cut short, and on
simulated curves whose truth is known (``lit_cbs.analysis.forecast_cbs``, the 80% band).

(a) Real readings, read from run files (``--runs``: the run folders of ``benchmarks.cbs_law`` by default): each
reading as the interval its data support (``brackets_from_records``). Each run is fitted on its first half of
readings and each later reading is counted once: covered where the band overlaps its interval
(``CBSForecast.covers``). The prior's median spread of log CBS for a run is fitted outside it: the median spread of
the whole curves of the runs on the other corpus (``data.corpus`` of their saved configuration), of every other
run where all share one.

(b) Simulations with a known curve: CBS(D) = a (D / 65,536)^b samples, its place on the factor-2
grid random (a = 16 x 2^u, u uniform in [0, 1)). A run reads log CBS(D) + Normal(0, s) (natural log of samples) at
65,536 x 2^j tokens (j = 0..5, ``tiny_cbs_curve``'s probe points), bracketed on the grid 1, 2, 4, ...
samples. Fit on the first n = 2, 3, 4 readings of one run; at each later point count whether the
band holds the value the run read (before bracketing: what the band is the interval of), the true
curve, and whether it overlaps the bracket. Scenarios: s = 0.15, b = 0.5 (readings like the real
ones); s = 0.25 (noisier than the prior on s expects); b = 0.9 (a steeper curve). A fixed seed per
simulated run, the same runs for every n. Output: the tables on stdout; with ``--markdown`` the section
"forecast_coverage" of that file, with ``--plot`` the figure.

Usage::

    python -m benchmarks.forecast_coverage                                   # 200 runs per scenario and n
    python -m benchmarks.forecast_coverage --runs /work/bench/cbs_law/runs/* --markdown docs/RESULTS.md \
        --plot docs/forecast_coverage.png
    python -m benchmarks.forecast_coverage --seeds 20                        # a quick look
"""

from __future__ import annotations

import os

# Each fit calls L-BFGS-B, whose tiny BLAS calls OpenBLAS would spread over threads that spin between them, which
# costs more than the calls (most of all on shared cores). Read when numpy loads: set before importing it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import dataclasses
import datetime
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, check_run, git_commit, refuse_unless_checked
from lit_cbs.analysis.forecast import SPREAD_PRIOR_MEDIAN, Bracket, CBSForecast, brackets_from_records, forecast_cbs
from lit_cbs.analysis.probe_schedule import run_config_value
from lit_cbs.probe import read_readings

COVERAGE = 0.8
GRID = 2.0 ** np.arange(16)  # the batches a probe brackets with, samples
PROBE_TOKENS = 65_536 * 2.0 ** np.arange(6)  # tiny_cbs_curve's probe points
FIT_SIZES = (2, 3, 4)  # readings a simulated forecast is fitted on
INF = math.inf


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A known curve a (D / 65,536)^exponent samples, read with a log-normal spread (log CBS units)."""

    name: str
    spread: float
    exponent: float


SCENARIOS = (
    Scenario("s 0.15, b 0.5 (like the real readings)", 0.15, 0.5),
    Scenario("s 0.25, b 0.5 (noisier)", 0.25, 0.5),
    Scenario("s 0.15, b 0.9 (steeper)", 0.15, 0.9),
)


def run_brackets(run: Path) -> list[Bracket]:
    """The readings of a run folder (its probe/cbs_probe.jsonl, as benchmarks.cbs_law writes them, or its
    cbs_probe.jsonl) as the intervals the data support, in tokens order."""
    path = next((f for f in (run / "probe" / "cbs_probe.jsonl", run / "cbs_probe.jsonl") if f.is_file()), None)
    if path is None:
        raise SystemExit(f"forecast_coverage: {run} holds no cbs_probe.jsonl (nor probe/cbs_probe.jsonl)")
    readings = read_readings(path)
    # A recipe run (summary.json) must have finished with no failed probe, and no reading may hold a failed branch.
    problems = check_run(run) if (run / "summary.json").is_file() else []
    problems += [f"{path}: branches {r.failed} failed at {r.tokens:,} tokens" for r in readings if r.failed]
    refuse_unless_checked(problems, "forecast_coverage")
    return brackets_from_records(readings, run=run.name)


def fitted(brackets: Sequence[Bracket], spread_prior: float = SPREAD_PRIOR_MEDIAN) -> tuple[CBSForecast, bool]:
    """The forecast fitted to ``brackets`` at COVERAGE, and whether it warned (that is counted, not shown)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forecast = forecast_cbs(brackets, coverage=COVERAGE, spread_prior=spread_prior)
    return forecast, bool(caught)


def truncated_real_runs(runs: Sequence[Path]) -> list[dict]:
    """One row per run: fitted on its first half of readings under a spread prior fitted on the runs of the other
    corpora (every other run where all share one), the later readings each once, with the band there."""
    brackets = {run: run_brackets(run) for run in runs}
    corpus = {run: (run_config_value(run, "data.corpus") or ("runs",))[0] for run in runs}
    spread = {run: math.exp(fitted(brackets[run])[0].params[2]) for run in runs}  # each run's whole curve
    rows = []
    for run in runs:
        outside = [r for r in runs if corpus[r] != corpus[run]] or [r for r in runs if r != run]
        prior = float(np.median([spread[r] for r in outside])) if outside else SPREAD_PRIOR_MEDIAN
        n = len(brackets[run]) // 2
        forecast, warned = fitted(brackets[run][:n], prior)
        later = [
            {
                "tokens": b.tokens,
                "interval": [b.lower, b.upper],
                "determined": b.determined,
                "band": [float(x[0]) for x in forecast.band(b.tokens)],
                "covered": forecast.covers(b),
            }
            for b in brackets[run][n:]
        ]
        rows.append({"run": run.name, "fitted": n, "prior": prior, "warned": warned, "later": later})
    return rows


def simulated_run(cbs, tokens: Sequence[float], spread: float, rng, run: str = "sim"):
    """One run's reads (samples) of ``cbs(D)`` x exp(Normal(0, spread)) at each of ``tokens``, and their
    brackets on GRID: ``(reads, [Bracket, ...])``."""
    reads = np.array([cbs(d) for d in tokens]) * np.exp(rng.normal(0.0, spread, len(tokens)))
    brackets = []
    for tokens_at, read in zip(tokens, reads):
        above = GRID[read < GRID]
        lower = float(GRID[read >= GRID].max(initial=GRID[0]))
        brackets.append(Bracket(float(tokens_at), lower, float(above[0]) if len(above) else INF, run))
    return reads, brackets


def simulated_coverage(scenario: Scenario, seeds: int, fit_sizes: Sequence[int] = FIT_SIZES) -> dict[int, dict]:
    """Per n: of the later points of ``seeds`` simulated runs, how many the band held (the value read,
    the true curve, the bracket overlapped), and the median ratio high / low of the band at the last point."""
    result = {}
    for n in fit_sizes:
        counts = {"points": 0, "read": 0, "curve": 0, "bracket": 0, "warned": 0}
        widths = []
        for seed in range(seeds):
            rng = np.random.default_rng(seed)  # the same runs for every n
            scale = 16 * 2 ** rng.uniform()

            def cbs(d, scale=scale):
                return scale * (d / PROBE_TOKENS[0]) ** scenario.exponent

            reads, brackets = simulated_run(cbs, PROBE_TOKENS, scenario.spread, rng, run=f"seed{seed}")
            forecast, warned = fitted(brackets[:n])
            low, high = forecast.band(PROBE_TOKENS[n:])
            truth = np.array([cbs(d) for d in PROBE_TOKENS[n:]])
            counts["points"] += len(low)
            counts["read"] += int(np.sum((low <= reads[n:]) & (reads[n:] <= high)))
            counts["curve"] += int(np.sum((low <= truth) & (truth <= high)))
            counts["bracket"] += sum(forecast.covers(b) for b in brackets[n:])
            counts["warned"] += warned
            widths.append(float(high[-1] / low[-1]))
        result[n] = {**counts, "runs": seeds, "last_width": float(np.median(widths))}
    return result


def markdown(real: list[dict], simulated: dict[str, dict[int, dict]], command: str, seeds: int, plot: Path | None):
    """The section 'forecast_coverage' of docs/RESULTS.md: ``real`` (truncated_real_runs) and ``simulated`` (per
    scenario, simulated_coverage) as tables, with the ``command`` that measured them."""
    checked = [point for row in real for point in row["later"]]
    covered = sum(point["covered"] for point in checked)
    determined = [point for point in checked if point["determined"]]
    lines = [
        "## Does the forecast's band hold what it says?",
        "",
        f"Command: `{command}` at commit {git_commit()} ({datetime.date.today().isoformat()}). "
        f"The {COVERAGE:.0%} posterior predictive band of `forecast_cbs`; its method and the priors are in "
        "lit_cbs/analysis/forecast.py and [science.md](science.md).",
        "",
        "### Real readings cut short",
        "",
        "Each run's readings read from its cbs_probe.jsonl, each as the interval its data support (a determined "
        "reading's bracket, an undetermined one's wider interval); the forecast fitted on the run's first half of "
        "readings, with the prior's median spread fitted on the runs of the other corpus (the median of their "
        "whole curves' spreads), and each later reading counted once; covered: the band overlaps its interval "
        "(`?`: undetermined).",
        "",
        "| run | fitted on | prior spread | warned | later reading: interval -> band (samples) |",
        "|---|---|---|---|---|",
    ]
    for row in real:
        later = "; ".join(
            f"{p['tokens']:,.0f}: [{p['interval'][0]:g}, {p['interval'][1]:g}] -> "
            f"[{p['band'][0]:.3g}, {p['band'][1]:.3g}]{'' if p['determined'] else ' ?'}"
            f"{'' if p['covered'] else ' **missed**'}"
            for p in row["later"]
        )
        warned = "yes" if row["warned"] else "no"
        lines.append(f"| {row['run']} | first {row['fitted']} | {row['prior']:.3f} | {warned} | {later} |")
    missed_unwarned = sum(not p["covered"] for row in real if not row["warned"] for p in row["later"])
    lines += [
        "",
        f"Covered: {covered} of {len(checked)} later readings; of the determined ones "
        f"{sum(p['covered'] for p in determined)} of {len(determined)}; misses without a warning: {missed_unwarned}.",
        "",
        f"### Simulated curves ({seeds} runs per row)",
        "",
        "Later points of each run: the share where the band holds the value read (nominal "
        f"{COVERAGE:.0%}), the true curve, and overlaps the bracket; the band's high / low at 2,097,152 tokens",
        "(median over runs).",
        "",
        "| scenario | fitted on | later points | value read held | curve held | bracket met | band at 2.1M | warned |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, by_n in simulated.items():
        for n, c in by_n.items():
            shares = " | ".join(f"{c[what] / c['points']:.0%}" for what in ("read", "curve", "bracket"))
            warned = f"{c['warned']} of {c['runs']}"
            lines.append(f"| {name} | first {n} | {c['points']} | {shares} | x{c['last_width']:.1f} | {warned} |")
    if plot is not None:
        lines += ["", f"![The band from a run's first readings, and the simulated coverage]({plot.name})"]
    return "\n".join(lines)


def plot_coverage(real: list[dict], simulated: dict[str, dict[int, dict]], runs: Sequence[Path], path: Path) -> Path:
    """Left: the first run a band missed (else the first run), fitted on its first half and all but its last;
    right: the simulated share of values read that the band held, against n, beside the nominal coverage."""
    from matplotlib.figure import Figure

    from lit_cbs.analysis.plots import save_figure

    figure = Figure(figsize=(11, 4.5))
    curve, shares = figure.subplots(1, 2)
    row = next((r for r in real if not all(p["covered"] for p in r["later"])), real[0])
    name, brackets = row["run"], run_brackets(runs[[run.name for run in runs].index(row["run"])])
    grid = np.geomspace(brackets[0].tokens / 1.2, brackets[-1].tokens * 1.2, 100)
    for n, color in ((row["fitted"], "tab:orange"), (len(brackets) - 1, "tab:blue")):
        forecast, _ = fitted(brackets[:n], row["prior"])
        low, high = forecast.band(grid)
        label = f"{COVERAGE:.0%} band, fitted on the first {n}"
        curve.fill_between(grid, low, high, color=color, alpha=0.25, label=label)
        curve.plot(grid, forecast.predict(grid), color=color, lw=1)
    for b in brackets:
        curve.plot([b.tokens, b.tokens], [b.lower, b.upper], "k-", lw=2)
    curve.set(xscale="log", yscale="log", xlabel="tokens seen D", ylabel="CBS (samples)")
    curve.set_title(f"{name}: the bands from its first {row['fitted']} and {len(brackets) - 1} readings", fontsize=9)
    curve.legend(fontsize=8)
    for scenario, by_n in simulated.items():
        sizes = list(by_n)
        shares.plot(sizes, [by_n[n]["read"] / by_n[n]["points"] for n in sizes], "o-", label=scenario)
    shares.axhline(COVERAGE, color="0.4", ls=":", label="nominal")
    shares.set(xlabel="readings fitted on", ylabel="share of later values read inside the band", ylim=(0, 1.05))
    shares.set_xticks(list(FIT_SIZES))
    shares.legend(fontsize=8)
    return save_figure(figure, path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=200, help="simulated runs per scenario and n (default 200)")
    parser.add_argument(
        "--runs", type=Path, nargs="+", help="run folders with readings (default: outputs/cbs_law/runs/*)"
    )
    parser.add_argument("--markdown", type=Path, help="write its section of this file (docs/RESULTS.md)")
    parser.add_argument("--plot", type=Path, help="write the figure here (e.g. docs/forecast_coverage.png)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds} must be at least 1")
    runs = args.runs or sorted((ROOT / "outputs" / "cbs_law" / "runs").glob("*"))
    if not runs:
        parser.error("no runs with readings: pass --runs RUN_DIR ... (python -m benchmarks.cbs_law writes them)")
    real = truncated_real_runs(runs)
    simulated = {scenario.name: simulated_coverage(scenario, args.seeds) for scenario in SCENARIOS}
    command = " ".join(["python -m benchmarks.forecast_coverage", *argv])
    text = markdown(real, simulated, command, args.seeds, args.plot)
    print(text)
    if args.plot is not None:
        plot_coverage(real, simulated, runs, args.plot)
    if args.markdown is not None:
        from benchmarks.common import replace_section

        replace_section(args.markdown, "forecast_coverage", text)
    return {"real": real, "simulated": simulated}


if __name__ == "__main__":
    main()
