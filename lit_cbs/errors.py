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
from typing import Any, Literal, overload

__all__ = [
    "LitCBSConfigError",
    "LitCBSConfigWarning",
    "is_positive_int",
    "one_of",
    "positive_int",
    "positive_number",
    "require_automatic_optimization",
]


class LitCBSConfigError(ValueError, TypeError):
    """A setting lit_cbs cannot train with; the message names the setting and the fix.

    Examples:
        >>> from lit_cbs import ConstantBatch
        >>> ConstantBatch(batch_size=0)
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: batch_size=0 must be a positive int (samples)
        >>> issubclass(LitCBSConfigError, ValueError) and issubclass(LitCBSConfigError, TypeError)
        True
    """


class LitCBSConfigWarning(UserWarning):
    """A setting lit_cbs trains with, but not as it was likely meant (an LR warmup as long as the run); the
    message names the setting and the fix. ``warnings.simplefilter("error", LitCBSConfigWarning)`` refuses them.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warnings.warn("lr warmup as long as the run", LitCBSConfigWarning)
        >>> caught[0].category.__name__
        'LitCBSConfigWarning'
    """


def is_positive_int(value: Any) -> bool:
    """True for an int >= 1 (a bool is not an int here).

    Args:
        value: anything.

    Returns:
        Whether ``value`` is an int (not a bool) >= 1.

    Examples:
        >>> is_positive_int(3), is_positive_int(0), is_positive_int(True), is_positive_int(2.0)
        (True, False, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@overload
def positive_int(name: str, value: Any, unit: str, *, optional: Literal[False] = False) -> int: ...
@overload
def positive_int(name: str, value: Any, unit: str, *, optional: bool) -> int | None: ...
def positive_int(name: str, value: Any, unit: str, *, optional: bool = False) -> int | None:
    """``value`` if it is an int >= 1 (``None`` too when ``optional``); else LitCBSConfigError.

    Args:
        name: the setting's name, as the message spells it.
        value: the value given.
        unit: what the number counts ("samples", "tokens", ...), for the message.
        optional: whether None is accepted (and returned).

    Returns:
        ``value``, unchanged.

    Raises:
        LitCBSConfigError: ``value`` is not an int >= 1 (nor None when ``optional``).

    Examples:
        >>> positive_int("batch_size", 64, "samples"), positive_int("hold", None, "tokens", optional=True)
        (64, None)
        >>> positive_int("batch_size", 0, "samples")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: batch_size=0 must be a positive int (samples)
    """
    if value is None and optional:
        return None
    if not is_positive_int(value):
        accepted = "a positive int" + (" or None" if optional else "")
        raise LitCBSConfigError(f"{name}={value!r} must be {accepted} ({unit})")
    return value


@overload
def positive_number(name: str, value: Any, unit: str, *, optional: Literal[False] = False) -> float: ...
@overload
def positive_number(name: str, value: Any, unit: str, *, optional: bool) -> float | None: ...
def positive_number(name: str, value: Any, unit: str, *, optional: bool = False) -> float | None:
    """``value`` as a float if it is a finite number > 0 (``None`` too when ``optional``); else LitCBSConfigError.

    Args:
        name: the setting's name, as the message spells it.
        value: the value given.
        unit: what the number counts ("nats", "tokens", ...), for the message.
        optional: whether None is accepted (and returned).

    Returns:
        ``value`` as a float (None for None when ``optional``).

    Raises:
        LitCBSConfigError: ``value`` is a bool, not a number, not finite or not > 0 (and not None when ``optional``).

    Examples:
        >>> positive_number("threshold", 1, "nats")
        1.0
        >>> positive_number("threshold", float("nan"), "nats")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: threshold=nan must be a finite number > 0 (nats)
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        accepted = "a finite number > 0" + (" or None" if optional else "")
        raise LitCBSConfigError(f"{name}={value!r} must be {accepted} ({unit})")
    return float(value)


