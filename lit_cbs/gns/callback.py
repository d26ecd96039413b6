"""``GradientNoiseScale``: the simple noise scale B_simple = tr(Sigma) / |G|^2, measured online.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv
1812.06162), appendix A: a gradient averaged over a batch of B samples has
E|G_B|^2 = |G|^2 + tr(Sigma) / B (G: the true gradient, Sigma: the per-sample gradient
covariance). Two measured squared norms at batch sizes B_small < B_big give unbiased estimates

    |G|^2     = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

whose ratio is B_simple. Both are noisy (|G|^2 can come out negative), so each is averaged by its
own bias-corrected exponential moving average and B_simple is the ratio of the two averages, not
an average of per-step ratios.

Here the big batch is the global batch of an optimizer step (after gradient accumulation and the
DDP all-reduce) and the small batch is one micro-batch on one rank: its gradient is read off as
the change of the accumulated ``.grad`` across its backward pass (times ``accumulate``, because
Lightning divides the loss by ``accumulate_grad_batches``), and for the micro-batch whose backward
all-reduces under DDP from inside a DDP communication hook, before the all-reduce. Per-example
mode (Gray et al. 2024, arXiv:2411.00999) takes B_small = 1 from per-sample gradients computed with
``torch.func``. Batch sizes are counted in samples from each micro-batch (Lightning's
``extract_batch_size``), so the estimate stays right when ``BatchWarmup`` changes the accumulation
or an epoch ends on a short micro-batch.

Both squared norms are sums over the parameters, so the estimates split over groups of
parameters (``groups=``): each group's |G|^2 and tr(Sigma) are its parameters' share, they add up
to the whole model's, and each group has its own B_simple.

A CBS probe's branches (``BatchAccounting.in_branch``) are not the main run: their backward
passes and steps, hooks and DDP communication alike, are not measured.

Merrill et al. 2025 find that under Adam this noise scale underestimates the critical batch size
by orders of magnitude: log it as a monitor next to ``CBSProbeCallback``, not as the CBS.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch.nn.parallel import DistributedDataParallel

from lit_cbs._internals import foreach_copy_, foreach_norm, foreach_sub_, should_accumulate, tree_map
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.callbacks.logs import log_to_loggers
from lit_cbs.errors import LitCBSConfigError, positive_int
from lit_cbs.models.decoder import layer_stacks


def two_batch_estimates(
    small_grad_sq: torch.Tensor | float,
    big_grad_sq: torch.Tensor | float,
    small_batch_size: torch.Tensor | float,
    big_batch_size: torch.Tensor | float,
) -> tuple[Any, Any]:
    """Unbiased estimates ``(|G|^2, tr(Sigma))`` from squared gradient norms at two batch sizes.

    McCandlish et al. 2018, appendix A. ``small_grad_sq`` is |G_small|^2 (averaged over however
    many small batches were measured), ``big_grad_sq`` is |G_big|^2; batch sizes in samples, with
    ``small_batch_size < big_batch_size``. For unequal micro-batches use the effective sizes
    1 / E[1/b] that make E|G_b|^2 = |G|^2 + tr(Sigma) / b hold (see ``GradientNoiseScale``).
    """
    inv_small, inv_big = 1.0 / small_batch_size, 1.0 / big_batch_size
    trace_sigma = (small_grad_sq - big_grad_sq) / (inv_small - inv_big)
    grad_sq = (inv_small * big_grad_sq - inv_big * small_grad_sq) / (inv_small - inv_big)
    return grad_sq, trace_sigma


def _squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """|tensor|^2 as float32; half-precision tensors are reduced in float32 so their norm is not rounded."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(tensor, dtype=torch.float32) ** 2
    return torch.linalg.vector_norm(tensor).float() ** 2


GROUP_PRESETS = ("param_groups", "blocks")
_SHOWN_NAMES = 6  # parameter names an error message lists


def _some_names(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN_NAMES])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > _SHOWN_NAMES else shown


