"""Old names that keep working for one release, each with a ``LitCBSDeprecationWarning`` naming the new one.

- ``moved_modules``: a module path from before 0.3's folder layout (``lit_cbs.warmup``) imports the
  module that replaced it (``lit_cbs.callbacks.warmup``), so ``from lit_cbs.warmup import BatchWarmup``,
  a Hydra ``_target_`` written against the old path and a checkpoint pickled with one still load.
- ``renamed_argument``: a keyword argument under its old name is passed on under its new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Mapping
from typing import Any

REMOVED_IN = "0.4"


class LitCBSDeprecationWarning(DeprecationWarning):
    """A lit_cbs name used under the name it had before; shown once per place (``lit_cbs`` sets the
    filter), as a plain DeprecationWarning from library code would be hidden."""


warnings.filterwarnings("default", category=LitCBSDeprecationWarning)


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{old} is now {new}; the old name goes in lit_cbs {REMOVED_IN}", LitCBSDeprecationWarning, stacklevel=stacklevel
    )


def renamed_argument(kwargs: dict[str, Any], old: str, new: str, owner: str) -> None:
    """Move ``kwargs[old]`` to ``kwargs[new]`` with a warning; both given is an error."""
    if old not in kwargs:
        return
    if new in kwargs:
        raise TypeError(f"{owner}: give {new}= only ({old}= is its old name)")
    warn_renamed(f"{owner}({old}=...)", f"{owner}({new}=...)", stacklevel=4)
    kwargs[new] = kwargs.pop(old)


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as a module holding the new module's names (a copy of its namespace,
    so the new module's own ``__spec__`` and ``__name__`` stay what they are)."""

    def __init__(self, moved: Mapping[str, str]):
        self.moved = dict(moved)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.moved:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        new = self.moved[module.__name__]
        warn_renamed(f"the module {module.__name__}", new, stacklevel=3)  # importlib's own frames are not counted
        target = importlib.import_module(new)
        module.__dict__.update({name: value for name, value in vars(target).items() if not name.startswith("__")})
        module.__doc__ = f"Moved to {new}."


def moved_modules(moved: Mapping[str, str]) -> None:
    """Let each old module path in ``moved`` (old -> new) import, with a warning, until ``REMOVED_IN``."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder(moved))
