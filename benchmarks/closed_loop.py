"""The closed loop's cost and saving, side by side: does CBS-adaptive warmup with side-job probes reach the control's
loss in as few main-run steps as the hand warmup, without slowing the main run, at a small price in device time?

Four runs of ``recipes/train.py`` on the tiny workload (4,194,304 tokens, base batch 16 x 128 tokens), per seed:

- ``control``: ``+recipe=tiny_small_batch``, batch 16 throughout;
- ``hand``: ``+recipe=tiny_warmup callbacks.cbs_probe=null``, 16 -> 32 -> 64 at hand-read thresholds;
- ``adaptive_in_process``: ``+recipe=tiny_adaptive``, CBSAdaptive fed by probes whose branches train while the run
  waits;
- ``adaptive_side_jobs``: the same with ``side_jobs=local side_jobs.launcher.threads=1``: a process on the other core
  trains the branches while the run trains on as k = 1.

Protocol: the main run on one thread (its side jobs on one thread of their own: the machine's two cores), one run at
a time, seeds 1, 2 and 11 (11 used by no benchmark before), each twice (``--repeats``), the four configurations of a
(seed, repeat) in an order that rotates. Every run validates on the same 16 held-out micro-batches every 131,072
tokens. With a constant LR the held-out loss moves by about 0.02 nats from one evaluation to the next, the size of
the margin, so every curve is smoothed over two evaluations (each point the mean of it and the one before), as Table 1
averages the last two: the target is the seed's control's final smoothed held-out loss + 0.02 nats. Per run, read
off its smoothed validation curve (linear between evaluations): main-run optimizer steps to the target, the same
plus the probe branches' steps of the probe points started before it, main-run wall seconds to it
(``fit_seconds``), and device-seconds to it: the main run's seconds (one core) plus the CPU seconds of its side jobs
started before it (imports included). Also the final smoothed loss, the readings and the batch changes, and what
the main run waited for its side jobs (``summary.json``).

Every run is checked before anything is written (``benchmarks.common.check_run``): a probing run must have readings,
none failed or pending; a warmup must change its batch. A run that did not do what its row claims stops the
benchmark with no table.

Usage::

    python -m benchmarks.closed_loop                        # 3 seeds x 2 repeats x 4 runs: about 60 minutes on 2 cores
    python -m benchmarks.closed_loop --quick --out /tmp/cl  # 1/16 of the budget, one seed, one repeat
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    ROOT,
    check_run,
    git_commit,
    json_default,
    machine,
    read_run,
    refuse_unless_checked,
    replace_section,
    run_logged,
    train_command,
)
from benchmarks.time_to_loss import TARGET_MARGIN, smoothed, time_to
from lit_cbs.probe.reading import read_readings

NAME = "closed_loop"
BUDGET = 4_194_304  # tokens: the default job's
SEEDS = (1, 2, 11)
SIDE_JOBS = ["side_jobs=local", "side_jobs.launcher.threads=1"]
CONFIGS = {
    "control": ["+recipe=tiny_small_batch"],
    "hand": ["+recipe=tiny_warmup", "callbacks.cbs_probe=null"],
    "adaptive_in_process": ["+recipe=tiny_adaptive"],
    "adaptive_side_jobs": ["+recipe=tiny_adaptive", *SIDE_JOBS],
}
LABELS = {
    "control": "small batch (16)",
    "hand": "batch warmup, hand thresholds",
    "adaptive_in_process": "CBS-adaptive, in-process probes",
    "adaptive_side_jobs": "CBS-adaptive, side-job probes",
}
CHECKS = {  # what a run of each configuration must have done (check_run)
    "control": {},
    "hand": {"changes_batch": True},
    "adaptive_in_process": {"probes": True, "changes_batch": True},
    "adaptive_side_jobs": {"probes": True, "changes_batch": True},
}
GOALS = {"steps": 1.10, "wall": 1.05, "side_device_share": 0.20}  # side-job adaptive against the hand warmup


def scaled(tokens: int, scale: float) -> int:
    """``tokens`` x ``scale``, a whole number of 64 x 128-token batches (the largest a threshold must fit)."""
    return max(8192, int(round(tokens * scale / 8192)) * 8192)


def overrides(key: str, seed: int, budget: int, run_dir: Path) -> list[str]:
    """The train.py overrides of one run at ``budget`` tokens: the recipes' token counts keep their share of it."""
    scale = budget / BUDGET
    common = [
        f"seed={seed}",
        f"max_tokens={budget}",
        f"val_check_tokens={scaled(131_072, scale)}",
        f"trainer.limit_val_batches={16 if budget == BUDGET else 4}",
        "trainer.enable_progress_bar=false",
        "callbacks.progress_bar=null",
        "callbacks.checkpoint=null",
        "plots=false",
        f"hydra.run.dir={run_dir}",
    ]
    if budget != BUDGET:
        common.append(f"lr_schedule.warmup_tokens={scaled(262_144, scale)}")
        if key == "hand":
            common.append(f"batch.schedule.thresholds=[0,{scaled(1_245_184, scale)},{scaled(2_523_136, scale)}]")
        if key.startswith("adaptive"):
            common += QUICK_PROBE
    return [*CONFIGS[key], *common]


