"""What BatchWarmup costs on a small language-model workload, side by side in one run.

Workload: the tiny OLMo preset (d_model 64, 4 layers, byte vocabulary) on random token batches
of 16 sequences x 128 tokens, AdamW, one Lightning Trainer per fit on CPU, a CSVLogger every 10 steps.
Configurations are interleaved and repeated so that load changes on the machine hit them alike;
the results are ratios. Every step is timed by two clocks: wall (``time.perf_counter``) and this
process's CPU time (``time.process_time``), which other jobs on shared cores disturb less.

(a) idle overhead: ms per optimizer step of a plain Trainer vs the same Trainer with
    ``BatchWarmup(ConstantBatch(16))``, with and without its per-step logging, and the time
    spent inside BatchWarmup's per-batch hooks;
(b) change cost: a fit whose global batch grows 16 -> 32 samples (accumulate 1 -> 2) mid-epoch:
    the extra time of the step that ends with the change and of the first step at the new size,
    over the steady step time of each one's size, counted in steps at the new size;
(c) loader rebuilds: ``train_dataloader()`` calls per fit in every configuration.

Usage: ``python benchmarks/overhead.py [--repeats 8] [--threads 1] [--output docs/benchmarks/overhead.md]``
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lit_cbs import BatchWarmup, ConstantBatch, PiecewiseBatch
from lit_cbs.models.olmo import OLMo, get_config

MICRO_BATCH_SIZE = 16  # sequences per micro-batch
SEQ_LEN = 128  # tokens per sequence trained on
IDLE_STEPS = 30  # optimizer steps per fit in (a)
STEADY_STEPS = 12  # optimizer steps at each of the two batch sizes in (b)
SKIPPED_STEPS = 3  # first steps of every fit left out of the steady medians (allocator, caches)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # seconds
# (a): BatchWarmup keyword arguments per configuration; None: a plain Trainer.
IDLE_CONFIGS = {
    "plain Trainer": None,
    "+ BatchWarmup(ConstantBatch(16))": {},
    "+ BatchWarmup(ConstantBatch(16), log_every_step=False)": {"log_every_step": False},
}
PER_BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end")
OVERHEAD = "(a) {}: overhead, % of a plain step"
HOOK_SHARE = "(a) {}: time inside its per-batch hooks, % of a plain step"
CHANGE_COST = "(b) extra cost of the change, steps at 32 samples"


class RandomTokens(Dataset):
    """Uniform random byte tokens; sample i is SEQ_LEN + 1 tokens (inputs and shifted targets)."""

    def __init__(self, samples: int, vocab_size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (samples, SEQ_LEN + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class TokenData(pl.LightningDataModule):
    """Exposes ``batch_size`` (the micro-batch, sequences) and counts ``train_dataloader()`` calls."""

    def __init__(self, samples: int, vocab_size: int):
        super().__init__()
        self.dataset = RandomTokens(samples, vocab_size)
        self.batch_size = MICRO_BATCH_SIZE
        self.seq_len = SEQ_LEN
        self.loader_builds = 0

    def train_dataloader(self) -> DataLoader:
        self.loader_builds += 1
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, drop_last=True)


class TinyLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = OLMo(get_config("tiny"))

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(Callback):
    """Reads every clock at the end of each optimizer step, after earlier callbacks' hooks."""

    def __init__(self):
        self.step_ends: dict[str, list[float]] = {clock: [] for clock in CLOCKS}
        self._steps_taken = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._steps_taken:
            self._steps_taken = trainer.global_step
            for clock, read in CLOCKS.items():
                self.step_ends[clock].append(read())

    def step_durations(self, clock: str) -> list[float]:
        """Seconds of 0-based step k at index k - 1: from the end of step k - 1 to the end of step k."""
        ends = self.step_ends[clock]
        return [end - start for start, end in zip(ends, ends[1:])]


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


def fit(max_steps: int, warmup: BatchWarmup | None) -> tuple[StepTimer, TokenData]:
    pl.seed_everything(0, verbose=False)
    module = TinyLM()
    data = TokenData(samples=max_steps * 2 * MICRO_BATCH_SIZE, vocab_size=module.model.config.vocab_size)
    timer = StepTimer()
    log_dir = tempfile.mkdtemp(prefix="lit_cbs_overhead_")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        max_epochs=1,
        callbacks=[warmup, timer] if warmup else [timer],  # the timer's hook runs after BatchWarmup's
        # Every configuration logs to CSV every 10 steps, so BatchWarmup's logging is paid for too.
        logger=CSVLogger(log_dir, name="fit"),
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    shutil.rmtree(log_dir)
    return timer, data


class Results:
    """Per measure and clock, one value per repeat; loader builds per configuration."""

    def __init__(self):
        self.values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.loader_builds: dict[str, list[int]] = defaultdict(list)

    def add(self, measure: str, clock: str, value: float) -> None:
        self.values[measure][clock].append(value)


def time_idle(results: Results, repeat: int) -> None:
    """(a): every idle configuration once, in an order that rotates with ``repeat``."""
    names = list(IDLE_CONFIGS)
    shift = repeat % len(names)
    step_ms, hook_ms = {}, {}
    for name in names[shift:] + names[:shift]:
        config = IDLE_CONFIGS[name]
        warmup = None if config is None else BatchWarmup(ConstantBatch(MICRO_BATCH_SIZE), **config)
        hook_seconds = None if warmup is None else time_hooks(warmup, PER_BATCH_HOOKS)
        timer, data = fit(IDLE_STEPS, warmup)
        results.loader_builds[name].append(data.loader_builds)
        step_ms[name] = {clock: 1000 * statistics.median(timer.step_durations(clock)[SKIPPED_STEPS:]) for clock in CLOCKS}
        if hook_seconds is not None:
            hook_ms[name] = {clock: 1000 * seconds / IDLE_STEPS for clock, seconds in hook_seconds.items()}
    plain = step_ms[names[0]]
    for name in names:  # rows grouped per configuration, whatever order the fits ran in
        for clock in CLOCKS:
            results.add(f"(a) {name}: ms per step", clock, step_ms[name][clock])
            if name in hook_ms:
                results.add(OVERHEAD.format(name), clock, 100 * (step_ms[name][clock] / plain[clock] - 1))
                results.add(f"(a) {name}: ms per step inside its per-batch hooks", clock, hook_ms[name][clock])
                results.add(HOOK_SHARE.format(name), clock, 100 * hook_ms[name][clock] / plain[clock])


