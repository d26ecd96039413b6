"""``LitGPTRun``: ``litgpt pretrain``'s own loop, unmodified, at the batch a lit_cbs schedule asks for."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lit_cbs import metrics
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.litgpt.parts import CHECKPOINT_FILE, STATE_KEY
from lit_cbs.litgpt.probes import BUILD, LitGPTProbes
from lit_cbs.probe.engine import ProbeConfig
from lit_cbs.rules.batch_schedules import CBSAdaptive
from lit_cbs.rules.warmup_core import WarmupCore

__all__ = ["LitGPTRun"]

HISTORY_FILE = "batch_history.json"


class DDPInstead:
    """LitGPT's ``FSDPStrategy`` under ``strategy: ddp``: where ``litgpt pretrain`` makes one (beyond one device) it
    gets "ddp", and its ``isinstance`` checks see no FSDP."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return "ddp"


class FabricHost:
    """A ``litgpt pretrain`` run as its side jobs' ``Host``: a LitGPT checkpoint each, which ``BUILD`` reads."""

    def __init__(self, run: LitGPTRun):
        self.run = run
        self.is_global_zero, self.world_size = run.fabric.is_global_zero, run.fabric.world_size

    def barrier(self) -> None:
        self.run.fabric.barrier()

    def broadcast(self, obj: Any) -> Any:
        return self.run.fabric.broadcast(obj)

    def checkpoint(self, folder: Path) -> Path:
        return folder / CHECKPOINT_FILE

    def save(self, path: Path) -> None:
        self.run.save(path)

    def build(self, folder: Path) -> tuple[str, dict[str, Any]]:
        return BUILD, {"checkpoint": str(folder / CHECKPOINT_FILE)}