def one_of(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``; else LitCBSConfigError listing them.

    Args:
        name: the setting's name, as the message spells it.
        value: the value given.
        choices: the values accepted.

    Returns:
        ``value``, unchanged.

    Raises:
        LitCBSConfigError: ``value`` is not in ``choices``.

    Examples:
        >>> one_of("unit", "tokens", ("samples", "tokens"))
        'tokens'
        >>> one_of("unit", "steps", ("samples", "tokens"))
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: unit='steps' is not supported; use one of ('samples', 'tokens')
    """
    if value not in choices:
        raise LitCBSConfigError(f"{name}={value!r} is not supported; use one of {tuple(choices)}")
    return value


def require_automatic_optimization(pl_module: Any, who: str, because: str) -> None:
    """``who`` (a callback) works only through Lightning's automatic optimization, ``because`` ...; say so
    before training when the module turned it off. Automatic optimization steps one optimizer, and Lightning
    refuses more by advising to turn it off, so a ``configure_optimizers`` that returns several is refused
    here instead, with what ``who`` supports, when Lightning calls it (from a callback's ``setup`` the
    optimizers do not exist yet): this puts a check around the module's ``configure_optimizers``, which
    removes itself when called.

    Args:
        pl_module: the LightningModule (anything with ``automatic_optimization`` and ``configure_optimizers``).
        who: the callback, as the message names it.
        because: what ``who`` does that needs automatic optimization, for the message.

    Raises:
        LitCBSConfigError: now, when ``pl_module.automatic_optimization`` is False; later, from the wrapped
            ``configure_optimizers``, when it returns more than one optimizer.

    Examples:
        >>> import torch
        >>> class Module:  # stands in for a LightningModule
        ...     automatic_optimization = False
        ...     def configure_optimizers(self):
        ...         weights = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
        ...         return [torch.optim.SGD(weights[:1], lr=0.1), torch.optim.AdamW(weights[1:])]
        >>> module = Module()
        >>> require_automatic_optimization(module, "BatchWarmup", "it rescales the LR")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: BatchWarmup needs automatic optimization (it rescales the LR); ...
        >>> module.automatic_optimization = True
        >>> require_automatic_optimization(module, "BatchWarmup", "it rescales the LR")  # passes; wraps the hook
        >>> module.configure_optimizers()
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: configure_optimizers returned 2 optimizers (SGD, AdamW), but BatchWarmup ...
    """
    if not pl_module.automatic_optimization:
        raise LitCBSConfigError(
            f"{who} needs automatic optimization ({because}); set `self.automatic_optimization = True` or remove {who}"
        )
    configure = pl_module.configure_optimizers
    if getattr(configure, "lit_cbs_counts_optimizers", False):
        return  # another callback of this fit put the check there
    own = "configure_optimizers" in vars(pl_module)  # assigned to the instance, not the class's method

    def configure_one_optimizer():
        import torch

        from lit_cbs._internals import tree_leaves

        if own:
            pl_module.configure_optimizers = configure
        else:
            del pl_module.configure_optimizers
        configured = configure()
        optimizers = {id(leaf): leaf for leaf in tree_leaves(configured) if isinstance(leaf, torch.optim.Optimizer)}
        if pl_module.automatic_optimization and len(optimizers) > 1:
            names = ", ".join(type(optimizer).__name__ for optimizer in optimizers.values())
            raise LitCBSConfigError(
                f"configure_optimizers returned {len(optimizers)} optimizers ({names}), but {who} trains under "
                "Lightning's automatic optimization, which steps one: give every parameter to one optimizer, a param "
                "group per setting (AdamW([{'params': decay, 'weight_decay': 0.1}, {'params': no_decay, "
                "'weight_decay': 0.0}])), whose groups lit_cbs's rules move alike"
            )
        return configured

    vars(configure_one_optimizer)["lit_cbs_counts_optimizers"] = True  # the mark the getattr above reads
    pl_module.configure_optimizers = configure_one_optimizer
