"""Side-job probes against in-process ones on the default job: what the main run pays, and what the readings are.

Part 1, the default job (``python recipes/train.py``, 4,194,304 tokens, probes at 524k and 2.1M tokens) with the
main run on one thread, three ways, interleaved (``--repeats`` times each seed):

- ``none``: no probe (``callbacks.cbs_probe=null``);
- ``in_process``: the default probe, whose branches train while the run waits;
- ``side_jobs``: the same probe with ``side_jobs=local side_jobs.launcher.threads=1``: a process on the other core
  trains the branches while the run trains on.

The main run's wall time is ``fit_seconds`` at its last optimizer step (the run's own clock: pauses for probes
included, the side jobs' wait after the last step not); the side-job run's readings must equal the in-process
run's of the same seed (same threads: every branch loss alike).

Part 2, time to a loss: the small-batch control, the hand warmup (part 1's ``none``), and the CBS-adaptive recipe
(``+recipe=tiny_adaptive``: readings over 2 windows of data) with in-process and with side-job probes, on three
seeds, one the other benchmarks never used (5). The target is each seed's control's final held-out loss + 0.02
nats; the time to it is read off the held-out curve (``fit_seconds``, linear between evaluations).

Every run validates on the same 16 held-out micro-batches every 131,072 tokens. Runs go one at a time (the
side jobs take the second core), with the configurations of a seed and repeat in an order that rotates.

Usage::

    python -m benchmarks.side_probe                        # 16 runs, about 90 minutes on 2 cores
    python -m benchmarks.side_probe --quick --out /tmp/sp  # 1/16 of the budget, one seed, one repeat
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, json_default, machine, read_run, replace_section, run_logged, train_command
from benchmarks.time_to_loss import TARGET_MARGIN, time_to
from lit_cbs.probe.reading import ProbeReading, read_readings

NAME = "side_probe"
BUDGET = 4_194_304  # tokens: the default job's
SEEDS = (1, 2)  # part 1
TIME_SEEDS = (1, 2, 5)  # part 2: 5 was used by no benchmark before
GOALS = {"main_wall_ratio": 1.03}
PROBE_SIDE_JOBS = ["side_jobs=local", "side_jobs.launcher.threads=1"]
PART1 = {"none": ["callbacks.cbs_probe=null"], "in_process": [], "side_jobs": PROBE_SIDE_JOBS}
PART2 = {
    "control": ["+recipe=tiny_small_batch"],
    "adaptive_in_process": ["+recipe=tiny_adaptive"],
    "adaptive_side_jobs": ["+recipe=tiny_adaptive", *PROBE_SIDE_JOBS],
}
LABELS = {
    "none": "no probe (hand warmup)",
    "in_process": "in-process probe",
    "side_jobs": "side-job probe",
    "control": "small batch (16)",
    "adaptive_in_process": "CBS-adaptive, in-process probes",
    "adaptive_side_jobs": "CBS-adaptive, side-job probes",
}


def scaled(tokens: int, scale: float) -> int:
    """``tokens`` x ``scale``, a whole number of 64 x 128-token batches (the largest a threshold must fit)."""
    return max(8192, int(round(tokens * scale / 8192)) * 8192)


def overrides(key: str, seed: int, budget: int, run_dir: Path) -> list[str]:
    """The train.py overrides of one run at ``budget`` tokens: the recipe's token counts keep their share."""
    scale = budget / BUDGET
    common = [
        f"seed={seed}",
        f"max_tokens={budget}",
        f"val_check_tokens={scaled(131_072, scale)}",
        "trainer.limit_val_batches=16",
        "trainer.enable_progress_bar=false",
        "callbacks.progress_bar=null",
        "callbacks.checkpoint=null",
        "plots=false",
        f"hydra.run.dir={run_dir}",
    ]
    if budget != BUDGET:
        common.append(f"lr_schedule.warmup_tokens={scaled(262_144, scale)}")
        if key in PART1:  # the hand warmup's thresholds
            common.append(f"batch.schedule.thresholds=[0,{scaled(1_245_184, scale)},{scaled(2_523_136, scale)}]")
        if key in ("adaptive_in_process", "adaptive_side_jobs"):
            common += [f"callbacks.cbs_probe.every_tokens={scaled(524_288, scale)}",
                       f"callbacks.cbs_probe.window_tokens={scaled(262_144, scale)}"]  # fmt: skip
        elif key in ("in_process", "side_jobs"):  # a window of a sixteenth holds k = 2 at every batch, not k = 16
            common += [f"callbacks.cbs_probe.geometric=[{scaled(524_288, scale)},4.0]",
                       f"callbacks.cbs_probe.window_tokens={scaled(131_072, scale)}",
                       "callbacks.cbs_probe.multipliers=[1,2]"]  # fmt: skip
    return [*(PART1[key] if key in PART1 else PART2[key]), *common]


