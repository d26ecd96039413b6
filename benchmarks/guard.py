"""Does BatchWarmup's guard rescue a premature batch increase, and leave a healthy warmup alone?

A batch increase set too early costs loss for the rest of the run. This benchmark trains the tiny
workload (docs/tiny_workload.md) with the recipes a user runs (``recipes/train.py``, one subprocess
each), seeds 1 and 2:

1. premature: the batch jumps 16 -> 128 at 5% of the tokens (LR x sqrt(8)), no guard;
2. guarded: the same schedule with ``batch.guard=true`` (the guard's defaults, lit_cbs.rules.guard);
3. control: batch 16 throughout (``+recipe=tiny_small_batch``).

and the default job with the guard on (``python recipes/train.py batch.guard=true``, its own seed
and 4,194,304-token budget, the CBS probe off: a probe leaves the main run untouched, so the guard
sees the same losses), where the guard should judge both increases and revert neither.

Reported per run: the held-out loss at the end of the budget (the last evaluation, on the whole
validation split), optimizer steps, batch changes, reverts; per configuration the seeds' mean and
spread (max - min). Goals: the guarded run ends within 0.02 nats of the control (means) while
keeping at least 30% of the steps the premature schedule saves; zero reverts on the default job.
Output: OUT/guard.json (rewritten after every run, so a stopped benchmark keeps what finished),
a PNG of the loss around each judged increase and the section "guard" of docs/RESULTS.md.

The budget of the three configurations is 2,097,152 tokens per run (half the tiny recipes'), so the
seven runs fit in about 40 minutes on 2 shared CPU cores with ``--jobs 2``; the premature increase
comes at 104,857 tokens (5%), inside the recipes' LR warmup of 262,144 tokens.

Usage::

    python -m benchmarks.guard --jobs 2                  # writes docs/RESULTS.md and docs/guard.png
    python -m benchmarks.guard --quick --out /tmp/guard  # a pipeline check: tiny budget, no results
    python -m benchmarks.guard --report-only             # the report from the runs finished in OUT
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import (
    machine,
    read_run,
    recipe_benchmark_arguments,
    replace_section,
    train_command,
    train_unless_done,
)
from lit_cbs.analysis.curves import read_metrics_csv, rolling_mean
from lit_cbs.analysis.plots import save_figure
from lit_cbs.metrics import TOKENS_SEEN as TOKENS_COLUMN
from lit_cbs.metrics import TRAIN_LOSS as LOSS_COLUMN

SMALL, LARGE = 16, 128  # global batches (samples of 128 tokens; --quick: 32)
SEEDS = (1, 2)
SMOOTHING = 15  # optimizer steps in the plotted running mean of the training loss
GOALS = {"loss_gap": 0.02, "kept_savings": 0.30}


@dataclass(frozen=True)
class Settings:
    tokens: int  # budget per run of the three configurations (tokens)
    change_at: int  # tokens where the premature schedule jumps to LARGE
    val_check_tokens: int  # tokens between held-out evaluations
    default_job_tokens: int  # budget of the default job's run (tokens)
    seeds: tuple[int, ...] = SEEDS  # of the three configurations
    val_batches: int | None = None  # held-out micro-batches per evaluation (None: the whole split)
    seq_len: int | None = None  # tokens per sample (None: the recipes' 128)


FULL = Settings(2_097_152, 2_097_152 // 20, 128 * 16 * 128, 4_194_304)
# Every run once, in seconds: a pipeline check. Samples of 32 tokens (the same steps for a quarter of the tokens); the
# premature increase comes after 16 steps at 16, the fewest whose second half gives the guard its guard.min_steps=8 to
# fit a trend to, and the budget ends with the 8 steps at 128 the guard watches, so the guarded run's increase is
# judged. The default job's budget holds none of its increases: it runs with the guard on.
QUICK = Settings(40_960, 8_192, 8_192, 8_192, seeds=SEEDS[:1], val_batches=2, seq_len=32)


@dataclass(frozen=True)
class Run:
    key: str
    config: str  # premature, guarded, control or default_job
    seed: int | None  # None: the recipe's own
    overrides: tuple[str, ...]


def runs_of(settings: Settings) -> list[Run]:
    """Every run, the longest first (they are trained --jobs at a time)."""
    budget = f"max_tokens={settings.tokens}"
    premature = (
        "+recipe=tiny_warmup",
        "callbacks.cbs_probe=null",
        f"batch.schedule.batch_sizes=[{SMALL},{LARGE}]",
        f"batch.schedule.thresholds=[0,{settings.change_at}]",
        budget,
    )
    runs = [
        Run(
            "default_job_guarded",
            "default_job",
            None,
            ("batch.guard=true", "callbacks.cbs_probe=null", f"max_tokens={settings.default_job_tokens}"),
        )
    ]
    for seed in settings.seeds:
        runs.append(Run(f"control_seed{seed}", "control", seed, ("+recipe=tiny_small_batch", budget, f"seed={seed}")))
    for seed in settings.seeds:
        runs.append(Run(f"guarded_seed{seed}", "guarded", seed, (*premature, "batch.guard=true", f"seed={seed}")))
        runs.append(Run(f"premature_seed{seed}", "premature", seed, (*premature, f"seed={seed}")))
    return runs


def command_of(run: Run, settings: Settings, out: Path) -> list[str]:
    return train_command(
        [
            *run.overrides,
            f"val_check_tokens={settings.val_check_tokens}",
            *([f"trainer.limit_val_batches={settings.val_batches}"] if settings.val_batches else []),
            *([f"data.seq_len={settings.seq_len}"] if settings.seq_len else []),
            # the recipes' 262,144, less in a --quick budget
            f"lr_schedule.warmup_tokens={min(262_144, settings.tokens // 8)}",
            "trainer.enable_progress_bar=false",
            "callbacks.progress_bar=null",
            "callbacks.checkpoint=null",
            "plots=false",
            f"hydra.run.dir={(out / run.key).resolve()}",
        ]
    )


def train(run: Run, settings: Settings, out: Path, threads: int) -> dict:
    """Train ``run`` (or reuse its finished folder); return what the report needs of it."""
    train_unless_done(
        command_of(run, settings, out), out / run.key, out / "logs" / f"{run.key}.log", threads, f"[guard] {run.key}"
    )
    return load(run, out)


def load(run: Run, out: Path) -> dict:
    run_dir = out / run.key
    history = json.loads((run_dir / "batch_history.json").read_text())
    result = {
        **read_run(run_dir, changes_batch=run.config in ("premature", "guarded")),  # the premature increase happened
        **asdict(run),
        "run_dir": str(run_dir),
        "verdicts": history["guard_verdicts"],
        "reverts": sum(change["cause"] == "guard" for change in history["changes"]),
    }
    wall = run_dir / "wall_seconds.txt"
    result["wall_seconds"] = float(wall.read_text()) if wall.exists() else None
    print(
        f"[guard] {run.key}: held-out loss {result['val_curve'][-1]['val_loss']:.4f}, "
        f"{result['optimizer_steps']:,} steps, {result['reverts']} revert(s)",
        flush=True,
    )
    return result


def table(runs: dict[str, dict]) -> dict[str, dict]:
    """Per configuration: each seed's final held-out loss and steps, their mean and spread, and the
    means against the control and the premature schedule."""
    rows = {}
    for config in ("premature", "guarded", "control"):
        done = [runs[f"{config}_seed{seed}"] for seed in SEEDS if f"{config}_seed{seed}" in runs]
        if not done:
            continue
        losses = [run["val_curve"][-1]["val_loss"] for run in done]
        steps = [run["optimizer_steps"] for run in done]
        rows[config] = {
            "seeds": [run["seed"] for run in done],
            "losses": losses,
            "steps": steps,
            "reverts": [run["reverts"] for run in done],
            "loss": statistics.mean(losses),
            "spread": max(losses) - min(losses),
            "mean_steps": statistics.mean(steps),
        }
    control, premature = rows.get("control"), rows.get("premature")
    for row in rows.values():
        if control is not None:
            row["vs_control"] = row["loss"] - control["loss"]
            row["steps_saved"] = 1 - row["mean_steps"] / control["mean_steps"]
            if premature is not None:
                row["kept_savings"] = (control["mean_steps"] - row["mean_steps"]) / (
                    control["mean_steps"] - premature["mean_steps"]
                )
    return rows


def goals(rows: dict[str, dict], runs: dict[str, dict]) -> list[tuple[str, bool]]:
    checks = []
    guarded = rows.get("guarded")
    if guarded is not None and "kept_savings" in guarded:
        checks.append(
            (
                f"guarded: held-out loss {guarded['vs_control']:+.4f} nats vs the control "
                f"(goal <= +{GOALS['loss_gap']})",
                guarded["vs_control"] <= GOALS["loss_gap"],
            )
        )
        kept = (
            f"guarded: keeps {guarded['kept_savings']:.0%} of the premature schedule's step savings "
            f"(goal >= {GOALS['kept_savings']:.0%})"
        )
        checks.append((kept, guarded["kept_savings"] >= GOALS["kept_savings"]))
    default_job = runs.get("default_job_guarded")
    if default_job is not None:
        judged = len(default_job["verdicts"] or [])
        checks.append(
            (
                f"default job: {default_job['reverts']} revert(s) in {judged} judged increase(s) (goal: 0)",
                default_job["reverts"] == 0,
            )
        )
    return checks


def changes_text(run: dict) -> str:
    return ", ".join(f"{c['old']} -> {c['new']} at {c['tokens']:,}" for c in run["batch_changes"]) or "none"


def plot(runs: dict[str, dict], settings: Settings, path: Path) -> Path | None:
    """Left: held-out loss vs tokens of every run. Then one panel per increase the guard judged (guarded
    runs and the default job): the run's per-step training loss, the control's at the same tokens, the
    trend the guard fit before the increase and extrapolated over the window, and its verdict."""
    from matplotlib.figure import Figure

    judged = [
        (key, verdict)
        for key in (*(f"guarded_seed{s}" for s in SEEDS), "default_job_guarded")
        if key in runs
        for verdict in runs[key]["verdicts"] or []
    ]
    if not runs:
        return None
    columns = 1 + len(judged)
    figure = Figure(figsize=(4.2 * min(columns, 4), 3.6 * math.ceil(columns / 4)))
    axes = figure.subplots(math.ceil(columns / 4), min(columns, 4), squeeze=False).ravel()
    styles = {"premature": "C3", "guarded": "C0", "control": "k", "default_job": "C2"}
    for key, run in runs.items():
        curve = run["val_curve"]
        axes[0].plot(
            [p["tokens"] for p in curve],
            [p["val_loss"] for p in curve],
            color=styles[run["config"]],
            ls="-" if run["seed"] in (None, SEEDS[0]) else "--",
            marker="o",
            ms=3,
            label=key,
        )
    axes[0].set(xlabel="tokens", ylabel="held-out loss (nats/token)", title="held-out loss")
    axes[0].legend(fontsize=6)
    for axis, (key, verdict) in zip(axes[1:], judged):
        run = runs[key]
        at, window_end = verdict["consumed_at_change"], verdict["decided_at"]
        low, high = at - at // 2, window_end + (window_end - at)
        control_key = f"control_seed{run['seed']}" if run["seed"] is not None else None
        for shown_key, color in ((key, styles[run["config"]]), (control_key, "0.5")):
            if shown_key not in runs:
                continue
            tokens, losses = training_loss(runs[shown_key])
            shown = (tokens > low) & (tokens <= high)
            axis.plot(tokens[shown], losses[shown], ".", ms=2, color=color, alpha=0.4)
            axis.plot(
                tokens[shown],
                rolling_mean(losses, SMOOTHING)[shown],
                color=color,
                lw=1.2,
                label=f"{shown_key} (mean of {SMOOTHING} steps)",
            )
        xs = np.geomspace(low + 1, window_end, 50)
        axis.plot(
            xs, verdict["trend_intercept"] + verdict["trend_slope"] * np.log(xs), "k--", lw=1, label="trend before it"
        )
        axis.axvspan(at, window_end, color="C1", alpha=0.15, label="window")
        outcome = "reverted" if verdict["reverted"] else "kept"
        axis.set(
            xlabel="tokens",
            title=f"{key}: {verdict['old_global_batch']} -> {verdict['new_global_batch']} {outcome}\n"
            f"rise {verdict['rise']:+.3f} vs threshold {verdict['threshold']:.3f} nats",
            ylabel="training loss",
        )
        axis.title.set_fontsize(8)
        axis.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
        axis.legend(fontsize=6)
    for axis in axes[columns:]:
        axis.set_visible(False)
    figure.tight_layout()
    return save_figure(figure, path)


def training_loss(run: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per-step training loss of a run against the tokens seen after each step."""
    series = read_metrics_csv(Path(run["run_dir"]) / "metrics.csv")
    loss_steps, losses = series[LOSS_COLUMN]
    token_steps, tokens = series[TOKENS_COLUMN]
    tokens_at = dict(zip(token_steps.tolist(), tokens.tolist()))
    return np.array([tokens_at[step] for step in loss_steps]), losses


