"""Time, not steps: how much sooner does batch warmup reach a loss, in wall-clock seconds?

Runs ``recipes/train.py`` (one subprocess at a time, each on every core) on the tiny workload, the
default job's 4,194,304 tokens, for each seed: the Table 1 configurations (``benchmarks.table1``:
small batch 16, large batch 64, hand-threshold warmup 16 -> 32 -> 64, CBS-adaptive warmup), all
with the recipes' micro-batch growth (``batch.max_micro_batch_size=64``: micro-batch 16 -> 32 -> 64,
no accumulation). Every run validates on the same 16 held-out micro-batches every 131,072 tokens.

The target is the small-batch control's final held-out loss + 0.02 nats (per seed). For each run,
the wall time at which its held-out loss first reaches the target is read off its validation curve
(``fit_seconds``, the wall clock since the fit began, logged on every row of metrics.csv; linear
between evaluations), probes and validation included; the ratio is to the control's own time to the
same target. Also per run: tokens/s per batch phase (the median of ``perf/tokens_per_s``, which
leaves validation and probes out), steps, and the whole run's wall time.

Two more measurements, seed 1 only: the hand-threshold warmup with ``model.compile=true`` (compiled
against eager tokens/s, per phase), and the default job itself, whole (``python recipes/train.py``:
probes, validation, checkpoints, plots) against the same job stripped to its training steps
(``fit_seconds`` of a run without probe, validation, checkpoints and plots).

``--gpu``: the GPU variant of ``benchmarks.table1 --gpu`` (a 25M-parameter model of the same
family, 512-token sequences, bf16 on one GPU, 2^25 tokens per run), one seed, with the compiled
run and without the default-job runs; its section goes only where ``--markdown`` says.

Output: a table on stdout, OUT/time_to_loss.json, a plot of held-out loss against wall-clock
seconds, and the section "time_to_loss" of docs/RESULTS.md (``--markdown``).

Usage::

    python -m benchmarks.time_to_loss                  # 2 seeds, about 30 minutes on 2 cores
    python -m benchmarks.time_to_loss --quick --out /tmp/ttl   # 1/16 of the budget, one seed, 1 validation
                                                               # batch, no extras
    python -m benchmarks.time_to_loss --gpu --out /tmp/ttl_gpu --markdown /tmp/ttl_gpu/time_to_loss.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    ROOT,
    check_run,
    git_commit,
    machine,
    read_run,
    refuse_gpu_run_without_a_gpu,
    refuse_unless_checked,
    replace_section,
    run_logged,
    train_command,
)
from benchmarks.table1 import CONFIGS, GPU_SEQ_LEN, GPU_TOKENS, REFERENCE_TOKENS, run_command

KEYS = ("small", "large64", "warmup", "adaptive")
TARGET_MARGIN = 0.02  # nats above the small-batch control's final held-out loss
EVALUATIONS = 32  # per run: one every 131,072 tokens at the full budget
VAL_BATCHES = 16
QUICK_VAL_BATCHES = 1  # --quick checks the pipeline: its evaluations need not be tight
GOALS = {"warmup": 0.75, "adaptive": 0.75, "default_job_overhead": 1.25}
COMPILED = "warmup_compiled"


def smoothed(curve: list[dict]) -> list[dict]:
    """The validation curve with each held-out loss the mean of it and the evaluation's before (from the second on):
    at a constant LR the loss moves by about the target's margin from one evaluation to the next."""
    return [
        {**point, "val_loss": (before["val_loss"] + point["val_loss"]) / 2} for before, point in zip(curve, curve[1:])
    ]


def time_to(curve: list[dict], target: float) -> float | None:
    """Wall seconds at which the held-out loss first reaches ``target`` (linear between evaluations), or None."""
    previous = None
    for point in curve:
        if point["val_loss"] <= target:
            if previous is None:
                return point["seconds"]
            share = (previous["val_loss"] - target) / (previous["val_loss"] - point["val_loss"])
            return previous["seconds"] + share * (point["seconds"] - previous["seconds"])
        previous = point
    return None


def tokens_per_second_by_phase(run_dir: Path) -> dict[int, float]:
    """Median tokens/s of the main run's optimizer steps, per global batch (samples)."""
    from lit_cbs import metrics
    from lit_cbs.analysis.curves import read_metrics_csv

    series = read_metrics_csv(run_dir / "metrics.csv")
    batch_steps, batches = series[metrics.GLOBAL_BATCH]
    rate_steps, rates = series[metrics.TOKENS_PER_S]
    batch_at = dict(zip(batch_steps.tolist(), batches.tolist()))
    by_batch: dict[int, list[float]] = {}
    for step, rate in zip(rate_steps.tolist(), rates.tolist()):
        if step in batch_at and step > 0:  # the first step includes the loader's start
            by_batch.setdefault(int(batch_at[step]), []).append(rate)
    return {batch: float(np.median(values)) for batch, values in sorted(by_batch.items())}


