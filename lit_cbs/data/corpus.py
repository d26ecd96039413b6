"""The embedded default corpus: the standard library's own ``.py`` files (674 files, 11.35 MB with Python 3.11),
without test suites, IDLE, installed packages or bytecode caches. It ships with every interpreter: no download."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

__all__ = ["stdlib_python_files"]

SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "idle_test", "site-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The standard library's folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_python_files() -> list[Path]:
    """The corpus files, sorted by path so the token stream is the same on every run."""
    files: list[Path] = []
    for directory, subdirs, names in os.walk(stdlib_root()):
        subdirs[:] = [name for name in subdirs if name not in SKIPPED_DIRS]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files)
