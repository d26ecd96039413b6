"""How repeatable are the CBS probe's readings, and does an LR cooldown of the branches change late ones?

Experiment R (repeatability) trains the same probed run with seeds 1, 2, 3 and 1 or 2 threads (12 runs
of ``recipes/train.py``, one subprocess each) and compares the readings at each probe point. R-default
is the default job with its own probes (524,288 and 2,097,152 tokens, windows of 131,072 tokens),
cut at 2,359,296 tokens, after its last probe window: nothing before depends on the budget (the LR is
constant after its warmup, the batch schedule's thresholds are absolute tokens, the probe points come
from the probe's own settings), so the readings are those of the full 4,194,304-token job. R-curve
is ``+recipe=tiny_cbs_curve`` (batch 16 throughout, probes at 65,536, ~592k, ~1.12M and 2,097,152
tokens with windows of 524,288 tokens), cut at 2,686,976 tokens. Experiment L (late inflation) trains
R-curve's run again (seeds 1, 2; 2 threads) probed only at its last two points, 1,118,208 and
2,097,152 tokens, with every branch (k = 1 included) decaying its LR linearly towards 0 over its last
25% of steps (``cooldown_fraction=0.25``), and compares with R-curve's constant-LR readings there.

Reported (the section "probe_repeat" of docs/benchmarks/cbs_probe.md, and on the terminal): per
probe point every run's bracket [cbs_lower, cbs_upper] (samples), whether it is determined at the
probe's confidence (0.9), the comparisons that decide it (L_k - L_j and its paired held-out SE,
nats), how many readings are determined and how far apart (grid steps, log2 of the ratio of
cbs_lower) the determined ones lie (goal: never more than one step); per probe point and k the
standard deviation across runs of L_k - L_1 against the median SE the probe reported for it; and
experiment L's branch losses, readings and branch tokens beside R-curve's. Raw numbers:
OUT/probe_repeat.json.

Budget: about 70-90 minutes on 2 shared CPU cores. Runs start in the order above as their threads
come free (1-thread runs two at a time, 2-thread runs one at a time); a finished run (summary.json
in its folder) is not trained again, and its wall time is in its folder's wall_seconds.txt.

Usage::

    python -m benchmarks.probe_repeat                # trains what is missing, writes the report
    python -m benchmarks.probe_repeat --report-only  # the report from the runs finished in OUT
    python -m benchmarks.probe_repeat --quick --out /tmp/repeat   # two short runs, seconds: a pipeline check
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.common import (
    ROOT,
    check_run,
    json_default,
    machine,
    refuse_unless_checked,
    replace_section,
    train_command,
    train_unless_done,
)
from lit_cbs.probe.reading import ProbeReading, difference, read_readings

SEEDS = (1, 2, 3)
THREADS = (1, 2)
CORES = 2  # cores the runs share; a run with T threads takes T of them
DEFAULT_TOKENS = 2_359_296  # the default job cut after its last probe window (2,097,152 + 131,072) and a margin
CURVE_TOKENS = 2_686_976  # tiny_cbs_curve cut after its last probe window (2,097,152 + 524,288) and a margin
LATE_POINTS = (1_118_208, 2_097_152)  # tokens: tiny_cbs_curve's last two probe points (window starts)
COOLDOWN = 0.25  # share of each branch's steps over which its LR decays towards 0 (experiment L)


@dataclass(frozen=True)
class Run:
    key: str
    experiment: str  # default, curve or cooldown
    seed: int
    threads: int  # OMP_NUM_THREADS
    overrides: tuple[str, ...]


# --quick: the default job twice (seeds 1, 2; 1 thread each) on 40,960 tokens, cut where its last window ends,
# probed (k = 1, 2) at 8,192, 16,384 and 32,768 tokens over windows of 8,192 scored on 4 held-out micro-batches, and
# validated on 2 (the whole split every 16,384 tokens cost more than the training): the pipeline in seconds, no
# readings to read.
QUICK_OVERRIDES = (
    "max_tokens=40960",
    "lr_schedule.warmup_tokens=8192",
    "callbacks.cbs_probe.geometric=[8192,2.0]",
    "callbacks.cbs_probe.multipliers=[1,2]",
    "callbacks.cbs_probe.window_tokens=8192",
    "callbacks.cbs_probe.early_stop=null",
    "callbacks.cbs_probe.heldout_batches=4",
    "val_check_tokens=16384",
    "trainer.limit_val_batches=2",
)


def runs_of(quick: bool = False) -> list[Run]:
    """Every run in the order they are started: experiment R (default job, then tiny_cbs_curve), then L;
    with ``quick``, two short runs of the default job."""
    if quick:
        return [Run(f"default_s{seed}_t1", "default", seed, 1, QUICK_OVERRIDES) for seed in SEEDS[:2]]
    # One data window per k, as these experiments were run (tiny_cbs_curve now trains each k on 2).
    curve = ("+recipe=tiny_cbs_curve", f"max_tokens={CURVE_TOKENS}", "callbacks.cbs_probe.replicates=1")
    runs = [
        Run(f"default_s{seed}_t{threads}", "default", seed, threads, (f"max_tokens={DEFAULT_TOKENS}",))
        for threads in (2, 1)
        for seed in SEEDS
    ]
    runs += [Run(f"curve_s{seed}_t{threads}", "curve", seed, threads, curve) for threads in (1, 2) for seed in SEEDS]
    late = (
        "callbacks.cbs_probe.geometric=null",
        f"callbacks.cbs_probe.at_tokens=[{','.join(map(str, LATE_POINTS))}]",
        f"callbacks.cbs_probe.cooldown_fraction={COOLDOWN}",
    )
    runs += [Run(f"cooldown_s{seed}_t2", "cooldown", seed, 2, (*curve, *late)) for seed in (1, 2)]
    return runs


def command_of(run: Run, out: Path) -> list[str]:
    return train_command(
        [
            *run.overrides,
            f"seed={run.seed}",
            f"hydra.run.dir={(out / run.key).resolve()}",
            "trainer.enable_progress_bar=false",
            "callbacks.progress_bar=null",
            "callbacks.checkpoint=null",
            "plots=false",
        ]
    )


def train_all(runs: list[Run], out: Path) -> None:
    """Train ``runs`` in order on CORES cores: a run starts when the one before it has started and
    its threads are free (1-thread runs go two at a time, 2-thread runs one at a time)."""
    free = threading.Condition()
    state = {"cores": CORES, "error": None}

    def train(run: Run) -> None:
        try:
            train_unless_done(
                command_of(run, out),
                out / run.key,
                out / "logs" / f"{run.key}.log",
                run.threads,
                f"[probe_repeat] {run.key}",
            )
            wall = out / run.key / "wall_seconds.txt"
            print(f"[probe_repeat] {run.key} done ({wall.read_text().strip() if wall.exists() else '?'} s)", flush=True)
        except BaseException as error:  # noqa: BLE001 - reported after the others finish
            state["error"] = error
        finally:
            with free:
                state["cores"] += run.threads
                free.notify_all()

    workers = []
    for run in runs:
        with free:
            free.wait_for(lambda threads=run.threads: state["cores"] >= threads or state["error"] is not None)
            if state["error"] is not None:
                break
            state["cores"] -= run.threads
        worker = threading.Thread(target=train, args=(run,))
        worker.start()
        workers.append(worker)
    for worker in workers:
        worker.join()
    if state["error"] is not None:
        raise state["error"]


def load(run: Run, out: Path) -> dict | None:
    """A finished run's readings (cbs_probe.jsonl), epsilon, wall time and command; None if not finished."""
    run_dir = out / run.key
    if not (run_dir / "summary.json").exists():
        return None
    refuse_unless_checked(check_run(run_dir, probes=True), run_dir.name)
    readings = read_readings(run_dir / "cbs_probe.jsonl")
    wall = run_dir / "wall_seconds.txt"
    return {
        **asdict(run),
        "command": " ".join(command_of(run, out)[1:]).replace(str(ROOT) + "/", ""),
        "epsilon": float(OmegaConf.load(run_dir / "resolved_config.yaml").callbacks.cbs_probe.epsilon),
        "wall_seconds": float(wall.read_text()) if wall.exists() else None,
        "readings": readings,
    }


