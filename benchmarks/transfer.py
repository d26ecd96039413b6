"""Measure small, train big: does a CBS forecast from the tiny model set the warmup of a larger one?

Merrill et al. 2025 found nearly the same CBS curve for OLMo 1B and 7B, so a cheap model's curve can
set an expensive model's batch warmup, and a run too big to probe needs its schedule forecast past
the proxy's last probe. This benchmark checks that at CPU scale, with the recipes a user runs
(``recipes/train.py`` and ``recipes/schedule_from_probe.py``, one subprocess each):

1. CBS curves at the same probe points, tokens and probe settings: ``+recipe=tiny_cbs_curve`` (tiny,
   233k parameters) and ``+recipe=tiny4x_cbs_curve`` (tiny4x, 868k), seeds 1 and 2 each, batch-16
   runs with probes (bisection over k = 1..16, 2 replicate windows, held-out loss, epsilon 0.02).
   Alongside: the tiny4x small-batch control ``+recipe=tiny4x_small_batch`` (seeds 1, 2), and tiny's
   small-batch run measured by ``GradientNoiseScale`` (micro-batch 4, seed 1).
2. The schedule ``schedule_from_probe.py --forecast-to BUDGET --coverage 0.8 --start 16 --final 64``
   forecasts from both tiny seeds' readings, trained as ``+recipe=tiny4x_warmup batch=from_tiny``
   (seeds 1, 2, no probe) as soon as tiny's curves are done.

Reported: every reading (CBS bracket, samples), the forecast and its schedule, the noise scale's
growth exponent beside the CBS fit's, each tiny4x run's held-out loss at the end of the budget (its
last evaluation) and optimizer steps against the control of its seed, and the goals: every tiny
seed's brackets within one grid step (a factor 2) of every tiny4x seed's at >= 75% of the probe
points; the forecast schedule saving >= 40% of the control's optimizer steps at a held-out loss at
most 0.02 nats above it (means over the seeds). Output: OUT/transfer.json (rewritten after every
run, so a stopped benchmark keeps what finished), two PNGs (the runs; the forecast with the noise
scale, forecast.png beside the first) and the section "transfer" of docs/RESULTS.md.

The budget is the recipes' 4,194,304 tokens per run, LR warmup 262,144 tokens, probe points from
65,536 tokens doubling with windows of 131,072 tokens (2 per k; a point passed inside a probe is
probed when it ends), 8 held-out evaluations per run on 64 micro-batches of the validation split.
About 45-60 minutes on 2 cores.

Usage::

    python -m benchmarks.transfer --jobs 2       # writes docs/RESULTS.md, docs/transfer.png, docs/forecast.png
    python -m benchmarks.transfer --quick --out /tmp/transfer
    python -m benchmarks.transfer --report-only  # the report from the runs finished in OUT
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import (
    ROOT,
    json_default,
    machine,
    read_run,
    recipe_benchmark_arguments,
    replace_section,
    run_logged,
    schedule_changes,
    train_command,
    train_unless_done,
)
from lit_cbs.probe.reading import read_readings

SEQ_LEN = 128
START, FINAL = 16, 64  # samples: the schedules' first and largest global batch
GOALS = {"agreeing_points": 0.75, "steps_saved": 0.40, "loss_gap": 0.02}
COVERAGE = 0.8  # the forecast band the schedule follows the lower edge of


@dataclass(frozen=True)
class Settings:
    """Token counts (tokens) and batch counts (micro-batches of 16 x 128 tokens) of every run, and its seeds."""

    tokens: int  # budget per run
    warmup_tokens: int  # LR warmup
    probe_first: int  # first probe point; then x2
    window_tokens: int  # tokens every probe branch trains on
    multipliers: tuple[int, ...]
    heldout_batches: int  # the probe's held-out micro-batches
    evaluations: int  # held-out evaluations per run
    val_batches: int  # micro-batches per evaluation
    replicates: int  # data windows each measured k trains on
    seeds: tuple[int, ...]  # every model and way of training runs at each (the noise-scale run: seed 1 alone)


FULL = Settings(4_194_304, 262_144, 65_536, 131_072, (1, 2, 4, 8, 16), 32, 8, 64, 2, (1, 2))
# One seed: a pipeline check of every kind of run (each a train.py process, most of whose cost is its start).
QUICK = Settings(32_768, 4_096, 4_096, 4_096, (1, 2), 2, 4, 2, 2, (1,))


@dataclass(frozen=True)
class Run:
    key: str
    label: str
    recipe: str
    seed: int
    schedule: str | None = None  # key of the schedule (conf/batch/<key>.yaml under OUT) it trains with


# tiny's small-batch run measured by GradientNoiseScale (micro-batch 4, so 4 micro-batches per step give
# the small batch): its B_simple over tokens beside the CBS forecast.
NOISE = Run("tiny_noise_scale_seed1", "tiny small batch, gradient noise scale, seed 1", "tiny_small_batch", 1)


@dataclass(frozen=True)
class Roster:
    """The runs of the benchmark at ``seeds`` (``Settings.seeds``), besides NOISE: per seed, both models'
    CBS curves, tiny4x's control and tiny4x trained with the schedule forecast from tiny's curves."""

    seeds: tuple[int, ...]

    @property
    def curves(self) -> list[Run]:
        return [
            Run(f"{model}_curve_seed{seed}", f"{model} CBS curve, seed {seed}", f"{model}_cbs_curve", seed)
            for model in ("tiny", "tiny4x")
            for seed in self.seeds
        ]

    @property
    def tiny_curves(self) -> list[str]:
        return [run.key for run in self.curves if run.recipe == "tiny_cbs_curve"]

    @property
    def tiny4x_curves(self) -> list[str]:
        return [run.key for run in self.curves if run.recipe == "tiny4x_cbs_curve"]

    @property
    def controls(self) -> list[Run]:
        return [
            Run(
                f"tiny4x_control_seed{seed}",
                f"tiny4x small batch (16), control, seed {seed}",
                "tiny4x_small_batch",
                seed,
            )
            for seed in self.seeds
        ]

    @property
    def schedules(self) -> dict[str, list[str]]:
        """Schedule key -> the curve runs it is forecast from."""
        return {"from_tiny": self.tiny_curves}

    @property
    def scheduled(self) -> list[Run]:
        return [
            Run(
                f"tiny4x_from_tiny_seed{seed}",
                f"tiny4x, schedule forecast from tiny's curve, seed {seed}",
                "tiny4x_warmup",
                seed,
                "from_tiny",
            )
            for seed in self.seeds
        ]

    @property
    def trained(self) -> list[Run]:
        """The ways tiny4x is trained."""
        return [*self.controls, *self.scheduled]


def run_command(run: Run, settings: Settings, out: Path) -> list[str]:
    """recipes/train.py's command line for ``run``."""
    overrides = [
        f"+recipe={run.recipe}",
        f"seed={run.seed}",
        f"max_tokens={settings.tokens}",
        f"lr_schedule.warmup_tokens={settings.warmup_tokens}",
        f"val_check_tokens={settings.tokens // settings.evaluations}",
        f"trainer.limit_val_batches={settings.val_batches}",
        "trainer.enable_progress_bar=false",
        "callbacks.progress_bar=null",
        "callbacks.checkpoint=null",
        "plots=false",
    ]
    if "curve" in run.recipe:
        overrides += [
            f"callbacks.cbs_probe.geometric=[{settings.probe_first},2.0]",
            f"callbacks.cbs_probe.window_tokens={settings.window_tokens}",
            f"callbacks.cbs_probe.multipliers=[{','.join(map(str, settings.multipliers))}]",
            f"callbacks.cbs_probe.heldout_batches={settings.heldout_batches}",
            f"callbacks.cbs_probe.replicates={settings.replicates}",
        ]
    if run == NOISE:
        overrides += [
            "data.batch_size=4",
            "batch.max_micro_batch_size=4",
            "+callbacks.gns={_target_:lit_cbs.GradientNoiseScale}",
        ]
    if run.schedule is not None:
        overrides += [f"batch={run.schedule}", f"hydra.searchpath=[file://{(out / 'conf').resolve()}]"]
    overrides.append(f"hydra.run.dir={(out / run.key).resolve()}")
    return train_command(overrides)


