"""A LitGPT checkpoint as a probe's ``RunParts``: ``GPT`` in a LightningModule, the run's next tokens, its state."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from litgpt.config import Config
from litgpt.model import GPT
from litgpt.pretrain import get_lr
from litgpt.utils import chunked_cross_entropy, instantiate_torch_optimizer

from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.data.loader import GlobalOrderLoader
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.engine import ProbeConfig
from lit_cbs.probe.from_checkpoint import RunParts
from lit_cbs.probe.from_checkpoint import probe_checkpoint as probe_lightning_checkpoint
from lit_cbs.probe.reading import ProbeReading
from lit_cbs.rules.lr_schedules import TokenLRScheduler

__all__ = ["LitGPTModule", "checkpoint_parts", "probe_checkpoint"]

STATE_KEY = "lit_cbs"  # lit_cbs's state in a LitGPT checkpoint's dict
CHECKPOINT_FILE = "lit_model.pth"


class LitGPTModule(pl.LightningModule):
    """LitGPT's ``GPT`` trained as ``litgpt pretrain`` trains it: rows of ``max_seq_length + 1`` tokens, the loss on
    the next token; LitGPT's optimizer (its name or ``{"class_path": ..., "init_args": ...}``).

    Examples:
        >>> from litgpt.config import Config
        >>> config = Config(block_size=32, vocab_size=256, padded_vocab_size=256, n_layer=1, n_head=2, n_embd=16)
        >>> module = LitGPTModule(config, optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}})
        >>> batch = torch.randint(0, 256, (2, 33))  # a TokenDataModule's or LitGPT's rows: 32 tokens and the next
        >>> module.training_step(batch, 0).item() > 0
        True

        ``Trainer(callbacks=[BatchWarmup(...), CBSProbeCallback(...)]).fit(module, TokenDataModule(path=...))``
        trains it with lit_cbs's callbacks (docs/guides/litgpt.md).
    """

    def __init__(
        self,
        config: Config,
        optimizer: str | dict[str, Any] = "AdamW",
        lr_schedule: Callable[[int], float] | None = None,
        max_seq_length: int | None = None,
    ):
        super().__init__()
        self.gpt = GPT(config)
        if max_seq_length:
            self.gpt.max_seq_length = max_seq_length
        self.optimizer, self.lr_schedule = optimizer, lr_schedule

    def probe_loss(self, batch: torch.Tensor) -> torch.Tensor:
        length = self.gpt.max_seq_length
        inputs, targets = batch[:, :length].long(), batch[:, 1 : length + 1].long()
        loss: torch.Tensor = chunked_cross_entropy(self.gpt(inputs), targets)
        return loss

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.probe_loss(batch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.probe_loss(batch)
        self.log("val/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = instantiate_torch_optimizer(self.optimizer, self.gpt.parameters())
        if self.lr_schedule is None:
            return optimizer
        scheduler = TokenLRScheduler(optimizer, self.lr_schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def litgpt_lr(tokens: int, *, tokens_per_iter: int, warmup_iters: int, max_iters: int, min_lr_ratio: float) -> float:
    """LitGPT's LR multiplier (``get_lr`` of a peak LR of 1) at ``tokens``: its iterations are micro-batches."""
    return float(get_lr(1.0, tokens // tokens_per_iter, warmup_iters, max_iters, min_lr_ratio))


class NextTokens(torch.utils.data.Dataset[torch.Tensor]):
    """The rows a LitGPT run's train loader yields next, read from its saved position as they are asked for; at the
    loader's end it reads on into the next epoch, as ``litgpt pretrain`` does."""

    def __init__(self, loader: Any, rows: int):
        self.loader, self.rows = loader, rows
        self._read: list[torch.Tensor] = []
        self._batches: Iterator[Any] | None = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> torch.Tensor:
        while len(self._read) <= index:
            if self._batches is None:
                self._batches = iter(self.loader)
            batch = next(self._batches, None)
            if batch is None:
                self._batches = None
                continue
            self._read.extend(batch.unbind(0))
        return self._read[index]


class LitGPTData(pl.LightningDataModule):
    """A LitGPT run's data from a checkpoint: its next rows (``GlobalOrderLoader`` in their order), its validation."""

    def __init__(self, train: Any, val: Any, micro_batch_size: int, seq_len: int, rows: int):
        super().__init__()
        self.train, self.val, self.rows = train, val, rows
        self.batch_size, self.tokens_per_sample = micro_batch_size, seq_len

    def train_dataloader(self) -> GlobalOrderLoader:
        return GlobalOrderLoader(NextTokens(self.train, self.rows), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> Any:
        return self.val


class LitGPTState(Callback):
    """Restores a LitGPT checkpoint at the fit's start: the weights, the optimizer, the LR's factor, the counts."""

    def __init__(self, saved: dict[str, Any], samples: int, tokens: int, lr_factor: float):
        self.saved, self.samples, self.tokens, self.lr_factor = saved, samples, tokens, lr_factor

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, LitGPTModule), "the parts checkpoint_parts builds"
        pl_module.gpt.load_state_dict(self.saved["model"])
        (optimizer,) = trainer.optimizers
        optimizer.load_state_dict(self.saved["optimizer"])
        for config in trainer.lr_scheduler_configs:  # the schedule's peak, moved as the run moved it
            config.scheduler.base_lrs = [lr * self.lr_factor for lr in config.scheduler.base_lrs]
        accounting = BatchAccounting.attach(trainer)
        accounting.samples_seen, accounting.tokens_seen = self.samples, self.tokens
        # The reading's step: Lightning counts optimizer steps here (a public attribute chain, no private one).
        progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
        progress.total.completed = progress.total.ready = int(self.saved["step_count"])


def _in_folder(folder: str, build: Callable[[], Any]) -> Any:
    """``build()`` with ``folder`` as the working directory: a run's relative data paths mean what they meant there."""
    here = os.getcwd()
    os.chdir(folder)
    try:
        return build()
    finally:
        os.chdir(here)


def _loaders(hyperparameters: dict[str, Any], micro_batch_size: int, seq_len: int) -> tuple[Any, Any]:
    """The train and validation loaders of the run's LitGPT data module (as ``hyperparameters.yaml`` names it)."""
    from jsonargparse import ArgumentParser
    from litgpt.data import DataModule

    parser = ArgumentParser()
    parser.add_argument("--data", type=DataModule)
    data = parser.instantiate_classes(parser.parse_object({"data": hyperparameters["data"]})).data
    data.connect(None, batch_size=micro_batch_size, max_seq_length=seq_len)
    data.setup()
    return data.train_dataloader(), data.val_dataloader()


def checkpoint_parts(checkpoint: str | os.PathLike[str]) -> RunParts:
    """The parts a probe trains a LitGPT checkpoint's branches with (``lit_model.pth`` of ``python -m lit_cbs.litgpt
    pretrain``, or its folder): ``LitGPTModule`` from its ``model_config.yaml``, the run's optimizer, LR schedule,
    precision and clipping from ``hyperparameters.yaml``, the next tokens from its train loader's saved position.
    The side jobs of such a run build theirs with it."""
    path = Path(checkpoint)
    file = path / CHECKPOINT_FILE if path.is_dir() else path
    if not file.is_file():
        raise LitCBSConfigError(f"checkpoint={str(checkpoint)!r} is not a LitGPT checkpoint ({CHECKPOINT_FILE})")
    saved = torch.load(file, map_location="cpu", weights_only=False)
    if STATE_KEY not in saved:
        raise LitCBSConfigError(
            f"{file} was written by litgpt pretrain alone: it holds no global batch to probe at. Probe checkpoints "
            "of `python -m lit_cbs.litgpt pretrain`"
        )
    run = saved[STATE_KEY]["run"]
    if run["world_size"] != 1:
        raise LitCBSConfigError(
            f"{file} comes from a run on {run['world_size']} devices, whose checkpoint keeps one rank's data position: "
            "a probe reads the run's next tokens from it, so probe runs on one device"
        )
    hyperparameters = yaml.safe_load((file.parent / "hyperparameters.yaml").read_text())
    micro, seq = run["micro_batch_size"], run["seq_len"]
    iters = int(saved["iter_num"])
    rows = max(1, (run["max_iters"] - iters) * micro)  # what the run has left to train, read as it is asked for
    train, val = _in_folder(run["cwd"], functools.partial(_loaders, hyperparameters, micro, seq))
    train.load_state_dict(saved["train_dataloader"])
    schedule = functools.partial(
        litgpt_lr,
        tokens_per_iter=micro * seq,
        warmup_iters=run["warmup_iters"],
        max_iters=run["max_iters"],
        min_lr_ratio=run["min_lr"] / run["lr"],
    )
    model = LitGPTModule(
        Config.from_file(file.parent / "model_config.yaml"), hyperparameters["optimizer"], schedule, seq
    )
    core = saved[STATE_KEY]["core"]
    samples = iters * micro
    return RunParts(
        model,
        LitGPTData(train, val, micro, seq, rows),
        trainer={
            "devices": 1,
            "precision": hyperparameters["precision"],
            "gradient_clip_val": run["max_norm"],
            "accumulate_grad_batches": core["accumulate"],
        },
        callbacks=[BatchAccounting(seq_len=seq), LitGPTState(saved, samples, samples * seq, core["lr_factor"])],
        lightning_checkpoint=False,
    )


def probe_checkpoint(
    checkpoint: str | os.PathLike[str], *, output_dir: str | os.PathLike[str] | None = None, **settings: Any
) -> ProbeReading:
    """The CBS at a LitGPT checkpoint of ``python -m lit_cbs.litgpt pretrain``, measured as its side jobs measure it;
    ``settings``: ``CBSProbeCallback``'s keywords.

    Examples:
        ``probe_checkpoint("out/pretrain/step-00000064", multipliers=[1, 2, 4], window_tokens=16384,
        evaluate="heldout", heldout_batches=8)`` (docs/guides/litgpt.md). Settings are refused before anything loads:

        >>> probe_checkpoint("out/step-00000064", multipliers=[2, 4])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lit_cbs.errors.LitCBSConfigError: multipliers=[2, 4] has no k = 1: ...
    """
    ProbeConfig(**settings)
    parts = checkpoint_parts(checkpoint)
    folder = Path(output_dir) if output_dir is not None else None
    return probe_lightning_checkpoint(Path(checkpoint), parts, output_dir=folder, **settings)