# --quick checks the pipeline, not the result: probes from 16,384 tokens over windows that hold a step of k = 2 at
# batch 64, tolerant enough that the loop acts within the small budget, which outlasts a side job's start-up (a
# process that imports torch and Lightning: the main run trains about 100k tokens meanwhile) with room to spare.
QUICK_BUDGET = BUDGET // 16
QUICK_PROBE = [
    "callbacks.cbs_probe.every_tokens=16384",
    "callbacks.cbs_probe.window_tokens=16384",
    "callbacks.cbs_probe.epsilon=0.45",
    "callbacks.cbs_probe.confidence=0.5",
]


def side_job_seconds(run_dir: Path) -> list[dict]:
    """Each side job's probe point (tokens) and CPU seconds (its process, imports included), from its scores."""
    jobs = []
    for scores in sorted((run_dir / "cbs_probe_jobs").glob("probe*/scores.json")):
        tokens = int(scores.parent.name.split("_")[1].removesuffix("tokens"))
        jobs.append({"tokens": tokens, "cpu_seconds": json.loads(scores.read_text())["cpu_seconds"]})
    return jobs


def at_target(curve: list[dict], target: float, field: str) -> float | None:
    """``field`` (step, tokens or seconds) where the held-out loss first reaches ``target``, interpolated."""
    return time_to([{**point, "seconds": point[field]} for point in curve], target)


def train(key: str, seed: int, repeat: int, args) -> dict:
    """One run (its main process on one thread), trained unless finished in OUT, checked, and read."""
    run_dir = (args.out / f"{key}_seed{seed}_r{repeat}").resolve()
    if not (run_dir / "summary.json").exists():
        command = train_command(overrides(key, seed, args.budget, run_dir))
        print(f"[{NAME}] {key}, seed {seed}, repeat {repeat}: {' '.join(command[2:])}", flush=True)
        run_logged(command, run_dir / "stdout.log", threads=1)
    run = read_run(run_dir)
    run.update(key=key, seed=seed, repeat=repeat, run_dir=str(run_dir), problems=check_run(run_dir, **CHECKS[key]))
    run["side_jobs"] = side_job_seconds(run_dir) if key == "adaptive_side_jobs" else []
    probes = run_dir / "cbs_probe.jsonl"
    run["readings"] = [r.to_record() for r in read_readings(probes)] if probes.exists() else []
    return run