def train(key: str, seed: int, repeat: int, args) -> dict:
    """One run, the main process on one thread; its summary, held-out curve, readings and main-run seconds."""
    run_dir = (args.out / f"{key}_seed{seed}_r{repeat}").resolve()
    if not (run_dir / "summary.json").exists():
        command = train_command(overrides(key, seed, args.budget, run_dir))
        print(f"[{NAME}] {key}, seed {seed}, repeat {repeat}: {' '.join(command[2:])}", flush=True)
        run_logged(command, run_dir / "stdout.log", threads=1)
    run = read_run(run_dir)
    probes = run_dir / "cbs_probe.jsonl"
    run["readings"] = read_readings(probes) if probes.exists() else []
    run.update(seed=seed, main_seconds=main_seconds(run_dir))
    return run


def main_seconds(run_dir: Path) -> float:
    """fit_seconds at the run's last optimizer step: its wall clock while it trained."""
    from lit_cbs.analysis.curves import read_metrics_csv
    from lit_cbs.metrics import FIT_SECONDS

    steps, seconds = read_metrics_csv(run_dir / "metrics.csv")[FIT_SECONDS]
    return float(seconds[steps.argmax()])


def same_readings(a: list[ProbeReading], b: list[ProbeReading]) -> bool:
    """The same probe points, branches, held-out losses and brackets."""
    keys = ("tokens", "losses", "batch_losses", "k_star", "cbs_lower", "cbs_upper", "determined")
    return len(a) == len(b) and all(all(getattr(x, k) == getattr(y, k) for k in keys) for x, y in zip(a, b))


def part1(args) -> dict:
    runs: dict[str, list[dict]] = {key: [] for key in PART1}
    keys = list(PART1)
    for repeat in range(args.repeats):
        for index, seed in enumerate(args.seeds):
            shift = (repeat + index) % len(keys)  # rotate the order: no configuration always runs first
            for key in keys[shift:] + keys[:shift]:
                runs[key].append(train(key, seed, repeat, args))
    ratios = [s["main_seconds"] / n["main_seconds"] for s, n in zip(runs["side_jobs"], runs["none"])]
    in_process = [p["main_seconds"] / n["main_seconds"] for p, n in zip(runs["in_process"], runs["none"])]
    equal = [same_readings(s["readings"], p["readings"]) for s, p in zip(runs["side_jobs"], runs["in_process"])]
    return {"runs": runs, "side_ratio": ratios, "in_process_ratio": in_process, "readings_equal": equal}


def part2(args, hand: list[dict]) -> dict:
    runs = {"control": [], "hand": [], "adaptive_in_process": [], "adaptive_side_jobs": []}
    for index, seed in enumerate(args.time_seeds):
        keys = ["control", "adaptive_in_process", "adaptive_side_jobs"]
        shift = index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            runs[key].append(train(key, seed, 0, args))
        done = [run for run in hand if run["seed"] == seed]  # part 1's run without a probe is the hand warmup
        runs["hand"].append(done[0] if done else train("none", seed, 0, args))
    rows = {}
    for key, seeds in runs.items():
        times = []
        for run, control in zip(seeds, runs["control"]):
            target = control["val_curve"][-1]["val_loss"] + TARGET_MARGIN
            reached, base = time_to(run["val_curve"], target), time_to(control["val_curve"], target)
            times.append((reached, base, reached / base if reached is not None and base else None))
        rows[key] = {"times": times, "final": [run["val_curve"][-1]["val_loss"] for run in seeds]}
    return {"rows": rows}


def spread(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} (range {min(values):.3f}-{max(values):.3f}, n={len(values)})"


