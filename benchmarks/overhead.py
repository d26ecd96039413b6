"""What lit_cbs's callbacks cost on a small language-model workload, side by side in one run.

Workload: ``CausalLM`` with the tiny OLMo preset (d_model 64, 4 layers, byte vocabulary; AdamW, no
LR schedule) on ``RandomTokenData`` batches of 16 sequences x 128 tokens (the micro-batch), one
Lightning Trainer per fit on CPU, a CSVLogger every 10 steps. Every callback is compared with the
same Trainer without it. The fits of each part are interleaved, in an order that rotates with the
repeat, and every part runs once per repeat, so load changes on the machine hit the configurations
alike; the results are ratios. Every step is timed by two clocks: wall (``time.perf_counter``) and
this process's CPU time (``time.process_time``), which other jobs on shared cores disturb less.

(a) BatchWarmup idle: ms per optimizer step of a plain Trainer vs the same Trainer with
    ``BatchWarmup(ConstantBatch(16))``, with and without its per-step logging, and the time
    spent inside BatchWarmup's per-batch hooks;
(b) change cost: a fit whose global batch grows 16 -> 32 samples (accumulate 1 -> 2) mid-epoch:
    the extra time of the step that ends with the change and of the first step at the new size,
    over the steady step time of each one's size, counted in steps at the new size;
(c) loader rebuilds: ``train_dataloader()`` calls per fit in every configuration;
(d) GradientNoiseScale: ms per optimizer step of 32 samples = 2 micro-batches
    (``BatchWarmup(ConstantBatch(32))``, accumulate 2) vs the same plus ``GradientNoiseScale()``,
    the time inside its five hooks (per micro-batch and per step), and the bytes of the gradient
    copy it keeps (its docstring: one copy of the optimizer's gradients, in their dtype); also
    ``GradientNoiseScale(groups="blocks")`` (6 groups: embedding, 4 blocks, lm_head) in the same
    rotation, and the time inside its hooks over that of ``GradientNoiseScale()`` in each repeat;
(e1) CBSProbeCallback between probes: the (a) Trainer with ``BatchWarmup(ConstantBatch(16))``
    plus a probe on a geometric schedule whose first point, after step 1, is skipped by its
    ``max_overhead`` and whose second lies at the fit's end: on every later step its per-batch hooks
    do what they do between two probes of a real schedule. Fitted in the rotation of (a), its hooks
    timed as in (a);
(e2) one probe: a fit with one probe after step 3 (multipliers 1, 2, 4, 8; a window of 8 steps,
    the least that holds one step of k = 8; ``evaluate="train_ema"``) with ``search="grid"`` and
    with ``search="bisect"``, vs the same fit without the probe: the extra time of the whole
    ``trainer.fit``, also in steps of the fit without it and per branch trained, the part of it in
    the probe's ``on_train_end`` (the CBS curve plot, once per fit), and the probe tokens
    (``tokens_spent``). The tokens are random, so the branches' losses and k* mean nothing:
    (e2) measures cost only.

``--quick`` runs 2 repeats, sequences of 32 tokens, and fewer steps in (a), (b), (d) and (e1) (the
probe's window cannot shrink in steps): a smoke run, not numbers to read; it writes markdown only
where --output / --results say.

Usage::

    python -m benchmarks.overhead [--repeats 8] [--threads 1]
        # writes docs/benchmarks/overhead.md and the section "overhead" of docs/RESULTS.md
    python -m benchmarks.overhead --quick --output /tmp/overhead.md --results /tmp/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from benchmarks.common import CLOCKS, ROOT, StepTimer, git_commit, refuse_unless_checked, replace_section
from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch, GradientNoiseScale, PiecewiseBatch
from lit_cbs.data.synthetic import RandomTokenData
from lit_cbs.models.lm import ADAMW, CausalLM

TITLE = "Overhead of lit_cbs's callbacks"
MICRO_BATCH_SIZE = 16  # sequences per micro-batch
SKIPPED_STEPS = 3  # first steps of every fit left out of the step medians (allocator, caches)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Optimizer steps per fit, and the sequences they train on."""

    idle: int  # (a) and (e1)
    steady: int  # (b): at each of the two batch sizes
    noise_scale: int  # (d)
    seq_len: int = 128  # tokens per sequence trained on

    @property
    def step_tokens(self) -> int:
        """Tokens of one optimizer step at batch 16."""
        return MICRO_BATCH_SIZE * self.seq_len


