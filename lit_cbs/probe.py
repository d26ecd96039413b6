"""``CBSProbeCallback``: measure the critical batch size (CBS) online by branched training.

Merrill et al. 2025 ("Critical Batch Size Revisited", arXiv 2505.23971) measure the CBS at a
checkpoint trained with batch B by branching: for each multiplier k, train with batch k*B and LR
f(k)*eta (f = sqrt for Adam) for the same window of Delta tokens, smooth the training loss with
an EMA (alpha = 0.5), and take k* = the largest k whose loss is within ``epsilon`` of every
smaller k's; B* = k* B, with the next k of the grid as the upper end of the interval.

How lit_cbs runs it inside one Trainer, without re-entering Lightning's loops:

1. At a probe point (tokens seen), after an optimizer step, snapshot the training state S0:
   parameters and buffers, optimizer state and hyperparameters, LR schedulers, grad scaler and
   RNG states (on CPU by default).
2. The main run goes on for one window; its micro-batches are recorded as they stream by (on
   CPU by default), and its own per-step losses are kept: the main run *is* the k = 1 branch.
3. At the window's end, snapshot the main state S1, then for each k restore S0 and train on the
   recorded micro-batches with batch k*B through the strategy's wrapped model (DDP/FSDP reduce
   gradients as in training), the trainer's precision context, gradient clipping and grad
   scaler, stepping the LR schedulers as the main run does. Every branch sees exactly the
   tokens the main run saw. Then restore S1: the main run is untouched (its parameters, optimizer state, RNG streams and data position).

``strategy="grid"`` trains every k in ``multipliers`` (the paper's protocol, k = 1 included).
``strategy="bisect"`` is cheaper for the same answer when recovery is monotone in k: it takes the
main run's own window as the k = 1 baseline (no branch needed) and bisects the rest of the grid,
training about log2(len(multipliers)) branches instead of len(multipliers).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import Metric

from lit_cbs._internals import (
    block_ddp_gradient_sync,
    collect_rng_states,
    metric_update_count,
    set_metric_update_count,
    set_rng_states,
    should_accumulate,
    tree_map,
)
from lit_cbs.lr_rules import get_lr_rule, scale_learning_rate
from lit_cbs.lr_schedules import TokenLRScheduler
from lit_cbs.schedules import CBSAdaptive
from lit_cbs.accounting import data_parallel_size
from lit_cbs.warmup import BatchWarmup

log = logging.getLogger(__name__)

STRATEGIES = ("grid", "bisect")
EVALS = ("train_ema", "heldout")


# ---------------------------------------------------------------------------- the paper's rule
def critical_multiplier(losses: dict[float, float], epsilon: float) -> float:
    """k* = the largest k such that L_k <= L_j + epsilon for every smaller j in ``losses``.

    ``losses`` maps each multiplier k to its smoothed loss (nats); a failed branch has loss NaN or
    inf and counts as not recovered (it is never chosen and constrains no larger k). The smallest
    finite k is always admissible; if every branch failed, k* is the smallest k.
    """
    if not losses:
        raise ValueError("losses is empty: give at least one multiplier's loss")
    if epsilon < 0:
        raise ValueError(f"epsilon={epsilon} must be >= 0 (nats)")
    admissible = [k for k in sorted(losses) if is_admissible(losses, k, epsilon)]
    return admissible[-1] if admissible else min(losses)


def is_admissible(losses: dict[float, float], k: float, epsilon: float) -> bool:
    """L_k is finite and within ``epsilon`` of every smaller k's finite loss."""
    if not math.isfinite(losses[k]):
        return False
    return all(losses[k] <= losses[j] + epsilon for j in losses if j < k and math.isfinite(losses[j]))


def cbs_interval(k_star: float, multipliers: Sequence[float], batch_size: int) -> tuple[float, float | None, float]:
    """(lower, upper, estimate) in samples: [k* B, next k B] and their geometric mean.

    At the top of the grid there is no upper end: upper is None and the estimate is the lower
    bound (the CBS is at least that).
    """
    ks = sorted(multipliers)
    lower = k_star * batch_size
    larger = [k for k in ks if k > k_star]
    if not larger:
        return lower, None, lower
    upper = larger[0] * batch_size
    return lower, upper, math.sqrt(lower * upper)