def upper(reading: ProbeReading) -> str:
    return "beyond" if reading.cbs_upper is None else f"{reading.cbs_upper:g}"


def no_slower(ratio: float | None, hand: float | None) -> bool:
    """Reached the target no later than the hand warmup (or reached it where the hand warmup did not)."""
    return ratio is not None and (hand is None or ratio <= hand)


def report(first: dict, second: dict, args, seconds: float) -> str:
    runs = first["runs"]
    lines = [
        f"`python -m benchmarks.{NAME}{' ' + ' '.join(args.argv) if args.argv else ''}` ({args.date}; {machine()};"
        f" {seconds / 60:.0f} min). The main run on one thread; side jobs on one thread of their own.",
        "",
        "| run | main-run wall s (per seed and repeat) | x no probe | readings |",
        "|---|---|---|---|",
    ]
    for key in PART1:
        walls = " / ".join(f"{run['main_seconds']:.0f}" for run in runs[key])
        ratio = {
            "none": "1",
            "in_process": spread(first["in_process_ratio"]),
            "side_jobs": spread(first["side_ratio"]),
        }[key]
        readings = "; ".join(
            ", ".join(f"{r.tokens:,}: [{r.cbs_lower:g}, {upper(r)}]" for r in run["readings"]) for run in runs[key][:1]
        )
        lines.append(f"| {LABELS[key]} | {walls} | {ratio} | {readings or '—'} |")
    mean_ratio = statistics.fmean(first["side_ratio"])
    lines += [
        "",
        f"- Goal: the side-job run's main-run wall time <= {GOALS['main_wall_ratio']}x the run without a probe: "
        f"{mean_ratio:.3f}x, {'met' if mean_ratio <= GOALS['main_wall_ratio'] else 'missed'}.",
        f"- Goal: the side-job readings equal the in-process ones: {sum(first['readings_equal'])} of "
        f"{len(first['readings_equal'])} runs equal, branch loss for branch loss.",
        "",
        f"Time to each seed's control's final held-out loss + {TARGET_MARGIN} nats (seeds "
        f"{', '.join(map(str, args.time_seeds))}), seconds and x the control's time:",
        "",
        "| run | per seed: seconds (x control) | final held-out loss |",
        "|---|---|---|",
    ]
    labels = {**LABELS, "hand": "batch warmup (hand thresholds)"}
    for key, row in second["rows"].items():
        cells = " / ".join(
            "not reached" if reached is None else f"{reached:.0f} ({ratio:.2f}x)" for reached, _, ratio in row["times"]
        )
        lines.append(f"| {labels[key]} | {cells} | {spread(row['final'])} |")
    hand = [ratio for _, _, ratio in second["rows"]["hand"]["times"]]
    for key in ("adaptive_in_process", "adaptive_side_jobs"):
        ratios = [ratio for _, _, ratio in second["rows"][key]["times"]]
        kept = sum(no_slower(r, h) for r, h in zip(ratios, hand))
        lines.append(f"- {labels[key]}: no slower to the target than the hand warmup on {kept} of {len(ratios)} seeds.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1/16 of the budget, one seed, one repeat, no markdown")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / NAME)
    parser.add_argument("--repeats", type=int, default=1, help="part 1's runs per seed and configuration")
    parser.add_argument("--markdown", type=Path, default=None, help="default: docs/RESULTS.md (none with --quick)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command's own flags, for the report's header
    args.date = time.strftime("%Y-%m-%d")
    args.budget = BUDGET // 16 if args.quick else BUDGET
    args.seeds = (1,) if args.quick else SEEDS
    args.time_seeds = (1,) if args.quick else TIME_SEEDS
    if args.markdown is None and not args.quick:
        args.markdown = ROOT / "docs" / "RESULTS.md"
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    first = part1(args)
    second = part2(args, first["runs"]["none"])
    text = report(first, second, args, time.perf_counter() - started)
    print(text)
    result = {"part1": first, "part2": second}
    (args.out / f"{NAME}.json").write_text(json.dumps(result, default=json_default, indent=1))
    if args.markdown is not None:
        replace_section(args.markdown, NAME, text)
    return {"part1": first, "part2": second, "text": text}


if __name__ == "__main__":
    main()