def probe_points(runs: list[dict]) -> list[int]:
    """The probe points (window starts, tokens) of ``runs``: readings within 10% of each other are one
    point, named by the median of their tokens."""
    groups: list[list[int]] = []
    for tokens in sorted(reading.tokens for run in runs for reading in run["readings"]):
        if groups and tokens <= 1.1 * groups[-1][0]:
            groups[-1].append(tokens)
        else:
            groups.append([tokens])
    return [int(statistics.median(group)) for group in groups]


def reading_at(run: dict, point: int, points: list[int]) -> ProbeReading | None:
    """The run's reading whose tokens are nearest to ``point`` among ``points``; None if it has none there."""
    return next((r for r in run["readings"] if min(points, key=lambda p: abs(math.log(r.tokens / p))) == point), None)


def k_text(k: float) -> str:
    return f"{k:g}"


def bracket(reading: ProbeReading) -> str:
    """[lower, upper] in samples (">= lower" at the top of the grid), "?" after it when undetermined."""
    upper = "" if reading.cbs_upper is None else f"{reading.cbs_upper:g}"
    text = f"[{reading.cbs_lower:g}, {upper}]" if upper else f">= {reading.cbs_lower:g}"
    return text if reading.determined else f"{text} ?"


def decisive(reading: ProbeReading) -> list[dict]:
    """The comparisons that decide a reading at its confidence: k* against the smaller k it is nearest to
    exceeding epsilon by (the largest upper bound of L_k* - L_j), and every measured larger k against the
    smaller k it is most clearly beyond epsilon of (the largest lower bound of L_k - L_j); nats."""
    measured, k_star, confidence = reading.scores(), float(reading.k_star), reading.confidence
    finite = sorted(k for k, score in measured.items() if not score.failed)
    found = []
    for k in sorted(k for k in measured if k >= k_star):
        if measured[k].failed:
            found.append({"k": k, "j": None, "role": "failed", "diff": None, "se": None})
            continue
        smaller = {j: difference(measured[k], measured[j]) for j in finite if j < k}
        if not smaller:
            continue
        side = 1 if k == k_star else 0  # k*: its upper bounds must be <= epsilon; larger k: some lower bound > epsilon
        j = max(smaller, key=lambda j: smaller[j].bounds(confidence)[side])
        found.append(
            {"k": k, "j": j, "role": "k*" if k == k_star else "larger", "diff": smaller[j].mean, "se": smaller[j].se}
        )
    return found


