"""Configuration errors: one exception type, one warning type and the checks every lit_cbs class runs on its arguments.

Every setting lit_cbs cannot train with raises ``LitCBSConfigError`` before training starts (in a
constructor, or in ``setup`` for what depends on the Trainer), with one line naming the setting,
the value given and the fix. It subclasses both ValueError and TypeError (a setting of the wrong
type is as much a configuration error as one out of range), so existing ``except ValueError`` or
``except TypeError`` handlers catch it. A setting lit_cbs can train with, though hardly as meant,
warns ``LitCBSConfigWarning`` instead, in the same form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


class LitCBSConfigError(ValueError, TypeError):
    """A setting lit_cbs cannot train with; the message names the setting and the fix."""


class LitCBSConfigWarning(UserWarning):
    """A setting lit_cbs trains with, but not as it was likely meant (an LR warmup as long as the run); the
    message names the setting and the fix. ``warnings.simplefilter("error", LitCBSConfigWarning)`` refuses them."""


def is_positive_int(value: Any) -> bool:
    """True for an int >= 1 (a bool is not an int here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def positive_int(name: str, value: Any, unit: str, *, optional: bool = False) -> int | None:
    """``value`` if it is an int >= 1 (``None`` too when ``optional``); else LitCBSConfigError.

    ``unit`` says what the number counts ("samples", "tokens", ...) in the message.
    """
    if value is None and optional:
        return None
    if not is_positive_int(value):
        accepted = "a positive int" + (" or None" if optional else "")
        raise LitCBSConfigError(f"{name}={value!r} must be {accepted} ({unit})")
    return value


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
    """``who`` (a callback) works only through Lightning's automatic optimization, ``because`` ...; say so
    before training when the module turned it off."""
    if not pl_module.automatic_optimization:
        raise LitCBSConfigError(
            f"{who} needs automatic optimization ({because}); set `self.automatic_optimization = True` or remove {who}"
        )