def measure(run: dict, target: float) -> dict:
    """A run's numbers at the target and over the whole run."""
    curve = smoothed(run["val_curve"])
    steps, tokens, seconds = (at_target(curve, target, field) for field in ("step", "tokens", "seconds"))
    readings = run["readings"]
    started = [r for r in readings if tokens is not None and r["tokens"] < tokens]
    branch_steps = sum(
        round(r["window_tokens"] / (k * r["batch_size"] * r["seq_len"])) for r in started for k in r["branches_trained"]
    )
    jobs = [job for job in run["side_jobs"] if tokens is not None and job["tokens"] < tokens]
    job_seconds = sum(job["cpu_seconds"] for job in run["side_jobs"])
    main_seconds = run["val_curve"][-1]["seconds"] or run["run_seconds"]
    return {
        "steps": steps,
        "steps_with_branches": None if steps is None else steps + branch_steps,
        "seconds": seconds,
        "device_seconds": None if seconds is None else seconds + sum(job["cpu_seconds"] for job in jobs),
        "final_loss": curve[-1]["val_loss"],
        "side_device_share": job_seconds / main_seconds if run["side_jobs"] else None,
        "changes": [(c["tokens"], c["old"], c["new"]) for c in run["batch_changes"]],
        "readings": [
            (r["tokens"], r["cbs_lower"], r["cbs_upper"], r["determined"], r["arrived_at_tokens"]) for r in readings
        ],
        "waits": (run["probe"] or {}).get("side_jobs"),
    }


def mean_se(values: list[float | None]) -> str:
    """Mean and standard error over runs, or how many runs missed."""
    reached = [v for v in values if v is not None]
    missed = f" ({len(values) - len(reached)} of {len(values)} never reached it)" if len(reached) < len(values) else ""
    if not reached:
        return "never" + missed
    if len(reached) == 1:
        return f"{reached[0]:,.0f}{missed}"
    se = statistics.stdev(reached) / len(reached) ** 0.5
    return f"{statistics.fmean(reached):,.0f} ± {se:,.0f}{missed}"


def ratio_to_hand(rows: dict[str, list[dict]], key: str, field: str) -> float | None:
    """The mean over runs of ``field`` for ``key`` over the hand warmup's, None if a run never reached the target."""
    mine, hand = [m[field] for m in rows[key]], [m[field] for m in rows["hand"]]
    if None in mine or None in hand:
        return None
    return statistics.fmean(mine) / statistics.fmean(hand)


def aggregate(runs: list[dict]) -> dict:
    """Each run measured at its seed's target: the control's final held-out loss + TARGET_MARGIN nats."""
    targets = {}
    for run in runs:
        if run["key"] == "control":
            targets.setdefault(run["seed"], smoothed(run["val_curve"])[-1]["val_loss"] + TARGET_MARGIN)
    for run in runs:
        run["measured"] = measure(run, targets[run["seed"]])
    rows = {key: [run["measured"] for run in runs if run["key"] == key] for key in CONFIGS}
    side_shares = [m["side_device_share"] for m in rows["adaptive_side_jobs"]]
    checks = {
        "steps": ratio_to_hand(rows, "adaptive_side_jobs", "steps"),
        "wall": ratio_to_hand(rows, "adaptive_side_jobs", "seconds"),
        "side_device_share": statistics.fmean(side_shares) if side_shares else None,
    }
    return {"targets": targets, "rows": rows, "checks": checks}


def goals(checks: dict) -> list[str]:
    said = {
        "steps": "main-run steps to the target, side-job adaptive over hand warmup",
        "wall": "main-run wall seconds to the target, side-job adaptive over hand warmup",
        "side_device_share": "side jobs' CPU seconds over the main run's seconds",
    }
    lines = []
    for name, value in checks.items():
        if value is None:
            lines.append(f"- {said[name]}: not measured (a run never reached the target): MISSED")
        else:
            met = "met" if value <= GOALS[name] else "MISSED"
            lines.append(f"- {said[name]}: {value:.2f} (goal <= {GOALS[name]:.2f}): {met}")
    return lines