def schedule_command(key: str, settings: Settings, out: Path) -> list[str]:
    """recipes/schedule_from_probe.py's command line writing OUT/conf/batch/<key>.yaml: the schedule
    forecast to the whole budget from the band's lower edge (coverage COVERAGE)."""
    probes = [str(probe_file(out / curve)) for curve in Roster(settings.seeds).schedules[key]]
    target = out / "conf" / "batch" / f"{key}.yaml"
    return [
        sys.executable,
        str(ROOT / "recipes" / "schedule_from_probe.py"),
        *probes,
        "--start",
        str(START),
        "--final",
        str(FINAL),
        "--out",
        str(target),
        "--forecast-to",
        str(settings.tokens),
        "--coverage",
        str(COVERAGE),
    ]


def probe_file(run_dir: Path) -> Path:
    found = sorted(run_dir.rglob("cbs_probe.jsonl"))
    if len(found) != 1:
        raise SystemExit(f"[transfer] {run_dir} holds {len(found)} cbs_probe.jsonl files, expected 1")
    return found[0]


def train(run: Run, settings: Settings, out: Path, threads: int) -> dict:
    """Train ``run`` (or reuse its finished folder) and return its summary, readings and loss curve."""
    train_unless_done(
        run_command(run, settings, out),
        out / run.key,
        out / "logs" / f"{run.key}.log",
        threads,
        f"[transfer] {run.label}",
    )
    return load(run, out)