def time_change(results: Results) -> None:
    """(b): one fit whose global batch grows 16 -> 32 samples after STEADY_STEPS steps."""
    threshold = STEADY_STEPS * MICRO_BATCH_SIZE
    warmup = BatchWarmup(PiecewiseBatch([MICRO_BATCH_SIZE, 2 * MICRO_BATCH_SIZE], [0, threshold], unit="samples"))
    timer, data = fit(2 * STEADY_STEPS, warmup)
    results.loader_builds["16 -> 32 samples by accumulation"].append(data.loader_builds)
    (change,) = warmup.history
    for clock in CLOCKS:
        durations = timer.step_durations(clock)  # durations[k - 1] is 0-based step k
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


def summary(values: list[float]) -> str:
    """median [min, max]"""
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def verdicts(results: Results) -> str:
    """The goals checked against the cpu-clock medians (steadier than wall time on shared cores)."""
    lines = []
    for name, config in IDLE_CONFIGS.items():
        if config is None:
            continue
        hooks = statistics.median(results.values[HOOK_SHARE.format(name)]["cpu"])
        overall = statistics.median(results.values[OVERHEAD.format(name)]["cpu"])
        met = "met" if hooks <= 1 else "missed"
        lines.append(
            f"- (a) {name}: {hooks:.2f} % of a step inside its hooks, {overall:.2f} % end to end; goal <= 1 %: {met}"
        )
    cost = results.values[CHANGE_COST]["cpu"]
    met = "met" if max(cost) <= 1 else "missed"
    lines.append(
        f"- (b) a change 16 -> 32 costs {statistics.median(cost):.2f} extra steps (max {max(cost):.2f}); goal <= 1 step: {met}"
    )
    rebuilt = [name for name, counts in results.loader_builds.items() if max(counts) > 1]
    lines.append(f"- (c) train loader rebuilt during a fit in: {', '.join(rebuilt) if rebuilt else 'no configuration'}")
    return "\n".join(lines)


def report(results: Results, args: argparse.Namespace, seconds: float, load_before, load_after) -> str:
    width = max(len(measure) for measure in results.values)
    header = f"| {'measure':<{width}} | " + " | ".join(f"{clock}: median [min, max]" for clock in CLOCKS) + " |"
    rule = f"|{'-' * (width + 2)}|" + "|".join("-" * (len(clock) + 23) for clock in CLOCKS) + "|"
    rows = [
        f"| {measure:<{width}} | " + " | ".join(summary(by_clock[clock]) for clock in CLOCKS) + " |"
        for measure, by_clock in results.values.items()
    ]
    builds = "\n".join(
        f"| {name} | {', '.join(map(str, sorted(set(counts))))} |" for name, counts in results.loader_builds.items()
    )
    command = " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    loads = [", ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after)]
    # This benchmark adds about 1 (one torch thread); more before it started means other jobs.
    shared_note = " (other jobs shared the cores: the cpu column is the steadier)" if load_before[0] >= 1 else ""
    return f"""# BatchWarmup overhead

Measured by `benchmarks/overhead.py` (its docstring has the method). Workload: tiny OLMo (d_model
64, 4 layers, byte vocabulary), random token batches of {MICRO_BATCH_SIZE} x {SEQ_LEN}, AdamW, one
Lightning Trainer per fit on CPU, CSVLogger every 10 steps. {args.repeats} repeats; within each, the (a) fits run in
an order that rotates per repeat. Step medians leave out the first {SKIPPED_STEPS} steps of every fit.
wall: `time.perf_counter`; cpu: `time.process_time` of the benchmark process.

- command: `{command}`
- date: {datetime.date.today().isoformat()}
- machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, Python {platform.python_version()}, torch {torch.__version__}, lightning {pl.__version__}
- load average (1, 5, 15 min) before: {loads[0]}; after: {loads[1]}{shared_note}
- runtime: {seconds:.0f} s

{verdicts(results)}

Reading the table: the time inside BatchWarmup's hooks is measured directly and is steady; the
end-to-end overhead is the difference of two fits' medians, so fit-to-fit noise (the min/max
spread of the plain Trainer's row) bounds how small a difference it can show. Every fit logs to a
CSVLogger every 10 steps; with `log_every_step=True` (the default) BatchWarmup writes its six
metrics straight to the loggers at that interval (as LearningRateMonitor does), a cost that does
not grow with the model.

{header}
{rule}
{chr(10).join(rows)}

| (c) configuration | train_dataloader() calls per fit |
|---|---|
{builds}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=8, help="fits per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared cores)")
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks/overhead.md"), help="markdown report")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one Trainer per fit: no banners
    load_before, start = os.getloadavg(), time.perf_counter()
    results = Results()
    for repeat in range(args.repeats):
        time_idle(results, repeat)
        time_change(results)
    markdown = report(results, args, time.perf_counter() - start, load_before, os.getloadavg())
    print(markdown)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(markdown)


if __name__ == "__main__":
    main()
