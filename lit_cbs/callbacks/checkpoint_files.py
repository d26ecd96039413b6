"""Checkpoints a kill cannot tear: written to ``.<name>.partial``, moved into place once complete on every rank.
A folder (FSDP2's distributed checkpoint) moves in with two renames; ``settle`` finishes or undoes a move a kill
interrupted."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