FULL = Sizes(idle=30, steady=12, noise_scale=12)
# (b) needs steady >= 6 for a step median at 16. Sequences of 32 tokens: the same steps and hooks at a quarter of the
# compute, which is most of a quick run's time.
QUICK = Sizes(idle=8, steady=6, noise_scale=6, seq_len=32)

# (e2): one probe, started after PROBE_AFTER_STEPS steps at batch 16; its window is the fewest
# tokens that hold one step of the largest branch, 8 x 16 samples = 8 steps of the main run.
PROBE_MULTIPLIERS = (1, 2, 4, 8)
PROBE_AFTER_STEPS = 3
PROBE_WINDOW_STEPS = max(PROBE_MULTIPLIERS)
PROBE_FIT_STEPS = PROBE_AFTER_STEPS + PROBE_WINDOW_STEPS + 1  # one step after the probe ends

PER_BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end")
NOISE_SCALE_HOOKS = (
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",  # writes its metrics at the logging interval
)
PLAIN = "plain Trainer"


@dataclasses.dataclass(frozen=True)
class Config:
    """One fit's callbacks; the last of them is the one the configuration measures."""

    part: str  # "(a)", "(d)", ...
    name: str
    # Fresh callbacks for every fit: of so many optimizer steps, of so many tokens each at batch 16.
    callbacks: Callable[[int, int], list[Callback]]
    baseline: str | None = None  # the configuration without the measured callback, same rotation
    hooks: tuple[str, ...] = ()  # the measured callback's hooks to time

    @property
    def label(self) -> str:
        return f"{self.part} {self.name}"

    @property
    def base_step(self) -> str:
        return "a plain step" if self.baseline == PLAIN else "a step without it"

    @property
    def hooks_kind(self) -> str:
        return "per-batch hooks" if self.hooks == PER_BATCH_HOOKS else "hooks"


def warmup_at(global_batch: int, **kwargs) -> BatchWarmup:
    return BatchWarmup(ConstantBatch(global_batch), **kwargs)


def probe(step_tokens: int, **kwargs) -> CBSProbeCallback:
    return CBSProbeCallback(
        multipliers=PROBE_MULTIPLIERS, window_tokens=PROBE_WINDOW_STEPS * step_tokens, evaluate="train_ema", **kwargs
    )


WARMUP_16 = "+ BatchWarmup(ConstantBatch(16))"
IDLE_PROBE = "+ BatchWarmup(ConstantBatch(16)) + CBSProbeCallback between probes"
IDLE_CONFIGS = [  # (a) and (e1), fitted in one rotation
    Config("(a)", PLAIN, lambda steps, step_tokens: []),
    Config("(a)", WARMUP_16, lambda steps, step_tokens: [warmup_at(16)], PLAIN, PER_BATCH_HOOKS),
    Config(
        "(a)",
        "+ BatchWarmup(ConstantBatch(16), log_every_step=False)",
        lambda steps, step_tokens: [warmup_at(16, log_every_step=False)],
        PLAIN,
        PER_BATCH_HOOKS,
    ),
    # A probe at 1 step's tokens and at `steps` steps' (the fit's end): the first, whose window fits in the fit, is
    # skipped by max_overhead (a probe the run cannot hold is refused at its start), so on every later step its
    # hooks do what they do between two probes.
    Config(
        "(e1)",
        IDLE_PROBE,
        lambda steps, step_tokens: [
            warmup_at(16),
            CBSProbeCallback(
                geometric=(step_tokens, steps),
                multipliers=(1, 2),
                window_tokens=2 * step_tokens,
                max_overhead=1e-9,
                evaluate="train_ema",
            ),
        ],
        WARMUP_16,
        PER_BATCH_HOOKS,
    ),
]
ACCUMULATE_2 = "BatchWarmup(ConstantBatch(32)), accumulate 2"
NOISE_SCALE = "+ GradientNoiseScale()"
NOISE_SCALE_BLOCKS = "+ GradientNoiseScale(groups='blocks')"
NOISE_SCALE_CONFIGS = [  # (d)
    Config("(d)", ACCUMULATE_2, lambda steps, step_tokens: [warmup_at(32)]),
    Config(
        "(d)",
        NOISE_SCALE,
        lambda steps, step_tokens: [warmup_at(32), GradientNoiseScale()],
        ACCUMULATE_2,
        NOISE_SCALE_HOOKS,
    ),
    Config(
        "(d)",
        NOISE_SCALE_BLOCKS,
        lambda steps, step_tokens: [warmup_at(32), GradientNoiseScale(groups="blocks")],
        ACCUMULATE_2,
        NOISE_SCALE_HOOKS,
    ),
]
BLOCKS_OVER_WHOLE = "(d) time inside its hooks, groups='blocks' / no groups"


