"""The paper's Table 1 at small scale: does batch warmup save optimizer steps at no loss?

Runs ``recipes/train.py`` (one subprocess per run, the recipes a user runs) on the tiny workload of
docs/tiny_workload.md: the tiny OLMo (233k parameters) on the embedded stdlib corpus, a budget of
4,194,304 tokens, base batch 16 x 128 tokens, LR 3e-3 tuned once for the small batch, for each seed:

- small batch (16): ``+recipe=tiny_small_batch``, the control;
- large batch (64): ``+recipe=tiny_large_batch``, warmup's final batch from the start, LR 3e-3 x sqrt(4);
- large batch (128): the same with batch 128, LR 3e-3 x sqrt(8);
- batch warmup: ``+recipe=tiny_warmup`` without its probe: 16 -> 32 at 1,245,184 tokens -> 64 at
  2,523,136 tokens, thresholds read off a measured CBS curve (docs/benchmarks/cbs_probe.md);
- CBS-adaptive warmup: ``+recipe=tiny_adaptive``: a probe every 262k tokens (k = 1 from the main run,
  one k = 2 branch over a window of 65k tokens, both scored on 32 held-out batches) doubles the batch
  when the reading says, at 90% confidence, that the CBS is at least twice it, up to 64, and stops
  probing there.

Every run validates on the whole held-out split every 128 micro-batches (262,144 tokens), so all
runs are evaluated at the same token counts. Reported per configuration, mean and spread (max - min)
over seeds: the held-out loss averaged over the last ``--last-evals`` evaluations; optimizer steps of
the main run and, for the adaptive run, plus the probe branches' steps; steps saved against the
small-batch control; tokens spent in probes; wall time of the subprocess. Output: a table on stdout,
``--json`` (every run's numbers and loss curve), a plot of held-out loss vs tokens and vs steps, and
``--markdown`` (the section "table1" of docs/RESULTS.md, see benchmarks/common.py).

``--quick`` scales the budget and every token count in the recipes by 1/4 (1,048,576 tokens) and runs
one seed: a few minutes, to check the pipeline, not to read results from. ``--tokens N`` scales to
any budget of at least 262,144 tokens (the probe's window must hold one step of its largest branch).
``--jobs N`` trains N runs at once, each on cores / N threads (their wall times then share the cores).
``--override KEY=VALUE`` passes a train.py override to every run, ``--override CONFIG:KEY=VALUE`` to the
runs of that configuration alone (e.g. a probe setting, which the runs without a probe cannot take).

Usage::

    python -m benchmarks.table1                      # 2 seeds; writes docs/RESULTS.md and docs/table1.png
    python -m benchmarks.table1 --quick --out /tmp/table1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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

REFERENCE_TOKENS = 4_194_304  # the recipes' budget; token counts below are at this budget
SEQ_LEN = 128
SMALL = "small"
SAVED_ARGS = (
    "tokens",
    "seeds",
    "last_evals",
    "configs",
    "argv",
    "date",
    "gpu",
    "load",
    "commit",
)  # what --from-json restores
GOALS = {
    "warmup_loss_gap": 0.02,  # nats at most worse than the small-batch control
    "warmup_steps_saved": 0.45,
    "large_loss_gap": 0.5,  # the large-batch control worse by more than this
    "adaptive_steps_saved": 0.45,  # counting probe branch steps
    "adaptive_probe_share": 0.15,  # probe branch tokens / training tokens, at most
}


@dataclass
class Config:
    key: str
    label: str
    recipe: str
    overrides: list[str]
    scaled: dict[str, list[int] | int] = field(
        default_factory=dict
    )  # override -> token count(s) at the reference budget


CONFIGS = [
    Config(SMALL, "small batch (16)", "tiny_small_batch", []),
    Config("large64", "large batch (64)", "tiny_large_batch", []),
    Config("large128", "large batch (128)", "tiny_large_batch", ["batch.schedule.batch_size=128"]),
    Config(
        "warmup",
        "batch warmup (hand thresholds)",
        "tiny_warmup",
        ["callbacks.cbs_probe=null"],
        {"batch.schedule.thresholds": [0, 1_245_184, 2_523_136]},
    ),
    Config(
        "adaptive",
        "CBS-adaptive warmup",
        "tiny_adaptive",
        [],
        {"callbacks.cbs_probe.every_tokens": 262_144, "callbacks.cbs_probe.window_tokens": 65_536},
    ),
]
# What each configuration's runs must have done before a row reports them (benchmarks.common.check_run).
CHECKS = {"warmup": {"changes_batch": True}, "adaptive": {"probes": True, "changes_batch": True}}


# The GPU variant (--gpu): a 25M-parameter model of the same family (d_model 512, 8 layers, 8 heads)
# with 512-token sequences, bf16 on one GPU, 2^25 tokens per run (not measured yet: no GPU was lent
# while writing this).
GPU_TOKENS = 2**25
GPU_SEQ_LEN = 512
GPU_OVERRIDES = [
    "trainer=gpu",
    "+model.config.d_model=512",
    "+model.config.n_layers=8",
    "+model.config.n_heads=8",
    "+model.config.mlp_hidden=1408",  # 2.75 x d_model, as the tiny preset
    f"+model.config.context_length={GPU_SEQ_LEN}",
    f"data.seq_len={GPU_SEQ_LEN}",
    "data.num_workers=4",
    "model.optimizer.lr=2.0e-3",  # not tuned: chosen for the width; every configuration scales it alike
]


def scale_tokens(tokens: int, scale: float, quantum: int) -> int:
    """``tokens`` x ``scale``, rounded to a multiple of ``quantum`` (a whole number of batches)."""
    return int(round(tokens * scale / quantum)) * quantum


def run_command(
    config: Config, seed: int, budget: int, run_dir: Path, gpu: bool = False, extra=(), evaluations: int = 16
) -> list[str]:
    """The train.py command line of one run. Token counts (thresholds, probe points and windows,
    LR warmup) keep their share of the budget; there are ``evaluations`` evaluations per run, at the
    same token counts."""
    seq_len = GPU_SEQ_LEN if gpu else SEQ_LEN
    scale = budget / REFERENCE_TOKENS
    quantum = 64 * seq_len  # the largest batch any threshold or window has to fit
    micro_tokens = 16 * seq_len
    overrides = [
        f"+recipe={config.recipe}",
        *config.overrides,
        *(GPU_OVERRIDES if gpu else []),
        f"seed={seed}",
        f"max_tokens={budget}",
        f"lr_schedule.warmup_tokens={scale_tokens(262_144, scale, micro_tokens)}",
        f"val_check_tokens={max(1, budget // evaluations)}",
        "trainer.enable_progress_bar=false",
        "callbacks.progress_bar=null",
        "callbacks.checkpoint=null",
        "plots=false",
    ]
    for name, tokens in config.scaled.items():
        if isinstance(tokens, list):
            value = "[" + ",".join(str(scale_tokens(t, scale, quantum)) for t in tokens) + "]"
        elif name.endswith("window_tokens"):  # at any budget, a window holds a step of k = 2 at batch 64
            value = str(max(2 * quantum, scale_tokens(tokens, scale, quantum)))
        else:
            value = str(scale_tokens(tokens, scale, quantum))
        overrides.append(f"{name}={value}")
    overrides += [*extra, f"hydra.run.dir={run_dir}"]
    return train_command(overrides)


def override_prefix(override: str) -> str | None:
    """The configuration ``CONFIG`` of an ``--override CONFIG:KEY=VALUE``, or None for one that applies to every
    run (a ':' in a Hydra override's value, e.g. in file:// paths, comes after its '=')."""
    head, colon, _ = override.partition("=")[0].partition(":")
    return head if colon else None


def overrides_for(key: str, overrides: list[str]) -> list[str]:
    """The train.py overrides of ``--override`` that configuration ``key``'s runs take: every unprefixed one,
    and its own (prefix removed). Those of a configuration come after the recipe's scaled token counts, so
    they win over them (e.g. a smaller probe for the adaptive run alone, where the others have no probe to set)."""
    chosen = []
    for override in overrides:
        prefix = override_prefix(override)
        if prefix is None:
            chosen.append(override)
        elif prefix == key:
            chosen.append(override.split(":", 1)[1])
    return chosen


def final_loss(run: dict, last_evals: int) -> float:
    return float(np.mean([point["val_loss"] for point in run["val_curve"][-last_evals:]]))


def steps_with_probes(run: dict) -> int:
    return run["optimizer_steps"] + (run["probe"]["optimizer_steps"] if run["probe"] else 0)


def aggregate(runs: dict[str, list[dict]], last_evals: int) -> dict[str, dict]:
    """Per configuration: mean and spread over seeds of every number the table shows."""
    rows = {}
    for key, seeds in runs.items():
        losses = [final_loss(run, last_evals) for run in seeds]
        rows[key] = {
            "loss_mean": statistics.fmean(losses),
            "loss_spread": max(losses) - min(losses),
            "losses": losses,
            "steps": statistics.fmean(run["optimizer_steps"] for run in seeds),
            "steps_with_probes": statistics.fmean(steps_with_probes(run) for run in seeds),
            "probe_tokens": statistics.fmean(run["probe"]["tokens"] if run["probe"] else 0 for run in seeds),
            "tokens": statistics.fmean(run["tokens"] for run in seeds),
            "wall_seconds": statistics.fmean(run["wall_seconds"] for run in seeds),
            "final_batches": sorted({run["final_batch"] for run in seeds}),
        }
    small = rows.get(SMALL)
    for row in rows.values():
        if small is not None:
            row["loss_vs_small"] = row["loss_mean"] - small["loss_mean"]
            row["steps_saved"] = 1 - row["steps"] / small["steps"]
            row["steps_saved_with_probes"] = 1 - row["steps_with_probes"] / small["steps"]
    return rows


def goals(rows: dict[str, dict]) -> list[tuple[str, bool]]:
    """The issue's goals, each with whether these numbers meet it."""
    if SMALL not in rows:
        return []
    small_spread = rows[SMALL]["loss_spread"]
    checks = []
    if "warmup" in rows:
        warmup = rows["warmup"]
        gap = warmup["loss_vs_small"]
        spread = max(small_spread, warmup["loss_spread"])
        checks.append(
            (
                f"warmup: loss {gap:+.4f} vs small batch (goal <= +{GOALS['warmup_loss_gap']} and within the seeds' "
                f"spread {spread:.4f})",
                gap <= GOALS["warmup_loss_gap"] and gap <= spread,
            )
        )
        checks.append(
            (
                f"warmup: {warmup['steps_saved']:.1%} fewer optimizer steps "
                f"(goal >= {GOALS['warmup_steps_saved']:.0%})",
                warmup["steps_saved"] >= GOALS["warmup_steps_saved"],
            )
        )
    for key in ("large64", "large128"):
        if key in rows:
            gap = rows[key]["loss_vs_small"]
            checks.append(
                (
                    f"{key}: loss {gap:+.4f} vs small batch at the same tokens (goal > +{GOALS['large_loss_gap']})",
                    gap > GOALS["large_loss_gap"],
                )
            )
    if "adaptive" in rows:
        adaptive = rows["adaptive"]
        share = adaptive["probe_tokens"] / adaptive["tokens"]
        checks.append(
            (
                f"adaptive: probe tokens {share:.1%} of the training tokens "
                f"(goal <= {GOALS['adaptive_probe_share']:.0%})",
                share <= GOALS["adaptive_probe_share"],
            )
        )
        checks.append(
            (
                f"adaptive: {adaptive['steps_saved_with_probes']:.1%} fewer steps counting probe branches "
                f"(goal >= {GOALS['adaptive_steps_saved']:.0%}) at loss {adaptive['loss_vs_small']:+.4f} "
                f"vs small batch (goal <= +{GOALS['warmup_loss_gap']})",
                adaptive["steps_saved_with_probes"] >= GOALS["adaptive_steps_saved"]
                and adaptive["loss_vs_small"] <= GOALS["warmup_loss_gap"],
            )
        )
    return checks


def table(rows: dict[str, dict], labels: dict[str, str], last_evals: int) -> str:
    header = (
        f"| run | held-out loss (mean of last {last_evals} evals) | spread over seeds | vs small | optimizer steps "
        "| steps saved | steps incl. probes | saved incl. probes | probe tokens | final batch | wall s |"
    )
    lines = [header, "|" + "---|" * 11]
    for key, row in rows.items():
        lines.append(
            f"| {labels[key]} | {row['loss_mean']:.4f} | {row['loss_spread']:.4f} | {row.get('loss_vs_small', 0):+.4f} "
            f"| {row['steps']:,.0f} | {row.get('steps_saved', 0):.0%} | {row['steps_with_probes']:,.0f} "
            f"| {row.get('steps_saved_with_probes', 0):.0%} | {row['probe_tokens']:,.0f} "
            f"| {'/'.join(map(str, row['final_batches']))} | {row['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], labels: dict[str, str], path: Path) -> Path:
    from matplotlib.figure import Figure

    from lit_cbs.analysis.plots import save_figure

    figure = Figure(figsize=(12, 4.5))
    by_tokens, by_steps = figure.subplots(1, 2, sharey=True)
    styles = ["-", "--", ":", "-."]
    for index, (key, seeds) in enumerate(runs.items()):
        color = f"C{index}"
        for seed_index, run in enumerate(seeds):
            curve = run["val_curve"]
            label = f"{labels[key]}, seed {run['seed']}"
            style = styles[seed_index % len(styles)]
            by_tokens.plot(
                [p["tokens"] for p in curve], [p["val_loss"] for p in curve], style, color=color, label=label
            )
            by_steps.plot([p["step"] for p in curve], [p["val_loss"] for p in curve], style, color=color)
    by_tokens.set(xlabel="tokens", ylabel="held-out loss (nats/token)", title="loss vs tokens")
    by_steps.set(xlabel="optimizer steps (main run)", title="loss vs optimizer steps")
    by_steps.set_xscale("log")
    first = min(p["val_loss"] for seeds in runs.values() for run in seeds for p in run["val_curve"][-1:])
    by_tokens.set_ylim(first - 0.05, first + 0.8)
    for axis in (by_tokens, by_steps):
        axis.grid(alpha=0.3)
    by_tokens.legend(fontsize=7, loc="lower left")
    return save_figure(figure, path)


def markdown(rows, labels, checks, runs, args, commands, plot_path: Path, markdown_path: Path, seconds: float) -> str:
    relative_plot = os.path.relpath(plot_path, markdown_path.parent)
    budget = args.tokens
    lines = [
        "## Table 1 at small scale",
        "",
        f"Command: `python -m benchmarks.table1 {' '.join(args.argv)}`".rstrip()
        + f" at commit {args.commit} ({seconds / 60:.1f} minutes, {args.date}; "
        f"{machine(args.load)}).",
        "",
        f"Workload: the tiny OLMo (233k parameters) on the embedded stdlib corpus, {budget:,} tokens per run, "
        "base batch 16 x 128 tokens, LR 3e-3 (batch k x 16 uses 3e-3 x sqrt(k)), "
        f"seeds {', '.join(map(str, args.seed_list))}. "
        f"Held-out loss: the whole validation split, averaged over each run's last {args.last_evals} evaluations "
        f"(one every {budget // 16:,} tokens); spread = max - min over seeds. Steps saved are against the small-batch "
        'control; "incl. probes" adds every optimizer step the probe\'s branches took.',
        "",
        table(rows, labels, args.last_evals),
        "",
        "Goals:",
        "",
        *[f"- {text}: {'met' if ok else 'MISSED'}" for text, ok in checks],
        "",
        f"![held-out loss vs tokens and vs steps]({relative_plot})",
        "",
        "Runs (train.py overrides):",
        "",
        *[
            f"- {labels[key]}: `{' '.join(o for o in overrides if not o.startswith('hydra.run.dir='))}`"
            for key, overrides in commands.items()
        ],
    ]
    adaptive = runs.get("adaptive")
    if adaptive:
        lines += ["", "CBS-adaptive runs (probe readings, samples):", ""]
        for run in adaptive:
            readings = ", ".join(
                f"{r['tokens']:,}: batch {r['batch_size']} k*={r['k_star']:g}"
                + ("" if r.get("determined", True) else " (undetermined)")
                + (f", window {r['window_tokens']:,}" if "window_tokens" in r else "")
                for r in run["probe"]["readings"]
            )
            changes = ", ".join(f"{c['old']} -> {c['new']} at {c['tokens']:,}" for c in run["batch_changes"]) or "none"
            lines.append(f"- seed {run['seed']}: {readings}; batch changes {changes}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=2, help="seeds per configuration (default 2; --quick: 1)")
    parser.add_argument(
        "--tokens", type=int, default=None, help=f"budget per run (default {REFERENCE_TOKENS:,}; --quick: a quarter)"
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the budget, one seed: a few minutes")
    parser.add_argument(
        "--gpu", action="store_true", help=f"the GPU variant: a 25M-parameter model, {GPU_TOKENS:,} tokens, one seed"
    )
    parser.add_argument("--configs", default=",".join(c.key for c in CONFIGS), help="which runs, comma-separated keys")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=(
            "a train.py override for every run, or with a CONFIG: prefix for that configuration's runs alone "
            "(repeatable), e.g. trainer.limit_val_batches=8 or adaptive:callbacks.cbs_probe.heldout_batches=4"
        ),
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained at once (default 1: each run's wall time is its own; more share the cores)",
    )
    parser.add_argument("--last-evals", type=int, default=2, help="held-out evaluations averaged for the final loss")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "table1", help="folder for the runs")
    parser.add_argument("--json", type=Path, default=None, help="write every number here (default: OUT/table1.json)")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="write the section 'table1' of this file (default: docs/RESULTS.md, none with --quick)",
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help="PNG (default: docs/table1.png next to --markdown, else OUT)"
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="PATH",
        help="train nothing: redo the table, goals, plot and markdown from a table1.json written earlier",
    )
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.date = str(datetime.date.today())
    args.commit = git_commit()
    saved = None
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        for name in SAVED_ARGS:
            setattr(args, name, saved["args"].get(name))
    if args.tokens is None:
        args.tokens = GPU_TOKENS if args.gpu else REFERENCE_TOKENS // 4 if args.quick else REFERENCE_TOKENS
    if (args.quick or args.gpu) and "--seeds" not in " ".join(args.argv):
        args.seeds = 1
    if args.tokens < 262_144:
        parser.error(
            f"--tokens={args.tokens} must be >= 262144 (the probe window must hold one step of its largest branch)"
        )
    if args.seeds < 1 or args.last_evals < 1:
        parser.error("--seeds and --last-evals must be >= 1")
    by_key = {c.key: c for c in CONFIGS}
    keys = [key.strip() for key in args.configs.split(",") if key.strip()]
    unknown = [key for key in keys if key not in by_key]
    if unknown or not keys:
        parser.error(f"--configs: unknown {unknown}; choose from {list(by_key)}")
    if args.gpu and saved is None:
        refuse_gpu_run_without_a_gpu(parser)
    if args.markdown is None and not args.quick and not args.gpu:
        args.markdown = ROOT / "docs" / "RESULTS.md"
    if args.plot is None:
        args.plot = (args.markdown.parent / "table1.png") if args.markdown else args.out / "table1.png"
    args.json = args.json or args.out / "table1.json"
    args.seed_list = list(range(1, args.seeds + 1))
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs} must be >= 1")
    for override in args.override:
        prefix = override_prefix(override)
        if prefix is not None and prefix not in by_key:
            parser.error(f"--override {override}: unknown configuration {prefix!r}; choose from {list(by_key)}")
    args.threads = None if args.jobs == 1 else max(1, (os.cpu_count() or 1) // args.jobs)

    started = time.perf_counter()
    runs: dict[str, list[dict]] = {}
    commands: dict[str, list[str]] = {}  # per configuration: train.py's overrides (the last seed's)
    if saved is not None:
        runs, commands, seconds = saved["runs"], saved["commands"], saved["seconds"]

    def train(key: str, seed: int) -> dict:
        config = by_key[key]
        run_dir = (args.out / f"{key}_seed{seed}").resolve()
        command = run_command(config, seed, args.tokens, run_dir, gpu=args.gpu, extra=overrides_for(key, args.override))
        commands[key] = command[2:]
        print(f"[table1] {config.label}, seed {seed}: {' '.join(command[1:])}", flush=True)
        run_started = time.perf_counter()
        run_logged(command, run_dir / "stdout.log", threads=args.threads)
        run = read_run(run_dir)
        run.update(seed=seed, wall_seconds=time.perf_counter() - run_started, run_dir=str(run_dir))
        print(
            f"[table1]   {config.label}, seed {seed}: final held-out loss {final_loss(run, args.last_evals):.4f}, "
            f"{run['optimizer_steps']:,} steps, {run['wall_seconds']:.0f} s",
            flush=True,
        )
        return run

    # Seeds outermost: a stopped benchmark has every configuration once.
    jobs = [(key, seed) for seed in ([] if saved is not None else args.seed_list) for key in keys]
    with ThreadPoolExecutor(args.jobs) as pool:
        for (key, _), run in zip(jobs, pool.map(lambda job: train(*job), jobs)):
            runs.setdefault(key, []).append(run)
    if saved is None:
        seconds = time.perf_counter() - started
        args.load = os.getloadavg()  # as the runs end
    runs = {key: runs[key] for key in keys}
    if saved is None:
        problems = [
            p for key in keys for run in runs[key] for p in check_run(Path(run["run_dir"]), **CHECKS.get(key, {}))
        ]
        refuse_unless_checked(problems, "table1")
    labels = {c.key: c.label for c in CONFIGS}
    rows = aggregate(runs, args.last_evals)
    checks = goals(rows)
    print(table(rows, labels, args.last_evals))
    for text, ok in checks:
        print(f"{text}: {'met' if ok else 'MISSED'}")
    plot(runs, labels, args.plot)
    saved_args = {name: getattr(args, name) for name in SAVED_ARGS}
    result = {
        "args": saved_args,
        "rows": rows,
        "goals": [{"goal": text, "met": ok} for text, ok in checks],
        "runs": runs,
        "commands": commands,
        "seconds": seconds,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    if args.markdown:
        text = markdown(rows, labels, checks, runs, args, commands, args.plot, args.markdown, seconds)
        replace_section(args.markdown, "table1", text)
    print(
        f"[table1] {seconds / 60:.1f} minutes; json {args.json}; plot {args.plot}"
        + (f"; markdown {args.markdown}" if args.markdown else "")
    )
    return result


if __name__ == "__main__":
    main()
