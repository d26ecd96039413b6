"""``BatchAccounting``: the batch's three factors and the samples and tokens a Trainer's run has trained on."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import DataLoader

from lit_cbs._internals import given_train_loader, should_accumulate, tree_leaves
from lit_cbs.callbacks.module_state import side_effects_undone
from lit_cbs.callbacks.step_hooks import GradientSync, StepTokens
from lit_cbs.data.loader import GlobalOrderLoader
from lit_cbs.errors import LitCBSConfigError, is_positive_int, positive_int
from lit_cbs.rules.lr_schedules import TokenLRScheduler

__all__ = ["BatchAccounting"]


def trainer_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """The Trainer's callbacks, in the order Lightning calls them."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared
    return callbacks


def mean_over_ranks(trainer: pl.Trainer, values: list[float]) -> list[float]:
    """``values`` averaged over all ranks, so a decision taken from them is the same on every rank."""
    tensor = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
    if trainer.world_size > 1:
        tensor = trainer.strategy.reduce(tensor, reduce_op="mean")
    return tensor.tolist()


def _infer_seq_len(batch: Any) -> int | None:
    """The tokens per sample: the width of the batch's first 2-D integer tensor ([samples, tokens]; a float
    [batch, features] tensor has no tokens), said; a warning at a width of T + 1 (T a power of two: inputs and
    targets). None for a batch without one."""
    leaves = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.ndim == 2]
    ids = next((x for x in leaves if not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)), None)
    if ids is None:
        return None
    width, inputs = ids.shape[1], ids.shape[1] - 1
    dtype = str(ids.dtype).removeprefix("torch.")
    found = f"the width of the batch's first 2-D integer tensor ({dtype} {list(ids.shape)})"
    if inputs >= 8 and inputs & (inputs - 1) == 0:
        rank_zero_warn(
            f"BatchAccounting counts {width} tokens per sample, {found}; if it holds inputs and targets shifted by one "
            f"({inputs} + 1), each sample trains on {inputs} and every token count is {width}/{inputs} too large: give "
            f"seq_len={inputs} (to BatchAccounting or BatchWarmup) or the datamodule a `tokens_per_sample` attribute"
        )
    else:
        rank_zero_info(
            f"BatchAccounting: {width} tokens per sample, {found}; give seq_len=... (to BatchAccounting or "
            "BatchWarmup) if a sample trains on fewer"
        )
    return width


def resizable_train_loader(trainer: pl.Trainer) -> GlobalOrderLoader | None:
    """The fit's train loader if it is a ``GlobalOrderLoader`` (resizable between steps), else None."""
    loader = trainer.train_dataloader
    return loader if isinstance(loader, GlobalOrderLoader) else None


def loss_of(output: Any, hook: str = "training_step") -> torch.Tensor:
    """The loss tensor of a step's output (a tensor or a dict with "loss")."""
    loss = output["loss"] if isinstance(output, dict) and "loss" in output else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{hook} must return a loss tensor or a dict with 'loss', got {output!r}")
    return loss


def micro_batch_loss(trainer: pl.Trainer, outputs: Any) -> torch.Tensor | None:
    """The detached mean loss of the micro-batch ``on_train_batch_end`` was handed, or None."""
    if outputs is None:
        return None
    return loss_of(outputs).detach() * trainer.accumulate_grad_batches


def micro_batch_owner(trainer: pl.Trainer, pl_module: pl.LightningModule, required: bool = True) -> Any:
    """What holds the micro-batch size as ``batch_size``: the datamodule, the module, its hparams or a loader given
    to ``trainer.fit``; None (or, if ``required``, LitCBSConfigError) if none does."""
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and hasattr(datamodule, "batch_size"):
        return datamodule
    if hasattr(pl_module, "batch_size"):
        return pl_module
    if "batch_size" in getattr(pl_module, "hparams", {}):
        return pl_module.hparams  # an AttributeDict: its items are attributes too
    loader = given_train_loader(trainer)
    if isinstance(getattr(loader, "batch_size", None), int):
        return loader
    if required:
        raise LitCBSConfigError(
            "BatchWarmup needs the micro-batch size: give the datamodule (or the LightningModule) a "
            "`batch_size` attribute that its train_dataloader uses, or pass a loader with a batch_size "
            "(trainer.fit(train_dataloaders=...))"
        )
    return None


_UNITS = {"seq_len": "tokens per sample", "max_tokens": "tokens"}  # of the settings a callback may take on its behalf