def run(key: str, seed: int, args, extra: tuple[str, ...] = ()) -> dict:
    config = {c.key: c for c in CONFIGS}[key.removesuffix("_compiled")]
    run_dir = (args.out / f"{key}_seed{seed}").resolve()
    command = run_command(
        config,
        seed,
        args.tokens,
        run_dir,
        gpu=args.gpu,
        extra=[f"trainer.limit_val_batches={args.val_batches}", *extra],
        evaluations=EVALUATIONS,
    )
    print(f"[time_to_loss] {key}, seed {seed}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    run_logged(command, run_dir / "stdout.log")
    result = read_run(run_dir)
    result.update(
        key=key,
        seed=seed,
        process_seconds=time.perf_counter() - started,
        run_dir=str(run_dir),
        tokens_per_s=tokens_per_second_by_phase(run_dir),
        overrides=command[2:],
    )
    return result


def default_job(args, stripped: bool) -> dict:
    """The default job as a user runs it, or stripped to its training steps."""
    name = "default_job_training_only" if stripped else "default_job"
    run_dir = (args.out / name).resolve()
    extra = (
        ["callbacks.cbs_probe=null", "trainer.limit_val_batches=0", "callbacks.checkpoint=null", "plots=false"]
        if stripped
        else []
    )
    command = train_command([*extra, f"hydra.run.dir={run_dir}"])
    print(f"[time_to_loss] {name}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    run_logged(command, run_dir / "stdout.log")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "process_seconds": time.perf_counter() - started,
        "fit_seconds": summary["fit_seconds"],
        "overrides": command[2:],
    }


def aggregate(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration, over seeds: time to each seed's target, its ratio to the control's, and the rest."""
    targets = {run["seed"]: smoothed(run["val_curve"])[-1]["val_loss"] + TARGET_MARGIN for run in runs["small"]}
    control = {run["seed"]: time_to(smoothed(run["val_curve"]), targets[run["seed"]]) for run in runs["small"]}
    rows = {}
    for key, seeds in runs.items():
        times = [time_to(smoothed(run["val_curve"]), targets[run["seed"]]) for run in seeds]
        ratios = [t / control[run["seed"]] if t is not None else None for t, run in zip(times, seeds)]
        reached = [r for r in ratios if r is not None]
        rows[key] = {
            "time_to_target": times,
            "ratio": statistics.fmean(reached) if len(reached) == len(ratios) else None,
            "ratios": ratios,
            "final_loss": statistics.fmean(run["val_curve"][-1]["val_loss"] for run in seeds),
            "fit_seconds": statistics.fmean(run["fit_seconds"] for run in seeds),
            "steps": statistics.fmean(run["optimizer_steps"] for run in seeds),
            "probe_tokens": statistics.fmean(run["probe"]["tokens"] if run["probe"] else 0 for run in seeds),
            "tokens_per_s": {
                batch: statistics.fmean(run["tokens_per_s"][batch] for run in seeds if batch in run["tokens_per_s"])
                for batch in sorted({b for run in seeds for b in run["tokens_per_s"]})
            },
        }
    return {"rows": rows, "targets": targets, "control_seconds": control}


def fmt_seconds(values: list[float | None]) -> str:
    return " / ".join("not reached" if v is None else f"{v:.0f}" for v in values)


def table(result: dict, labels: dict[str, str]) -> str:
    lines = [
        "| run | time to target, s (per seed) | x control's time | final held-out loss "
        "| fit s | steps | tokens/s per batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, row in result["rows"].items():
        ratio = "—" if row["ratio"] is None else f"{row['ratio']:.2f}"
        if row["ratio"] is None and any(r is not None for r in row["ratios"]):
            ratio = " / ".join("—" if r is None else f"{r:.2f}" for r in row["ratios"])
        rates = ", ".join(f"{batch}: {rate:,.0f}" for batch, rate in row["tokens_per_s"].items())
        lines.append(
            f"| {labels[key]} | {fmt_seconds(row['time_to_target'])} | {ratio} | {row['final_loss']:.4f} "
            f"| {row['fit_seconds']:.0f} | {row['steps']:,.0f} | {rates} |"
        )
    return "\n".join(lines)


def goals(result: dict, extras: dict) -> list[tuple[str, bool]]:
    rows, checks = result["rows"], []
    for key in ("warmup", "adaptive"):
        if key in rows:
            ratio = rows[key]["ratio"]
            checks.append(
                (
                    f"{key}: reaches the target in {'never' if ratio is None else f'{ratio:.2f}x'} the control's time "
                    f"(goal <= {GOALS[key]}x)",
                    ratio is not None and ratio <= GOALS[key],
                )
            )
    if "default_job" in extras:
        overhead = extras["default_job"]["process_seconds"] / extras["default_job_training_only"]["fit_seconds"]
        checks.append(
            (
                f"the default job's whole wall time is {overhead:.2f}x its training time (goal <= "
                f"{GOALS['default_job_overhead']}x)",
                overhead <= GOALS["default_job_overhead"],
            )
        )
    return checks


def plot(runs: dict[str, list[dict]], result: dict, labels: dict[str, str], path: Path) -> Path:
    from matplotlib.figure import Figure

    from lit_cbs.analysis.plots import save_figure

    figure = Figure(figsize=(8, 5))
    axis = figure.add_subplot()
    styles = ["-", "--", ":"]
    for index, (key, seeds) in enumerate(runs.items()):
        for seed_index, run in enumerate(seeds):
            curve = [p for p in run["val_curve"] if p["seconds"] is not None]
            axis.plot(
                [p["seconds"] for p in curve],
                [p["val_loss"] for p in curve],
                styles[seed_index % 3],
                color=f"C{index}",
                label=f"{labels[key]}, seed {run['seed']}",
            )
    for seed_index, (_, target) in enumerate(sorted(result["targets"].items())):
        axis.axhline(target, color="gray", ls=styles[seed_index % 3], lw=0.8)
    finals = [run["val_curve"][-1]["val_loss"] for seeds in runs.values() for run in seeds]
    axis.set_ylim(min(finals) - 0.05, min(finals) + 0.6)
    axis.set(
        xlabel="wall-clock seconds since the fit began (validation and probes included)",
        ylabel="held-out loss (nats/token)",
        title="held-out loss against time; gray: each seed's target (small batch's final + 0.02)",
    )
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    return save_figure(figure, path)


def markdown(result, runs, extras, checks, labels, args, plot_path: Path, seconds: float) -> str:
    relative_plot = os.path.relpath(plot_path, args.markdown.parent)
    if args.gpu:
        where = (
            f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU visible'}, "
            f"torch {torch.__version__}"
        )
        model = (
            f"a 25M-parameter model of the tiny OLMo's family (d_model 512, 8 layers, {GPU_SEQ_LEN}-token sequences) "
            "in bf16 on one GPU, on the embedded corpus"
        )
    else:
        where, model = machine(args.load), "the tiny OLMo on the embedded corpus"
    lines = [
        "## Time to a loss",
        "",
        f"Command: `python -m benchmarks.time_to_loss {' '.join(args.argv)}`".rstrip()
        + f" at commit {args.commit} ({seconds / 60:.1f} minutes, {args.date}; {where}; one run at a time).",
        "",
        f"Workload: {model}, {args.tokens:,} tokens per run, seeds {', '.join(map(str, args.seed_list))}; "
        "the micro-batch grows with the batch (16 -> 32 -> 64 samples, no accumulation); held-out loss on "
        f"{args.val_batches} micro-batches every {args.tokens // EVALUATIONS:,} tokens, each the mean of its "
        "evaluation and the one before (at a constant LR the loss moves by about the margin between two). Target: "
        f"each seed's small-batch final held-out loss + {TARGET_MARGIN} nats "
        f"({', '.join(f'{t:.4f}' for t in result['targets'].values())}). Times are `fit_seconds` (wall clock from the "
        "fit's start, validation and probes included), interpolated between evaluations; the ratio is to the control's "
        "time to the same target, per seed, averaged. Tokens/s: median per optimizer step and batch (samples), "
        "validation and probes left out.",
        "",
        table(result, labels),
        "",
    ]
    if COMPILED in extras:
        eager = runs["warmup"][0]["tokens_per_s"]
        compiled = extras[COMPILED]["tokens_per_s"]
        lines += [
            "Compiled against eager (hand-threshold warmup, seed 1, `model.compile=true`), "
            "tokens/s per batch (samples): "
            + ", ".join(
                f"{batch}: {compiled.get(batch, float('nan')):,.0f} vs {rate:,.0f}" for batch, rate in eager.items()
            )
            + f"; the compiled run's fit took {extras[COMPILED]['fit_seconds']:.0f} s (cold compile included).",
            "",
        ]
    if "default_job" in extras:
        whole, training = extras["default_job"], extras["default_job_training_only"]
        lines += [
            f"The default job (`python recipes/train.py`): {whole['process_seconds']:.0f} s for the whole process "
            f"(probes, validation, checkpoints, plots, start-up) against {training['fit_seconds']:.0f} s of training "
            f"steps alone (`{' '.join(o for o in training['overrides'] if not o.startswith('hydra.'))}`).",
            "",
        ]
    lines += [
        "Goals (on the 2-core CPU; on a GPU, as measured):" if args.gpu else "Goals:",
        "",
        *[f"- {text}: {'met' if ok else 'MISSED'}" for text, ok in checks],
        "",
        f"![held-out loss against wall-clock seconds]({relative_plot})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=2, help="seeds per configuration (default 2; --quick: 1)")
    parser.add_argument(
        "--tokens", type=int, default=None, help=f"budget per run (default {REFERENCE_TOKENS:,}; --quick: 1/16)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1/16 of the budget, one seed, 1 validation batch, no compiled or default-job runs",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help=(
            f"the GPU variant: a 25M-parameter model, {GPU_TOKENS:,} tokens, one seed, "
            "the compiled run, no default-job runs"
        ),
    )
    parser.add_argument("--configs", default=",".join(KEYS), help=f"comma-separated, from {KEYS} (small is needed)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "time_to_loss", help="folder for the runs")
    parser.add_argument(
        "--markdown", type=Path, default=None, help="the results file (default docs/RESULTS.md; none with --quick)"
    )
    parser.add_argument("--plot", type=Path, default=None, help="PNG (default: docs/time_to_loss.png, else OUT)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.date, args.commit = str(datetime.date.today()), git_commit()
    args.tokens = args.tokens or (
        REFERENCE_TOKENS // 16 if args.quick else GPU_TOKENS if args.gpu else REFERENCE_TOKENS
    )
    if (args.quick or args.gpu) and "--seeds" not in args.argv:
        args.seeds = 1
    keys = [key.strip() for key in args.configs.split(",") if key.strip()]
    if "small" not in keys or any(key not in KEYS for key in keys):
        parser.error(f"--configs={args.configs!r}: choose from {KEYS}, with small (the control)")
    smallest = (
        262_144 if "adaptive" in keys else 16 * 128 * EVALUATIONS
    )  # a probe window; else a step of the control per evaluation
    if args.tokens < smallest or args.seeds < 1:
        parser.error(
            f"--tokens must be >= {smallest} (with adaptive: the probe window holds one step of its largest branch; "
            "else the control steps at least once between evaluations) and --seeds >= 1"
        )
    if args.gpu:
        refuse_gpu_run_without_a_gpu(parser)
    if args.markdown is None and not args.quick and not args.gpu:
        args.markdown = ROOT / "docs" / "RESULTS.md"
    args.plot = args.plot or (
        (args.markdown.parent / "time_to_loss.png") if args.markdown else args.out / "time_to_loss.png"
    )
    args.seed_list = list(range(1, args.seeds + 1))
    args.val_batches = QUICK_VAL_BATCHES if args.quick else VAL_BATCHES
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    runs: dict[str, list[dict]] = {key: [] for key in keys}
    for seed in args.seed_list:  # seeds outermost: a stopped benchmark has every configuration once
        for key in keys:
            runs[key].append(run(key, seed, args))
    extras: dict[str, dict] = {}
    if not args.quick:
        extras[COMPILED] = run(COMPILED, 1, args, extra=("model.compile=true",))
    if not args.quick and not args.gpu:  # the default job is the CPU's tiny workload
        extras["default_job"] = default_job(args, stripped=False)
        extras["default_job_training_only"] = default_job(args, stripped=True)
    seconds = time.perf_counter() - started
    args.load = os.getloadavg()
    checked = {"warmup": {"changes_batch": True}, "adaptive": {"probes": True, "changes_batch": True}}
    problems = [p for key in keys for run in runs[key] for p in check_run(Path(run["run_dir"]), **checked.get(key, {}))]
    refuse_unless_checked(problems, "time_to_loss")
    labels = {c.key: c.label for c in CONFIGS}
    result = aggregate(runs)
    checks = goals(result, extras)
    print(table(result, labels))
    for text, ok in checks:
        print(f"{text}: {'met' if ok else 'MISSED'}")
    plot(runs, result, labels, args.plot)
    saved = {
        "result": result,
        "runs": runs,
        "extras": extras,
        "goals": [{"goal": t, "met": ok} for t, ok in checks],
        "seconds": seconds,
        "argv": args.argv,
        "date": args.date,
    }
    (args.out / "time_to_loss.json").write_text(json.dumps(saved, indent=2, default=str))
    if args.markdown:
        replace_section(
            args.markdown, "time_to_loss", markdown(result, runs, extras, checks, labels, args, args.plot, seconds)
        )
    print(f"[time_to_loss] {seconds / 60:.1f} minutes; {args.out / 'time_to_loss.json'}; plot {args.plot}")
    return saved


if __name__ == "__main__":
    main()
