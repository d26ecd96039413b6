"""Package attributes that import their module on first use (PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str], module_globals: dict) -> tuple[Callable, Callable]:
    """``__getattr__`` and ``__dir__`` for ``package`` that load each name in ``exports`` (name ->
    module) when it is first read, so importing the package imports none of them."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(list(module_globals) + list(exports))

    return __getattr__, __dir__
