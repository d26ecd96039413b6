"""Do the CBS probe's readings hold on runs of other seeds?

The held-out SE of a reading covers the held-out batches, not the data the branches trained on, so
readings of the same point by runs of other seeds disagreed by more than their error bars said
(docs/benchmarks/cbs_probe.md). ``CBSProbeCallback(replicates=2)`` trains each measured k on two
disjoint windows of data and adds their spread to every comparison's SE. This benchmark measures
what that buys, with the recipes a user runs (``recipes/train.py``, one subprocess each):

- default: the default job, ``callbacks.cbs_probe.replicates=2`` (probes at 524,288 and
  2,097,152 tokens, windows of 131,072), cut at 2,621,440 tokens, after its last probe.
- curve: ``+recipe=tiny_cbs_curve`` (batch 16, k = 1..16 over windows of 524,288 tokens, replicates
  2: readings at 65,536, ~1.1M and ~2.2M tokens), cut at 3,276,800 tokens, after its last probe.

each with seeds 1, 2, 3 and 1234. Before any batch change the readings do not depend on the budget
(constant LR after warmup, absolute thresholds), so they are those of the full 4,194,304-token runs.

Reported (the section "calibration" of docs/RESULTS.md):

1. Readings, per probe point and seed: the bracket as the probe judged it (both windows) and as the
   first window alone judges it (the data a probe with ``replicates=1`` has, up to bisection's
   choice of k), each with its 90% interval (``lit_cbs.analysis.forecast.supported_interval``: a
   determined reading's bracket; an undetermined one's wider interval). Goals: determined readings
   of the same point within one grid step of each other (all), and the 90% interval holding the
   across-seed median bracket (the medians of the seeds' lower and upper ends; geometric mean of
   the middle two for an even count) in >= 85% of the determined, non-trivial readings. Beside them,
   the standard deviation across seeds of L_k - L_1 against the median SE the readings reported, both
   ways, and what the second window cost in branch tokens.
   Coverage is counted apart for each kind of reading: determined above the floor of the grid (the only kind
   that tests the interval), trivial (determined at the floor: k* the smallest k, which every seed reads alike)
   and undetermined (an interval as wide as its data leave it). Forecasts are checked in
   ``benchmarks.forecast_coverage``, on readings read from run files.

Raw numbers: OUT/calibration.json. Budget: about 45-60 minutes on 2 CPU cores (8 runs, 2 at a time
with one thread each); a finished run (summary.json in its folder) is not trained again.

Usage::

    python -m benchmarks.calibration                # trains what is missing, writes the report
    python -m benchmarks.calibration --report-only
    python -m benchmarks.calibration --quick --out /tmp/calibration   # short runs, seconds: a pipeline check
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.common import (
    check_run,
    git_commit,
    json_default,
    machine,
    recipe_benchmark_arguments,
    refuse_unless_checked,
    replace_section,
    train_unless_done,
)
from benchmarks.probe_repeat import command_of, probe_points, reading_at
from benchmarks.transfer import probe_file
from lit_cbs.analysis.forecast import supported_interval
from lit_cbs.probe.reading import BranchScore, ProbeReading, read_readings

SEEDS = (1, 2, 3, 1234)
GOALS = {"agreement_steps": 1, "median_held": 0.85}
# A reading's kind: only a determined reading above the floor of the grid says where the CBS is; one at the floor
# (k* the smallest k) every seed reads alike, and an undetermined one's interval is wide: neither tests calibration.
KINDS = ("determined", "trivial", "undetermined")


@dataclass(frozen=True)
class Run:
    key: str
    experiment: str  # default or curve
    seed: int
    overrides: tuple[str, ...]


EXPERIMENTS = {
    "default": ("max_tokens=2621440", "callbacks.cbs_probe.replicates=2"),
    "curve": ("+recipe=tiny_cbs_curve", "max_tokens=3276800"),
}
# --quick: the default job with samples of 32 tokens, not 128 (the same steps and probes for a quarter of the tokens),
# on 12,288 tokens, cut where its last probe ends; probed (k = 1, 2, 4) at 2,048 and 8,192 tokens over two windows of
# 2,048 (one step of k = 4).
QUICK = (
    "data.seq_len=32",
    "max_tokens=12288",
    "lr_schedule.warmup_tokens=2048",
    "callbacks.cbs_probe.geometric=[2048,4.0]",
    "callbacks.cbs_probe.multipliers=[1,2,4]",
    "callbacks.cbs_probe.window_tokens=2048",
    "callbacks.cbs_probe.heldout_batches=4",
    "callbacks.cbs_probe.replicates=2",
    "val_check_tokens=6144",
    "trainer.limit_val_batches=2",
)


def runs_of(quick: bool) -> list[Run]:
    if quick:
        return [Run(f"default_s{seed}", "default", seed, QUICK) for seed in SEEDS[:3]]
    return [Run(f"{name}_s{seed}", name, seed, overrides) for name, overrides in EXPERIMENTS.items() for seed in SEEDS]


def train(run: Run, out: Path, threads: int) -> None:
    train_unless_done(
        command_of(run, out), out / run.key, out / "logs" / f"{run.key}.log", threads, f"[calibration] {run.key}"
    )
    print(f"[calibration] {run.key} done", flush=True)


def run_readings(run_dir: Path) -> list[ProbeReading]:
    refuse_unless_checked(check_run(run_dir, probes=True), run_dir.name)
    return read_readings(probe_file(run_dir))


def load(run: Run, out: Path) -> dict | None:
    """A finished run's readings, each also as its first window alone judges it (``alone``, by tokens)."""
    run_dir = out / run.key
    if not (run_dir / "summary.json").exists():
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    wall = run_dir / "wall_seconds.txt"
    multipliers = [float(k) for k in OmegaConf.load(run_dir / "resolved_config.yaml").callbacks.cbs_probe.multipliers]
    readings = run_readings(run_dir)
    return {
        **asdict(run),
        "readings": readings,
        "alone": {r.tokens: first_window(r, multipliers) for r in readings},
        "multipliers": multipliers,
        "tokens": summary["tokens"],
        "command": " ".join(command_of(run, out)[1:]),
        "wall_seconds": float(wall.read_text()) if wall.exists() else None,
    }