class BatchAccounting(Callback):
    """The batch sizes and the samples and tokens trained on (all ranks), which every lit_cbs callback reads.
    ``attach(trainer)`` finds the Trainer's or attaches one, so add it only to give ``seq_len`` or ``max_tokens``
    without a ``BatchWarmup``, the only callback that changes the batch.

    Besides the counts it stops the run at ``max_tokens`` and feeds ``TokenLRScheduler``s the tokens. Right after
    itself it places the two callbacks whose hooks every run needs before the others': ``GradientSync`` (FSDP2)
    and ``step_tokens`` (the gradient rescale of ``lit_cbs.token_mean_loss``).

    Args:
        seq_len: tokens per sample. Default: the datamodule's ``tokens_per_sample`` or ``seq_len``, else the width
            of the first batch's token ids (its first 2-D integer tensor); data without token ids has no tokens.
        max_tokens: stop after the optimizer step that reaches this many tokens (all ranks).

    Examples:
        >>> from lit_cbs.callbacks import BatchAccounting
        >>> accounting = BatchAccounting(seq_len=128, max_tokens=1_000_000)
        >>> accounting.global_batch, accounting.accumulate, accounting.budget_reached
        (None, 1, False)
        >>> with accounting.branching():  # a CBS probe's work: what measures the main run ignores it
        ...     accounting.in_branch
        True
    """

    def __init__(self, seq_len: int | None = None, max_tokens: int | None = None):
        self.seq_len = positive_int("seq_len", seq_len, _UNITS["seq_len"], optional=True)
        self.max_tokens = positive_int("max_tokens", max_tokens, _UNITS["max_tokens"], optional=True)
        self.samples_seen = self.tokens_seen = 0
        self.trainer: pl.Trainer | None = None  # whose fit this counts, from its setup on
        self.micro_batch_size: int | None = None  # samples per micro-batch and rank (None: not known yet)
        self._micro_batch_set = False  # a BatchWarmup sets it: the loader must then yield exactly that
        self._check_next_batch = True  # the next batch is the first of an epoch, or the first after a change
        self._sync_at_next_batch = False  # the first batch of a resumed run reads the loader's epoch length again
        self._seq_len_resolved = False
        self._token_schedulers: list[TokenLRScheduler] = []
        self.gradient_sync = GradientSync()
        self.in_branch = False
        self.branch_seconds = 0.0
        self._fit_start: float | None = None
        self._seconds_before_fit = 0.0  # fit_seconds of the checkpoint resumed from
        self.tokens_at_fit_start = self.samples_at_fit_start = 0
        self.checkpoint_data_parallel_size: int | None = None
        self.step_tokens = StepTokens(self)

    @classmethod
    def attach(cls, trainer: pl.Trainer, given_by: str | None = None, **settings: int | None) -> BatchAccounting:
        """The Trainer's accounting, attached first among its callbacks if it has none, with the ``settings`` a
        callback named ``given_by`` took on its behalf (LitCBSConfigError if it already has others)."""
        callbacks = trainer_callbacks(trainer)
        found = [callback for callback in callbacks if isinstance(callback, cls)]
        if len(found) > 1:
            raise LitCBSConfigError("the Trainer has more than one BatchAccounting callback; keep one")
        accounting = found[0] if found else cls()
        if callbacks[:1] != [accounting]:  # (a CBS probe's branch hides all other callbacks)
            accounting._lead(trainer)
        if accounting.trainer is not trainer and trainer.lightning_module is not None:
            accounting.setup(trainer, trainer.lightning_module, "fit")
        for name, value in settings.items():
            if positive_int(name, value, _UNITS[name], optional=True) is None:
                continue
            if getattr(accounting, name) not in (None, value):
                raise LitCBSConfigError(
                    f"{given_by}({name}={value}) conflicts with BatchAccounting({name}={getattr(accounting, name)}); "
                    "give it to one of them"
                )
            setattr(accounting, name, value)
        return accounting

    @property
    def accumulate(self) -> int:
        """Micro-batches per optimizer step (the Trainer's ``accumulate_grad_batches``; 1 before setup)."""
        return self.trainer.accumulate_grad_batches if self.trainer is not None else 1

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read their own micro-batches (tensor-parallel ranks share one; 1 before setup)."""
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        return int(kwargs["num_replicas"]) if kwargs else 1

    @property
    def global_batch(self) -> int | None:
        """Samples per optimizer step, all ranks (None while the micro-batch is unknown)."""
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.accumulate * self.data_parallel_size

    @property
    def fit_seconds(self) -> float:
        """Wall seconds of training since this fit began (validation, probes included), plus a checkpoint's."""
        return self._seconds_before_fit + (time.perf_counter() - self._fit_start if self._fit_start else 0.0)

    @property
    def budget_reached(self) -> bool:
        """True once ``max_tokens`` were trained on."""
        return self.max_tokens is not None and self.tokens_seen >= self.max_tokens

    @contextlib.contextmanager
    def branching(self) -> Iterator[None]:
        """Mark the work inside as a CBS probe's (``in_branch``), its wall seconds added to ``branch_seconds``."""
        if self.in_branch:
            yield
            return
        # Queued accelerator work belongs to whichever side launched it: wait for it at both ends.
        device = self.trainer.strategy.root_device if self.trainer is not None else None
        if cuda := device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        self.in_branch = True
        main_step_tokens, self.step_tokens.count = self.step_tokens.count, None  # branches count their own steps'
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(device)
            self.in_branch = False
            self.step_tokens.count = main_step_tokens
            self.branch_seconds += time.perf_counter() - start

    def set_micro_batch_size(self, value: int) -> None:
        """Set the micro-batch (samples per rank) the train loader yields from the next micro-batch on."""
        trainer = self.trainer
        assert trainer is not None  # BatchWarmup sets it from its setup on, after this one's
        owner = micro_batch_owner(trainer, trainer.lightning_module)
        if not isinstance(owner, DataLoader):
            owner.batch_size = value
        elif value != owner.batch_size:  # given to trainer.fit: its batch_size is fixed when it is built
            raise LitCBSConfigError(
                f"BatchWarmup needs micro-batch {value}, but the train loader given to "
                f"trainer.fit(train_dataloaders=...) was built with batch_size={owner.batch_size}, "
                "which a DataLoader cannot change: pass a "
                "lit_cbs.GlobalOrderLoader (resized between steps), or a datamodule whose `batch_size` its "
                "train_dataloader reads, or set BatchWarmup(max_micro_batch_size=None) to grow by accumulation"
            )
        self.micro_batch_size = value
        self._micro_batch_set = True
        self._check_next_batch = True
        self._sync_loader(trainer)

    def _sync_loader(self, trainer: pl.Trainer) -> None:
        """Resize a ``GlobalOrderLoader`` to the micro-batch set, and tell the fit loop (which reads an epoch's
        length once, into three places) its micro-batches: those yielded, and those left at this size."""
        loader = resizable_train_loader(trainer)
        if loader is None:
            return
        if self._micro_batch_set:
            assert self.micro_batch_size is not None  # set with _micro_batch_set, by set_micro_batch_size
            loader.batch_size = self.micro_batch_size
        fit_loop, micro_batches = trainer.fit_loop, len(loader)
        fit_loop.max_batches = micro_batches
        combined_loader, fetcher = fit_loop._combined_loader, fit_loop._data_fetcher
        if combined_loader is not None and combined_loader.limits is not None:
            combined_loader.limits[:] = [micro_batches] * len(combined_loader.limits)  # the running iterator's list
        if fetcher is not None and fetcher.length is not None:
            fetcher.length = micro_batches
            if fetcher.fetched >= micro_batches > 0:  # the micro-batch just fetched is the epoch's last after all
                fetcher.done = fit_loop.epoch_loop.batch_progress.is_last_batch = True

    def _lead(self, trainer: pl.Trainer) -> None:
        """Put this accounting first among the Trainer's callbacks, its two companions right after it."""
        first = [self, self.gradient_sync, self.step_tokens]
        callbacks = trainer_callbacks(trainer)
        if callbacks[:3] != first:
            # A new list, not an insertion: Lightning may be iterating the old one (in setup).
            rest = [callback for callback in callbacks if all(callback is not mine for mine in first)]
            trainer.callbacks = first + rest  # type: ignore[attr-defined]  # see trainer_callbacks

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.trainer is trainer:
            return
        self.trainer = trainer
        self._lead(trainer)
        owner = micro_batch_owner(trainer, pl_module, required=False)
        if owner is not None and not self._micro_batch_set and is_positive_int(owner.batch_size):
            self.micro_batch_size = owner.batch_size

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.branch_seconds = 0.0
        self._fit_start = time.perf_counter()
        self.tokens_at_fit_start, self.samples_at_fit_start = self.tokens_seen, self.samples_seen
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self._token_schedulers = [scheduler for scheduler in schedulers if isinstance(scheduler, TokenLRScheduler)]
        datamodule = getattr(trainer, "datamodule", None)
        if self.seq_len is None:  # the datamodule's tokens_per_sample, else its seq_len
            found = (getattr(datamodule, name, None) for name in ("tokens_per_sample", "seq_len"))
            self.seq_len = next((value for value in found if is_positive_int(value)), None)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A resumed run: Lightning counted the epoch's micro-batches before the loader's position was restored.
        self._sync_loader(trainer)
        self._sync_at_next_batch = True
        loader = resizable_train_loader(trainer)
        if loader is not None and loader.deals_unevenly:
            self._check_zero_sample_batch(trainer, pl_module, loader)
        if self.budget_reached:
            trainer.should_stop = True  # resumed from a run's final state: no step is left to train

    def _check_zero_sample_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loader: GlobalOrderLoader
    ) -> None:
        """Try ``training_step`` once, side effects undone, on a zero-sample batch (an epoch's last on some rank):
        a loss that is not finite there would reach every rank's gradient through the all-reduce."""
        world = self.data_parallel_size
        batch = trainer.strategy.batch_to_device(loader.empty_batch())
        step_tokens = self.step_tokens.count
        try:
            with torch.no_grad(), side_effects_undone(pl_module), trainer.precision_plugin.train_step_context():
                loss = loss_of(pl_module.training_step(batch, 0)).detach()
            outcome = None if bool(torch.isfinite(loss).all()) else f"the loss {loss.item()}"
        except Exception as error:  # whatever it raises, the run would raise at an epoch's end, hours in
            outcome = f"{type(error).__name__}: {error}"
        finally:
            self.step_tokens.count = step_tokens
        if outcome is not None:
            raise LitCBSConfigError(
                f"the train loader's {loader.num_samples} samples do not divide over {world} data-parallel ranks, so "
                f"an epoch's last micro-batch can hold no sample on some rank, which still runs the step's forward and "
                f"backward; training_step on such a zero-sample batch gives {outcome}: make it return a finite loss "
                "there (lit_cbs.token_mean_loss(self, loss_sum, tokens) does: a sum over no tokens), or give the "
                f"dataset a multiple of {world} samples"
            )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_next_batch = True  # the loader may have been (re)built for this epoch
        self._sync_loader(trainer)  # Lightning counted this epoch's micro-batches at the size of the first

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._sync_at_next_batch:
            self._sync_at_next_batch = False
            self._sync_loader(trainer)
        micro = extract_batch_size(batch)
        loader = resizable_train_loader(trainer)
        if self._check_next_batch:
            self._check_next_batch = False
            self._check_micro_batch(trainer, micro, loader)
        if not self._seq_len_resolved:
            self._seq_len_resolved = True
            if self.seq_len is None:
                self.seq_len = _infer_seq_len(batch)
            if self.seq_len is None and self.max_tokens is not None:
                raise LitCBSConfigError(
                    f"max_tokens={self.max_tokens} but the batches hold no token ids (no 2-D integer tensor), so "
                    "tokens cannot be counted: stop by max_steps or max_epochs, or give seq_len=... (or the "
                    "datamodule a `tokens_per_sample` attribute) if it is token data"
                )
        # A GlobalOrderLoader's last round of an epoch deals fewer samples, unevenly over the ranks: it says how many.
        samples = loader.last_round_samples if loader is not None else micro * self.data_parallel_size
        assert samples is not None  # the loader has just yielded this batch: it says its round's samples
        self.samples_seen += samples
        self.tokens_seen += samples * (self.seq_len or 0)
        for scheduler in self._token_schedulers:
            scheduler.tokens_seen = self.tokens_seen

    def _check_micro_batch(self, trainer: pl.Trainer, micro: int, loader: GlobalOrderLoader | None) -> None:
        """The first batch of an epoch, and after a change, must hold the micro-batch set: else every count is wrong."""
        if not self._micro_batch_set:
            # Nobody sets it: the loader says what it is, else its batches do.
            self.micro_batch_size = loader.batch_size if loader is not None else micro
            return
        if micro == (loader.last_samples if loader is not None else self.micro_batch_size):
            return
        assert self.micro_batch_size is not None  # set with _micro_batch_set, by set_micro_batch_size
        if micro < self.micro_batch_size and trainer.num_training_batches == 1:
            return  # an epoch shorter than one micro-batch (drop_last=False)
        where = "the datamodule's" if getattr(trainer, "datamodule", None) is not None else "the LightningModule's"
        raise LitCBSConfigError(
            f"BatchWarmup counts micro-batches of batch_size={self.micro_batch_size} samples, but the train "
            f"loader's batch holds {micro}: build train_dataloader() with DataLoader(..., batch_size=self.batch_size) "
            f"from {where} `batch_size`, read when the loader is created (or lit_cbs.GlobalOrderLoader, which "
            "BatchWarmup resizes between optimizer steps)"
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.budget_reached and not should_accumulate(trainer):
            trainer.should_stop = True

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "seq_len": self.seq_len,
            "data_parallel_size": self.data_parallel_size,
            "fit_seconds": self.fit_seconds,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples_seen = state_dict["samples_seen"]
        self.tokens_seen = state_dict["tokens_seen"]
        self.seq_len = self.seq_len or state_dict["seq_len"]
        self.checkpoint_data_parallel_size = state_dict["data_parallel_size"]
        self._seconds_before_fit = state_dict["fit_seconds"]