def decisive_text(reading: ProbeReading) -> str:
    return "; ".join(
        f"k={k_text(c['k'])} failed"
        if c["role"] == "failed"
        else f"L{k_text(c['k'])}-L{k_text(c['j'])} = {c['diff']:+.4f} ± {c['se']:.4f}"
        for c in decisive(reading)
    )


def repeatability(runs: list[dict]) -> list[dict]:
    """Per probe point: every run's reading, the determined count and the largest disagreement of the
    determined readings' cbs_lower in grid steps (log2 of the ratio)."""
    points = probe_points(runs)
    rows = []
    for point in points:
        readings = {run["key"]: reading_at(run, point, points) for run in runs}
        lowers = [r.cbs_lower for r in readings.values() if r is not None and r.determined]
        steps = math.log2(max(lowers) / min(lowers)) if lowers else None
        rows.append(
            {
                "point": point,
                "readings": readings,
                "determined": len(lowers),
                "measured": sum(r is not None for r in readings.values()),
                "max_steps": steps,
                "over_one_step": steps is not None and steps > 1 + 1e-9,
            }
        )
    return rows


def spread(runs: list[dict], rows: list[dict]) -> list[dict]:
    """Per probe point and k (measured, not failed, in 3 or more runs): L_k - L_1 in each run, their
    standard deviation across runs, the median SE of it the runs reported, and the standard deviation
    within seeds (pooled over the seeds whose two runs, 1 and 2 threads, both measured k:
    sqrt(mean((d_1 - d_2)^2) / 2)), the spread of a repeat of nearly the same run (nats)."""
    found = []
    for row in rows:
        readings = {key: r for key, r in row["readings"].items() if r is not None and r.losses.get("1") is not None}
        ks = sorted({float(k) for r in readings.values() for k, loss in r.losses.items() if loss is not None} - {1.0})
        for k in ks:
            name = k_text(k)
            measured = {key: r.losses for key, r in readings.items() if r.losses.get(name) is not None}
            diffs = {key: losses[name] - losses["1"] for key, losses in measured.items()}
            if len(diffs) < 3:
                continue
            ses = [readings[key].loss_se[name] for key in diffs if readings[key].loss_se.get(name) is not None]
            pairs = [
                (diffs[key], diffs[twin])
                for key in diffs
                if key.endswith("_t1") and (twin := key.removesuffix("_t1") + "_t2") in diffs
            ]
            within = math.sqrt(statistics.mean((a - b) ** 2 for a, b in pairs) / 2) if pairs else None
            found.append(
                {
                    "point": row["point"],
                    "k": k,
                    "runs": len(diffs),
                    "of": len(row["readings"]),
                    "diffs": diffs,
                    "mean": statistics.mean(diffs.values()),
                    "std": statistics.stdev(diffs.values()),
                    "median_se": statistics.median(ses) if ses else None,
                    "within_seed_std": within,
                    "seed_pairs": len(pairs),
                }
            )
    return found


