"""Does the CBS forecast's band hold what it says? Its coverage on real probe readings cut short, and on
simulated curves whose truth is known (``lit_cbs.analysis.forecast_cbs``, the 80% band).

(a) Real readings. ``REAL_RUNS`` holds every run of the tiny workload whose readings this
repository's documentation reports (docs/RESULTS.md, docs/benchmarks/cbs_probe.md): each reading as
the interval a forecast is fitted to, its bracket where it is determined, and the 90% interval the
page gives where it is not; an undetermined reading whose interval no page gives is left out (its
interval is not known). For each run and each n from 2 to its number of readings - 1: fit on its
first n readings, and count the later readings whose interval the band overlaps
(``CBSForecast.covers``), and the fits that warned that the readings cannot test the curve's shape.

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
    python -m benchmarks.forecast_coverage --markdown docs/RESULTS.md --plot docs/forecast_coverage.png
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

from lit_cbs.analysis.forecast import Bracket, CBSForecast, forecast_cbs

COVERAGE = 0.8
GRID = 2.0 ** np.arange(16)  # the batches a probe brackets with, samples
PROBE_TOKENS = 65_536 * 2.0 ** np.arange(6)  # tiny_cbs_curve's probe points
FIT_SIZES = (2, 3, 4)  # readings a simulated forecast is fitted on
INF = math.inf

# (tokens, lower, upper samples, determined) per reading; the source says where the page reports them.
REAL_RUNS: dict[str, tuple[str, list[tuple[int, float, float, bool]]]] = {
    **{
        f"tiny_cbs_curve seed {seed}": (
            "docs/RESULTS.md, calibration: two windows, 90% intervals",
            [(65_536, 16, 32, True), (1_116_160, *middle), (2_166_784, *last)],
        )
        for seed, middle, last in (
            (1, (16, 256, False), (128, 256, True)),
            (2, (64, 256, False), (64, 256, False)),
            (3, (64, 256, False), (128, 256, True)),
            (1234, (128, 256, True), (128, 256, True)),
        )
    },
    "tiny_cbs_curve seed 1234, one window": (
        "docs/benchmarks/cbs_probe.md, the curve",
        [(65_536, 16, 32, True), (591_872, 16, 32, True), (1_118_208, 64, 128, True), (2_097_152, 128, 256, True)],
    ),
    "tiny_cbs_curve seed 1, one window": (
        "docs/benchmarks/cbs_probe.md, R-curve, 1 thread (1,118,208: undetermined)",
        [(65_536, 16, 32, True), (591_872, 64, 128, True), (2_097_152, 128, 256, True)],
    ),
    "tiny_cbs_curve seed 2, one window": (
        "docs/benchmarks/cbs_probe.md, R-curve, 1 thread (591,872: undetermined)",
        [(65_536, 16, 32, True), (1_118_208, 128, 256, True), (2_097_152, 128, 256, True)],
    ),
    "transfer tiny seed 1": (
        "docs/RESULTS.md, transfer (593,920: undetermined) and calibration (2,097,152)",
        [(65_536, 16, 32, True), (329_728, 16, 32, True), (1_048_576, 64, 128, True), (2_097_152, 64, INF, False)],
    ),
    "transfer tiny seed 2": (
        "docs/RESULTS.md, transfer (329,728 and 593,920: undetermined)",
        [(65_536, 16, 32, True), (1_048_576, 64, 128, True), (2_097_152, 64, 128, True)],
    ),
    "transfer tiny4x seed 1": (
        "docs/RESULTS.md, transfer (2,097,152: undetermined)",
        [(65_536, 16, 32, True), (329_728, 32, 64, True), (593_920, 64, 128, True), (1_048_576, 64, 128, True)],
    ),
    "transfer tiny4x seed 2": (
        "docs/RESULTS.md, transfer (329,728 and 593,920: undetermined)",
        [(65_536, 16, 32, True), (1_048_576, 64, 128, True), (2_097_152, 64, 128, True)],
    ),
}


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


def real_brackets(name: str) -> list[Bracket]:
    """The readings of ``REAL_RUNS[name]`` as brackets, in tokens order."""
    return [Bracket(float(t), float(lo), float(hi), name, determined) for t, lo, hi, determined in REAL_RUNS[name][1]]


def fitted(brackets: Sequence[Bracket]) -> tuple[CBSForecast, bool]:
    """The forecast fitted to ``brackets`` at COVERAGE, and whether it warned (that is counted, not shown)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forecast = forecast_cbs(brackets, coverage=COVERAGE)
    return forecast, bool(caught)


