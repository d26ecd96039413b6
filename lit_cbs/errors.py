"""Configuration errors: one exception type, one warning type, and the argument checks every lit_cbs class runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, cast, overload


class LitCBSConfigError(ValueError, TypeError):
    """A setting lit_cbs cannot train with, raised before training; the message names the setting and the fix.
    Both a ValueError and a TypeError, so existing handlers of either catch it.

    Examples:
        >>> positive_int("batch_size", 0, "samples")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: batch_size=0 must be a positive int (samples)
    """


class LitCBSConfigWarning(UserWarning):
    """A setting lit_cbs trains with, but hardly as meant (an LR warmup as long as the run); the message names the
    setting and the fix."""


def is_positive_int(value: Any) -> bool:  # a bool is not an int here
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@overload
def positive_int(name: str, value: Any, unit: str, *, optional: Literal[False] = False) -> int: ...
@overload
def positive_int(name: str, value: Any, unit: str, *, optional: bool) -> int | None: ...
def positive_int(name: str, value: Any, unit: str, *, optional: bool = False) -> int | None:
    """``value`` if it is an int >= 1 (``None`` too when ``optional``); else LitCBSConfigError naming ``name`` and
    ``unit`` (what the number counts)."""
    if value is None and optional:
        return None
    if not is_positive_int(value):
        accepted = "a positive int" + (" or None" if optional else "")
        raise LitCBSConfigError(f"{name}={value!r} must be {accepted} ({unit})")
    return cast(int, value)


@overload
def positive_number(name: str, value: Any, unit: str, *, optional: Literal[False] = False) -> float: ...
@overload
def positive_number(name: str, value: Any, unit: str, *, optional: bool) -> float | None: ...
def positive_number(name: str, value: Any, unit: str, *, optional: bool = False) -> float | None:
    """``value`` as a float if it is a finite number > 0 (``None`` too when ``optional``); else LitCBSConfigError."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        accepted = "a finite number > 0" + (" or None" if optional else "")
        raise LitCBSConfigError(f"{name}={value!r} must be {accepted} ({unit})")
    return float(value)


def one_of(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``; else LitCBSConfigError listing them."""
    if value not in choices:
        raise LitCBSConfigError(f"{name}={value!r} is not supported; use one of {tuple(choices)}")
    return value


def require_automatic_optimization(pl_module: Any, who: str, because: str) -> None:
    """Refuse, before training, a module without automatic optimization, or (when Lightning calls its
    ``configure_optimizers``, wrapped here) with several optimizers; ``who`` (a callback) needs one ``because``."""
    if not pl_module.automatic_optimization:
        raise LitCBSConfigError(
            f"{who} needs automatic optimization ({because}); set `self.automatic_optimization = True` or remove {who}"
        )
    configure = pl_module.configure_optimizers
    if getattr(configure, "lit_cbs_counts_optimizers", False):
        return  # another callback of this fit put the check there
    own = "configure_optimizers" in vars(pl_module)  # assigned to the instance, not the class's method

    def configure_one_optimizer() -> Any:
        import torch

        from lit_cbs._internals import tree_leaves

        if own:
            pl_module.configure_optimizers = configure
        else:
            del pl_module.configure_optimizers
        configured = configure()
        names = {id(o): type(o).__name__ for o in tree_leaves(configured) if isinstance(o, torch.optim.Optimizer)}
        if pl_module.automatic_optimization and len(names) > 1:
            raise LitCBSConfigError(
                f"configure_optimizers returned {len(names)} optimizers ({', '.join(names.values())}), but {who} "
                "trains under Lightning's automatic optimization, which steps one: give every parameter to one "
                "optimizer, a param group per setting (AdamW([{'params': decay, 'weight_decay': 0.1}, {'params': "
                "no_decay, 'weight_decay': 0.0}])), whose groups lit_cbs's rules move alike"
            )
        return configured

    configure_one_optimizer.lit_cbs_counts_optimizers = True  # type: ignore[attr-defined]  # read above
    pl_module.configure_optimizers = configure_one_optimizer