def probed_once(search: str, steps: int, step_tokens: int) -> list[Callback]:
    return [warmup_at(16), probe(step_tokens, at_tokens=[PROBE_AFTER_STEPS * step_tokens], search=search)]


PROBE_BASELINE = "BatchWarmup(ConstantBatch(16)), no probe"
PROBE_SEARCHES = ("grid", "bisect")
PROBE_CONFIGS = [  # (e2)
    Config("(e2)", PROBE_BASELINE, lambda steps, step_tokens: [warmup_at(16)]),
    *(
        Config(
            "(e2)",
            f"+ CBSProbeCallback(search={search!r})",
            functools.partial(probed_once, search),
            PROBE_BASELINE,
            ("on_train_end",),
        )
        for search in PROBE_SEARCHES
    ),
]

CHANGE_COST = "(b) extra cost of the change, steps at 32 samples"
PROBE_STEPS = "(e2) {}: extra fit time, steps without it"
GRID_OVER_BISECT = "(e2) extra fit time, grid / bisect"


def overhead_measure(config: Config) -> str:
    return f"{config.label}: overhead, % of {config.base_step}"


def hook_share_measure(config: Config) -> str:
    return f"{config.label}: time inside its {config.hooks_kind}, % of {config.base_step}"


class CountedTokenData(RandomTokenData):
    """Counts ``train_dataloader()`` calls: (c) checks that a batch change rebuilds no loader."""

    def __init__(self, samples: int, seq_len: int):
        super().__init__(vocab_size=256, seq_len=seq_len, batch_size=MICRO_BATCH_SIZE, samples=samples)
        self.loader_builds = 0

    def train_dataloader(self):
        self.loader_builds += 1
        return super().train_dataloader()


def steady_ms(timer: StepTimer, clock: str) -> float:
    """Median ms per step, leaving out the first SKIPPED_STEPS steps."""
    return 1000 * statistics.median(timer.durations(clock)[SKIPPED_STEPS:])


def time_hooks(callback: Callback, hook_names: tuple[str, ...]) -> dict[str, float]:
    """Wrap ``callback``'s hooks; the returned dict adds up the seconds spent in them, per clock."""
    seconds = dict.fromkeys(CLOCKS, 0.0)

    def timed(hook):
        @functools.wraps(hook)
        def wrapper(*args, **kwargs):
            starts = {clock: read() for clock, read in CLOCKS.items()}
            result = hook(*args, **kwargs)
            for clock, read in CLOCKS.items():
                seconds[clock] += read() - starts[clock]
            return result

        return wrapper

    for name in hook_names:
        setattr(callback, name, timed(getattr(callback, name)))
    return seconds


@dataclasses.dataclass
class Fit:
    """What one fit leaves to measure."""

    callbacks: list[Callback]
    timer: StepTimer
    data: CountedTokenData
    module: CausalLM
    seconds: dict[str, float]  # of trainer.fit, per clock
    hook_seconds: dict[str, float] | None  # inside the timed hooks, per clock


def fit(max_steps: int, callbacks: list[Callback], seq_len: int, hooks: tuple[str, ...] = ()) -> Fit:
    """One fit of ``max_steps`` optimizer steps on sequences of ``seq_len`` tokens; ``hooks`` of the last callback
    are timed."""
    pl.seed_everything(0, verbose=False)
    module = CausalLM("tiny", optimizer=functools.partial(ADAMW, lr=1e-3), lr_schedule=None)
    data = CountedTokenData(samples=max_steps * 2 * MICRO_BATCH_SIZE, seq_len=seq_len)
    hook_seconds = time_hooks(callbacks[-1], hooks) if hooks else None
    timer = StepTimer()
    log_dir = tempfile.mkdtemp(prefix="lit_cbs_overhead_")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        max_epochs=1,
        callbacks=[*callbacks, timer],  # the timer's hook runs after theirs
        # Every configuration logs to CSV every 10 steps, so the callbacks' logging is paid for too.
        logger=CSVLogger(log_dir, name="fit"),
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    starts = {clock: read() for clock, read in CLOCKS.items()}
    trainer.fit(module, data)
    seconds = {clock: read() - starts[clock] for clock, read in CLOCKS.items()}
    shutil.rmtree(log_dir)
    return Fit(callbacks, timer, data, module, seconds, hook_seconds)