def thread_effect(experiment: str, rows: list[dict]) -> list[dict]:
    """Per seed and probe point: |main_loss with 1 thread - with 2| (nats): are a seed's two runs the same run?"""
    found = []
    for row in rows:
        for seed in SEEDS:
            pair = [row["readings"].get(f"{experiment}_s{seed}_t{threads}") for threads in THREADS]
            if all(r is not None for r in pair):
                gap = abs(pair[0].main_loss - pair[1].main_loss)
                found.append({"point": row["point"], "seed": seed, "main_loss_gap": gap})
    return found


def late_inflation(curve: list[dict], cooled: list[dict]) -> list[dict]:
    """Per seed and late probe point: the reading with a constant branch LR (tiny_cbs_curve, 2 threads)
    and with the cooldown, side by side."""
    by_key = {run["key"]: run for run in curve + cooled}
    found = []
    for run in cooled:
        base = by_key.get(f"curve_s{run['seed']}_t2")
        for reading in run["readings"]:
            point = min(LATE_POINTS, key=lambda p: abs(math.log(reading.tokens / p)))
            at = reading.tokens
            constant = None if base is None else min(base["readings"], key=lambda r: abs(math.log(r.tokens / at)))
            pair = {}
            for name, r in (("constant", constant), ("cooldown", reading)):
                if r is None:
                    continue
                measured = r.scores()
                one = measured.get(1.0)
                pair[name] = {
                    "tokens": r.tokens,
                    "bracket": bracket(r),
                    "cbs_lower": r.cbs_lower,
                    "determined": r.determined,
                    "tokens_spent": r.tokens_spent,
                    "main_loss": r.main_loss,
                    "losses": {k_text(k): s.loss for k, s in sorted(measured.items())},
                    "vs_k1": {
                        k_text(k): ((d := difference(s, one)).mean, d.se)
                        for k, s in sorted(measured.items())
                        if k != 1.0 and one is not None and not s.failed
                    },
                    "monotone": all(
                        b.loss >= a.loss
                        for (_, a), (_, b) in zip(sorted(measured.items()), sorted(measured.items())[1:])
                    ),
                    "decisive": decisive_text(r),
                }
            found.append(
                {
                    "seed": run["seed"],
                    "point": point,
                    **pair,
                    "same_window": constant is not None and constant.tokens == reading.tokens,
                }
            )
    return found