def block_groups(names: list[str], stacks: list[str]) -> dict[str, list[str]]:
    """``groups="blocks"``: parameter names -> {group: names}, one group ``block<i>`` per transformer block.

    ``stacks`` are the paths of the block stacks (``layer_stacks``). A parameter under
    ``<stack>.<i>.`` belongs to ``block<i>`` (so
    ``model.blocks.3._checkpoint_wrapped_module.mlp.up_proj.weight`` is in ``block3``); every other
    parameter belongs to the group named by its module's path below the first stack's parent
    (``model.embedding.weight`` -> ``embedding``, a final norm's weight -> its module's name), or,
    outside that parent, below the path all parameters share (a transformers model's
    ``model.lm.lm_head.weight`` -> ``lm_head``). Blocks of a later stack keep its path below the
    first stack's parent (``decoder.block0``), so two stacks never share a group. Groups come in
    the order of ``names``.
    """
    if not stacks:
        raise LitCBSConfigError(
            "groups='blocks' looks for the model's stack of transformer blocks (an nn.ModuleList of modules of one class, "
            f"as lit_cbs's OLMo.blocks or a transformers model's model.layers), but the LightningModule has none; parameters: "
            f"{_some_names(names)}; pass groups={{name: regex}} instead"
        )
    parent = stacks[0].rpartition(".")[0]
    prefix = parent + "." if parent else ""
    shared = _shared_prefix(names)
    patterns = [(stack, re.compile(rf"^{re.escape(stack)}\.(\d+)\.")) for stack in stacks]
    groups: dict[str, list[str]] = {}
    for name in names:
        match = next(((stack, found) for stack, pattern in patterns if (found := pattern.match(name))), None)
        if match:
            stack, found = match
            group = f"block{found.group(1)}"
            if stack != stacks[0]:
                group = f"{stack.removeprefix(prefix).rpartition('.')[0] or stack}.{group}"
        else:
            relative = name.removeprefix(prefix) if name.startswith(prefix) else name.removeprefix(shared)
            group = relative.rpartition(".")[0] or relative  # the module's path; a parameter of the root: its own name
        groups.setdefault(group, []).append(name)
    return groups


def _shared_prefix(names: list[str]) -> str:
    """The longest dotted path (ending in ".") that starts every name."""
    parts = [name.split(".")[:-1] for name in names]
    shared = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        shared.append(level[0])
    return ".".join(shared) + "." if shared else ""


def regex_groups(patterns: Mapping[str, re.Pattern], names: list[str]) -> dict[str, list[str]]:
    """``groups={group: regex}``: parameter names -> {group: names}, a name in a group when ``regex.search`` finds it.

    Every group must match a parameter and no parameter two groups; names matched by none are in
    no group (they count in the whole-model metrics only).
    """
    groups: dict[str, list[str]] = {group: [] for group in patterns}
    for name in names:
        owners = [group for group, pattern in patterns.items() if pattern.search(name)]
        if len(owners) > 1:
            raise LitCBSConfigError(
                f"parameter {name!r} is matched by groups {owners} ("
                + ", ".join(f"{group}={patterns[group].pattern!r}" for group in owners)
                + "); a parameter may be in one group only: make the regexes disjoint (e.g. anchor them with '^' or '\\.')"
            )
        for group in owners:
            groups[group].append(name)
    for group, members in groups.items():
        if not members:
            raise LitCBSConfigError(
                f"groups[{group!r}]={patterns[group].pattern!r} matches none of the trained parameters "
                f"({_some_names(names)}); fix the regex (matched with re.search) or remove the group"
            )
    return groups


def _compiled_groups(groups: Any) -> dict[str, re.Pattern] | None:
    """The ``groups`` argument checked: {group: compiled regex} for a dict, None for None or a preset."""
    if groups is None or (isinstance(groups, str) and groups in GROUP_PRESETS):
        return None
    if not isinstance(groups, Mapping) or not groups:
        raise LitCBSConfigError(
            f"groups={groups!r} is not supported; use None, one of {GROUP_PRESETS} or a non-empty dict of "
            "group name -> regex over parameter names"
        )
    compiled = {}
    for group, pattern in groups.items():
        if not isinstance(group, str) or not group:
            raise LitCBSConfigError(f"groups has the name {group!r}; group names must be non-empty strings")
        if not isinstance(pattern, str):
            raise LitCBSConfigError(f"groups[{group!r}]={pattern!r} must be a regex string over parameter names")
        try:
            compiled[group] = re.compile(pattern)
        except re.error as error:
            raise LitCBSConfigError(f"groups[{group!r}]={pattern!r} is not a valid regex: {error}") from error
    return compiled