class Results:
    """Per measure and clock, one value per repeat; counts that do not depend on a clock beside them."""

    def __init__(self):
        self.values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.loader_builds: dict[str, list[int]] = defaultdict(list)
        self.probe_tokens: dict[str, list[int]] = defaultdict(list)  # (e2) tokens_spent per search
        self.probe_branches: dict[str, list[float]] = {}  # (e2) multipliers trained per search
        self.gradient_copy_bytes: int | None = None  # (d)
        self.gradient_bytes: int | None = None

    def add(self, measure: str, clock: str, value: float) -> None:
        self.values[measure][clock].append(value)


def rotated(configs: list[Config], repeat: int) -> list[Config]:
    shift = repeat % len(configs)
    return configs[shift:] + configs[:shift]


def time_steps(results: Results, configs: list[Config], steps: int, repeat: int, seq_len: int) -> dict[str, Fit]:
    """(a), (d), (e1): every configuration once, in an order that rotates with ``repeat``."""
    step_tokens = MICRO_BATCH_SIZE * seq_len
    fits = {
        config.name: fit(steps, config.callbacks(steps, step_tokens), seq_len, config.hooks)
        for config in rotated(configs, repeat)
    }
    for config in configs:  # rows grouped per configuration, whatever order the fits ran in
        run = fits[config.name]
        results.loader_builds[config.label].append(run.data.loader_builds)
        for clock in CLOCKS:
            step_ms = steady_ms(run.timer, clock)
            results.add(f"{config.label}: ms per step", clock, step_ms)
            if config.baseline is None:
                continue
            base_ms = steady_ms(fits[config.baseline].timer, clock)
            hook_ms = 1000 * run.hook_seconds[clock] / steps
            results.add(overhead_measure(config), clock, 100 * (step_ms / base_ms - 1))
            results.add(f"{config.label}: ms per step inside its {config.hooks_kind}", clock, hook_ms)
            results.add(hook_share_measure(config), clock, 100 * hook_ms / base_ms)
    return fits


def time_change(results: Results, steady_steps: int, seq_len: int) -> None:
    """(b): one fit whose global batch grows 16 -> 32 samples after ``steady_steps`` steps."""
    threshold = steady_steps * MICRO_BATCH_SIZE
    warmup = BatchWarmup(PiecewiseBatch([MICRO_BATCH_SIZE, 2 * MICRO_BATCH_SIZE], [0, threshold], unit="samples"))
    run = fit(2 * steady_steps, [warmup], seq_len)
    results.loader_builds["(b) 16 -> 32 samples by accumulation"].append(run.data.loader_builds)
    (change,) = warmup.history
    for clock in CLOCKS:
        durations = run.timer.durations(clock)  # durations[k - 1] is 0-based step k
        # The change is applied at the end of step change.step - 1 (0-based), so that step's time
        # includes it; step change.step is the first at the new size.
        changed, first_new = durations[change.step - 2], durations[change.step - 1]
        old_steady = statistics.median(durations[SKIPPED_STEPS : change.step - 2])
        new_steady = statistics.median(durations[change.step :])
        results.add("(b) steady step at 16 samples, ms", clock, 1000 * old_steady)
        results.add("(b) step ending with the change 16 -> 32, ms", clock, 1000 * changed)
        results.add("(b) steady step at 32 samples, ms", clock, 1000 * new_steady)
        results.add("(b) first step at 32 samples, ms", clock, 1000 * first_new)
        extra_steps = ((changed - old_steady) + (first_new - new_steady)) / new_steady
        results.add(CHANGE_COST, clock, extra_steps)