def load(run: Run, out: Path) -> dict:
    """A finished run's summary, loss curve and (for a curve) readings."""
    run_dir = out / run.key
    checks = {"probes": "curve" in run.recipe, "changes_batch": "warmup" in run.recipe and schedule_changes(run_dir)}
    result = {**read_run(run_dir, **checks), **asdict(run), "run_dir": str(run_dir)}
    wall = run_dir / "wall_seconds.txt"
    result["wall_seconds"] = float(wall.read_text()) if wall.exists() else None
    if "curve" in run.recipe:
        result["readings"] = read_readings(probe_file(run_dir))
    print(
        f"[transfer] {run.label}: held-out loss {result['val_curve'][-1]['val_loss']:.4f} "
        f"at {result['val_curve'][-1]['tokens']:,} tokens, {result['optimizer_steps']:,} steps",
        flush=True,
    )
    return result


def load_unfinished_curve(run: Run, out: Path) -> dict:
    """The readings a curve run still training has written so far (--report-only on a benchmark cut short)."""
    readings = read_readings(probe_file(out / run.key))
    print(f"[transfer] {run.label}: unfinished, {len(readings)} readings so far", flush=True)
    return {**asdict(run), "run_dir": str(out / run.key), "readings": readings, "unfinished": True}


def read_schedule(key: str, out: Path) -> dict | None:
    from omegaconf import OmegaConf

    path = out / "conf" / "batch" / f"{key}.yaml"
    if not path.exists():
        return None
    schedule = OmegaConf.load(path).schedule
    return {"batch_sizes": list(schedule.batch_sizes), "thresholds": list(schedule.thresholds), "path": str(path)}


def agreement(runs: dict[str, dict], roster: Roster) -> list[dict]:
    """Per probe point (tokens): each curve's bracket and whether every tiny seed's lower bound is within
    one grid step (a factor 2) of every tiny4x seed's."""
    curves = {run.key: runs[run.key]["readings"] for run in roster.curves if run.key in runs}
    points = sorted({r.tokens for readings in curves.values() for r in readings})
    rows = []
    for tokens in points:
        at = {key: next((r for r in readings if r.tokens == tokens), None) for key, readings in curves.items()}
        steps = [
            None if at.get(big) is None or at.get(tiny) is None else math.log2(at[tiny].cbs_lower / at[big].cbs_lower)
            for tiny in roster.tiny_curves
            for big in roster.tiny4x_curves
            if tiny in at and big in at
        ]
        rows.append(
            {
                "tokens": tokens,
                "brackets": {key: None if r is None else [r.cbs_lower, r.cbs_upper] for key, r in at.items()},
                "grid_steps_apart": steps,
                "agree": bool(steps) and all(s is not None and abs(s) <= 1 for s in steps),
            }
        )
    return rows