@dataclasses.dataclass
class NoiseMeasurement:
    """One optimizer step's raw measurement; tensors hold one entry per measured group.

    The entries follow ``GradientNoiseScale.group_names``: the groups, then (entry ``None``) the
    parameters in no group, if any; without ``groups`` the single entry is the whole model.

    ``small_grad_sq``: mean squared norm of the small-batch gradients; ``big_grad_sq``: squared norm
    of the step's gradient (the mean over the global batch); ``small_batch_size`` and
    ``big_batch_size``: effective sizes in samples (1 / E[1/b] for the small batches,
    M^2 / sum(1/b_i) over the step's M micro-batches for the big one); ``grad_sq`` and
    ``trace_sigma``: this step's unbiased estimates before averaging.
    """

    small_grad_sq: torch.Tensor
    big_grad_sq: torch.Tensor
    small_batch_size: float
    big_batch_size: float
    grad_sq: torch.Tensor
    trace_sigma: torch.Tensor


class _LossOfBatch(torch.nn.Module):
    """Wraps ``per_example_loss(module, batch)`` as a module so ``torch.func.functional_call`` can swap its parameters."""

    def __init__(self, module: torch.nn.Module, loss: Callable[[torch.nn.Module, Any], torch.Tensor]):
        super().__init__()
        self.module = module
        self.loss = loss

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss(self.module, batch)