def time_noise_scale(results: Results, steps: int, repeat: int, seq_len: int) -> None:
    """(d): steps of 2 micro-batches with and without GradientNoiseScale; the bytes it keeps."""
    fits = time_steps(results, NOISE_SCALE_CONFIGS, steps, repeat, seq_len)
    for clock in CLOCKS:
        blocks, whole = (fits[name].hook_seconds[clock] for name in (NOISE_SCALE_BLOCKS, NOISE_SCALE))
        results.add(BLOCKS_OVER_WHOLE, clock, blocks / whole)
    run = fits[NOISE_SCALE]
    noise_scale = run.callbacks[-1]
    # Its gradient copies (a private attribute: the docstring states the size, this checks it).
    results.gradient_copy_bytes = sum(t.nbytes for t in noise_scale._accumulated.values())
    results.gradient_bytes = sum(p.grad.nbytes for p in run.module.parameters() if p.grad is not None)


def time_probe(results: Results, repeat: int, seq_len: int) -> None:
    """(e2): the fit without a probe and with one probe of each search, in a rotating order."""
    step_tokens = MICRO_BATCH_SIZE * seq_len
    fits = {
        config.name: fit(PROBE_FIT_STEPS, config.callbacks(PROBE_FIT_STEPS, step_tokens), seq_len, config.hooks)
        for config in rotated(PROBE_CONFIGS, repeat)
    }
    base = fits[PROBE_BASELINE]
    results.loader_builds[PROBE_CONFIGS[0].label].append(base.data.loader_builds)
    for clock in CLOCKS:
        results.add(f"{PROBE_CONFIGS[0].label}: ms per step", clock, steady_ms(base.timer, clock))
    extra_seconds = {}
    for config in PROBE_CONFIGS[1:]:
        run = fits[config.name]
        probe_callback = run.callbacks[-1]
        if len(probe_callback.history) != 1 or probe_callback.failures:  # the row needs one probe, taken
            refuse_unless_checked(
                [f"{config.label}: {len(probe_callback.history)} readings, failures {probe_callback.failures}"],
                "overhead",
            )
        (record,) = probe_callback.history
        results.loader_builds[config.label].append(run.data.loader_builds)
        results.probe_tokens[config.name].append(probe_callback.tokens_spent)
        results.probe_branches[config.name] = record.branches_trained
        for clock in CLOCKS:
            base_step = steady_ms(base.timer, clock) / 1000
            extra = run.seconds[clock] - base.seconds[clock]
            extra_seconds[config.name, clock] = extra
            results.add(f"{config.label}: extra fit time, s", clock, extra)
            results.add(PROBE_STEPS.format(config.name), clock, extra / base_step)
            per_branch = extra / base_step / len(record.branches_trained)
            results.add(f"{config.label}: extra fit time per branch trained, steps without it", clock, per_branch)
            results.add(
                f"{config.label}: of it in on_train_end (the CBS curve plot), s", clock, run.hook_seconds[clock]
            )
    grid, bisect = (config.name for config in PROBE_CONFIGS[1:])
    for clock in CLOCKS:
        results.add(GRID_OVER_BISECT, clock, extra_seconds[grid, clock] / extra_seconds[bisect, clock])


def part_of(label: str) -> str:
    """The part a measure or configuration belongs to: "(a)" of "(a) plain Trainer: ms per step"."""
    return label.split(" ")[0]


def summary(values: list[float]) -> str:
    """median [min, max]"""
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def idle_verdict(config: Config, results: Results, what: str) -> str:
    hooks = statistics.median(results.values[hook_share_measure(config)]["cpu"])
    overall = statistics.median(results.values[overhead_measure(config)]["cpu"])
    met = "met" if hooks <= 1 else "missed"
    return (
        f"- {config.part} {what}: {hooks:.2f} % of a step inside its {config.hooks_kind}, "
        f"{overall:.2f} % end to end; goal <= 1 %: {met}"
    )