def repeatability_markdown(
    title: str, runs: list[dict], rows: list[dict], spreads: list[dict], threads: list[dict]
) -> list[str]:
    keys = [run["key"] for run in runs]
    lines = [
        f"#### {title}",
        "",
        "| window start (tokens) | " + " | ".join(f"seed {run['seed']}, {run['threads']} thr" for run in runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    for row in rows:
        cells = []
        for key in keys:
            r = row["readings"][key]
            if r is None:
                cells.append("not probed")
                continue
            at = "" if r.tokens == row["point"] else f" (at {r.tokens:,})"
            cells.append(f"{bracket(r)}{at}<br>{decisive_text(r)}")
        lines.append(f"| {row['point']:,} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| window start (tokens) | determined | largest disagreement (grid steps) "
        "| two determined readings > 1 step apart |",
        "|---|---|---|---|",
    ]
    for row in rows:
        steps = "-" if row["max_steps"] is None else f"{row['max_steps']:.0f}"
        lines.append(
            f"| {row['point']:,} | {row['determined']} of {row['measured']} | {steps} "
            f"| {'YES' if row['over_one_step'] else 'no'} |"
        )
    lines += [
        "",
        "Run-to-run spread of L_k - L_1 against the SE the probe reports (nats; std over the runs that measured k, "
        "n - 1 in the denominator; SE: the median of those runs' loss_se):",
        "",
        "| window start (tokens) | k | runs | mean L_k - L_1 | std across runs | median reported SE | std / SE "
        "| std within seeds, 1 vs 2 threads (seeds) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in spreads:
        ratio = "-" if not s["median_se"] else f"{s['std'] / s['median_se']:.1f}"
        se = "-" if s["median_se"] is None else f"{s['median_se']:.4f}"
        within = "-" if s["within_seed_std"] is None else f"{s['within_seed_std']:.4f} ({s['seed_pairs']})"
        lines.append(
            f"| {s['point']:,} | {k_text(s['k'])} | {s['runs']} of {s['of']} | {s['mean']:+.4f} | {s['std']:.4f} "
            f"| {se} | {ratio} | {within} |"
        )
    if threads:
        gaps = {}
        for t in threads:
            gaps[t["point"]] = max(gaps.get(t["point"], 0.0), t["main_loss_gap"])
        lines += [
            "",
            "Same seed, 1 vs 2 threads: the largest gap between the two runs' main-run held-out loss at the window's "
            "end (nats; threads change the order of floating-point sums, so a seed's two runs drift apart and are not "
            "independent samples while the gap is small): "
            + ", ".join(f"{gap:.4f} at {point:,}" for point, gap in gaps.items())
            + ".",
        ]
    return lines


def late_markdown(pairs: list[dict]) -> list[str]:
    lines = [
        "| seed | window start (tokens) | branch LR | main run's L | L_1 | L_k - L_1 ± SE | reading | decisive "
        "| L monotone in k | tokens spent |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pair in pairs:
        for name in ("constant", "cooldown"):
            v = pair.get(name)
            if v is None:
                continue
            diffs = ", ".join(f"k={k}: {d:+.4f} ± {se:.4f}" for k, (d, se) in v["vs_k1"].items())
            lines.append(
                f"| {pair['seed']} | {v['tokens']:,} "
                f"| {'constant' if name == 'constant' else f'cooldown {COOLDOWN:.0%}'} | {v['main_loss']:.4f} "
                f"| {v['losses'].get('1', math.nan):.4f} | {diffs} | {v['bracket']} | {v['decisive']} "
                f"| {'yes' if v['monotone'] else 'no'} | {v['tokens_spent']:,} |"
            )
    verdicts = []
    for pair in pairs:
        c, d = pair.get("constant"), pair.get("cooldown")
        if c is None or d is None:
            continue
        change = (
            "smaller"
            if d["cbs_lower"] < c["cbs_lower"]
            else "larger"
            if d["cbs_lower"] > c["cbs_lower"]
            else "the same"
        )
        verdicts.append(
            f"- seed {pair['seed']}, {pair['point']:,} tokens: with cooldown the reading is {change} "
            f"({d['bracket']} vs {c['bracket']}); losses monotone in k: {'yes' if d['monotone'] else 'no'} "
            f"with cooldown, {'yes' if c['monotone'] else 'no'} without; "
            f"cost {d['tokens_spent']:,} vs {c['tokens_spent']:,} tokens"
            + ("" if pair["same_window"] else "; **the window starts differ**")
        )
    return lines + [""] + verdicts


def markdown(results: dict, quick: bool = False) -> str:
    runs = [run for experiment in results["runs"].values() for run in experiment]
    lines = [
        "### Setup",
        "",
        f"Command: `python -m benchmarks.probe_repeat` ({results['date']}, training {results['minutes']} minutes; "
        f"{results['machine']}; 2 cores shared with other jobs, so wall times vary); report: "
        "`python -m benchmarks.probe_repeat --report-only`.",
        "",
        (__doc__ or "").split("\n\n")[1].replace("\n", " "),
        "",
    ]
    lines += [
        "### Runs",
        "",
        "| run | experiment | seed | threads | wall (s) | probes | branch tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        wall = "-" if run["wall_seconds"] is None else f"{run['wall_seconds']:.0f}"
        lines.append(
            f"| {run['key']} | {run['experiment']} | {run['seed']} | {run['threads']} | {wall} "
            f"| {len(run['readings'])} | {sum(r.tokens_spent for r in run['readings']):,} |"
        )
    missing = [run.key for run in runs_of(quick) if run.key not in {r["key"] for r in runs}]
    if missing:
        lines += ["", f"**Incomplete: not finished: {', '.join(missing)}.**"]
    lines += ["", "Commands (from the repository root, `PYTHONPATH=$PWD OMP_NUM_THREADS=<threads>`):", ""]
    lines += [f"- {run['key']}: `python {run['command']}`" for run in runs]
    lines += [
        "",
        "### 1-2. Repeatability (experiment R)",
        "",
        "Each cell: the reading's bracket [cbs_lower, cbs_upper] in samples (`?`: undetermined at confidence 0.9), "
        "then the comparisons that decide it: k* against the smaller k it comes nearest to exceeding epsilon (0.02 "
        "nats) by, and each measured larger k against the smaller k it most clearly exceeds epsilon by (paired "
        "held-out SE).",
    ]
    for experiment, title in (("default", "R-default: the default job"), ("curve", "R-curve: +recipe=tiny_cbs_curve")):
        r = results["repeatability"].get(experiment)
        if r:
            lines += [""] + repeatability_markdown(
                title, results["runs"][experiment], r["rows"], r["spread"], r["threads"]
            )
    lines += [
        "",
        "### 3. Late inflation (experiment L): branch LR cooldown",
        "",
        "tiny_cbs_curve's main run (seeds 1, 2; 2 threads), probed at its late points with every branch (k = 1 "
        f"included) decaying its LR linearly towards 0 over its last {COOLDOWN:.0%} of steps, against R-curve's "
        "readings of the same run at the same window starts (constant branch LR; k = 1 is the main run). Main run's L: "
        "the main run's held-out loss at the window's end, the same model in both rows; L_1: the k = 1 branch's (with "
        "cooldown: after its own LR decay).",
        "",
    ]
    lines += late_markdown(results["late"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "outputs" / "probe_repeat", help="folder for the runs and probe_repeat.json"
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="write the section 'probe_repeat' of this file (the text around it is kept; default "
        "docs/benchmarks/cbs_probe.md, none with --quick)",
    )
    parser.add_argument("--report-only", action="store_true", help="train nothing: report the runs finished in OUT")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=(
            "two short runs of the default job (seconds): a pipeline check; writes markdown only where --markdown says"
        ),
    )
    args = parser.parse_args(argv)
    if args.markdown is None and not args.quick:
        args.markdown = ROOT / "docs" / "benchmarks" / "cbs_probe.md"
    args.out.mkdir(parents=True, exist_ok=True)
    minutes_file = args.out / "minutes.txt"
    if not args.report_only:
        started = time.perf_counter()
        train_all(runs_of(args.quick), args.out)
        minutes_file.write_text(f"{(time.perf_counter() - started) / 60:.1f}\n")
    loaded = [run for run in (load(run, args.out) for run in runs_of(args.quick)) if run is not None]
    by_experiment = {
        name: [run for run in loaded if run["experiment"] == name] for name in ("default", "curve", "cooldown")
    }
    results = {
        "date": str(datetime.date.today()),
        "machine": machine(),
        "minutes": minutes_file.read_text().strip() if minutes_file.exists() else "?",
        "runs": by_experiment,
        "repeatability": {},
        "late": late_inflation(by_experiment["curve"], by_experiment["cooldown"]),
    }
    for experiment in ("default", "curve"):
        runs = by_experiment[experiment]
        if runs:
            rows = repeatability(runs)
            results["repeatability"][experiment] = {
                "rows": rows,
                "spread": spread(runs, rows),
                "threads": thread_effect(experiment, rows),
            }
    (args.out / "probe_repeat.json").write_text(json.dumps(results, indent=2, default=json_default))
    text = markdown(results, args.quick)
    if args.markdown is not None:
        replace_section(args.markdown, "probe_repeat", text)
    print(text, flush=True)
    print(
        f"[probe_repeat] {args.out / 'probe_repeat.json'}" + (f"; {args.markdown}" if args.markdown else ""), flush=True
    )
    return results


if __name__ == "__main__":
    main()