class GradientNoiseScale(Callback):
    """Log the gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018), in samples.

    Small batch: one micro-batch on one rank (under gradient accumulation, or each rank's batch
    under DDP without accumulation); big batch: the global batch of the optimizer step. So at least
    one of ``accumulate_grad_batches >= 2`` or 2+ DDP processes is needed, or per-example mode
    (``per_example_loss``, B_small = 1). Steps with a single micro-batch in all (e.g. while
    ``BatchWarmup`` still runs at accumulate 1 on one process) are not measured. The loss must be
    the mean over the micro-batch's samples (as ``training_step`` returns it for Lightning's
    accumulation), and ``automatic_optimization`` must be on.

    Measured at every optimizer step (before gradient clipping, after AMP unscaling) and written
    straight to the trainer's loggers every ``log_every_n_steps`` steps, in the row of the step's
    other metrics (as LearningRateMonitor does; cheaper than ``self.log`` at every step):
    ``gns/b_simple`` (samples), ``gns/trace_sigma`` and
    ``gns/grad_sq`` (squared gradient norms, per sample and true respectively), from bias-corrected
    EMAs; with ``groups`` also ``gns/<group>/b_simple``, ``gns/<group>/trace_sigma`` and
    ``gns/<group>/grad_sq`` per group of parameters (the groups' ``grad_sq`` and ``trace_sigma`` add
    up to the whole model's when the groups hold every trained parameter). ``b_simple`` and
    ``metrics()`` give the current values. Steps whose gradients are not finite (an AMP overflow)
    leave the averages unchanged.

    Cost. Memory: when a rank accumulates 2+ micro-batches per step, one copy of the gradients of
    the optimizer's parameters, in the gradients' own dtype (fp32 under ``bf16-mixed``, bf16 under
    ``bf16-true``); nothing extra under DDP without accumulation. Time: per micro-batch one
    subtraction, one norm and one copy over the gradients (about three gradient-sized memory
    passes); per step one norm over the gradients, one host synchronisation (to leave non-finite
    steps out) and, under DDP, one all-reduce of a few scalars. Groups add no kernels: every norm
    above is one fused ``torch._foreach_norm`` whose results land in their groups by one
    ``index_add_``, so per micro-batch groups cost the same passes and only the per-step scalars
    (three per group) grow.
    Per-example mode instead holds ``micro_batch_size`` (or ``per_example_chunk_size``)
    per-example gradients at once and costs one extra forward and backward per micro-batch.

    Args:
        ema_decay: decay of the EMAs of |G|^2 and tr(Sigma) per optimizer step, in [0, 1).
        groups: also measure per group of the optimizer's parameters. None: the whole model only.
            ``"param_groups"``: one group per optimizer parameter group, named by its ``"name"``
            (else ``pg<i>``). ``"blocks"``: ``block0``, ``block1``, ... per transformer block of the
            model's stack of blocks (an ``nn.ModuleList`` of one class: ``OLMo.blocks``, a
            transformers model's decoder layers; see ``layer_stacks``), and one group per other
            module holding parameters (``embedding``, ``lm_head``; see ``block_groups``). A dict ``{group: regex}``: a parameter (by its name in
            ``named_parameters()`` of the LightningModule, e.g. ``model.blocks.0.mlp.up_proj.weight``)
            is in a group when ``re.search(regex, name)`` finds a match (anchor with ``^``/``$`` for
            whole names); a group that matches no trained parameter, or a parameter matched by two
            groups, stops the fit before training; parameters matched by none count in the
            whole-model metrics only.
        per_example_loss: turns on per-example mode: ``per_example_loss(module, batch)`` must return
            the training loss of ``batch`` (a scalar) without logging or side effects. It is called
            through ``torch.func.vmap`` with every tensor of the micro-batch cut to one sample
            (leading dimension 1), with the parameters swapped by ``torch.func.functional_call``.
        per_example_chunk_size: samples per ``vmap`` chunk in per-example mode (None: the whole
            micro-batch at once); lowers the memory of per-example mode.

    Attributes:
        last_measurement: the latest ``NoiseMeasurement`` (None before the first measured step).
        num_updates: optimizer steps measured so far.
        group_names: the measured groups in the order of ``NoiseMeasurement``'s entries (set when
            the fit starts); ``None`` stands for the parameters in no group.
    """

    def __init__(
        self,
        ema_decay: float = 0.99,
        groups: str | Mapping[str, str] | None = None,
        per_example_loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        per_example_chunk_size: int | None = None,
    ):
        if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0.0 <= ema_decay < 1.0:
            raise LitCBSConfigError(f"ema_decay={ema_decay!r} must be a float in [0, 1) (decay per optimizer step)")
        if per_example_loss is not None and not callable(per_example_loss):
            raise LitCBSConfigError(f"per_example_loss must be a callable (module, batch) -> loss, got {per_example_loss!r}")
        positive_int("per_example_chunk_size", per_example_chunk_size, "samples", optional=True)
        if per_example_chunk_size is not None and per_example_loss is None:
            raise LitCBSConfigError("per_example_chunk_size only applies to per-example mode: also pass per_example_loss")
        self.ema_decay = float(ema_decay)
        self.groups = groups
        self._patterns = _compiled_groups(groups)
        self.per_example_loss = per_example_loss
        self.per_example_chunk_size = per_example_chunk_size

        self.num_updates = 0
        self._stepped = False  # a step was measured and its metrics are not written yet
        self.last_measurement: NoiseMeasurement | None = None
        self._ema_grad_sq: torch.Tensor | None = None  # per group, not bias-corrected
        self._ema_trace_sigma: torch.Tensor | None = None

        self.group_names: list[str | None] = []
        self._restored_group_names: list[str | None] | None = None  # from a checkpoint, checked when the fit starts
        self._group_of: dict[torch.Tensor, int] = {}  # parameter -> index in group_names
        self._group_index: dict[tuple[int, ...], torch.Tensor] = {}  # ids of parameters -> their group indices
        self._named_params: dict[str, torch.Tensor] = {}
        self._loss_module: _LossOfBatch | None = None
        self._world_size = 1
        self._device = torch.device("cpu")
        self._accounting: BatchAccounting | None = None  # the Trainer's: says when a CBS probe's branch runs
        # The current optimizer step's window of micro-batches (this rank).
        self._said_unmeasured = False  # a step it could not measure was reported
        self._accumulated: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> copy of its accumulated .grad
        self._held: set[torch.Tensor] = set()  # parameters whose copy holds this window's accumulated gradient
        self._micro_batch_size = 0
        self._pending_small: torch.Tensor | None = None  # per-example mode: squared norms summed per group
        self._hook_grad_sq: torch.Tensor | None = None  # DDP hook: the syncing micro-batch's squared norms
        self._window: torch.Tensor | None = None
        self._local_micro_batches = 0

    # ------------------------------------------------------------------ validation and setup
    @property
    def per_example(self) -> bool:
        return self.per_example_loss is not None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise LitCBSConfigError(
                "GradientNoiseScale needs automatic optimization (it reads Lightning's gradient accumulation); "
                "set `self.automatic_optimization = True` or remove GradientNoiseScale"
            )
        strategy = trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise LitCBSConfigError(
                f"GradientNoiseScale supports single-device and DDP strategies, got {type(strategy).__name__}: "
                "it reads whole local gradients, which sharded strategies (FSDP, DeepSpeed, model parallel) split "
                "across ranks; use strategy='ddp' or a single device"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._world_size = trainer.world_size
        self._accounting = BatchAccounting.attach(trainer)
        if not self.per_example and self._world_size == 1 and not self._accumulation_will_exceed_one(trainer):
            raise LitCBSConfigError(
                f"GradientNoiseScale needs two batch sizes, but accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches} on {self._world_size} process gives one: set "
                "Trainer(accumulate_grad_batches=2 or more), train on 2+ DDP processes, or pass "
                "per_example_loss=... for per-example mode (B_small = 1 sample)"
            )
        (optimizer,) = trainer.optimizers  # automatic optimization: exactly one
        self.group_names, self._group_of = self._assign_groups(optimizer, pl_module)
        self._group_index = {}
        self._device = pl_module.device
        if self._ema_grad_sq is None:
            self._ema_grad_sq = torch.zeros(len(self.group_names), device=self._device)
            self._ema_trace_sigma = torch.zeros(len(self.group_names), device=self._device)
        else:  # restored from a checkpoint before the strategy's setup
            self._check_restored_groups()
            self._ema_grad_sq = self._ema_grad_sq.to(self._device)
            self._ema_trace_sigma = self._ema_trace_sigma.to(self._device)
        self._reset_window()
        if self.per_example:
            self._named_params = {f"module.{n}": p for n, p in pl_module.named_parameters() if p in self._group_of}
            self._loss_module = _LossOfBatch(pl_module, self.per_example_loss)
        elif isinstance(trainer.strategy, DDPStrategy):
            self._register_comm_hook(trainer.strategy.model)

    def _assign_groups(
        self, optimizer: torch.optim.Optimizer, pl_module: pl.LightningModule
    ) -> tuple[list[str | None], dict[torch.Tensor, int]]:
        """The measured groups' names and each trained parameter's index among them."""
        trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if self.groups == "param_groups":
            names = [group.get("name", f"pg{i}") for i, group in enumerate(optimizer.param_groups)]
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:
                raise LitCBSConfigError(
                    f"groups='param_groups' names each group by its optimizer parameter group's 'name', but {repeated} "
                    "name more than one group: give the parameter groups distinct names"
                )
            group_of = {p: i for i, group in enumerate(optimizer.param_groups) for p in group["params"] if p.requires_grad}
            return names, group_of
        if self.groups is None:
            return [None], dict.fromkeys(trained, 0)
        trained_ids = {id(p) for p in trained}
        by_name = {name: p for name, p in pl_module.named_parameters() if id(p) in trained_ids}
        names = list(by_name)
        members = block_groups(names, layer_stacks(pl_module)) if self.groups == "blocks" else regex_groups(self._patterns, names)
        group_names: list[str | None] = list(members)
        group_of = {by_name[name]: i for i, group in enumerate(members.values()) for name in group}
        if len(group_of) < len(trained):  # parameters in no group keep the whole-model sums complete
            group_names.append(None)
            group_of.update({p: len(members) for p in trained if p not in group_of})
        return group_names, group_of

    @staticmethod
    def _accumulation_will_exceed_one(trainer: pl.Trainer) -> bool:
        """True if accumulation is or will become >= 2 (the trainer's, a BatchWarmup or a GradientAccumulationScheduler)."""
        from lit_cbs.callbacks.warmup import BatchWarmup

        if trainer.accumulate_grad_batches > 1:
            return True
        ranks = BatchAccounting.attach(trainer).data_parallel_size
        for callback in trainer.callbacks:
            # The accumulation BatchWarmup will use at each size to come (it grows the micro-batch first).
            if isinstance(callback, BatchWarmup) and any(
                size // (callback.micro_batch_for(size) * ranks) > 1 for size in callback.schedule.sizes(callback.consumed)
            ):
                return True
            if isinstance(callback, GradientAccumulationScheduler) and max(callback.scheduling.values()) > 1:
                return True
        return False

    def _register_comm_hook(self, model: DistributedDataParallel) -> None:
        try:
            model.register_comm_hook(state=model.process_group, hook=self._comm_hook)
        except RuntimeError as error:
            raise LitCBSConfigError(
                "GradientNoiseScale installs a DDP communication hook to read each rank's gradient before the all-reduce, "
                "but one is already registered: remove DDPStrategy(ddp_comm_hook=...) or GradientNoiseScale"
            ) from error

    # ------------------------------------------------------------------ per micro-batch
    def _reset_window(self) -> None:
        # Per group: small-batch squared norms; then small-batch count, sum of 1/b over small batches,
        # micro-batch count, sum of 1/b over micro-batches (b in samples).
        self._window = torch.zeros(len(self.group_names) + 4, device=self._device)
        self._local_micro_batches = 0
        self._held.clear()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._micro_batch_size = extract_batch_size(batch)
        if self.per_example:
            self._pending_small = self._per_example_grad_sq(batch)

    @property
    def _in_branch(self) -> bool:
        """A CBS probe's branch runs: its gradients, hooks and steps are not the main run's."""
        return self._accounting is not None and self._accounting.in_branch

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self._in_branch:
            return
        self._held.clear()  # the accumulated gradient restarts from zero

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_branch:
            return
        if self._accounting is not None and self._accounting.step_tokens.active:
            raise LitCBSConfigError(
                "GradientNoiseScale measures each micro-batch's mean loss, but this training_step returns "
                "lit_cbs.token_mean_loss(...), whose micro-batch gradients are sums over tokens until the step "
                "rescales them: remove GradientNoiseScale, or return the micro-batch's mean loss"
            )
        groups = len(self.group_names)
        b = float(self._micro_batch_size)
        window = self._window
        if self.per_example:
            window[:groups] += self._pending_small
            window[groups] += b
            window[groups + 1] += b  # b samples, each a batch of 1
        else:
            if self._hook_grad_sq is not None:  # this backward all-reduced: the hook measured it before
                grad_sq, self._hook_grad_sq = self._hook_grad_sq, None
            else:
                more_follow = should_accumulate(trainer)
                grad_sq = self._micro_batch_grad_sq(((p, p.grad) for p in self._group_of), keep=more_follow)
            # Lightning divided this micro-batch's loss by accumulate_grad_batches.
            window[:groups] += grad_sq * trainer.accumulate_grad_batches**2
            window[groups] += 1.0
            window[groups + 1] += 1.0 / b
        window[groups + 2] += 1.0
        window[groups + 3] += 1.0 / b
        self._local_micro_batches += 1

    def _micro_batch_grad_sq(self, params_and_grads, keep: bool) -> torch.Tensor:
        """Squared norm per group of (accumulated gradient - its copy before this backward); keep: update the copy.

        Fused over the parameters (torch's ``_foreach_*`` kernels): per-parameter kernels cost more than the
        arithmetic on a small model.
        """
        held, fresh = [], []  # (param, grad): with a copy of the gradient before this backward, or the first one
        for param, grad in params_and_grads:
            if grad is not None:
                (held if param in self._held else fresh).append((param, grad))
        held_copies = [self._accumulated[param] for param, _ in held]
        if held:
            foreach_sub_(held_copies, [grad for _, grad in held])  # minus this micro-batch's contribution
        grad_sq = self._group_squared_norms(
            [param for param, _ in held] + [param for param, _ in fresh], held_copies + [grad for _, grad in fresh]
        )
        if keep:
            if held:
                foreach_copy_(held_copies, [grad for _, grad in held])
            for param, grad in fresh:
                copy = self._accumulated.get(param)
                if copy is None:
                    self._accumulated[param] = grad.detach().clone()
                else:
                    copy.copy_(grad)
                self._held.add(param)
        return grad_sq

    def _group_squared_norms(self, params: list, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Per measured group (``group_names``), the sum of the squared norms of ``tensors`` (``tensors[i]`` belongs to
        ``params[i]``), in float32; half-precision tensors are reduced in float32 so their norm is not rounded."""
        grad_sq = torch.zeros(len(self.group_names), device=self._device)
        half = [i for i, tensor in enumerate(tensors) if tensor.dtype in (torch.float16, torch.bfloat16)]
        full = [i for i, tensor in enumerate(tensors) if tensor.dtype not in (torch.float16, torch.bfloat16)]
        for indices, dtype in ((half, {"dtype": torch.float32}), (full, {})):
            if not indices:
                continue
            norms = foreach_norm([tensors[i] for i in indices], 2, **dtype)
            key = tuple(id(params[i]) for i in indices)
            index = self._group_index.get(key)
            if index is None:
                index = torch.tensor([self._group_of[params[i]] for i in indices], device=self._device)
                self._group_index[key] = index
            grad_sq.index_add_(0, index, torch.stack(norms).float().square())
        return grad_sq

    def _comm_hook(self, process_group, bucket):
        """DDP communication hook: measure this rank's last micro-batch in ``bucket``, then all-reduce as DDP would.
        A CBS probe's branch is all-reduced unmeasured.

        Unannotated: DDP compares annotations with ``dist.GradBucket``, and this module's are strings.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self._in_branch:
            return allreduce_hook(process_group, bucket)
        pairs = [(p, g) for p, g in zip(bucket.parameters(), bucket.gradients()) if p in self._group_of]
        grad_sq = self._micro_batch_grad_sq(pairs, keep=False)
        self._hook_grad_sq = grad_sq if self._hook_grad_sq is None else self._hook_grad_sq + grad_sq
        return allreduce_hook(process_group, bucket)

    def _per_example_grad_sq(self, batch: Any) -> torch.Tensor:
        """Sum over the micro-batch's samples of each sample's squared gradient norm, per group."""
        size = self._micro_batch_size
        names = list(self._named_params)
        params = {name: p.detach() for name, p in self._named_params.items()}
        group_index = torch.tensor([self._group_of[self._named_params[n]] for n in names], device=self._device)

        def sample_grad_sq(params, sample):
            grads = torch.func.grad(lambda p: torch.func.functional_call(self._loss_module, p, (sample,), strict=False))(params)
            norms = torch.stack([_squared_norm(grads[n]) for n in names])
            return torch.zeros(len(self.group_names), device=norms.device).index_add(0, group_index, norms)

        def per_sample(leaf):
            return isinstance(leaf, torch.Tensor) and leaf.ndim > 0 and leaf.shape[0] == size

        # vmap over dim 0 of every per-sample tensor, each sample kept as a batch of one.
        samples = tree_map(lambda leaf: leaf.unsqueeze(1) if per_sample(leaf) else leaf, batch)
        in_dims = tree_map(lambda leaf: 0 if per_sample(leaf) else None, batch)
        devices = [self._device.index or 0] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # dropout here must not move the training RNG streams
            per_sample_sq = torch.func.vmap(
                sample_grad_sq, in_dims=(None, in_dims), randomness="different", chunk_size=self.per_example_chunk_size
            )(params, samples)
        return per_sample_sq.sum(0)

    # ------------------------------------------------------------------ per optimizer step
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self._in_branch:
            return
        groups = len(self.group_names)
        window, local_micro_batches = self._window, self._local_micro_batches
        self._reset_window()
        if not self.per_example and self._world_size * local_micro_batches < 2:
            if not self._said_unmeasured:  # one micro-batch on one process: no second batch size this step
                self._said_unmeasured = True
                why = (
                    "the micro-batch is the whole batch: cap BatchWarmup's max_micro_batch_size below it, train on 2+ "
                    "processes, or pass per_example_loss=..."
                    if trainer.accumulate_grad_batches == 1
                    else "an epoch ended inside the step"
                )
                rank_zero_warn(
                    f"GradientNoiseScale: step {trainer.global_step + 1} is one micro-batch on one process, which leaves no "
                    f"smaller batch to compare with, so steps like it are not measured ({why})"
                )
            return
        params = [param for param in self._group_of if param.grad is not None]
        big_grad_sq = self._group_squared_norms(params, [param.grad for param in params])
        # A short last window of an epoch is still divided by accumulate_grad_batches: rescale to the mean.
        big_grad_sq *= (trainer.accumulate_grad_batches / local_micro_batches) ** 2
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and not self.per_example:
            window[:groups] /= scaler.get_scale() ** 2  # micro-batch gradients were read before unscaling
        if self._world_size > 1:
            window = trainer.strategy.reduce(window, reduce_op="sum")
        small_count, small_inv_sum, micro_count, micro_inv_sum = window[groups:]
        small_grad_sq = window[:groups] / small_count
        small_batch_size = small_count / small_inv_sum
        big_batch_size = micro_count**2 / micro_inv_sum
        grad_sq, trace_sigma = two_batch_estimates(small_grad_sq, big_grad_sq, small_batch_size, big_batch_size)
        self.last_measurement = NoiseMeasurement(
            small_grad_sq=small_grad_sq,
            big_grad_sq=big_grad_sq,
            small_batch_size=float(small_batch_size),
            big_batch_size=float(big_batch_size),
            grad_sq=grad_sq,
            trace_sigma=trace_sigma,
        )
        if not bool(torch.isfinite(grad_sq).all() & torch.isfinite(trace_sigma).all()):
            return  # an AMP overflow: the optimizer skips this step, the averages skip it too
        self._ema_grad_sq = self.ema_decay * self._ema_grad_sq + (1 - self.ema_decay) * grad_sq
        self._ema_trace_sigma = self.ema_decay * self._ema_trace_sigma + (1 - self.ema_decay) * trace_sigma
        self.num_updates += 1
        self._stepped = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        # After the optimizer step, so the row is the one Lightning and BatchWarmup write for this step.
        if not self._stepped:
            return
        self._stepped = False
        log_to_loggers(trainer, lambda _: self.metrics())

    def metrics(self) -> dict[str, float]:
        """The logged metrics' current values (empty before the first measured step)."""
        if not self.num_updates:
            return {}
        correction = 1.0 - self.ema_decay**self.num_updates  # bias correction of EMAs started at zero
        grad_sq = self._ema_grad_sq / correction
        trace_sigma = self._ema_trace_sigma / correction
        whole = torch.stack([trace_sigma.sum() / grad_sq.sum(), trace_sigma.sum(), grad_sq.sum()])
        per_group = torch.stack([trace_sigma / grad_sq, trace_sigma, grad_sq], dim=1)
        # One device-to-host copy for all of them, however many groups.
        rows = torch.cat([whole[None], per_group]).tolist()
        metrics = {}
        for group, row in zip(["", *self.group_names], rows):
            if group is not None:  # None: the parameters in no group, logged in the whole model only
                prefix = f"gns/{group}/" if group else "gns/"
                metrics.update({prefix + metric: value for metric, value in zip(("b_simple", "trace_sigma", "grad_sq"), row)})
        return metrics

    @property
    def b_simple(self) -> float | None:
        """The current estimate of B_simple in samples (None before the first measured step)."""
        if not self.num_updates:
            return None
        return float(self._ema_trace_sigma.sum() / self._ema_grad_sq.sum())

    # ------------------------------------------------------------------ checkpointing
    def _check_restored_groups(self) -> None:
        restored = self._restored_group_names
        if restored is not None and restored != self.group_names:
            raise LitCBSConfigError(
                f"the checkpoint's GradientNoiseScale measured the groups {restored} but groups={self.groups!r} "
                f"gives {self.group_names} (None: the parameters in no group); resume with the groups the "
                "checkpoint was written with"
            )

    def state_dict(self) -> dict[str, Any]:
        if self._ema_grad_sq is None:
            return {}
        return {
            "group_names": list(self.group_names),
            "num_updates": self.num_updates,
            "ema_grad_sq": self._ema_grad_sq.detach().cpu(),
            "ema_trace_sigma": self._ema_trace_sigma.detach().cpu(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._restored_group_names = list(state_dict["group_names"])
        if self.group_names:  # loaded after the fit started: check now
            self._check_restored_groups()
        self.num_updates = state_dict["num_updates"]
        self._ema_grad_sq = state_dict["ema_grad_sq"].to(self._device, torch.float32)
        self._ema_trace_sigma = state_dict["ema_trace_sigma"].to(self._device, torch.float32)