# ---------------------------------------------------------------------------- 1. readings
def first_window(reading: ProbeReading, multipliers: list[float]) -> ProbeReading:
    """``reading`` as its first data window alone judges it: the reading a probe with ``replicates=1``
    would have taken from the same branches."""
    windows = reading.replicate_batch_losses
    failed = BranchScore(math.inf)
    scores = {float(k): BranchScore.heldout(windows[k][0]) if k in windows else failed for k in reading.losses}
    kept = ("tokens", "step", "seq_len", "window_tokens", "search", "evaluate", "main_loss", "failed", "tokens_spent")
    kept += ("overhead",)
    return ProbeReading.decide(
        scores,
        reading.epsilon,
        reading.confidence,
        multipliers,
        reading.batch_size,
        branches_trained=sorted(set(reading.branches_trained)),
        **{key: getattr(reading, key) for key in kept},
    )


def nearest(reading: ProbeReading, points: list[int]) -> int:
    """The probe point (``probe_repeat.probe_points``) ``reading`` belongs to."""
    return min(points, key=lambda p: abs(math.log(reading.tokens / p)))


def median_bracket(brackets: list[tuple[float, float | None]]) -> tuple[float, float]:
    """The medians of the brackets' lower and upper ends (samples; no upper end, None, counts as inf;
    the geometric mean of the middle two for an even count)."""

    def median(values: list[float]) -> float:
        values = sorted(values)
        middle = len(values) // 2
        if len(values) % 2:
            return values[middle]
        a, b = values[middle - 1], values[middle]
        return math.inf if math.isinf(b) else math.sqrt(a * b)

    return (
        median([lower for lower, _ in brackets]),
        median([math.inf if upper is None else upper for _, upper in brackets]),
    )


def judge_readings(runs: list[dict]) -> list[dict]:
    """Per experiment and probe point: each seed's reading judged over both windows and over the first
    alone, its 90% interval, and whether that interval holds the median bracket of the other seeds'
    two-window readings."""
    rows = []
    for experiment in EXPERIMENTS:
        group = [run for run in runs if run["experiment"] == experiment]
        points = probe_points(group)
        for point in points:
            found = {run["seed"]: (run, reading_at(run, point, points)) for run in group}
            readings = {seed: reading for seed, (_, reading) in found.items() if reading is not None}
            for seed, reading in readings.items():
                others = [r for s, r in readings.items() if s != seed]
                reference = median_bracket([(r.cbs_lower, r.cbs_upper) for r in others]) if others else None
                row = {
                    "experiment": experiment,
                    "point": point,
                    "seed": seed,
                    "tokens": reading.tokens,
                    "reference": reference,
                }
                for name, judged in (("two", reading), ("one", found[seed][0]["alone"][reading.tokens])):
                    low, high = supported_interval(judged)
                    floor = judged.k_star == min(float(k) for k in judged.losses)
                    row[name] = {
                        "lower": judged.cbs_lower,
                        "upper": judged.cbs_upper,
                        "determined": judged.determined,
                        "kind": KINDS[2] if not judged.determined else KINDS[1] if floor else KINDS[0],
                        "interval": [low, high],
                        "holds": None if reference is None else low <= reference[0] and reference[1] <= high,
                    }
                rows.append(row)
    return rows