def report(result: dict, runs: list[dict], args, seconds: float) -> str:
    rows, checks = result["rows"], result["checks"]
    lines = [
        f"Command: `python -m benchmarks.{NAME}{' ' + ' '.join(args.argv) if args.argv else ''}` "
        f"at commit {args.commit} "
        f"({args.date}; {machine()}; {seconds / 60:.0f} minutes). Main run on one thread, its side jobs on one thread "
        f"of their own; seeds {', '.join(map(str, args.seeds))}, {args.repeats} repeat(s) each, runs one at a time in "
        "rotating order. Held-out losses smoothed over 2 evaluations; target: each seed's control's final one + "
        f"{TARGET_MARGIN} nats ({', '.join(f'{t:.4f}' for t in result['targets'].values())}). Mean ± standard error "
        "over runs.",
        "",
        "| run | main-run steps to target | incl. probe branch steps | main-run wall s to target | device-s to target "
        "(side jobs incl.) | final held-out loss |",
        "|---|---|---|---|---|---|",
    ]
    for key, measured in rows.items():
        final = [m["final_loss"] for m in measured]
        lines.append(
            f"| {LABELS[key]} | {mean_se([m['steps'] for m in measured])} "
            f"| {mean_se([m['steps_with_branches'] for m in measured])} | {mean_se([m['seconds'] for m in measured])} "
            f"| {mean_se([m['device_seconds'] for m in measured])} | {statistics.fmean(final):.4f} "
            f"(range {min(final):.4f}-{max(final):.4f}) |"
        )
    lines += ["", "Goals, the side-job adaptive runs against the hand warmup on the same seeds:", "", *goals(checks)]
    lines += ["", "Readings (tokens: CBS bracket in samples, * determined, arrived at) and batch changes, per run:", ""]
    for run in sorted((r for r in runs if r["key"].startswith("adaptive")), key=lambda r: (r["key"], r["seed"])):
        measured = run["measured"]
        readings = "; ".join(
            f"{tokens:,}: [{lower:g}, {'beyond' if upper is None else f'{upper:g}'}]{'*' if determined else ''}"
            + (f" at {arrived:,}" if arrived is not None else "")
            for tokens, lower, upper, determined, arrived in measured["readings"]
        )
        changes = ", ".join(f"{old} -> {new} at {tokens:,}" for tokens, old, new in measured["changes"]) or "none"
        lines.append(f"- {LABELS[run['key']]}, seed {run['seed']}, repeat {run['repeat']}: {readings}; batch {changes}")
    waits = [m["waits"] for m in rows["adaptive_side_jobs"] if m["waits"]]
    if waits:
        lines += [
            "",
            "What the side-job runs' main runs waited for their side jobs (seconds, mean over runs): "
            f"{statistics.fmean(w['checkpoint'] for w in waits):.2f} writing "
            f"{statistics.fmean(w['checkpoints'] for w in waits):.1f} checkpoints, "
            f"{statistics.fmean(w['poll'] for w in waits):.2f} in "
            f"{statistics.fmean(w['polls'] for w in waits):,.0f} looks for results, "
            f"{statistics.fmean(w['at_end'] for w in waits):.2f} for the last readings at the end.",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1/16 of the budget, one seed, one repeat, no markdown")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / NAME)
    parser.add_argument("--repeats", type=int, default=2, help="runs per seed and configuration")
    parser.add_argument("--markdown", type=Path, default=None, help="default: docs/RESULTS.md (none with --quick)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.date = time.strftime("%Y-%m-%d")
    args.commit = git_commit()
    args.budget = QUICK_BUDGET if args.quick else BUDGET
    args.seeds = (1,) if args.quick else SEEDS
    args.repeats = 1 if args.quick else args.repeats
    if args.markdown is None and not args.quick:
        args.markdown = ROOT / "docs" / "RESULTS.md"
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs, keys = [], list(CONFIGS)
    for repeat in range(args.repeats):
        for index, seed in enumerate(args.seeds):
            shift = (repeat * len(args.seeds) + index) % len(keys)  # no configuration always runs first
            for key in keys[shift:] + keys[:shift]:
                runs.append(train(key, seed, repeat, args))
    refuse_unless_checked([problem for run in runs for problem in run["problems"]], NAME)
    result = aggregate(runs)
    text = report(result, runs, args, time.perf_counter() - started)
    print(text)
    (args.out / f"{NAME}.json").write_text(json.dumps({**result, "runs": runs}, default=json_default, indent=1))
    if args.markdown is not None:
        replace_section(args.markdown, NAME, text)
    return {**result, "text": text}


if __name__ == "__main__":
    main()
