"""``FinalStateCheckpoint``: Lightning's ModelCheckpoint for runs that stop at any time and resume exactly, from
checkpoints a kill cannot tear (written to ``.<name>.partial``, moved into place once complete on every rank)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import threading
import warnings
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_cbs._internals import should_accumulate
from lit_cbs.callbacks.accounting import mean_over_ranks, trainer_callbacks

__all__ = ["FinalStateCheckpoint"]


class FinalStateCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (same arguments) whose checkpoints resume exactly, however the run stops.

    ``last.ckpt`` (``save_last=True``) is written again when training ends, right after the last step. SIGTERM and
    SLURM's requeue signal wait for the next optimizer-step boundary, where every rank hands them to Lightning at
    once. While a CBS probe window is open, ``last.ckpt`` holds its start and periodic checkpoints inside it are
    skipped, so a resumed run redoes the probe. ``enable_version_counter`` defaults to False: a requeued job
    overwrites its ``last.ckpt``.

    Examples:
        >>> import tempfile
        >>> from lit_cbs.callbacks import FinalStateCheckpoint
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     checkpoint = FinalStateCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=500)
        >>> checkpoint.save_last, checkpoint.CHECKPOINT_NAME_LAST + checkpoint.FILE_EXTENSION
        (True, 'last.ckpt')
    """

    def __init__(self, *args: Any, enable_version_counter: bool = False, **kwargs: Any):
        kwargs["enable_version_counter"] = enable_version_counter  # a keyword: *args cannot reach it
        super().__init__(*args, **kwargs)
        self._lightning_handlers: dict[int, Any] = {}  # signal -> Lightning's handler, called at a step boundary
        self._skipped_in_window: int | None = None  # the window whose skipped periodic checkpoint was said
        self.stop_signal: int | None = None  # a stop signal waiting for the next optimizer-step boundary
        self.probe_window_step: int | None = None  # where the open CBS probe window began (``set_probe_window``)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Every checkpoint the Trainer writes appears only once complete (below).
        super().setup(trainer, pl_module, stage)
        atomic_saves(trainer.strategy)

    # ------------------------------------------------------------------ signals
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.stop_signal = None
        if self.probe_window_step == trainer.global_step and self.save_last:
            # A resumed run whose probe window opens at its first step: the checkpoint resumed is its start.
            assert trainer.ckpt_path is not None  # the window's start was restored from the checkpoint resumed
            source, target = Path(trainer.ckpt_path), self._last_path()
            if trainer.is_global_zero and source.resolve() != target.resolve():
                copy_checkpoint(source, target)
            trainer.strategy.barrier("FinalStateCheckpoint.resumed")
            self._last_global_step_saved, self.last_model_path = trainer.global_step, str(target)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; Lightning's stay
        signals = [signal.SIGTERM]
        environment = trainer._accelerator_connector.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            assert environment.requeue_signal is not None  # SLURMEnvironment sets SIGUSR1 when auto_requeue
            signals.append(environment.requeue_signal)
        for signum in signals:
            self._lightning_handlers[signum] = signal.getsignal(signum)

            def record(received: int, frame: Any) -> None:
                # SIGTERM wins over the requeue signal: the run stops either way.
                if self.stop_signal != signal.SIGTERM:
                    self.stop_signal = received

            signal.signal(signum, record)

    def _deliver_stop_signal(self, trainer: pl.Trainer) -> None:
        """At a step boundary: if a stop signal arrived on any rank, hand it to Lightning on every rank."""
        if not self._lightning_handlers:
            return
        pending = [float(self.stop_signal == signum) for signum in self._lightning_handlers]
        if trainer.world_size > 1:
            pending = mean_over_ranks(trainer, pending)
        arrived = [signum for signum, flag in zip(self._lightning_handlers, pending) if flag > 0]
        if not arrived:
            return
        signum = arrived[0]  # SIGTERM first
        self.stop_signal = signum
        self._restore_lightning_handlers()
        window, inside = self.probe_window_step, ""
        if window is not None:
            retrained = trainer.global_step - window
            inside = f", inside the CBS probe whose window began at step {window}" + (
                f": last.ckpt holds step {window}, so a resumed run redoes the probe there ({retrained} main-run "
                f"step{'s are' if retrained != 1 else ' is'} retrained)"
                if self.save_last
                else ""
            )
        rank_zero_info(f"{signal.Signals(signum).name}: stopping after step {trainer.global_step}{inside}")
        handler = signal.getsignal(signum)
        if callable(handler):
            handler(signum, None)
        if signum != signal.SIGTERM:  # the requeue signal: Lightning saved the hpc checkpoint and requeued
            if window is not None and self.save_last and Path(self.last_model_path or "").exists():
                # The checkpoint Lightning saved at the requeue signal holds the open probe's start instead.
                hpc_path = trainer._checkpoint_connector._hpc_resume_path
                if hpc_path is not None and trainer.is_global_zero:
                    copy_checkpoint(Path(self.last_model_path), Path(hpc_path))
                    rank_zero_info(f"{Path(hpc_path).name} holds step {window}, where the CBS probe began")
                trainer.strategy.barrier("FinalStateCheckpoint.hpc")
            trainer.should_stop = True

    def _restore_lightning_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._lightning_handlers.items():
            signal.signal(signum, handler)
        self._lightning_handlers = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's, saying in one line that a run resumed into another folder saves there (not its warning)."""
        before = state_dict.get("dirpath", self.dirpath)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The dirpath has changed")
            super().load_state_dict(state_dict)
        if before != self.dirpath:
            rank_zero_info(
                f"FinalStateCheckpoint: resumed from a run that saved to {before}; this run saves to {self.dirpath}"
            )

    # ------------------------------------------------------------------ saving
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if should_accumulate(trainer):
            return
        window, every = self.probe_window_step, self._every_n_train_steps
        if window is None or window == trainer.global_step:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        elif every >= 1 and trainer.global_step % every == 0 and self._skipped_in_window != window:
            self._skipped_in_window = window
            rank_zero_info(
                f"FinalStateCheckpoint: no checkpoint at step {trainer.global_step}, inside the CBS probe window that "
                f"began at step {window} (last.ckpt holds that step): the probe's reading needs the state of its start"
            )
        if window == trainer.global_step and self.save_last and self._last_global_step_saved != window:
            self._save_last_now(trainer)
            rank_zero_info(
                f"FinalStateCheckpoint: last.ckpt holds step {window}, where a CBS probe window begins: a run stopped "
                "inside the probe resumes from there and redoes it"
            )
        self._deliver_stop_signal(trainer)
        if trainer.should_stop or trainer.received_sigterm or 0 <= trainer.max_steps <= trainer.global_step:
            # The run ends after this step: save it here, as the periodic checkpoints are saved, while
            # Lightning still counts the epoch unfinished (after the epoch's last step it would count the
            # epoch done but not start the next one's count of micro-batches, and a resumed run would skip it).
            self._save_final_state(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.training and not should_accumulate(trainer):
            self._deliver_stop_signal(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_lightning_handlers()
        self._save_final_state(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self._restore_lightning_handlers()
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.training and should_accumulate(trainer):
            rank_zero_warn(
                f"SIGTERM inside an accumulation window after step {trainer.global_step}: not checkpointed (resuming "
                f"there would lose the window's gradients); last.ckpt holds step {self._last_global_step_saved}"
            )
        elif trainer.training:  # not at the end of a validation inside the fit, which Lightning ends by raising it too
            self._save_final_state(trainer)
        # Lightning's SIGTERMException (a bare SystemExit) gets one line, the step the run stopped after and the
        # checkpoint that resumes it, which Python prints on its way out, and exit status 1 (not a scheduler's done).
        stopped, saved = (
            f"SIGTERM: training stopped after optimizer step {trainer.global_step}",
            self._last_global_step_saved,
        )
        if not self.save_last or not self.last_model_path or not Path(self.last_model_path).exists():
            message = (
                f"{stopped}; no last.ckpt (FinalStateCheckpoint(save_last=True) writes one at the stop): "
                f"resume from the newest checkpoint in {self.dirpath} "
                "with trainer.fit(model, datamodule, ckpt_path=<it>), if any"
            )
        else:
            where = "it" if saved == trainer.global_step else f"step {saved}"
            window = self.probe_window_step
            if window is not None and saved == window != trainer.global_step:
                where += ", where the CBS probe in progress began (a resumed run redoes it)"
            message = (
                f"{stopped}; {self.last_model_path} holds {where}: resume with "
                f"trainer.fit(model, datamodule, ckpt_path={self.last_model_path!r})"
            )
        exception.args, exception.code = (message,), message

    def _save_final_state(self, trainer: pl.Trainer) -> None:
        if not self.save_last or trainer.global_step == 0 or self._last_global_step_saved == trainer.global_step:
            return
        if self.probe_window_step is not None and self.stop_signal is not None:
            return  # stopped inside a probe: last.ckpt keeps the window's start (said where the stop was delivered)
        self._save_last_now(trainer)

    def _last_path(self) -> Path:
        """Where ``last.ckpt`` goes, in ``dirpath`` (which ``ModelCheckpoint.setup`` resolves)."""
        assert self.dirpath is not None  # set by setup
        return Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"

    def _save_last_now(self, trainer: pl.Trainer) -> None:
        path = str(self._last_path())
        trainer.save_checkpoint(path, weights_only=self.save_weights_only)
        self._last_global_step_saved = trainer.global_step
        self.last_model_path = path


def _final_state_checkpoints(trainer: pl.Trainer) -> list[FinalStateCheckpoint]:
    return [callback for callback in trainer_callbacks(trainer) if isinstance(callback, FinalStateCheckpoint)]


def stop_signal(trainer: pl.Trainer) -> int | None:
    """The stop signal a ``FinalStateCheckpoint`` holds for the next optimizer-step boundary, or None."""
    return next((cb.stop_signal for cb in _final_state_checkpoints(trainer) if cb.stop_signal is not None), None)


def set_probe_window(trainer: pl.Trainer, step: int | None) -> None:
    """A CBS probe window began at optimizer ``step`` (None: it closed): a checkpoint inside it could not redo
    the probe, so ``FinalStateCheckpoint`` keeps the window's start."""
    for callback in _final_state_checkpoints(trainer):
        callback.probe_window_step = step


PARTIAL = ".partial"  # suffix of a checkpoint being written: .<name>.partial
REPLACED = ".replaced"  # suffix of the checkpoint a completed write is replacing: .<name>.replaced
DCP_METADATA = ".metadata"  # written by torch.distributed.checkpoint once every shard is written
LIGHTNING_METADATA = "meta.pt"  # Lightning's non-tensor state beside a distributed checkpoint


def partial_path(target: Path) -> Path:
    """Where a checkpoint bound for ``target`` is written until complete."""
    return target.with_name(f".{target.name}{PARTIAL}")


def replaced_path(target: Path) -> Path:
    """Where the checkpoint ``target`` held waits while a new one is moved in."""
    return target.with_name(f".{target.name}{REPLACED}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _sync_folder(folder: Path) -> None:
    """Make the renames in ``folder`` durable (a power cut after it keeps them), where the platform can."""
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def replace(partial: Path, target: Path) -> None:
    """Move the complete checkpoint ``partial`` to ``target``: one ``os.replace`` for a file over a file, else the
    old one aside to ``.<name>.replaced`` first (``settle`` completes this after a kill between the steps)."""
    aside = replaced_path(target)
    _remove(aside)  # left by a replacement a kill interrupted, its checkpoint since superseded
    if target.exists() and not (target.is_file() and partial.is_file()):
        os.replace(target, aside)
        _sync_folder(target.parent)
        os.replace(partial, target)
        _sync_folder(target.parent)
        _remove(aside)
    else:
        os.replace(partial, target)
        _sync_folder(target.parent)


def settle(folder: Path) -> None:
    """Finish or undo the checkpoint moves a kill interrupted in ``folder``; the processes of a job that start
    together take turns (a lock on the folder)."""
    if not folder.is_dir():
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        for aside in sorted(folder.glob(f".*{REPLACED}")):
            target = folder / aside.name[1 : -len(REPLACED)]
            if not target.exists():  # the new one if it was complete, else the old one
                os.replace(partial if (partial := partial_path(target)).exists() else aside, target)
            _remove(aside)
        for partial in sorted(folder.glob(f".*{PARTIAL}")):
            _remove(partial)  # no replacement under way: a write that did not finish
        _sync_folder(folder)
    finally:
        os.close(descriptor)  # releases the lock


def copy_checkpoint(source: Path, target: Path) -> None:
    """Copy a checkpoint file, or a distributed checkpoint's folder, to ``target`` atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove(partial := partial_path(target))
    (shutil.copytree if source.is_dir() else shutil.copyfile)(source, partial)
    replace(partial, target)


def unreadable(path: Path) -> str | None:
    """What makes the checkpoint at ``path`` incomplete, in words, or None if it is complete."""
    if not path.exists():
        return "it does not exist"
    if path.is_file():
        return None if _whole_archive(path) else "it is not a whole torch.save archive (cut short while written?)"
    if not (path / DCP_METADATA).is_file():
        return f"its folder has no {DCP_METADATA} (the distributed checkpoint was not finished)"
    if not _whole_archive(path / LIGHTNING_METADATA):
        return f"its folder has no whole {LIGHTNING_METADATA} (the distributed checkpoint was not finished)"
    missing = _missing_shard_bytes(path)
    return f"its shard {missing} is missing or short" if missing is not None else None


def _whole_archive(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _missing_shard_bytes(folder: Path) -> str | None:
    """The first shard the metadata lists that is missing or short, or None."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unreadable metadata makes the checkpoint incomplete
        return f"{DCP_METADATA} ({type(error).__name__})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = str(getattr(info, "relative_path", ""))
        ends[relative] = max(ends.get(relative, 0), int(info.offset) + int(info.length))
    for relative, end in sorted(ends.items()):
        shard = folder / relative
        if not shard.is_file() or shard.stat().st_size < end:
            return relative
    return None


def checkpoint_candidates(folders: Iterable[Path]) -> list[Path]:
    """The checkpoints in ``folders`` (``*.ckpt`` files and folders, not those being written), settled first."""
    found: list[Path] = []
    for folder in folders:
        settle(folder)
        if folder.is_dir():
            found.extend(path for path in folder.glob("*.ckpt") if not path.name.startswith("."))
    return found


def newest_complete(folders: Iterable[Path]) -> Path | None:
    """The complete checkpoint written last in ``folders`` (by modification time), or None."""
    complete = [path for path in checkpoint_candidates(folders) if unreadable(path) is None]
    return max(complete, key=lambda path: path.stat().st_mtime_ns, default=None)


def atomic_saves(strategy: Any) -> None:
    """Make every checkpoint ``strategy`` saves to a local path appear only once complete on every rank;
    idempotent. Remote paths (``s3://``) are written as before (their objects appear whole)."""
    save = strategy.save_checkpoint
    if getattr(save, "writes_atomically", False):
        return

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if "://" in str(filepath):
            save(checkpoint, filepath, storage_options=storage_options)
            return
        target = Path(strategy.broadcast(str(filepath)))
        partial = partial_path(target)
        if strategy.is_global_zero:
            target.parent.mkdir(parents=True, exist_ok=True)
            _remove(partial)  # a write a kill interrupted
        strategy.barrier("lit_cbs.atomic_saves.before")
        save(checkpoint, partial, storage_options=storage_options)
        strategy.barrier("lit_cbs.atomic_saves.written")
        if strategy.is_global_zero:
            replace(partial, target)
        strategy.barrier("lit_cbs.atomic_saves.moved")

    save_checkpoint.writes_atomically = True  # type: ignore[attr-defined]
    strategy.save_checkpoint = save_checkpoint