def agreement(rows: list[dict], judgement: str) -> list[dict]:
    """Per experiment and point: the determined readings and how far apart they lie (grid steps, log2)."""
    found = []
    for key in sorted(
        {(row["experiment"], row["point"]) for row in rows}, key=lambda k: (list(EXPERIMENTS).index(k[0]), k[1])
    ):
        lowers = [
            row[judgement]["lower"]
            for row in rows
            if (row["experiment"], row["point"]) == key and row[judgement]["determined"]
        ]
        found.append(
            {
                "experiment": key[0],
                "point": key[1],
                "determined": len(lowers),
                "of": sum((row["experiment"], row["point"]) == key for row in rows),
                "steps": math.log2(max(lowers) / min(lowers)) if lowers else None,
            }
        )
    return found


def spread(runs: list[dict]) -> list[dict]:
    """Per experiment, point and k measured by 3+ seeds: the standard deviation across seeds of L_k - L_1
    against the median SE the readings report for it, over both windows and over the first alone (nats)."""
    found = []
    for experiment in EXPERIMENTS:
        group = [run for run in runs if run["experiment"] == experiment]
        points = probe_points(group)
        for point in points:
            measured = [(run, r) for run in group if (r := reading_at(run, point, points)) is not None]
            readings = [r for _, r in measured]
            judged = {"two": readings, "one": [run["alone"][r.tokens] for run, r in measured]}
            ks = sorted({float(k) for r in readings for k, loss in r.losses.items() if loss is not None} - {1.0})
            for k in ks:
                name = f"{k:g}"
                row = {"experiment": experiment, "point": point, "k": k}
                for way, records in judged.items():
                    diffs = [
                        r.losses[name] - r.losses["1"]
                        for r in records
                        if r.losses.get(name) is not None and r.losses.get("1") is not None
                    ]
                    ses = [r.loss_se[name] for r in records if r.loss_se.get(name) is not None]
                    if len(diffs) < 3 or not ses:
                        break
                    row[way] = {
                        "runs": len(diffs),
                        "mean": statistics.mean(diffs),
                        "std": statistics.stdev(diffs),
                        "median_se": statistics.median(ses),
                    }
                else:
                    found.append(row)
    return found


def cost(run: dict) -> dict:
    """Branch tokens the run's probes spent, and what their first windows alone spent."""
    spent = sum(r.tokens_spent for r in run["readings"])
    first = sum(
        sum(1 for k in set(r.branches_trained) if r.branches_trained.count(k) == r.replicates) * r.window_tokens
        for r in run["readings"]
    )
    return {"tokens": spent, "first_window_tokens": first, "main_tokens": run["tokens"]}


# ---------------------------------------------------------------------------- report
def goals(rows: list[dict], agreed: list[dict]) -> list[tuple[str, bool]]:
    found = []
    apart = [a["steps"] for a in agreed if a["steps"] is not None]
    found.append(
        (
            f"determined readings of a point at most {GOALS['agreement_steps']} grid step apart at "
            f"{sum(x <= GOALS['agreement_steps'] + 1e-9 for x in apart)} of {len(apart)} points (goal: all)",
            all(x <= GOALS["agreement_steps"] + 1e-9 for x in apart),
        )
    )
    judged = [row["two"]["holds"] for row in rows if row["two"]["holds"] is not None and row["two"]["kind"] == KINDS[0]]
    if judged:
        share = sum(judged) / len(judged)
        found.append(
            (
                f"the 90% interval of a determined, non-trivial reading holds the other seeds' median bracket in "
                f"{sum(judged)} of {len(judged)} ({share:.0%}; goal >= {GOALS['median_held']:.0%})",
                share >= GOALS["median_held"],
            )
        )
    return found


def span(pair) -> str:
    low, high = pair
    return f"[{low:g}, {'inf' if high is None or math.isinf(high) else f'{high:g}'}]"


def cell(judged: dict) -> str:
    text = span([judged["lower"], judged["upper"]]) + ("" if judged["determined"] else " ?")
    mark = {True: "holds", False: "**misses**", None: "-"}[judged["holds"]]
    return f"{text}; 90%: {span(judged['interval'])} {mark}"