def outcomes(runs: dict[str, dict], roster: Roster) -> dict[str, dict]:
    """Per tiny4x training run: final held-out loss, optimizer steps, and both against its seed's control."""
    rows = {}
    for run in roster.trained:
        if run.key not in runs:
            continue
        result = runs[run.key]
        rows[run.key] = {
            "seed": run.seed,
            "loss": result["val_curve"][-1]["val_loss"],
            "steps": result["optimizer_steps"],
            "tokens": result["tokens"],
            "final_batch": result["final_batch"],
            "wall_seconds": result["wall_seconds"],
        }
    for row in rows.values():
        control = rows.get(f"tiny4x_control_seed{row['seed']}")
        if control is not None:
            row["loss_vs_control"] = row["loss"] - control["loss"]
            row["steps_saved"] = 1 - row["steps"] / control["steps"]
    return rows


def goals(points: list[dict], rows: dict[str, dict], roster: Roster) -> list[tuple[str, bool]]:
    checks = []
    if points:
        agreeing = sum(point["agree"] for point in points)
        checks.append(
            (
                f"brackets of every tiny seed and every tiny4x seed within one grid step at {agreeing} "
                f"of {len(points)} probe points (goal >= {GOALS['agreeing_points']:.0%} of them)",
                agreeing >= GOALS["agreeing_points"] * len(points),
            )
        )
    paired = [rows[run.key] for run in roster.scheduled if "steps_saved" in rows.get(run.key, {})]
    if paired:
        saved = statistics.mean(row["steps_saved"] for row in paired)
        gap = statistics.mean(row["loss_vs_control"] for row in paired)
        checks.append(
            (
                f"schedule forecast from tiny's curve, mean over {len(paired)} seed(s): {saved:.1%} fewer optimizer "
                f"steps than the control of the same seed (goal >= {GOALS['steps_saved']:.0%}) "
                f"at held-out loss {gap:+.4f} nats "
                f"(goal <= +{GOALS['loss_gap']})",
                saved >= GOALS["steps_saved"] and gap <= GOALS["loss_gap"],
            )
        )
    return checks


def forecast_of(runs: dict[str, dict], out: Path, roster: Roster):
    """The forecast the schedule was read from (the fit schedule_from_probe.py makes: tiny's curves, one
    run per file, here named by their runs) and, when the noise-scale run finished, its B_simple over tokens."""
    from lit_cbs.analysis import brackets_from_records, forecast_cbs
    from lit_cbs.analysis.forecast import noise_scale_over_tokens

    if not all(key in runs for key in roster.tiny_curves):
        return None, None
    brackets = [b for key in roster.tiny_curves for b in brackets_from_records(runs[key]["readings"], run=key)]
    noise = noise_scale_over_tokens(out / NOISE.key / "metrics.csv") if NOISE.key in runs else None
    return forecast_cbs(brackets, coverage=COVERAGE), noise


def bracket(pair) -> str:
    if pair is None:
        return "-"
    lower, upper = pair
    return f"[{lower:g}, {'beyond' if upper is None else f'{upper:g}'}]"


def schedule_text(schedule: dict | None) -> str:
    if schedule is None:
        return "not written"
    steps = [f"{b} from {t:,}" for b, t in zip(schedule["batch_sizes"], schedule["thresholds"])]
    return ", ".join(steps) + " tokens"