def verdicts(results: Results, sizes: Sizes) -> str:
    """The goals checked against the cpu-clock medians (steadier than wall time on shared cores)."""
    by_name = {config.name: config for config in IDLE_CONFIGS + NOISE_SCALE_CONFIGS}
    lines = [idle_verdict(config, results, config.name.removeprefix("+ ")) for config in IDLE_CONFIGS[1:3]]
    noise_scale = "GradientNoiseScale (it works every step: this is its cost when nothing else happens)"
    lines.append(idle_verdict(by_name[NOISE_SCALE], results, noise_scale))
    blocks = "GradientNoiseScale(groups='blocks')"
    lines.append(idle_verdict(by_name[NOISE_SCALE_BLOCKS], results, blocks))
    ratio = results.values[BLOCKS_OVER_WHOLE]["cpu"]
    lines.append(
        f"- (d) {blocks} spends {statistics.median(ratio):.2f} x (min {min(ratio):.2f}, max {max(ratio):.2f}) "
        "the time of GradientNoiseScale() inside its hooks: the groups reuse the same fused norms"
    )
    lines.append(idle_verdict(by_name[IDLE_PROBE], results, "CBSProbeCallback between probes"))
    cost = results.values[CHANGE_COST]["cpu"]
    met = "met" if max(cost) <= 1 else "missed"
    lines.append(
        f"- (b) a change 16 -> 32 costs {statistics.median(cost):.2f} extra steps (max {max(cost):.2f}); "
        f"goal <= 1 step: {met}"
    )
    rebuilt = [name for name, counts in results.loader_builds.items() if max(counts) > 1]
    lines.append(f"- (c) train loader rebuilt during a fit in: {', '.join(rebuilt) if rebuilt else 'no configuration'}")
    lines.append(
        f"- (d) GradientNoiseScale keeps {results.gradient_copy_bytes:,} bytes of gradient copies = "
        f"{results.gradient_copy_bytes / results.gradient_bytes:.2f} x the gradients "
        f"({results.gradient_bytes:,} bytes); its docstring: one copy of the gradients when a rank accumulates "
        "2+ micro-batches"
    )
    grid, bisect = (config.name for config in PROBE_CONFIGS[1:])
    spent = {name: statistics.median(results.probe_tokens[name]) for name in (grid, bisect)}
    steps = {name: statistics.median(results.values[PROBE_STEPS.format(name)]["cpu"]) for name in (grid, bisect)}
    branches = {name: ", ".join(f"{k:g}" for k in results.probe_branches[name]) for name in (grid, bisect)}
    time_ratio = statistics.median(results.values[GRID_OVER_BISECT]["cpu"])
    lines.append(
        f"- (e2) one probe (k = {', '.join(map(str, PROBE_MULTIPLIERS))}, window "
        f"{PROBE_WINDOW_STEPS * sizes.step_tokens:,} tokens = "
        f"{PROBE_WINDOW_STEPS} steps): grid trains k = {branches[grid]}, {spent[grid]:,.0f} tokens, "
        f"{steps[grid]:.1f} steps of extra time; bisect trains k = {branches[bisect]}, {spent[bisect]:,.0f} tokens, "
        f"{steps[bisect]:.1f} steps"
    )
    lines.append(
        f"- (e2) probe tokens grid / bisect: {spent[grid] / spent[bisect]:.2f} (probe.py: bisect trains about "
        f"log2({len(PROBE_MULTIPLIERS)}) branches instead of {len(PROBE_MULTIPLIERS)}); "
        f"extra time grid / bisect: {time_ratio:.2f}"
    )
    return "\n".join(lines)