def markdown(
    runs: list[dict],
    rows: list[dict],
    agreed: dict[str, list[dict]],
    spreads: list[dict],
    costs: dict,
    found: list[tuple[str, bool]],
    args,
    plot_path: Path,
) -> str:
    lines = [
        "## Are the probe's readings calibrated across runs?",
        "",
        f"Command: `python -m benchmarks.calibration {' '.join(args.argv)}`".rstrip()
        + f" at commit {git_commit()} ({args.date}; {machine(os.getloadavg())}).",
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        "Runs (commands from the repository root, `OMP_NUM_THREADS=1`, two at a time):",
        "",
    ]
    lines += [
        (
            f"- {run['key']}: `python "
            f"{run['command'].split('/recipes/', 1)[-1] if '/recipes/' in run['command'] else run['command']}`"
        ).replace("python train.py", "python recipes/train.py")
        for run in runs
    ]
    lines += [
        "",
        "### 1. Readings",
        "",
        "Each cell: the bracket (samples; `?` undetermined at 90%), then its 90% interval and whether that holds "
        "the median bracket of the other seeds' two-window readings. *Two windows*: as the probe judged it "
        "(replicates=2); *first window*: its first window's data alone, as a probe with replicates=1 has them.",
        "",
    ]
    seeds = sorted({row["seed"] for row in rows})
    for experiment in EXPERIMENTS:
        mine = [row for row in rows if row["experiment"] == experiment]
        if not mine:
            continue
        lines += [
            f"#### {experiment}",
            "",
            "| point (tokens) | judged on | " + " | ".join(f"seed {s}" for s in seeds) + " | median of all |",
            "|---|---|" + "---|" * (len(seeds) + 1),
        ]
        for point in sorted({row["point"] for row in mine}):
            here = {row["seed"]: row for row in mine if row["point"] == point}
            overall = median_bracket([(r["two"]["lower"], r["two"]["upper"]) for r in here.values()])
            for way, label in (("two", "two windows"), ("one", "first window")):
                lines.append(
                    f"| {point:,} | {label} | "
                    + " | ".join(cell(here[s][way]) if s in here else "-" for s in seeds)
                    + f" | {span(overall) if way == 'two' else ''} |"
                )
        lines += [""]
    lines += [
        "Determined readings of a point, and how far apart (grid steps, log2 of the ratio of lower ends):",
        "",
        "| experiment | point (tokens) | two windows: determined, apart | first window: determined, apart |",
        "|---|---|---|---|",
    ]
    for two, one in zip(agreed["two"], agreed["one"]):

        def text(a):
            return f"{a['determined']} of {a['of']}, " + ("-" if a["steps"] is None else f"{a['steps']:.0f}")

        lines.append(f"| {two['experiment']} | {two['point']:,} | {text(two)} | {text(one)} |")
    lines += [
        "",
        "The 90% interval holds the other seeds' median bracket, by the reading's kind (determined: above the floor "
        "of the grid; trivial: determined at the floor, k* the smallest k, which every seed reads alike; "
        "undetermined: the wider interval its data support):",
        "",
        "| judged on | " + " | ".join(KINDS) + " |",
        "|---|---|---|---|",
    ]
    for way, label in (("two", "two windows"), ("one", "first window alone")):
        counts = []
        for kind in KINDS:
            held = [row[way]["holds"] for row in rows if row[way]["holds"] is not None and row[way]["kind"] == kind]
            counts.append(f"{sum(held)} of {len(held)}")
        lines.append(f"| {label} | " + " | ".join(counts) + " |")
    lines += [
        "",
        "Run-to-run spread of L_k - L_1 against the SE the readings report "
        "(nats; std across seeds, n - 1; SE: their median):",
        "",
        "| experiment | point (tokens) | k | seeds | mean (two windows) | std | median SE | std / SE "
        "| first window: std | median SE | std / SE |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in spreads:
        two, one = row["two"], row["one"]
        lines.append(
            f"| {row['experiment']} | {row['point']:,} | {row['k']:g} | {two['runs']} | {two['mean']:+.4f} "
            f"| {two['std']:.4f} | {two['median_se']:.4f} | {two['std'] / two['median_se']:.1f} | {one['std']:.4f} "
            f"| {one['median_se']:.4f} | {one['std'] / one['median_se']:.1f} |"
        )
    lines += [
        "",
        "What the second window costs (branch tokens of all probes of a run; the main run's tokens beside them):",
        "",
        "| run | branch tokens | of which the first windows | main-run tokens | wall s |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        c = costs[run["key"]]
        lines.append(
            f"| {run['key']} | {c['tokens']:,} | {c['first_window_tokens']:,} | {c['main_tokens']:,} "
            f"| {run['wall_seconds'] or 0:.0f} |"
        )
    lines += [
        "",
        'Forecasts on readings they did not see: the section "Does the forecast\'s band hold what it says?" '
        "(benchmarks.forecast_coverage, from run files).",
        "",
        "Goals:",
        "",
        *[f"- {text}: {'met' if ok else 'MISSED'}" for text, ok in found],
        "",
        "![90% intervals of every seed's readings, two windows and one]"
        f"({os.path.relpath(plot_path, args.markdown.parent)})"
        if args.markdown
        else "",
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    """Per experiment: every seed's 90% interval at each point, over the first window alone and over both."""
    from matplotlib.figure import Figure

    from lit_cbs.analysis.plots import save_figure

    experiments = [e for e in EXPERIMENTS if any(row["experiment"] == e for row in rows)]
    figure = Figure(figsize=(6.5 * len(experiments), 4.5))
    axes = figure.subplots(1, len(experiments), squeeze=False)[0]
    seeds = sorted({row["seed"] for row in rows})
    for axis, experiment in zip(axes, experiments):
        mine = [row for row in rows if row["experiment"] == experiment]
        top = 2 * max(max(r[w]["interval"][0] for w in ("one", "two")) for r in mine)
        slots = 2 * len(seeds)  # per point: each seed's first window, then its two windows, side by side
        for row in mine:
            index = seeds.index(row["seed"])
            for way, slot, width, alpha in (("one", 2 * index, 2, 0.45), ("two", 2 * index + 1, 4, 0.95)):
                x = row["point"] * 1.05 ** (slot - (slots - 1) / 2)
                low, high = row[way]["interval"]
                axis.plot(
                    [x, x],
                    [low, min(high, top)],
                    color=f"C{index}",
                    lw=width,
                    alpha=alpha,
                    ls="-" if math.isfinite(high) else ":",
                    solid_capstyle="butt",
                )
        for point in sorted({row["point"] for row in mine}):
            here = [row for row in mine if row["point"] == point]
            overall = median_bracket([(r["two"]["lower"], r["two"]["upper"]) for r in here])
            edges = [point * 1.05 ** (-(slots + 1) / 2), point * 1.05 ** ((slots + 1) / 2)]
            axis.fill_between(edges, [overall[0]] * 2, [min(overall[1], top)] * 2, color="0.5", alpha=0.15, lw=0)
        for index, seed in enumerate(seeds):
            axis.plot([], [], color=f"C{index}", lw=4, label=f"seed {seed}")
        axis.plot([], [], color="0.3", lw=2, alpha=0.45, label="thin: first window alone; thick: two windows")
        axis.fill_between([], [], [], color="0.5", alpha=0.15, label="median bracket of all seeds (two windows)")
        ticks = [2**n for n in range(3, 12) if 2**n <= top * 1.5]
        axis.set(
            xscale="log",
            yscale="log",
            xlabel="tokens at the probe",
            ylabel="CBS, samples: each reading's 90% interval",
            title=f"{experiment}: where each seed's reading places the CBS",
        )
        axis.set_yticks(ticks, labels=[str(t) for t in ticks])
        axis.minorticks_off()
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6, loc="upper left")
    return save_figure(figure, path)


def main(argv: list[str] | None = None) -> dict:
    args = recipe_benchmark_arguments(
        "calibration",
        __doc__.split("\n\n")[0],
        "3 short runs of the default job: a pipeline check, no results",
        argv,
    )
    planned = runs_of(args.quick)
    started = time.perf_counter()
    if not args.report_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            for future in [pool.submit(train, run, args.out, args.threads) for run in planned]:
                future.result()
    runs = [run for run in (load(run, args.out) for run in planned) if run is not None]
    rows = judge_readings(runs)
    agreed = {way: agreement(rows, way) for way in ("two", "one")}
    spreads = spread(runs)
    costs = {run["key"]: cost(run) for run in runs}
    found = goals(rows, agreed["two"])
    result = {
        "rows": rows,
        "agreement": agreed,
        "spread": spreads,
        "costs": costs,
        "goals": [{"goal": text, "met": ok} for text, ok in found],
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    (args.out / "calibration.json").write_text(json.dumps(result, indent=2, default=json_default))
    for text, ok in found:
        print(f"[calibration] {text}: {'met' if ok else 'MISSED'}")
    plot(rows, args.plot)
    if args.markdown:
        replace_section(
            args.markdown, "calibration", markdown(runs, rows, agreed, spreads, costs, found, args, args.plot)
        )
    print(
        f"[calibration] {result['seconds'] / 60:.1f} minutes; {args.out / 'calibration.json'}; plot {args.plot}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