def plot(runs: dict[str, dict], schedules: dict[str, dict | None], path: Path, roster: Roster) -> Path:
    from matplotlib.figure import Figure

    from lit_cbs.analysis.plots import save_figure

    figure = Figure(figsize=(16, 4.5))
    cbs_axis, tokens_axis, steps_axis = figure.subplots(1, 3)
    for index, run in enumerate(roster.curves):
        if run.key not in runs:
            continue
        readings = runs[run.key]["readings"]
        shift = 1.04 ** (index - 1.5)  # side by side at each point
        for r in readings:
            upper = r.cbs_upper if r.cbs_upper is not None else 2 * r.cbs_lower
            cbs_axis.plot(
                [r.tokens * shift] * 2,
                [r.cbs_lower, upper],
                color=f"C{index}",
                lw=3,
                alpha=0.7,
                ls="-" if r.cbs_upper is not None and r.determined else ":",
            )
        cbs_axis.plot([], [], color=f"C{index}", lw=3, label=f"{run.label} (bracket; dotted: undetermined)")
    for index, (key, schedule) in enumerate(schedules.items()):
        if schedule is None:
            continue
        end = max(run.get("tokens", 0) for run in runs.values()) or 2 * schedule["thresholds"][-1]
        cbs_axis.step(
            [*schedule["thresholds"], end],
            [*schedule["batch_sizes"], schedule["batch_sizes"][-1]],
            where="post",
            color=f"C{index + 4}",
            ls="--",
            label=f"schedule {key}",
        )
    cbs_axis.set(
        xscale="log",
        yscale="log",
        xlabel="tokens",
        ylabel="global batch / CBS (samples of 128 tokens)",
        title="CBS brackets and the forecast schedule",
    )
    cbs_axis.set_yticks([8, 16, 32, 64, 128, 256, 512], labels=["8", "16", "32", "64", "128", "256", "512"])
    cbs_axis.minorticks_off()
    cbs_axis.legend(fontsize=6)
    for run in roster.trained:
        if run.key not in runs:
            continue
        curve = runs[run.key]["val_curve"]
        style = ("-" if run in roster.controls else "--") + ("o" if run.seed == roster.seeds[0] else "s")
        color = "k" if run in roster.controls else "tab:red"
        tokens_axis.plot(
            [p["tokens"] for p in curve], [p["val_loss"] for p in curve], style, color=color, ms=4, label=run.label
        )
        steps_axis.plot([p["step"] for p in curve], [p["val_loss"] for p in curve], style, color=color, ms=4)
    tokens_axis.set(xlabel="tokens", ylabel="held-out loss (nats/token)", title="tiny4x: loss vs tokens")
    steps_axis.set(xlabel="optimizer steps", xscale="log", title="tiny4x: loss vs optimizer steps")
    tokens_axis.legend(fontsize=6)
    finals = [runs[run.key]["val_curve"][-1]["val_loss"] for run in roster.trained if run.key in runs]
    if finals:
        for axis in (tokens_axis, steps_axis):
            axis.set_ylim(min(finals) - 0.05, min(finals) + 0.6)
    for axis in (cbs_axis, tokens_axis, steps_axis):
        axis.grid(alpha=0.3)
    return save_figure(figure, path)