def report(results: Results, args: argparse.Namespace, steps: Sizes, seconds: float, load_before, load_after) -> str:
    """The markdown report without its title."""
    width = max(len(measure) for measure in results.values)
    header = f"| {'measure':<{width}} | " + " | ".join(f"{clock}: median [min, max]" for clock in CLOCKS) + " |"
    rule = f"|{'-' * (width + 2)}|" + "|".join("-" * (len(clock) + 23) for clock in CLOCKS) + "|"
    measures = sorted(results.values, key=part_of)  # sorted() keeps the order within a part
    rows = [
        f"| {measure:<{width}} | " + " | ".join(summary(results.values[measure][clock]) for clock in CLOCKS) + " |"
        for measure in measures
    ]
    builds = "\n".join(
        f"| {name} | {', '.join(map(str, sorted(set(results.loader_builds[name]))))} |"
        for name in sorted(results.loader_builds, key=part_of)
    )
    command = " ".join(["python -m benchmarks.overhead", *sys.argv[1:]])
    loads = [", ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after)]
    # This benchmark adds about 1 (one torch thread); more before it started means other jobs.
    shared_note = " (other jobs shared the cores: the cpu column is the steadier)" if load_before[0] >= 1 else ""
    quick_note = "\n**A `--quick` smoke run: too few repeats and steps to read numbers from.**\n" if args.quick else ""
    seq_len = steps.seq_len
    return f"""Measured by `benchmarks/overhead.py` (its docstring has the method). Workload: `CausalLM` with the tiny
OLMo (d_model 64, 4 layers, byte vocabulary), random token micro-batches of {MICRO_BATCH_SIZE} x {seq_len}, AdamW, one
Lightning Trainer per fit on CPU, CSVLogger every 10 steps. Every callback is compared with the same
Trainer without it. {args.repeats} repeats; within each, the fits of (a) + (e1), of (d) and of (e2) run in
orders that rotate per repeat. Steps per fit: (a) and (e1) {steps.idle}, (b) {steps.steady} + {steps.steady},
(d) {steps.noise_scale} of 2 micro-batches, (e2) {PROBE_FIT_STEPS}. Step medians leave out the first
{SKIPPED_STEPS} steps of every fit. wall: `time.perf_counter`; cpu: `time.process_time` of the benchmark process.
{quick_note}
- command: `{command}` at commit {git_commit()}
- date: {datetime.date.today().isoformat()}
- machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, \
Python {platform.python_version()}, torch {torch.__version__}, lightning {pl.__version__}
- load average (1, 5, 15 min) before: {loads[0]}; after: {loads[1]}{shared_note}
- runtime: {seconds:.0f} s

{verdicts(results, steps)}

Reading the table: the time inside a callback's hooks is measured directly and is steady; the
end-to-end overhead is the difference of two fits' medians, so fit-to-fit noise (the min/max
spread of the baseline's row) bounds how small a difference it can show. Every fit logs to a
CSVLogger every 10 steps; with `log_every_step=True` (the default) BatchWarmup writes its six
metrics straight to the loggers at that interval (as LearningRateMonitor does), a cost that does
not grow with the model.

(d) GradientNoiseScale's hooks pass over the gradients about three times per micro-batch and once
per step (fused over the parameters), and write three metrics to the loggers at their interval: a
cost in proportion to the parameters, while the step's compute grows with parameters x tokens, so
its share of a step falls as the micro-batch holds more tokens than these {steps.step_tokens:,}.
With `groups="blocks"` the same norms are summed per group by one `index_add_` and 18 more metrics
are written at the logging interval.

(e1) is the probe's cost on every step outside a probe: its per-batch hooks only check whether the
next probe point is reached. (e2) is one whole probe, from the snapshot at its start to the main
state restored after its branches, plus the CBS curve plot at the end of the fit (shown apart).
A branch of multiplier k trains the window's {PROBE_WINDOW_STEPS} micro-batches in \
{PROBE_WINDOW_STEPS} / k optimizer steps,
so it should cost about {PROBE_WINDOW_STEPS} steps' time. The tokens are random, so the branches'
losses and k* mean nothing here: (e2) measures cost only. Which multipliers bisect trains depends
on which of them pass, so on real data it may train others than here (and up to one more).

{header}
{rule}
{chr(10).join(rows)}

| (c) configuration | train_dataloader() calls per fit |
|---|---|
{builds}
"""


def preload_plotting() -> None:
    """Import what the probe's curve plot needs, so the first probed fit does not pay the one-off import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="fits per configuration (default 8; --quick: 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared cores)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 repeats, fewer steps and sequences of 32 tokens: a smoke run, not numbers to read",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="markdown report (default: docs/benchmarks/overhead.md; --quick: none)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="write the section 'overhead' of this file (default: docs/RESULTS.md; --quick: none)",
    )
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 2 if args.quick else 8
    if args.repeats < 1 or args.threads < 1:
        parser.error(f"--repeats={args.repeats} and --threads={args.threads} must be >= 1")
    if not args.quick:
        args.output = args.output or ROOT / "docs" / "benchmarks" / "overhead.md"
        args.results = args.results or ROOT / "docs" / "RESULTS.md"
    steps = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one Trainer per fit: no banners
    preload_plotting()
    load_before, start = os.getloadavg(), time.perf_counter()
    results = Results()
    for repeat in range(args.repeats):
        time_steps(results, IDLE_CONFIGS, steps.idle, repeat, steps.seq_len)
        time_change(results, steps.steady, steps.seq_len)
        time_noise_scale(results, steps.noise_scale, repeat, steps.seq_len)
        time_probe(results, repeat, steps.seq_len)
    body = report(results, args, steps, time.perf_counter() - start, load_before, os.getloadavg())
    print(f"# {TITLE}\n\n{body}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(f"# {TITLE}\n\n{body}")
    if args.results:
        replace_section(args.results, "overhead", f"## {TITLE}\n\n{body}")  # under the file's own "# Results"


if __name__ == "__main__":
    main()
