"""``plan=true``: a run's batch phases, memory per device, CBS probe cost, wall time and grown cluster, unstarted."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

from lit_cbs.rules.batch_schedules import BatchSchedule, micro_batch_for
from lit_cbs.run.memory import ADAMW_STATE, GIB, TOKEN_BYTES, DeviceMemory, ModelShape, OptimizerState, device_memory

__all__: list[str] = []  # users run it as `plan=true`


@dataclasses.dataclass(frozen=True)
class BatchPhase:
    """A stretch of training at one global batch (samples); tokens are global."""

    start_tokens: int
    end_tokens: int
    global_batch: int
    micro_batch: int  # samples per rank per forward
    accumulate: int
    optimizer_steps: int
    lr_factor: float  # product of the batch changes' LR factors so far
    ranks: int = 0  # on a grown cluster (RunPlan.cluster)
    end_step: int = 0  # there: optimizer steps taken when the phase ends, where the run stops to move

    @property
    def tokens(self) -> int:
        return self.end_tokens - self.start_tokens


def batch_phases(
    schedule: BatchSchedule,
    max_tokens: int,
    seq_len: int,
    micro_batch: int | Callable[[int], int],
    data_parallel_size: int,
    lr_factor: Callable[[float], float],
) -> list[BatchPhase]:
    """The run's phases, step by step as BatchWarmup takes them (one epoch)."""
    micro_for = micro_batch if callable(micro_batch) else (lambda global_batch: micro_batch)
    spans: list[list[Any]] = []  # [start tokens, global batch, optimizer steps, LR factor]
    tokens = samples = 0
    while tokens < max_tokens:
        new = schedule.batch_size(tokens if schedule.unit == "tokens" else samples)
        if not spans or (new != spans[-1][1] and samples % new == 0):
            spans.append([tokens, new, 0, spans[-1][3] * lr_factor(new / spans[-1][1]) if spans else 1.0])
        spans[-1][2] += 1
        tokens, samples = tokens + spans[-1][1] * seq_len, samples + spans[-1][1]
    ends = [span[0] for span in spans[1:]] + [tokens]
    return [
        BatchPhase(start, end, batch, micro, batch // (micro * data_parallel_size), steps, factor)
        for (start, batch, steps, factor), end in zip(spans, ends)
        for micro in [micro_for(batch)]
    ]


@dataclasses.dataclass(frozen=True)
class ProbeCost:
    """What a CBSProbeCallback will cost; bytes per rank, in host memory."""

    points: list[int]  # token counts of the probes whose span ends within max_tokens
    snapshot_bytes: int  # the rank's parameters and optimizer state
    window_bytes: int  # the recorded micro-batches of one probe's windows
    heldout_bytes: int
    max_branches: int
    snapshots: int  # held at once: the window's start, the main run after it, one per branch with early_stop
    side_jobs: str | None  # the side jobs' launcher (their branches train elsewhere)
    tokens: int  # trained in branches over the run, at most
    host_bytes: int  # at the peak (side jobs: only the held-out batches the main run scores itself on)


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("hours", 3600)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:,.1f} s" if seconds < 120 else f"{seconds / 60:,.1f} minutes"


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A run worked out from its settings; ``report()`` is what ``plan=true`` prints."""

    name: str
    model_config: Any  # an OLMoConfig or a transformers config
    schedule: BatchSchedule
    lr_factor: Callable[[float], float]  # the LR rule's: batch ratio new / old -> LR factor
    max_tokens: int
    seq_len: int
    micro_batch: int
    val_micro_batch: int
    precision: str
    strategy: str  # single, ddp or fsdp; all ranks data-parallel
    accelerator: str
    devices_per_node: int
    num_nodes: int
    activation_checkpointing: bool
    probe_callback: Any = None  # the run's CBSProbeCallback
    optimizer: OptimizerState = ADAMW_STATE
    max_micro_batch_size: int | None = None  # BatchWarmup grows the micro-batch up to it
    command: str = "recipes/train.py"  # the run's command line, for the commands that move it between clusters
    slurm_arguments: str = ""  # its arguments for recipes/slurm/train.sbatch
    # What the plan is checked against (plan_for.*): GiB per GPU and per node, MFU, peak FLOP/s, the grown cluster's
    # smallest micro-batch (samples) and most ranks, what one rank writes per second (side-job probes' checkpoints).
    gpu_memory_gib: float = 80.0
    host_memory_gib: float = 1024.0
    mfu: float = 0.4
    peak_flops_per_device: float = 989e12
    min_micro_batch_size: int = 1
    max_devices: int | None = None
    checkpoint_gib_per_s: float = 1.0
    law: Any = None  # a CBSLaw (plan_for.law): the schedule it gives this run
    corpus: str | None = None  # data.corpus: the law's intercept for it (None: the law's corpora pooled)

    @functools.cached_property
    def shape(self) -> ModelShape:
        return ModelShape.measure(self.model_config)

    @property
    def processes(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def _shards(self) -> int:
        """The ranks FSDP2 shards the model state over."""
        return self.processes if self.strategy == "fsdp" else 1

    @property
    def on_gpu(self) -> bool:
        """Only on GPUs are wall times estimated and memory held against plan_for.gpu_memory_gib."""
        return self.accelerator in ("gpu", "cuda")

    def _micro_for(self, global_batch: int, ranks: int) -> int:
        if self.max_micro_batch_size:
            return micro_batch_for(global_batch, ranks, self.max_micro_batch_size)
        return self.micro_batch

    def _memory_at(self, micro: int, checkpointing: bool) -> DeviceMemory:
        run = (self.precision, self.strategy, self.processes, checkpointing, self.optimizer)
        return device_memory(self.shape, micro, self.seq_len, *run)

    @functools.cached_property
    def phases(self) -> list[BatchPhase]:
        micro_for = functools.partial(self._micro_for, ranks=self.processes)
        return batch_phases(self.schedule, self.max_tokens, self.seq_len, micro_for, self.processes, self.lr_factor)

    @property
    def tokens(self) -> int:
        """Tokens the main run trains on (the last step may pass max_tokens)."""
        return self.phases[-1].end_tokens if self.phases else 0

    @functools.cached_property
    def memory(self) -> dict[bool, DeviceMemory]:
        """Activation checkpointing on/off -> memory per device at the largest micro-batch."""
        micro = max((p.micro_batch for p in self.phases), default=self.micro_batch)
        return {checkpointing: self._memory_at(micro, checkpointing) for checkpointing in (True, False)}

    @functools.cached_property
    def micro_batch_limit(self) -> int | None:
        """On a GPU, the largest micro-batch whose step fits plan_for.gpu_memory_gib."""
        sizes = range(1, max(self.schedule.sizes()) // self.processes + 1) if self.on_gpu else range(0)
        limit, checkpointing = self.gpu_memory_gib * GIB, self.activation_checkpointing  # memory grows with micro
        return max(itertools.takewhile(lambda m: self._memory_at(m, checkpointing).total <= limit, sizes), default=None)

    @functools.cached_property
    def probe(self) -> ProbeCost | None:
        from lit_cbs.probe.reading import max_branches

        if self.probe_callback is None:
            return None
        config, sample_bytes = self.probe_callback.config, (self.seq_len + 1) * TOKEN_BYTES
        points: list[int] = []
        while (point := config.probe_point(len(points))) + config.span_tokens <= self.max_tokens:
            points.append(int(point))
        _, parameters, optimizer_state = self.shape.state_bytes(self.precision, self._shards, self.optimizer)
        branches = max_branches(config.search, len(config.multipliers))
        heldout = config.heldout_batches * self.val_micro_batch * sample_bytes if config.evaluate == "heldout" else 0
        window = config.span_tokens // self.seq_len // self.processes * sample_bytes
        side_jobs = type(config.side_jobs.launcher).__name__ if config.side_jobs is not None else None
        tokens = len(points) * branches * config.window_tokens * config.replicates
        snapshot, snapshots = parameters + optimizer_state, 2 + (branches if config.early_stop else 0)
        host = heldout if side_jobs is not None else snapshots * snapshot + window + heldout
        return ProbeCost(points, snapshot, window, heldout, branches, snapshots, side_jobs, tokens, host)

    @functools.cached_property
    def cluster(self) -> list[BatchPhase]:
        """Each phase on the fewest whole nodes that keep a rank's share of a step (``ranks``, ``end_step`` set)."""
        per_node, cap, end_step = self.devices_per_node, self.max_devices, 0
        planned: list[BatchPhase] = []
        for phase in self.phases:
            batch = phase.global_batch
            candidates = [w for w in range(per_node, batch + 1, per_node) if batch % w == 0]
            candidates = [w for w in candidates if cap is None or w <= cap] or candidates[:1]
            efficient = [w for w in candidates if self._micro_for(batch, w) >= self.min_micro_batch_size]
            efficient = efficient or candidates[:1]
            enough = [w for w in efficient if batch / w <= self.phases[0].global_batch / self.processes]
            ranks = self.processes if not planned else (enough[0] if enough else efficient[-1])
            micro, end_step = self._micro_for(batch, ranks), end_step + phase.optimizer_steps
            grown = dict(micro_batch=micro, accumulate=batch // (micro * ranks), ranks=ranks, end_step=end_step)
            planned.append(dataclasses.replace(phase, **grown))
        return planned

    @property
    def wall_seconds(self) -> float:
        """The main run's: it waits for in-process probes' branches, and for each side-job probe's checkpoint."""
        probe = self.probe
        paused = probe.tokens if probe is not None and probe.side_jobs is None else 0
        points = len(probe.points) if probe is not None else 0
        return self._seconds(self.tokens + paused, self.processes) + self.probe_checkpoint_seconds * points

    @property
    def probe_checkpoint_seconds(self) -> float:
        """Seconds a side-job probe point waits while each rank writes its share at plan_for.checkpoint_gib_per_s."""
        if self.probe is None or self.probe.side_jobs is None:
            return 0.0
        return self.probe.snapshot_bytes / GIB / self.checkpoint_gib_per_s

    @property
    def probe_device_hours(self) -> float:
        """Device-hours of every probe's branches at the run's MFU, wherever they train."""
        return self._seconds(self.probe.tokens, 1) / 3600 if self.probe is not None else 0.0

    def _seconds(self, tokens: int, devices: int) -> float:
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu={self.mfu} must be in (0, 1]")
        flops = self.shape.model.flops_per_token(self.seq_len)
        return flops * tokens / (self.mfu * self.peak_flops_per_device * devices)

    def report(self) -> str:
        """The plan as ``plan=true`` prints it."""
        c, on, off, flops = self.shape.config, self.memory[True], self.memory[False], self.shape.model.flops_per_token
        strategy = {"fsdp": f"FSDP2 over {self.processes} ranks", "ddp": "DDP", "single": "one process"}[self.strategy]
        working = {"fsdp": "gathered params, grads", "ddp": "DDP grad buckets", "single": "autocast copies"}
        labels = ["parameters", "gradients", f"{self.optimizer.name} state", working[self.strategy]]
        labels += ["activations (saved)", "activations (peak add)", "total"]  # DeviceMemory's fields, then the total
        unit, size = ("GiB", GIB) if off.total >= GIB else ("MiB", 2**20)
        device, warnings = "GPU" if self.on_gpu else "device", []
        lines = [
            f"lit_cbs plan: {self.name} (nothing trained, no data read)",
            f"model            {c.n_layers} layers x d_model {c.d_model}, {self.shape.parameters:,} parameters, "
            f"{flops(self.seq_len):.3g} FLOPs per token (training) at {self.seq_len:,} tokens",
            f"processes        {self.processes} ({self.num_nodes} node{'s' if self.num_nodes > 1 else ''} x "
            f"{self.devices_per_node} {'GPU' if self.on_gpu else self.accelerator}), {strategy}, "
            f"precision {self.precision}",
            f"tokens           {self.tokens:,} in {sum(p.optimizer_steps for p in self.phases):,} optimizer steps "
            f"(max_tokens={self.max_tokens:,})",
            "",
            "batch schedule   (global batch in samples of seq_len tokens; "
            "accumulation = micro-batches per step per rank)",
            f"  {'from tokens':>17} {'tokens':>17} {'global':>7} {'micro':>6} {'accum':>6} {'steps':>9} {'LR x':>6}",
            *(
                f"  {p.start_tokens:>17,} {p.tokens:>17,} {p.global_batch:>7,} {p.micro_batch:>6} {p.accumulate:>6} "
                f"{p.optimizer_steps:>9,} {p.lr_factor:>6.3g}"
                for p in self.phases
            ),
            "",
            f"memory per {device} ({unit}) at micro-batch {max((p.micro_batch for p in self.phases), default=0)} x "
            f"{self.seq_len:,} tokens; activation checkpointing {'on' if self.activation_checkpointing else 'off'} "
            "(model.activation_checkpointing)",
            f"  {'':<24} {'AC on':>8} {'AC off':>8}",
            *(
                f"  {label:<24} {with_ac / size:>8.2f} {without / size:>8.2f}"
                for label, with_ac, without in zip(
                    labels, [*dataclasses.astuple(on), on.total], [*dataclasses.astuple(off), off.total]
                )
            ),
            "  (plus CUDA context, communication buffers and fragmentation; limit "
            f"plan_for.gpu_memory_gib={self.gpu_memory_gib:g})"
            if self.on_gpu
            else f"  (host memory of each process on {self.accelerator}; plan_for.gpu_memory_gib applies to GPUs only)",
            "",
            *self._probe_report(),
            *self._law_report(),
            "",
        ]
        if not self.on_gpu:
            lines.append(
                f"wall time        not estimated on {self.accelerator} (the estimate assumes a GPU's peak FLOP/s, "
                "plan_for.peak_flops_per_device)"
            )
        else:
            seconds, pauses, probe = self.wall_seconds, "", self.probe
            if probe is not None and probe.side_jobs is not None:
                writes = _duration(self.probe_checkpoint_seconds * len(probe.points))
                pauses = f" (side-job probes pause it only for their checkpoints: {writes})"
            elif probe is not None:
                waits = _duration(seconds - self._seconds(self.tokens, self.processes))
                pauses = f", of which the run waits {waits} for its in-process probes"
            lines.append(
                f"wall time        {_duration(seconds)} at MFU {self.mfu:.0%} (plan_for.mfu) of "
                f"{self.peak_flops_per_device / 1e12:,.0f} TFLOP/s per device "
                "(model.peak_flops_per_device, else plan_for.peak_flops_per_device), "
                f"{self.processes * seconds / 3600:,.0f} device-hours{pauses}"
            )
        if self.micro_batch_limit is not None:
            lines.append(
                f"micro-batch      the largest that fits plan_for.gpu_memory_gib={self.gpu_memory_gib:g}: "
                f"{self.micro_batch_limit} samples per device (batch.max_micro_batch_size={self.micro_batch_limit}: "
                "each phase then trains at the largest divisor of a rank's share up to it, the accumulation after)"
            )
        lines += self._cluster_report()
        needed = self.memory[self.activation_checkpointing].total / GIB
        if self.on_gpu and needed > self.gpu_memory_gib:  # what does not fit plan_for's limits, with what to change
            fixes = "lower data.batch_size" + (", or shard with trainer=fsdp" if self.strategy != "fsdp" else "")
            if not self.activation_checkpointing and self.memory[True].total / GIB <= self.gpu_memory_gib:
                fixes = "set model.activation_checkpointing=true, or " + fixes
            warnings.append(
                f"{needed:,.1f} GiB per GPU exceeds plan_for.gpu_memory_gib={self.gpu_memory_gib:g}: {fixes}"
            )
        per_node = self.probe.host_bytes * self.devices_per_node / GIB if self.probe is not None else 0
        if per_node > self.host_memory_gib:
            warnings.append(
                f"the CBS probe holds {per_node:,.1f} GiB of host memory per node ({self.devices_per_node} ranks), "
                f"more than plan_for.host_memory_gib={self.host_memory_gib:g}: use more nodes (FSDP2 shards "
                "the snapshots), a smaller callbacks.cbs_probe.window_tokens, or snapshot_device=cuda"
            )
        fits = "memory per device and host memory within plan_for's limits" if self.on_gpu else None
        fits = fits or "host memory within plan_for.host_memory_gib"
        return "\n".join(lines + ([f"WARNING: {w}" for w in warnings] or [f"fits             {fits}"]))

    def _probe_report(self) -> list[str]:
        probe = self.probe
        if probe is None:
            return ["CBS probe        none"]
        config = self.probe_callback.config
        windows = f" on each of {config.replicates} data windows" if config.replicates > 1 else ""
        lines = [
            f"CBS probe        {len(probe.points)} probes fit (at {', '.join(f'{t:,}' for t in probe.points[:6])}"
            f"{', ...' if len(probe.points) > 6 else ''} tokens), up to {probe.max_branches} branches of "
            f"{config.window_tokens:,} tokens each{windows}: up to {probe.tokens:,} tokens "
            f"({probe.tokens / max(1, self.tokens):.1%} of training)"
        ]
        if probe.side_jobs is None:
            return lines + [
                f"  host memory per rank {probe.host_bytes / GIB:,.2f} GiB: {probe.snapshots} snapshots of "
                f"{probe.snapshot_bytes / GIB:,.2f} (weights + {self.optimizer.name} state), window batches "
                f"{probe.window_bytes / GIB:,.2f}, held-out {probe.heldout_bytes / GIB:,.2f}; "
                f"{probe.host_bytes * self.devices_per_node / GIB:,.1f} GiB per node "
                f"(limit plan_for.host_memory_gib={self.host_memory_gib:g})"
            ]
        hours = f"{self.probe_device_hours:,.0f} device-hours" if self.on_gpu else "their own devices"
        write = self.probe_checkpoint_seconds
        return lines + [
            f"  as side jobs ({probe.side_jobs}): the branches train on {hours} beside the main run, "
            f"which does not wait for them; each probe writes a {probe.snapshot_bytes * self._shards / GIB:,.2f} GiB "
            "checkpoint for its job (deleted once its reading is in), "
            f"which the main run waits for: {_duration(write)} a probe point at "
            f"plan_for.checkpoint_gib_per_s={self.checkpoint_gib_per_s:g} per rank, "
            f"{_duration(write * len(probe.points))} in all",
            f"  host memory per rank {probe.host_bytes / GIB:,.2f} GiB: the held-out batches the main run "
            "scores its own window on (no snapshot, no recorded window)",
        ]

    def _law_report(self) -> list[str]:
        """The schedule plan_for.law gives this run (its size and budget), from the first batch to the largest."""
        if self.law is None:
            return []
        from lit_cbs.analysis.law import schedule_from_law

        sizes = [p.global_batch for p in self.phases]
        corpus = self.corpus if self.corpus in self.law.corpora else None
        schedule, changes = schedule_from_law(
            self.law, self.shape.parameters, self.max_tokens, sizes[0], self.seq_len, final=max(sizes), corpus=corpus
        )
        return [
            f"CBS law          plan_for.law: {self.law.describe()}",
            f"  for {self.shape.parameters:,} parameters on {corpus or 'its corpora pooled'}, along the lower "
            f"edge of its 80% band from {sizes[0]} to at most {max(sizes)} samples: "
            f"batch.schedule.batch_sizes={schedule.batch_sizes} batch.schedule.thresholds={schedule.thresholds}",
            "  probe points worth checking it at (tokens, before each increase): "
            + (", ".join(f"{c.tokens:,}" for c in changes) or "none: the batch never grows"),
        ]

    def _cluster_report(self) -> list[str]:
        """Each phase on the ranks ``cluster`` gives it, and the commands that move the run between them."""
        if len(self.cluster) < 2:
            return []
        cap = f", plan_for.max_devices={self.max_devices}" if self.max_devices else ""
        timed, per_node = self.on_gpu, self.devices_per_node
        times = f" {'tokens/s':>12} {'wall time':>12} {f'on {self.processes} ranks':>14}" if timed else ""
        lines = [
            "",
            "growing the cluster with the batch: each phase on the fewest whole nodes that keep a rank's share "
            "of a step at the first phase's, "
            f"micro-batch >= plan_for.min_micro_batch_size={self.min_micro_batch_size}{cap}",
            f"  {'from tokens':>17} {'global':>7} {'ranks':>6} {'micro':>6} {'accum':>6}{times}",
        ]
        grown = [self._seconds(p.tokens, p.ranks) for p in self.cluster]
        fixed = [self._seconds(p.tokens, self.processes) for p in self.cluster]
        for p, seconds, alone in zip(self.cluster, grown, fixed):
            row = f"  {p.start_tokens:>17,} {p.global_batch:>7,} {p.ranks:>6} {p.micro_batch:>6} {p.accumulate:>6}"
            timing = f" {p.tokens / seconds:>12,.0f} {_duration(seconds):>12} {_duration(alone):>14}"
            lines.append(row + (timing if timed else ""))
        if timed:
            hours = sum(p.ranks * seconds for p, seconds in zip(self.cluster, grown)) / 3600
            lines.append(
                f"  wall time {_duration(sum(grown))} against {_duration(sum(fixed))} on {self.processes} ranks "
                f"throughout ({sum(fixed) / sum(grown):.2f}x sooner; {hours:,.0f} device-hours either way at the "
                "same MFU; probes not counted)"
            )
        lines.append(
            "  stop each phase where the batch grows (trainer.max_steps) and resume the run on the next phase's nodes:"
        )
        sbatch = [
            "  or as SLURM jobs, each after the one before (recipes/slurm/train.sbatch sets the nodes and devices):"
        ]
        for index, p in enumerate(self.cluster):
            nodes, run = p.ranks // per_node, f"outputs/{self.name}/phase{index + 1}"
            resume = f" ckpt_path=outputs/{self.name}/phase{index}/checkpoints/last.ckpt" if index else ""
            stop = f" trainer.max_steps={p.end_step}" if index < len(self.cluster) - 1 else ""
            after = " --dependency=afterok:<the previous job's id>" if index else ""
            lines.append(
                f"    torchrun --nnodes {nodes} --nproc_per_node {per_node} {self.command} "
                f"trainer.num_nodes={nodes}{stop} hydra.run.dir={run}{resume}"
            )
            sbatch.append(
                f"    RUN_DIR={run} sbatch --nodes={nodes} --ntasks-per-node={per_node}"
                f"{after} recipes/slurm/train.sbatch {self.slurm_arguments}{stop}{resume}"
            )
        return lines + sbatch