def markdown(
    runs,
    schedules,
    points,
    rows,
    checks,
    forecast,
    noise,
    args,
    plot_path: Path,
    forecast_path: Path | None,
    markdown_path: Path,
) -> str:
    from lit_cbs.analysis.forecast import growth_exponent

    s = args.settings
    roster = Roster(s.seeds)
    missing = [run.label for run in [*roster.curves, NOISE, *roster.trained] if run.key not in runs]
    unfinished = [run.label for run in roster.curves if runs.get(run.key, {}).get("unfinished")]
    lines = [
        "## Measure small, train big: does the tiny model's CBS forecast carry to tiny4x?",
        "",
        f"Command: `python -m benchmarks.transfer {' '.join(args.argv)}`".rstrip()
        + f" ({args.date}; {machine(os.getloadavg())}).",
        "",
        f"Budget: {s.tokens:,} tokens per run (the recipes'), batch 16 x 128 tokens (the forecast schedule grows it to "
        f"at most {FINAL}), LR 3e-3 (x sqrt(2) per doubling), LR warmup {s.warmup_tokens:,} tokens then constant, the "
        "embedded stdlib corpus. tiny: 233,472 parameters; tiny4x: 868,352 (d_model 128, 8 heads, 4 layers). Probes: "
        f"points from {s.probe_first:,} tokens doubling, windows of {s.window_tokens:,} tokens, each k trained on "
        f"{s.replicates} disjoint data windows, k = {', '.join(map(str, s.multipliers))} by bisection, held-out loss "
        f"on {s.heldout_batches} micro-batches, epsilon 0.02 nats, confidence 0.9; the same for both models. Seeds "
        f"{', '.join(map(str, s.seeds))} for every model and way of training. Held-out loss below: the last of "
        f"{s.evaluations} evaluations ({s.val_batches} micro-batches of the validation split), "
        "at the end of the budget.",
        "",
    ]
    if missing:
        lines += [f"**Incomplete: not run (yet): {', '.join(missing)}.**", ""]
    if unfinished:
        lines += [f"**Unfinished when reported (its readings so far are shown): {', '.join(unfinished)}.**", ""]
    curve_keys = [run.key for run in roster.curves]
    lines += [
        "CBS brackets (samples of 128 tokens; `?`: undetermined at 90%) at each probe point:",
        "",
        "| tokens | "
        + " | ".join(run.label.replace(" CBS curve", "") for run in roster.curves)
        + " | grid steps apart (tiny vs tiny4x) | within one step |",
        "|---|" + "---|" * (len(roster.curves) + 2),
    ]
    for point in points:
        cells = []
        for key in curve_keys:
            reading = next((r for r in runs.get(key, {}).get("readings", []) if r.tokens == point["tokens"]), None)
            sure = reading is None or reading.determined
            cells.append("-" if reading is None else bracket(point["brackets"][key]) + ("" if sure else " ?"))
        apart = ", ".join("-" if x is None else f"{x:+.0f}" for x in point["grid_steps_apart"])
        lines.append(f"| {point['tokens']:,} | {' | '.join(cells)} | {apart} | {'yes' if point['agree'] else 'no'} |")
    lines += [""]
    if forecast is not None:
        lines += [
            "The forecast (`recipes/schedule_from_probe.py "
            f"{' '.join(f'{key}/cbs_probe.jsonl' for key in roster.tiny_curves)} --forecast-to {s.tokens} "
            f"--coverage {COVERAGE} --start {START} --final {FINAL}`): {forecast.describe()}."
        ]
        if noise is not None:
            lines += [
                f"The noise scale B_simple of tiny's small-batch run (seed 1, micro-batch 4) grows as "
                f"D^{growth_exponent(*noise):.3f} over the run, the CBS fit as D^{forecast.exponent:.3f}; at the end "
                f"B_simple = {noise[1][-1]:.1f} samples, the fitted CBS {float(forecast.predict(noise[0][-1])):.1f}."
            ]
        lines += [""]
    lines += ["Schedules (global batch, samples):", ""]
    lines += [
        f"- {key} ({' + '.join(roster.schedules[key])}): {schedule_text(schedule)}"
        for key, schedule in schedules.items()
    ]
    lines += [
        "",
        "tiny4x trained two ways, each seed against the control of the same seed:",
        "",
        "| run | held-out loss | vs control | optimizer steps | steps saved | final batch | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in roster.trained:
        if run.key in rows:
            row = rows[run.key]
            lines.append(
                f"| {run.label} | {row['loss']:.4f} | {row.get('loss_vs_control', 0):+.4f} | {row['steps']:,} "
                f"| {row.get('steps_saved', 0):.0%} | {row['final_batch']} | {row['wall_seconds'] or 0:.0f} |"
            )
    finished_curves = [r for r in roster.curves if r.key in runs and not runs[r.key].get("unfinished")]
    cost = [
        f"{run.label}: {runs[run.key]['probe']['tokens']:,} probe tokens, {runs[run.key]['wall_seconds'] or 0:.0f} s"
        for run in finished_curves
    ]
    lines += [
        "",
        "What the curves cost (probe branch tokens on top of the budget, wall time of the run): "
        + "; ".join(cost)
        + ".",
        "",
    ]
    gaps = [
        runs[f"tiny4x_curve_seed{seed}"]["val_curve"][-1]["val_loss"]
        - runs[f"tiny4x_control_seed{seed}"]["val_curve"][-1]["val_loss"]
        for seed in s.seeds
        if f"tiny4x_control_seed{seed}" in runs
        and f"tiny4x_curve_seed{seed}" in runs
        and not runs[f"tiny4x_curve_seed{seed}"].get("unfinished")
    ]
    if gaps:
        lines += [
            f"The probed tiny4x runs' main runs against the unprobed controls (same seed and batch): held-out loss "
            f"{', '.join(f'{g:+.4f}' for g in gaps)} nats apart (a probe must leave the main run untouched).",
            "",
        ]
    lines += [
        "Goals:",
        "",
        *[f"- {text}: {'met' if ok else 'MISSED'}" for text, ok in checks],
        "",
        f"![CBS brackets, schedules and tiny4x's loss]({os.path.relpath(plot_path, markdown_path.parent)})",
    ]
    if forecast_path is not None:
        lines += [
            "",
            f"![The forecast from tiny's readings, its 80% band and the noise scale]"
            f"({os.path.relpath(forecast_path, markdown_path.parent)})",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = recipe_benchmark_arguments(
        "transfer",
        __doc__.split("\n\n")[0],
        f"{QUICK.tokens:,} tokens per run, small probes, one seed: a pipeline check, no results",
        argv,
    )
    args.settings = QUICK if args.quick else FULL
    roster = Roster(args.settings.seeds)
    threads = args.threads
    runs: dict[str, dict] = {}

    def save() -> None:  # after every run: a stopped benchmark keeps what finished
        (args.out / "transfer.json").write_text(
            json.dumps({"settings": asdict(args.settings), "runs": runs}, indent=2, default=json_default)
        )

    def train_all() -> None:
        """Every run, ``--jobs`` at a time; a scheduled run starts as soon as the curves it reads have finished."""
        waiting = list(roster.scheduled)
        with ThreadPoolExecutor(args.jobs) as pool:
            pending = {
                pool.submit(train, run, args.settings, args.out, threads): run
                for run in [*roster.curves, NOISE, *roster.controls]
            }
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    runs[pending.pop(future).key] = future.result()
                    save()
                ready = [run for run in waiting if all(curve in runs for curve in roster.schedules[run.schedule])]
                for key in {run.schedule for run in ready}:
                    run_logged(
                        schedule_command(key, args.settings, args.out),
                        args.out / "logs" / f"schedule_{key}.log",
                        threads,
                    )
                for run in ready:
                    waiting.remove(run)
                    pending[pool.submit(train, run, args.settings, args.out, threads)] = run

    started = time.perf_counter()
    if args.report_only:
        for run in [*roster.curves, NOISE, *roster.trained]:
            if (args.out / run.key / "summary.json").exists():
                runs[run.key] = load(run, args.out)
            elif run in roster.curves and any((args.out / run.key).rglob("cbs_probe.jsonl")):
                runs[run.key] = load_unfinished_curve(run, args.out)
    else:
        train_all()
    schedules = {key: read_schedule(key, args.out) for key in roster.schedules}
    points, rows = agreement(runs, roster), outcomes(runs, roster)
    checks = goals(points, rows, roster)
    forecast, noise = forecast_of(runs, args.out, roster)
    result = {
        "settings": asdict(args.settings),
        "schedules": schedules,
        "points": points,
        "rows": rows,
        "goals": [{"goal": text, "met": ok} for text, ok in checks],
        "runs": runs,
        "seconds": time.perf_counter() - started,
        "forecast": None if forecast is None else {"description": forecast.describe(), "exponent": forecast.exponent},
    }
    (args.out / "transfer.json").write_text(json.dumps(result, indent=2, default=json_default))
    for key, schedule in schedules.items():
        print(f"[transfer] schedule {key}: {schedule_text(schedule)}")
    for text, ok in checks:
        print(f"[transfer] {text}: {'met' if ok else 'MISSED'}")
    plot(runs, schedules, args.plot, roster)
    forecast_path = None
    if forecast is not None:
        from lit_cbs.analysis import plot_forecast

        forecast_path = plot_forecast(
            forecast, args.plot.with_name("forecast.png"), tokens_to=args.settings.tokens, noise_scale=noise
        )
    if args.markdown:
        replace_section(
            args.markdown,
            "transfer",
            markdown(
                runs, schedules, points, rows, checks, forecast, noise, args, args.plot, forecast_path, args.markdown
            ),
        )
    print(
        f"[transfer] {result['seconds'] / 60:.1f} minutes; {args.out / 'transfer.json'}; plot {args.plot}"
        + (f"; markdown {args.markdown}" if args.markdown else ""),
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