class LitGPTRun:
    """Drives ``litgpt pretrain`` by a ``WarmupCore``: inside ``patched()`` its loop takes the accumulation, the LR
    factor and the optimizer rules from the core after every optimizer step, its checkpoints hold the core's state,
    and with ``probe`` side jobs read the CBS from its checkpoints (feeding a ``CBSAdaptive`` schedule).
    ``python -m lit_cbs.litgpt pretrain`` is this around LitGPT's command line.

    Examples:
        >>> from lit_cbs.rules.batch_schedules import PiecewiseBatch
        >>> run = LitGPTRun(WarmupCore(PiecewiseBatch([4, 8], [0, 8192]), lr_rule="sqrt"))
        >>> with run.patched():  # then litgpt's CLI or litgpt.pretrain.setup(...) trains at 4, then 8 sequences
        ...     pass
        >>> LitGPTRun(WarmupCore(CBSAdaptive(4, 16)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lit_cbs.errors.LitCBSConfigError: CBSAdaptive grows the batch from CBS readings: give probe=ProbeConfig(...) ...
    """

    def __init__(
        self, core: WarmupCore, probe: ProbeConfig | None = None, compile: bool = True, strategy: str | None = None
    ):
        if core.max_micro_batch_size is not None:
            raise LitCBSConfigError(
                "max_micro_batch_size: litgpt pretrain reads a fixed micro-batch (--train.micro_batch_size) from its "
                "streaming loader, so the batch grows by accumulation: drop max_micro_batch_size"
            )
        if isinstance(core.schedule, CBSAdaptive) and probe is None:
            raise LitCBSConfigError(
                "CBSAdaptive grows the batch from CBS readings: give probe=ProbeConfig(...) with side_jobs "
                "(the lit_cbs config's probe: key)"
            )
        if probe is not None and probe.side_jobs is None:
            raise LitCBSConfigError(
                "probe.side_jobs is missing: in litgpt pretrain the branches train as side jobs from the run's "
                "checkpoints (give probe.side_jobs.launcher)"
            )
        if probe is not None and core.rules.names() != probe.rules.names():
            raise LitCBSConfigError(
                f"probe({probe.rules.describe()}) and the run ({core.rules.describe()}) move the optimizer differently "
                "at a batch change: give the probe the run's lr_rule, weight_decay_rule, beta2_rule and beta2_floor"
            )
        if strategy not in (None, "ddp"):
            raise LitCBSConfigError(
                f"strategy={strategy!r}: give null (LitGPT's FSDP beyond one device) or 'ddp' (DDP instead: on CPUs, "
                "where Lightning has no FSDP)"
            )
        self.core, self.compile, self.strategy = core, compile, strategy
        self._saved_run: dict[str, Any] | None = None  # the facts of the run a resume loads
        self.fabric: Any = None
        self.state: dict[str, Any] | None = None  # litgpt's: model, optimizer, loader, iter_num, step_count
        self.facts: dict[str, Any] = {}  # what a probe of a checkpoint rebuilds the run from
        self.out_dir: Path | None = None
        self.tokenizer_dir: Path | None = None
        self.in_loop = False  # litgpt reads the accumulation before its loop too: its own there (a resume agrees)
        self.probes = LitGPTProbes(probe, core.schedule, self._counts) if probe is not None else None

    # -- litgpt's functions, wrapped -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def patched(self) -> Iterator[LitGPTRun]:
        """LitGPT's ``main``, ``fit``, ``get_lr``, ``save_checkpoint`` and ``TrainArgs.gradient_accumulation_iters``
        wrapped (restored after); with ``compile=False``, its ``torch.compile`` skipped."""
        from litgpt import pretrain
        from litgpt.args import TrainArgs

        main, fit, get_lr, save = pretrain.main, pretrain.fit, pretrain.get_lr, pretrain.save_checkpoint
        accumulation = TrainArgs.__dict__["gradient_accumulation_iters"]
        run = self

        def save_whole(fabric: Any, state: dict[str, Any], tokenizer_dir: Any, checkpoint_file: Path) -> None:
            # Written beside, then renamed: a kill inside the write leaves no torn file for --resume auto to pick.
            partial = checkpoint_file.with_name(checkpoint_file.name + ".partial")
            save(fabric, state, tokenizer_dir, partial)
            fabric.barrier()
            if fabric.is_global_zero:
                os.replace(partial, checkpoint_file)

        def accumulation_now(train: Any, devices: int, num_nodes: int = 1) -> int:
            if run.in_loop and run.core.accumulate is not None:
                return run.core.accumulate
            return int(accumulation(train, devices, num_nodes))

        def lr_now(*args: Any, **kwargs: Any) -> float:
            run.in_loop = True  # called first thing in each iteration of the loop
            return float(get_lr(*args, **kwargs)) * run.core.lr_factor

        pretrain.main = functools.wraps(main)(lambda **kwargs: self._main(main, kwargs))
        pretrain.fit = functools.wraps(fit)(lambda **kwargs: self._fit(fit, kwargs))
        pretrain.get_lr, pretrain.save_checkpoint = lr_now, save_whole
        TrainArgs.gradient_accumulation_iters = accumulation_now
        fsdp = pretrain.FSDPStrategy
        if self.strategy == "ddp":
            pretrain.FSDPStrategy = DDPInstead
        compile_ = torch.compile
        if not self.compile:
            torch.compile = lambda model, *args, **kwargs: model  # type: ignore[assignment]
        try:
            yield self
        finally:
            pretrain.main, pretrain.fit, pretrain.get_lr, pretrain.save_checkpoint = main, fit, get_lr, save
            TrainArgs.gradient_accumulation_iters = accumulation
            torch.compile, pretrain.FSDPStrategy = compile_, fsdp

    def _main(self, main: Any, kwargs: dict[str, Any]) -> None:
        """Refuse what cannot train before the model is built; resume the core with litgpt's state."""
        fabric, train, config = kwargs["fabric"], kwargs["train"], kwargs["config"]
        self.fabric, self.out_dir, self.tokenizer_dir = fabric, Path(kwargs["out_dir"]), kwargs["tokenizer_dir"]
        world, micro = fabric.world_size, train.micro_batch_size
        seq = train.max_seq_length or config.block_size
        self.core.start(micro, world)
        if train.global_batch_size != self.core.global_batch:
            raise LitCBSConfigError(
                f"--train.global_batch_size={train.global_batch_size} but the lit_cbs schedule starts at "
                f"{self.core.global_batch} sequences: set --train.global_batch_size={self.core.global_batch}"
            )
        max_iters = train.max_tokens // world // (micro * seq)  # litgpt's budget, in micro-batches per device
        whole = math.lcm(*self.core.schedule.sizes())
        if (max_iters * micro * world) % whole:
            tokens = whole * seq
            nearest = max_iters * micro * world // whole * tokens
            raise LitCBSConfigError(
                f"--train.max_tokens={train.max_tokens} trains {max_iters * micro * world} sequences, which the "
                f"schedule's batch sizes {self.core.schedule.sizes()} do not all divide: the last step would be "
                f"cut short; set --train.max_tokens to a multiple of {tokens} (e.g. {nearest or tokens})"
            )
        if self.probes is not None and world > 1:
            raise LitCBSConfigError(
                f"probe: the run trains on {world} devices, but a LitGPT checkpoint keeps one rank's data position, "
                "from which a side job reads the run's next tokens: probe runs on one device (--devices 1)"
            )
        if self.probes is not None:
            self.probes.config.check_inside_run(
                max_iters * micro * seq * world, f"--train.max_tokens={train.max_tokens}"
            )
        self.facts = {
            "cwd": os.getcwd(),
            "world_size": world,
            "micro_batch_size": micro,
            "seq_len": seq,
            "max_iters": max_iters,
            "max_tokens": train.max_tokens,
            "min_lr": train.min_lr,
            "max_norm": train.max_norm,
        }
        original_load = fabric.load

        def load(path: Any, state: dict[str, Any] | None = None, strict: bool = True) -> Any:
            if state is not None and "iter_num" in state:  # litgpt's resume: the core's state comes along
                state[STATE_KEY] = self
                try:
                    remainder = original_load(path, state, strict)
                except KeyError as error:
                    if STATE_KEY not in str(error):
                        raise
                    raise LitCBSConfigError(
                        f"--resume: {path} was written by litgpt pretrain alone (no lit_cbs state): resume it with "
                        "litgpt"
                    ) from None
                self._resplit(state, path)
                return remainder
            return original_load(path, state, strict)

        fabric.load = load
        try:
            main(**kwargs)
        finally:
            fabric.load = original_load
        if fabric.is_global_zero:
            history = [dataclasses.asdict(change) for change in self.core.history]
            (self.out_dir / HISTORY_FILE).write_text(json.dumps(history, indent=2))
        for line in self.summary():
            fabric.print(line)

    def _resplit(self, state: dict[str, Any], path: Any) -> None:
        """A resume on another number of devices (or micro-batch): the same samples, global batch and LR by tokens.
        LitGPT counts its iterations per device, so the count is moved to what the samples trained are here."""
        assert self._saved_run is not None and self.core.global_batch is not None, "loaded just now, after start"
        before, facts = self._saved_run, self.facts
        samples = int(state["iter_num"]) * before["micro_batch_size"] * before["world_size"]
        unit = facts["micro_batch_size"] * facts["world_size"]
        if (before["world_size"], before["micro_batch_size"]) == (facts["world_size"], facts["micro_batch_size"]):
            return
        if samples % unit or self.core.global_batch % unit:
            raise LitCBSConfigError(
                f"--resume {path}: the run trained {samples} sequences at global batch {self.core.global_batch}, "
                f"which {facts['world_size']} devices x --train.micro_batch_size={facts['micro_batch_size']} do not "
                "divide: resume on a number of devices (or a micro-batch) that does"
            )
        state["iter_num"] = samples // unit
        self.core.accumulate = self.core.global_batch // unit

    def _fit(self, fit: Any, kwargs: dict[str, Any]) -> None:
        """Hook the optimizer's step; wait for the readings still out when the loop ends (before the final save)."""
        state, train = kwargs["state"], kwargs["train"]
        self.state = state
        state[STATE_KEY] = self
        optimizer = state["optimizer"].optimizer  # the torch optimizer under Fabric's wrapper
        self.core.check_optimizers([optimizer], [], self._counts()[0 if self.core.schedule.unit == "samples" else 1])
        loader, nodes = kwargs["train_dataloader"], kwargs.get("num_nodes", 1)
        # What a probe's LR schedule needs of litgpt's get_lr: its peak, floor and warmup, computed as litgpt does.
        self.facts["warmup_iters"] = train.warmup_iters(kwargs["devices"], nodes, self.facts["max_iters"], loader)
        self.facts["lr"] = optimizer.defaults["lr"]
        if self.probes is not None:
            assert self.out_dir is not None, "set by main"
            self.probes.attach(FabricHost(self), self.fabric, self.out_dir, lambda: int(state["iter_num"]) - 1)
        handle = optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self._after_step(optimizer))
        try:
            fit(**kwargs)
        finally:
            handle.remove()
            self.in_loop = False
        if self.probes is not None:
            self.probes.finish()

    def _counts(self) -> tuple[int, int]:
        """(samples, tokens) trained, all ranks, as litgpt counts them."""
        if self.state is None:
            return 0, 0
        facts = self.facts
        samples = int(self.state["iter_num"]) * facts["micro_batch_size"] * facts["world_size"]
        return samples, samples * facts["seq_len"]

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step (litgpt counts it right after): a due change, the step's record, the probe."""
        assert self.state is not None, "hooked by fit"
        step, (samples, tokens) = int(self.state["step_count"]) + 1, self._counts()
        lr, batch = optimizer.param_groups[0]["lr"], self.core.global_batch
        self.fabric.log_dict(
            {metrics.GLOBAL_BATCH: batch, metrics.LR: lr, metrics.TOKENS_SEEN: tokens},
            step=int(self.state["iter_num"]) - 1,
        )
        if samples < self.facts["max_iters"] * self.facts["micro_batch_size"] * self.facts["world_size"]:
            self.core.after_step([optimizer], step, samples, tokens, position=samples)  # not after the last step
        if self.probes is not None:  # a point opened now measures the batch the run trains next
            assert self.core.global_batch is not None, "started"
            self.probes.after_step(step, samples, tokens, self.core.global_batch, self.facts)

    def save(self, path: Path) -> None:
        """A LitGPT checkpoint of the step just taken, as litgpt's own save after it writes it."""
        from litgpt import pretrain

        assert self.state is not None, "saved inside fit"
        state = dict(self.state, step_count=int(self.state["step_count"]) + 1)  # litgpt counts the step after this
        pretrain.save_checkpoint(self.fabric, state, self.tokenizer_dir, path)

    def summary(self) -> list[str]:
        """The run's closing lines: trouble first (probes that failed or are out, a batch that never grew)."""
        lines = self.probes.summary() if self.probes is not None else []
        changes = ", ".join(f"{c.new_global_batch} at {c.tokens_seen:,} tokens" for c in self.core.history)
        first = self.core.schedule.batch_size(0)
        return [*lines, f"lit_cbs: global batch {first}" + (f" -> {changes}" if changes else "")]

    # -- the checkpoint -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        probe = self.probes.state_dict() if self.probes is not None else None
        return {"core": self.core.state_dict(), "run": dict(self.facts), "probe": probe}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.core.load_state_dict(state["core"])
        self._saved_run = dict(state["run"])
        if self.probes is not None and state["probe"] is not None:
            self.probes.load_state_dict(state["probe"])