def truncated_real_runs() -> list[dict]:
    """One row per real run and n: fitted on its first n readings, the later ones' intervals and the band there."""
    rows = []
    for name in REAL_RUNS:
        brackets = real_brackets(name)
        for n in range(2, len(brackets)):
            forecast, warned = fitted(brackets[:n])
            later = [
                {
                    "tokens": b.tokens,
                    "interval": [b.lower, b.upper],
                    "band": [float(x[0]) for x in forecast.band(b.tokens)],
                    "covered": forecast.covers(b),
                }
                for b in brackets[n:]
            ]
            rows.append({"run": name, "fitted": n, "warned": warned, "later": later})
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
    lines = [
        "## Does the forecast's band hold what it says?",
        "",
        f"Command: `{command}` ({datetime.date.today().isoformat()}). "
        f"The {COVERAGE:.0%} posterior predictive band of `forecast_cbs`; its method and the priors are in "
        "lit_cbs/analysis/forecast.py and [science.md](science.md).",
        "",
        "### Real readings cut short",
        "",
        "Each run fitted on its first n readings (intervals as the pages report them; an undetermined reading "
        "whose interval no page gives is left out); covered: the band overlaps the later reading's interval.",
        "",
        "| run | fitted on | warned | later reading: interval -> band (samples) |",
        "|---|---|---|---|",
    ]
    for row in real:
        later = "; ".join(
            f"{p['tokens']:,.0f}: [{p['interval'][0]:g}, {p['interval'][1]:g}] -> "
            f"[{p['band'][0]:.0f}, {p['band'][1]:.0f}]{'' if p['covered'] else ' **missed**'}"
            for p in row["later"]
        )
        lines.append(f"| {row['run']} | first {row['fitted']} | {'yes' if row['warned'] else 'no'} | {later} |")
    missed_unwarned = sum(not p["covered"] for row in real if not row["warned"] for p in row["later"])
    lines += [
        "",
        f"Covered: {covered} of {len(checked)} later readings; every miss without a warning: {missed_unwarned}.",
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


def plot_coverage(real: list[dict], simulated: dict[str, dict[int, dict]], path: Path) -> Path:
    """Left: the run whose flat start a power law cannot see past, fitted on its first 2 and 3 readings;
    right: the simulated share of values read that the band held, against n, beside the nominal coverage."""
    from matplotlib.figure import Figure

    from lit_cbs.analysis.plots import save_figure

    figure = Figure(figsize=(11, 4.5))
    curve, shares = figure.subplots(1, 2)
    name = "tiny_cbs_curve seed 1234, one window"
    brackets = real_brackets(name)
    grid = np.geomspace(brackets[0].tokens / 1.2, brackets[-1].tokens * 1.2, 100)
    for n, color in ((2, "tab:orange"), (3, "tab:blue")):
        forecast, _ = fitted(brackets[:n])
        low, high = forecast.band(grid)
        label = f"{COVERAGE:.0%} band, fitted on the first {n}"
        curve.fill_between(grid, low, high, color=color, alpha=0.25, label=label)
        curve.plot(grid, forecast.predict(grid), color=color, lw=1)
    for b in brackets:
        curve.plot([b.tokens, b.tokens], [b.lower, b.upper], "k-", lw=2)
    curve.set(xscale="log", yscale="log", xlabel="tokens seen D", ylabel="CBS (samples)")
    curve.set_title(f"{name}:\nfitted on 2 readings it warns; the later ones (black) grow past that band", fontsize=9)
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
    parser.add_argument("--markdown", type=Path, help="write its section of this file (docs/RESULTS.md)")
    parser.add_argument("--plot", type=Path, help="write the figure here (e.g. docs/forecast_coverage.png)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds} must be at least 1")
    real = truncated_real_runs()
    simulated = {scenario.name: simulated_coverage(scenario, args.seeds) for scenario in SCENARIOS}
    command = " ".join(["python -m benchmarks.forecast_coverage", *argv])
    text = markdown(real, simulated, command, args.seeds, args.plot)
    print(text)
    if args.plot is not None:
        plot_coverage(real, simulated, args.plot)
    if args.markdown is not None:
        from benchmarks.common import replace_section

        replace_section(args.markdown, "forecast_coverage", text)
    return {"real": real, "simulated": simulated}


if __name__ == "__main__":
    main()