def ema_last(values: Sequence[float], alpha: float) -> float:
    """The EMA (weight ``alpha`` on the newest value) of ``values`` at its last element."""
    ema = None
    for value in values:
        ema = value if ema is None else alpha * value + (1 - alpha) * ema
    return float("nan") if ema is None else float(ema)


def max_branches(strategy: str, multipliers: int) -> int:
    """Branches one probe trains at most: every multiplier for "grid"; for "bisect", one baseline
    branch plus ceil(log2(multipliers)) others."""
    return multipliers if strategy == "grid" else 1 + math.ceil(math.log2(max(2, multipliers)))


# ---------------------------------------------------------------------------- state snapshots
def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a tensor (a DTensor's shard under FSDP2)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _reshard(pl_module) -> None:
    """Put FSDP2 parameters back into their sharded form.

    A forward without backward (held-out loss) leaves modules built with
    reshard_after_forward=False unsharded; snapshots copy and restore the shards.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in pl_module.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _copy_to(value, device):
    if isinstance(value, torch.Tensor):
        return _local(value).detach().to(device, copy=True)
    return copy.deepcopy(value)


class TrainingSnapshot:
    """An in-memory copy of everything a training step changes, restored in place.

    Parameters, buffers and optimizer state are copied rank-locally (FSDP2 shards stay shards);
    schedulers and the grad scaler through their state_dicts; RNG states of torch (CPU and CUDA),
    numpy and random; the states of torchmetrics metrics in the module (a training_step that
    updates a metric would otherwise count the branches' batches).
    """

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        _reshard(pl_module)
        self.tensors = [_copy_to(t, self.device) for t in self._module_tensors(pl_module)]
        self.optimizers = [
            (
                {param: {key: _copy_to(v, self.device) for key, v in state.items()} for param, state in opt.state.items()},
                [{key: copy.deepcopy(v) for key, v in group.items() if key != "params"} for group in opt.param_groups],
            )
            for opt in trainer.optimizers
        ]
        self.schedulers = [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        self.rng = collect_rng_states(include_cuda=torch.cuda.is_available())
        self.training = pl_module.training
        self.metrics = [
            (metric, copy.deepcopy(metric.metric_state), metric_update_count(metric))
            for metric in pl_module.modules()
            if isinstance(metric, Metric)
        ]

    @staticmethod
    def _module_tensors(pl_module) -> list[torch.Tensor]:
        return list(pl_module.parameters()) + list(pl_module.buffers())

    @torch.no_grad()
    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _reshard(pl_module)
        for live, saved in zip(self._module_tensors(pl_module), self.tensors):
            _local(live).copy_(saved)
        for opt, (states, groups) in zip(trainer.optimizers, self.optimizers):
            for param in list(opt.state):
                if param not in states:
                    del opt.state[param]  # state created by a branch (e.g. Adam's first step)
            for param, saved_state in states.items():
                live_state = opt.state[param]
                for key in list(live_state):
                    if key not in saved_state:
                        del live_state[key]
                for key, value in saved_state.items():
                    if isinstance(value, torch.Tensor) and isinstance(live_state.get(key), torch.Tensor):
                        _local(live_state[key]).copy_(value)
                    elif isinstance(value, torch.Tensor):
                        live_state[key] = value.to(_local(param).device, copy=True)
                    else:
                        live_state[key] = copy.deepcopy(value)
            for group, saved_group in zip(opt.param_groups, groups):
                group.update(copy.deepcopy(saved_group))
            opt.zero_grad(set_to_none=True)
        for config, state in zip(trainer.lr_scheduler_configs, self.schedulers):
            config.scheduler.load_state_dict(copy.deepcopy(state))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(self.scaler))
        set_rng_states(self.rng)
        for metric, state, update_count in self.metrics:
            for name, value in state.items():
                setattr(metric, name, copy.deepcopy(value))
            set_metric_update_count(metric, update_count)
        pl_module.train(self.training)


@contextlib.contextmanager
def _logging_muted(pl_module: pl.LightningModule):
    """Branches call the user's training_step; its self.log calls must not reach the main run's logs."""
    if "log" in vars(pl_module):  # already muted by an enclosing block
        yield
        return
    pl_module.log = lambda *args, **kwargs: None
    pl_module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del pl_module.log
        del pl_module.log_dict


def _loss_of(output) -> torch.Tensor:
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"training_step must return a loss tensor or a dict with 'loss' for CBS probing, got {output!r}")
    return loss


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


class BranchFailed(Exception):
    """A branch diverged (non-finite loss) or ran out of memory; it counts as not recovered."""


class ProbeAborted(Exception):
    """SIGTERM arrived during a probe: the main state is restored and Lightning shuts down as usual."""


# ---------------------------------------------------------------------------- the callback
class CBSProbeCallback(Callback):
    """Measure the critical batch size at intervals by branched mini-fits from in-memory copies.

    Needs ``BatchWarmup`` among the Trainer's callbacks (``ConstantBatch`` for a fixed batch): it
    gives the current global batch B, the micro-batch and the token count.

    Args:
        every_tokens: probe every this many tokens (global).
        at_tokens: probe at these token counts.
        geometric: ``(first_tokens, ratio)``: probe at first, first*ratio, ... (dense early, where
            the CBS moves fast). Exactly one of the three must be given. A point passed while
            another probe's window runs is probed as soon as that window ends.
        multipliers: the grid of k (batch k*B for each branch); fractions below 1 are used where
            k*B is a whole number of micro-batches on every rank, skipped (and said) otherwise.
        window_tokens: Delta, the tokens every branch trains on (rounded down to a whole number
            of steps of the largest branch).
        epsilon: tolerance in nats of the k* rule (the paper: 0.01; see docs/tiny_workload.md for the noise
            floor of small runs).
        ema_alpha: weight of the newest step loss in the EMA (the paper: 0.5).
        lr_rule: LR factor for batch ratio k ("sqrt" for Adam, "linear" for SGD, ...).
        strategy: "grid" (every k, the paper's protocol) or "bisect" (main run as the k=1
            baseline, bisection over the rest; assumes recovery is monotone in k).
        evaluate: "train_ema" (the paper) or "heldout": the loss on the first ``heldout_batches``
            batches of the datamodule's val_dataloader at the window's end.
        max_overhead: skip a probe that would bring probe tokens above this fraction of the
            training tokens.
        snapshot_device: where snapshots and recorded batches live ("cpu" keeps accelerator
            memory free).
        output_dir: where ``cbs_probe.jsonl`` and ``cbs_curve.png`` go (default: the trainer's
            log_dir or default_root_dir).

    Attributes:
        history: one dict per probe (tokens, batch_size, losses per k, k_star, cbs_lower,
            cbs_upper, cbs_estimate in samples, tokens_spent, failed ks).
        tokens_spent: tokens trained in branches so far (all ranks).
    """

    def __init__(
        self,
        every_tokens: int | None = None,
        at_tokens: Sequence[int] | None = None,
        geometric: tuple[int, float] | None = None,
        multipliers: Sequence[float] = (1, 2, 4, 8),
        window_tokens: int = 1_000_000,
        epsilon: float = 0.01,
        ema_alpha: float = 0.5,
        lr_rule="sqrt",
        strategy: str = "grid",
        evaluate: str = "train_ema",
        heldout_batches: int = 8,
        max_overhead: float | None = None,
        snapshot_device: str = "cpu",
        output_dir: str | os.PathLike | None = None,
    ):
        given = [x is not None for x in (every_tokens, at_tokens, geometric)]
        if sum(given) != 1:
            raise ValueError("give exactly one of every_tokens, at_tokens or geometric=(first_tokens, ratio)")
        if every_tokens is not None and (not isinstance(every_tokens, int) or every_tokens <= 0):
            raise ValueError(f"every_tokens={every_tokens!r} must be a positive int (tokens)")
        if at_tokens is not None:
            at_tokens = sorted(int(t) for t in at_tokens)
            if not at_tokens or at_tokens[0] <= 0:
                raise ValueError(f"at_tokens={at_tokens!r} must be a non-empty list of positive token counts")
        if geometric is not None:
            first, ratio = geometric
            if not (first > 0 and ratio > 1):
                raise ValueError(f"geometric={geometric!r} needs first_tokens > 0 and ratio > 1")
        multipliers = list(multipliers)
        if not multipliers or any(not (isinstance(k, (int, float)) and k > 0) for k in multipliers):
            raise ValueError(f"multipliers={multipliers!r} must be a non-empty list of positive numbers")
        if len(set(multipliers)) != len(multipliers):
            raise ValueError(f"multipliers={multipliers!r} has duplicates")
        if not isinstance(window_tokens, int) or window_tokens <= 0:
            raise ValueError(f"window_tokens={window_tokens!r} must be a positive int (tokens)")
        if epsilon < 0:
            raise ValueError(f"epsilon={epsilon} must be >= 0 (nats)")
        if not 0 < ema_alpha <= 1:
            raise ValueError(f"ema_alpha={ema_alpha} must lie in (0, 1]")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is unknown; use one of {STRATEGIES}")
        if evaluate not in EVALS:
            raise ValueError(f"evaluate={evaluate!r} is unknown; use one of {EVALS}")
        if strategy == "bisect" and 1 not in multipliers:
            raise ValueError("strategy='bisect' uses the main run as the k=1 baseline: include 1 in multipliers")
        if max_overhead is not None and not max_overhead > 0:
            raise ValueError(f"max_overhead={max_overhead} must be > 0 (probe tokens / training tokens)")
        self.every_tokens = every_tokens
        self.at_tokens = at_tokens
        self.geometric = tuple(geometric) if geometric is not None else None
        self.multipliers = sorted(float(k) for k in multipliers)
        self.window_tokens = window_tokens
        self.epsilon = float(epsilon)
        self.ema_alpha = float(ema_alpha)
        self.lr_rule = get_lr_rule(lr_rule)
        self.strategy = strategy
        self.evaluate = evaluate
        self.heldout_batches = heldout_batches
        self.max_overhead = max_overhead
        self.snapshot_device = snapshot_device
        self.output_dir = Path(output_dir) if output_dir is not None else None

        self.history: list[dict[str, Any]] = []
        self.tokens_spent = 0
        self.probes_started = 0
        self._warmup: BatchWarmup | None = None
        self._window: dict[str, Any] | None = None  # the probe whose window the main run is training
        self._heldout: list | None = None
        self._resolved_output_dir: Path | None = None

    # ------------------------------------------------------------------ probe points
    def probe_point(self, index: int) -> int:
        """Token count of the index-th probe (0-based)."""
        if self.every_tokens is not None:
            return self.every_tokens * (index + 1)
        if self.at_tokens is not None:
            return self.at_tokens[index] if index < len(self.at_tokens) else math.inf
        first, ratio = self.geometric
        return int(round(first * ratio**index))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        warmups = [cb for cb in trainer.callbacks if isinstance(cb, BatchWarmup)]
        if not warmups:
            raise ValueError(
                "CBSProbeCallback needs BatchWarmup in the Trainer's callbacks for the batch size and token "
                "count; add BatchWarmup(ConstantBatch(<global batch>)) for a fixed batch"
            )
        self._warmup = warmups[0]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warmup = self._warmup
        seq_len = warmup.seq_len
        unit = warmup.micro_batch_size * data_parallel_size(trainer)
        if seq_len is not None:
            largest_step = max(self.multipliers) * warmup.global_batch * seq_len
            if self.window_tokens < largest_step:
                raise ValueError(
                    f"window_tokens={self.window_tokens} is smaller than one step of the largest branch "
                    f"(k={max(self.multipliers):g} x batch {warmup.global_batch} x {seq_len} tokens = {largest_step:g}); "
                    "raise window_tokens or drop the largest multipliers"
                )
        if warmup.max_tokens is not None and self.probe_point(self.probes_started) >= warmup.max_tokens:
            raise ValueError(
                f"no probe point lies inside the run: the first is at {self.probe_point(self.probes_started):g} tokens "
                f"but BatchWarmup.max_tokens={warmup.max_tokens}; probe earlier"
            )
        too_small = [k for k in self.multipliers if (k * warmup.global_batch) % unit]
        if too_small:
            rank_zero_warn(
                f"multipliers {too_small} give batches that are not a whole number of micro-batches "
                f"({unit} samples) at batch {warmup.global_batch}; they are skipped while that holds"
            )
        if self.evaluate == "heldout":
            self._heldout = self._load_heldout(trainer)
        # trainer.log_dir broadcasts from rank 0: resolve it on every rank, once.
        self._resolved_output_dir = self.output_dir or Path(trainer.log_dir or trainer.default_root_dir)

    def _load_heldout(self, trainer) -> list:
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "val_dataloader"):
            raise ValueError("evaluate='heldout' needs a datamodule with val_dataloader(); use evaluate='train_ema'")
        batches = []
        for batch in datamodule.val_dataloader():
            batches.append(move_data_to_device(batch, self.snapshot_device))
            if len(batches) == self.heldout_batches:
                break
        if not batches:
            raise ValueError("evaluate='heldout': the val_dataloader yielded no batch")
        return batches

    # ------------------------------------------------------------------ main-run hooks
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._window is not None:
            self._window["batches"].append(move_data_to_device(tree_map(_detach, batch), self.snapshot_device))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        window = self._window
        if window is not None:
            # Lightning hands back the loss divided by accumulate; undo it for the micro-batch's mean.
            window["micro_losses"].append(float(_loss_of(outputs).detach()) * trainer.accumulate_grad_batches)
        if should_accumulate(trainer):
            return
        if window is not None:
            window["step_losses"].append(sum(window["micro_losses"]) / len(window["micro_losses"]))
            window["micro_losses"] = []
            if len(window["batches"]) * window["micro_samples"] >= window["samples_per_rank"]:
                self._finish_probe(trainer, pl_module)
            return
        warmup = self._warmup
        if warmup.tokens_seen >= self.probe_point(self.probes_started):
            self._start_probe(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._window is not None:
            rank_zero_warn(f"CBS probe at {self._window['tokens']:,} tokens dropped: training ended inside its window")
            self._window = None
        if trainer.is_global_zero and self.history:
            plot_cbs_curve(
                self.history, self._warmup.history, self._resolved_output_dir / "cbs_curve.png", self._warmup.tokens_seen
            )

    # ------------------------------------------------------------------ probing

    def _usable_multipliers(self, batch_size: int, unit: int, window_samples: int) -> list[float]:
        usable = []
        for k in self.multipliers:
            branch = k * batch_size
            if abs(branch - round(branch)) < 1e-9 and round(branch) % unit == 0 and branch <= window_samples:
                usable.append(k)
        return usable

    def _start_probe(self, trainer, pl_module) -> None:
        warmup = self._warmup
        self.probes_started += 1
        while self.probe_point(self.probes_started) <= warmup.tokens_seen:
            self.probes_started += 1  # points passed inside one step (or during an earlier window)
        batch_size, micro, world = warmup.global_batch, warmup.micro_batch_size, data_parallel_size(trainer)
        seq_len = warmup.seq_len or 1
        window_samples = self.window_tokens // seq_len
        ks = self._usable_multipliers(batch_size, micro * world, window_samples)
        if not ks or (self.strategy == "bisect" and 1.0 not in ks):
            rank_zero_warn(f"CBS probe at {warmup.tokens_seen:,} tokens skipped: no multiplier fits batch {batch_size}")
            return
        # Every branch trains on the same whole number of its own steps.
        window_samples = int(window_samples // (max(ks) * batch_size) * (max(ks) * batch_size))
        if warmup.max_tokens is not None and warmup.tokens_seen + window_samples * seq_len > warmup.max_tokens:
            # The main run would stop inside the window and take its snapshot and data with it.
            rank_zero_info(
                f"CBS probe at {warmup.tokens_seen:,} tokens not started: its window of {window_samples * seq_len:,} "
                f"tokens would end past max_tokens={warmup.max_tokens:,}"
            )
            return
        expected_cost = max_branches(self.strategy, len(ks)) * window_samples * seq_len
        if self.max_overhead is not None:
            overhead = (self.tokens_spent + expected_cost) / max(1, warmup.tokens_seen + window_samples * seq_len)
            if overhead > self.max_overhead:
                rank_zero_info(
                    f"CBS probe at {warmup.tokens_seen:,} tokens skipped: it would bring probe overhead to "
                    f"{overhead:.2f} > max_overhead={self.max_overhead}"
                )
                return
        self._window = {
            "tokens": warmup.tokens_seen,
            "step": trainer.global_step,
            "batch_size": batch_size,
            "accumulate": warmup.accumulate,
            "multipliers": ks,
            "window_samples": window_samples,
            "samples_per_rank": window_samples // world,
            "micro_samples": micro,
            "seq_len": seq_len,
            "snapshot": TrainingSnapshot(trainer, pl_module, self.snapshot_device),
            "batches": [],
            "micro_losses": [],
            "step_losses": [],
        }

    def _finish_probe(self, trainer, pl_module) -> None:
        window, self._window = self._window, None
        main_changed_batch = self._warmup.global_batch != window["batch_size"]
        if self.evaluate == "heldout":
            main_loss = self._heldout_loss(trainer, pl_module)
        else:
            main_loss = ema_last(self._reduce_mean(trainer, window["step_losses"]), self.ema_alpha)
        after_window = TrainingSnapshot(trainer, pl_module, self.snapshot_device)
        losses: dict[float, float] = {}
        failed: list[float] = []
        trained: list[float] = []

        def measure(k: float) -> float:
            if k == 1.0 and self.strategy == "bisect" and not main_changed_batch:
                return main_loss
            trained.append(k)
            try:
                return self._run_branch(trainer, pl_module, window, k)
            except BranchFailed as error:
                rank_zero_warn(f"CBS probe branch k={k:g} failed ({error}); counted as not recovered")
                failed.append(k)
                return math.inf

        try:
            with _logging_muted(pl_module):
                if self.strategy == "grid":
                    for k in window["multipliers"]:
                        losses[k] = measure(k)
                else:
                    losses = self._bisect(window["multipliers"], measure)
        except ProbeAborted:
            rank_zero_warn(f"CBS probe at {window['tokens']:,} tokens aborted by SIGTERM; main state restored")
            return
        finally:
            after_window.restore(trainer, pl_module)
            self._warmup.accounting.set_gradient_sync(None)
        k_star = critical_multiplier(losses, self.epsilon)
        lower, upper, estimate = cbs_interval(k_star, window["multipliers"], window["batch_size"])
        spent = len(trained) * window["window_samples"] * window["seq_len"]
        self.tokens_spent += spent
        record = {
            "tokens": window["tokens"],
            "step": window["step"],
            "batch_size": window["batch_size"],
            "window_tokens": window["window_samples"] * window["seq_len"],
            "strategy": self.strategy,
            "evaluate": self.evaluate,
            "losses": {f"{k:g}": (v if math.isfinite(v) else None) for k, v in sorted(losses.items())},
            "main_loss": main_loss,
            "branches_trained": trained,
            "failed": failed,
            "k_star": k_star,
            "cbs_lower": lower,
            "cbs_upper": upper,
            "cbs_estimate": estimate,
            "tokens_spent": spent,
            "overhead": self.tokens_spent / max(1, self._warmup.tokens_seen),
            "adaptive_batch": None,  # the batch CBSAdaptive moved to on this measurement, if any
        }
        schedule = self._warmup.schedule
        if isinstance(schedule, CBSAdaptive):
            consumed = self._warmup.consumed
            if schedule.observe(consumed, lower):
                record["adaptive_batch"] = schedule.batch_size(consumed)
                rank_zero_info(f"CBSAdaptive: CBS >= {lower:g} samples; global batch -> {record['adaptive_batch']}")
        self.history.append(record)
        self._report(trainer, pl_module, record)

    def _bisect(self, ks: list[float], measure) -> dict[float, float]:
        """Largest admissible k by bisection, assuming the admissible ks are a prefix of the grid."""
        losses = {ks[0]: measure(ks[0])}
        low, high = 0, len(ks) - 1  # ks[low] is admissible; k* lies in ks[low..high]
        while low < high:
            mid = (low + high + 1) // 2
            losses[ks[mid]] = measure(ks[mid])
            if is_admissible(losses, ks[mid], self.epsilon):
                low = mid
            else:
                high = mid - 1
        return losses

    def _run_branch(self, trainer, pl_module, window, k: float) -> float:
        """Train batch k*B over the recorded window from the start snapshot; return its loss."""
        window["snapshot"].restore(trainer, pl_module)
        strategy = trainer.strategy
        optimizers = trainer.optimizers
        schedulers = [c for c in trainer.lr_scheduler_configs if c.interval == "step" and not c.reduce_on_plateau]
        factor = self.lr_rule.lr_factor(k)
        for optimizer in optimizers:
            scale_learning_rate(optimizer, [c.scheduler for c in trainer.lr_scheduler_configs], factor)
            self.lr_rule.adjust_optimizer(optimizer, k)
        optimizer = optimizers[0]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        micro_per_step = int(round(k * window["accumulate"]))
        batches = window["batches"][: window["samples_per_rank"] // window["micro_samples"]]
        world = data_parallel_size(trainer)
        tokens = window["tokens"]
        step_losses = []
        pl_module.train()
        try:
            for start in range(0, len(batches) - micro_per_step + 1, micro_per_step):
                optimizer.zero_grad(set_to_none=True)
                total = torch.zeros((), dtype=torch.float64, device=strategy.root_device)
                for i in range(micro_per_step):
                    last = i == micro_per_step - 1
                    batch = move_data_to_device(batches[start + i], strategy.root_device)
                    self._warmup.accounting.set_gradient_sync(last)
                    with block_ddp_gradient_sync(strategy, block=not last):
                        loss = _loss_of(strategy.training_step(batch, start + i))
                        scaled = loss / micro_per_step
                        (scaler.scale(scaled) if scaler is not None else scaled).backward()
                    total += loss.detach()
                step_loss = total / micro_per_step
                bad = not bool(torch.isfinite(step_loss))
                if strategy.reduce_boolean_decision(bad, all=False):
                    raise BranchFailed(f"non-finite loss at branch step {len(step_losses)}")
                if scaler is not None:
                    scaler.unscale_(optimizer)
                if trainer.gradient_clip_val:
                    trainer.precision_plugin.clip_gradients(
                        optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm or "norm"
                    )
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                tokens += micro_per_step * window["micro_samples"] * world * window["seq_len"]
                for config in schedulers:
                    if isinstance(config.scheduler, TokenLRScheduler):
                        config.scheduler.tokens_seen = tokens
                    config.scheduler.step()
                step_losses.append(float(step_loss))
                if strategy.reduce_boolean_decision(trainer.received_sigterm, all=False):
                    raise ProbeAborted()
        except RuntimeError as error:
            if _is_out_of_memory(error):
                raise BranchFailed("out of memory") from error
            raise
        if self.evaluate == "heldout":
            return self._heldout_loss(trainer, pl_module)
        return ema_last(self._reduce_mean(trainer, step_losses), self.ema_alpha)

    def _reduce_mean(self, trainer, values: list[float]) -> list[float]:
        """Per-step losses averaged over ranks, so every rank reaches the same k*."""
        tensor = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            tensor = trainer.strategy.reduce(tensor, reduce_op="mean")
        return tensor.tolist()

    @torch.no_grad()
    def _heldout_loss(self, trainer, pl_module) -> float:
        was_training = pl_module.training
        pl_module.eval()
        total = 0.0
        with _logging_muted(pl_module), trainer.precision_plugin.forward_context():
            for i, batch in enumerate(self._heldout):
                batch = move_data_to_device(batch, trainer.strategy.root_device)
                total += float(_loss_of(pl_module.training_step(batch, i)))
        pl_module.train(was_training)
        return self._reduce_mean(trainer, [total / len(self._heldout)])[0]

    def _report(self, trainer, pl_module, record) -> None:
        metrics = {
            "cbs/lower": float(record["cbs_lower"]),
            "cbs/estimate": float(record["cbs_estimate"]),
            "cbs/k_star": float(record["k_star"]),
            "probe/overhead": float(record["overhead"]),
            "probe/tokens_spent": float(self.tokens_spent),
        }
        if record["cbs_upper"] is not None:
            metrics["cbs/upper"] = float(record["cbs_upper"])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        losses = ", ".join(f"k={k}: {v:.4f}" if v is not None else f"k={k}: failed" for k, v in record["losses"].items())
        upper = f"{record['cbs_upper']:g}" if record["cbs_upper"] is not None else "beyond the grid"
        rank_zero_info(
            f"CBS probe at {record['tokens']:,} tokens (batch {record['batch_size']}): k*={record['k_star']:g}, "
            f"CBS in [{record['cbs_lower']:g}, {upper}] samples; {losses}; probe overhead {record['overhead']:.2f}"
        )
        if trainer.is_global_zero:
            out = self._resolved_output_dir
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "cbs_probe.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        # A window in progress cannot be finished after a resume (its start snapshot lives only in
        # memory), so a checkpoint taken inside one asks the resumed run to probe again at once.
        return {
            "history": copy.deepcopy(self.history),
            "tokens_spent": self.tokens_spent,
            "probes_started": self.probes_started - (self._window is not None),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = copy.deepcopy(state_dict["history"])
        self.tokens_spent = state_dict["tokens_spent"]
        self.probes_started = state_dict["probes_started"]


def _detach(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def plot_cbs_curve(
    history: list[dict], batch_changes: list, path: str | os.PathLike, end_tokens: float | None = None
) -> Path:
    """CBS interval per probe vs tokens, with the global batch the run actually used up to
    ``end_tokens`` (default: just past the last probe) (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    tokens = [r["tokens"] for r in history]
    estimate = [r["cbs_estimate"] for r in history]
    lower = [r["cbs_lower"] for r in history]
    upper = [r["cbs_upper"] if r["cbs_upper"] is not None else r["cbs_lower"] for r in history]
    ax.vlines(tokens, lower, upper, color="tab:blue", alpha=0.6, label="CBS interval [k* B, next k B]")
    ax.scatter(tokens, estimate, color="tab:blue", zorder=3, label="CBS estimate (geometric mean)")
    open_ended = [r for r in history if r["cbs_upper"] is None]
    if open_ended:
        ax.scatter([r["tokens"] for r in open_ended], [r["cbs_lower"] for r in open_ended], marker="^",
                   color="tab:red", zorder=4, label="lower bound (top of grid)")
    if history:
        start = history[0]["batch_size"] if not batch_changes else batch_changes[0].old_global_batch
        xs, ys = [0], [start]
        for change in batch_changes:
            xs += [change.tokens_seen, change.tokens_seen]
            ys += [ys[-1], change.new_global_batch]
        xs.append(max(end_tokens or 0, max(tokens) * 1.05))
        ys.append(ys[-1])
        ax.plot(xs, ys, color="tab:orange", drawstyle="default", label="global batch used")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("batch size (samples)")
    ax.set_yscale("log", base=2)
    ax.set_title("Critical batch size by branched training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