def markdown(runs, rows, checks, args, plot_path: Path | None, markdown_path: Path) -> str:
    s = args.settings
    lines = [
        "## The guard on a premature batch increase",
        "",
        f"Command: `python -m benchmarks.guard {' '.join(args.argv)}`".rstrip()
        + (
            f" (the runs trained by `python -m benchmarks.guard {args.trained_by}`)"
            if args.report_only and args.trained_by
            else ""
        )
        + f" ({args.date}, training {args.minutes:.1f} minutes; {machine(os.getloadavg())}; "
        "cores shared with other jobs).",
        "",
        (
            f"Workload: the tiny OLMo (233k parameters) on the embedded stdlib corpus, {s.tokens:,} tokens per run, "
            f"seeds {', '.join(map(str, SEEDS))}, base batch {SMALL} x {s.seq_len or 128} tokens at LR 3e-3 "
            f"(x sqrt(ratio) per change), LR warmup 262,144 tokens then constant. Premature: {SMALL} -> {LARGE} at "
            f"{s.change_at:,} tokens ({s.change_at / s.tokens:.0%}); guarded: the same with `batch.guard=true` "
            "(defaults: window a quarter and fit the second half of the tokens before each increase, threshold 2 x the "
            "per-step loss's spread around the trend and at least 0.05 nats, 8 steps at least, hold as long as the "
            "tokens before the revert). Held-out loss: the last evaluation (the whole validation split) at the end of "
            "the budget; spread = max - min over seeds; kept = the share of the premature schedule's step savings "
            "(against the control) a run keeps."
        ),
        "",
        "| run | held-out loss per seed | mean | spread | vs control "
        "| optimizer steps per seed | steps saved | kept | reverts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for config, row in rows.items():
        lines.append(
            f"| {config} | {', '.join(f'{x:.4f}' for x in row['losses'])} | {row['loss']:.4f} | {row['spread']:.4f} "
            f"| {row.get('vs_control', 0):+.4f} | {', '.join(f'{x:,}' for x in row['steps'])} "
            f"| {row.get('steps_saved', 0):.0%} | {row.get('kept_savings', float('nan')):.0%} "
            f"| {', '.join(map(str, row['reverts']))} |"
        )
    lines += ["", "Batch changes (tokens where each took effect):", ""]
    lines += [
        f"- {key}: {changes_text(run)}" for key, run in runs.items() if run["config"] in ("guarded", "default_job")
    ]
    lines += [
        "",
        "The guard's verdicts (rise of the training loss over the window above the trend before the increase):",
        "",
    ]
    for key, run in runs.items():
        for v in run["verdicts"] or []:
            lines.append(
                f"- {key}: {v['old_global_batch']} -> {v['new_global_batch']} at {v['consumed_at_change']:,} tokens, "
                f"judged at {v['decided_at']:,} over {v['watch_steps']} steps: rise {v['rise']:+.4f} nats, threshold "
                f"{v['threshold']:.4f} (per-step spread {v['residual_std']:.4f} over {v['fit_steps']} steps): "
                f"{'reverted' if v['reverted'] else 'kept'}"
            )
    missing = [run.key for run in runs_of(s) if run.key not in runs]
    if missing:
        lines += ["", f"**Incomplete: not run (yet): {', '.join(missing)}.**"]
    lines += ["", "Goals:", "", *[f"- {text}: {'met' if ok else 'MISSED'}" for text, ok in checks]]
    if plot_path is not None:
        image = os.path.relpath(plot_path, markdown_path.parent)
        lines += ["", f"![held-out loss, and the training loss around each increase the guard judged]({image})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = recipe_benchmark_arguments(
        "guard",
        __doc__.split("\n\n")[0],
        f"{QUICK.tokens:,} tokens per run, in samples of {QUICK.seq_len}: a pipeline check, no results",
        argv,
    )
    args.settings = QUICK if args.quick else FULL
    runs: dict[str, dict] = {}
    started = time.perf_counter()
    if args.report_only:
        runs = {
            run.key: load(run, args.out)
            for run in runs_of(args.settings)
            if (args.out / run.key / "summary.json").exists()
        }
    else:
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(train, run, args.settings, args.out, args.threads) for run in runs_of(args.settings)]
            for future in as_completed(futures):
                result = future.result()
                runs[result["key"]] = result
                (args.out / "guard.json").write_text(
                    json.dumps({"settings": asdict(args.settings), "runs": runs}, indent=2)
                )
    runs = {run.key: runs[run.key] for run in runs_of(args.settings) if run.key in runs}  # in the table's order
    minutes_file, command_file = args.out / "minutes.txt", args.out / "command.txt"  # the training's, for --report-only
    if not args.report_only:
        minutes_file.write_text(f"{(time.perf_counter() - started) / 60:.1f}\n")
        command_file.write_text(" ".join(args.argv) + "\n")
    args.minutes = float(minutes_file.read_text()) if minutes_file.exists() else float("nan")
    args.trained_by = command_file.read_text().strip() if command_file.exists() else None
    rows = table(runs)
    checks = goals(rows, runs)
    result = {
        "settings": asdict(args.settings),
        "rows": rows,
        "goals": [{"goal": t, "met": ok} for t, ok in checks],
        "runs": runs,
    }
    (args.out / "guard.json").write_text(json.dumps(result, indent=2))
    for text, ok in checks:
        print(f"[guard] {text}: {'met' if ok else 'MISSED'}")
    plot_path = plot(runs, args.settings, args.plot)
    if args.markdown:
        replace_section(args.markdown, "guard", markdown(runs, rows, checks, args, plot_path, args.markdown))
    print(
        f"[guard] {args.minutes:.1f} minutes; {args.out / 'guard.json'}; plot {plot_path}"
        + (f"; markdown {args.markdown}" if args.markdown else ""),
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
