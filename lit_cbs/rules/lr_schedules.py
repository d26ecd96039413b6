"""LR multipliers indexed by tokens seen, so a batch change does not shift them, and ``TokenLRScheduler``."""

from __future__ import annotations

import abc
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from lit_cbs.errors import LitCBSConfigError, LitCBSConfigWarning, one_of

__all__ = ["CosineSchedule", "OneCycle", "StepDecay", "TokenLRScheduler", "WarmupStableDecay"]


def _tokens(name: str, value: Any, allow_zero: bool = True) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise LitCBSConfigError(f"{name}={value!r} must be an int >= {0 if allow_zero else 1} (tokens)")
    return value


class _Schedule(abc.ABC):  # a multiplier of the base LR; its repr lists the arguments it was built with
    warmup_tokens = 0

    def _warmup_and_total(
        self, warmup_tokens: int, total_tokens: int, room_for: str | None = None, min_lr_ratio: float | None = None
    ) -> None:
        """Set them, refusing a warmup longer than the run (or leaving no ``room_for``), warning at one as long."""
        self.warmup_tokens = _tokens("warmup_tokens", warmup_tokens)
        self.total_tokens = _tokens("total_tokens", total_tokens, allow_zero=False)
        fix = f"shorten the warmup (a tenth of the run: warmup_tokens={total_tokens // 10}) or lengthen total_tokens"
        if room_for is not None and warmup_tokens >= total_tokens:
            problem = f"leaves no tokens of total_tokens={total_tokens} for the {room_for};"
            raise LitCBSConfigError(f"warmup_tokens={warmup_tokens} {problem} {fix}")
        if warmup_tokens > total_tokens:
            problem = f"exceeds total_tokens={total_tokens}: the LR never reaches its peak;"
            raise LitCBSConfigError(f"warmup_tokens={warmup_tokens} {problem} {fix}")
        if warmup_tokens == total_tokens:
            problem = "the LR rises until the last token and never trains at its base value"
            message = f"warmup_tokens={warmup_tokens} is the whole run (total_tokens={total_tokens}): {problem}; {fix}"
            warnings.warn(message, LitCBSConfigWarning, stacklevel=3)
        if min_lr_ratio is not None:
            if not 0.0 <= min_lr_ratio <= 1.0:
                raise LitCBSConfigError(f"min_lr_ratio={min_lr_ratio} must lie in [0, 1] (a fraction of the base LR)")
            self.min_lr_ratio = float(min_lr_ratio)

    def __call__(self, tokens: int) -> float:
        if tokens < self.warmup_tokens:
            return (tokens + 1) / (self.warmup_tokens + 1)
        return self._after_warmup(tokens)

    @abc.abstractmethod
    def _after_warmup(self, tokens: int) -> float:
        """The multiplier once the warmup is over."""

    def __repr__(self) -> str:
        arguments = ", ".join(f"{name}={getattr(self, name)!r}" for name in inspect.signature(type(self)).parameters)
        return f"{type(self).__name__}({arguments})"


class WarmupStableDecay(_Schedule):
    """Linear warmup over ``warmup_tokens``, constant, then a decay (``decay_shape``: linear, cosine or 1 - sqrt)
    to ``min_lr_ratio`` over the last ``decay_tokens`` of ``total_tokens``; ``decay_tokens=0``: no decay.

    Examples:
        >>> schedule = WarmupStableDecay(warmup_tokens=1000, total_tokens=10_000, decay_tokens=2000, min_lr_ratio=0.1)
        >>> [round(schedule(tokens), 4) for tokens in (0, 499, 1000, 8000, 9000, 10_000)]
        [0.001, 0.4995, 1.0, 1.0, 0.55, 0.1]
    """

    def __init__(
        self,
        warmup_tokens: int,
        total_tokens: int,
        decay_tokens: int = 0,
        min_lr_ratio: float = 0.0,
        decay_shape: str = "linear",
    ):
        self.decay_tokens = _tokens("decay_tokens", decay_tokens)
        if _tokens("warmup_tokens", warmup_tokens) + decay_tokens > _tokens("total_tokens", total_tokens, False):
            raise LitCBSConfigError(
                f"warmup_tokens + decay_tokens = {warmup_tokens + decay_tokens} exceeds total_tokens={total_tokens}; "
                "shorten the warmup or the decay, or lengthen total_tokens"
            )
        self._warmup_and_total(warmup_tokens, total_tokens, min_lr_ratio=min_lr_ratio)  # with no decay: may be the run
        self.decay_shape = str(one_of("decay_shape", decay_shape, ("linear", "cosine", "sqrt")))

    def _after_warmup(self, tokens: int) -> float:
        decay_start = self.total_tokens - self.decay_tokens
        if self.decay_tokens == 0 or tokens < decay_start:
            return 1.0
        progress = min(1.0, (tokens - decay_start) / self.decay_tokens)
        remaining = {
            "linear": 1.0 - progress,
            "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
            "sqrt": 1.0 - math.sqrt(progress),
        }[self.decay_shape]
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * remaining


class CosineSchedule(_Schedule):
    """Linear warmup over ``warmup_tokens``, then a cosine from 1 to ``min_lr_ratio`` at ``total_tokens``.

    Examples:
        >>> schedule = CosineSchedule(warmup_tokens=1000, total_tokens=11_000, min_lr_ratio=0.1)
        >>> [round(schedule(tokens), 4) for tokens in (0, 1000, 6000, 11_000)]
        [0.001, 1.0, 0.55, 0.1]
    """

    def __init__(self, warmup_tokens: int, total_tokens: int, min_lr_ratio: float = 0.1):
        self._warmup_and_total(warmup_tokens, total_tokens, room_for="cosine decay", min_lr_ratio=min_lr_ratio)

    def _after_warmup(self, tokens: int) -> float:
        progress = min(1.0, (tokens - self.warmup_tokens) / (self.total_tokens - self.warmup_tokens))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class StepDecay(_Schedule):
    """Linear warmup over ``warmup_tokens``, then the multiplier times ``gamma`` at each of ``milestones``
    (tokens): ``StepLR`` in tokens. ``total_tokens`` is where the run ends (for ``Seesaw``).

    Examples:
        >>> schedule = StepDecay(warmup_tokens=0, milestones=[4000, 8000], total_tokens=10_000, gamma=0.5)
        >>> [schedule(tokens) for tokens in (0, 3999, 4000, 8000)]
        [1.0, 1.0, 0.5, 0.25]
    """

    def __init__(self, warmup_tokens: int, milestones: Sequence[int], total_tokens: int, gamma: float = 0.5):
        self._warmup_and_total(warmup_tokens, total_tokens)
        self.milestones = [_tokens(f"milestones[{i}]", m) for i, m in enumerate(milestones)]
        if self.milestones != sorted(set(self.milestones)) or (self.milestones and self.milestones[0] < warmup_tokens):
            raise LitCBSConfigError(
                f"milestones={self.milestones} must strictly increase, from warmup_tokens={warmup_tokens} on"
            )
        if not 0.0 < gamma < 1.0:
            raise LitCBSConfigError(f"gamma={gamma} must lie in (0, 1) (the multiplier's factor at each milestone)")
        self.gamma = float(gamma)

    def _after_warmup(self, tokens: int) -> float:
        return self.gamma ** sum(tokens >= milestone for milestone in self.milestones)


class OneCycle(_Schedule):
    """``OneCycleLR``'s curve (its arguments, no momentum) as a multiplier of ``max_lr``, the optimizer's ``lr``, for
    ``LambdaLR`` (``total`` in steps) or ``TokenLRScheduler`` (tokens): unlike ``OneCycleLR``, BatchWarmup can scale it.

    Examples:
        >>> [round(OneCycle(total=100)(step), 4) for step in (0, 29, 99)]
        [0.04, 1.0, 0.0]
    """

    def __init__(
        self,
        total: int,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
    ):
        self.total = _tokens("total", total, allow_zero=False)
        if not 0.0 < pct_start < 1.0:
            raise LitCBSConfigError(f"pct_start={pct_start} must lie in (0, 1)")
        if div_factor <= 0 or final_div_factor <= 0:
            raise LitCBSConfigError(f"div_factor={div_factor} and final_div_factor={final_div_factor} must be > 0")
        one_of("anneal_strategy", anneal_strategy, ("cos", "linear"))
        self.pct_start, self.anneal_strategy = pct_start, anneal_strategy
        self.div_factor, self.final_div_factor, self.three_phase = div_factor, final_div_factor, three_phase
        initial = 1.0 / div_factor
        up = (float(pct_start * total) - 1, initial, 1.0)  # (end step, start multiplier, end multiplier)
        middle = [(float(2 * pct_start * total) - 2, 1.0, initial)] if three_phase else []  # as OneCycleLR's phases
        last = (total - 1, initial if three_phase else 1.0, initial / final_div_factor)
        self._phases = [up, *middle, last]

    def _after_warmup(self, step: int) -> float:  # no warmup of its own: every step is a one-cycle phase's
        step, ends = min(step, self.total - 1), [phase[0] for phase in self._phases]
        number = next((i for i, phase_end in enumerate(ends) if step <= phase_end), len(ends) - 1)
        (phase_end, start, end), phase_start = self._phases[number], [0.0, *ends][number]
        progress = (step - phase_start) / (phase_end - phase_start)
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * progress) + 1)
        return (end - start) * progress + start


class TokenLRScheduler(LambdaLR):
    """``LambdaLR`` with LR = base LR x ``schedule(tokens_seen)``; ``tokens_seen`` (global tokens trained on) is set
    before each ``step()`` by BatchWarmup or BatchAccounting, or by a plain loop itself.

    Examples:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
        >>> scheduler = TokenLRScheduler(optimizer, CosineSchedule(warmup_tokens=0, total_tokens=1000))
        >>> scheduler.tokens_seen = 500; optimizer.step(); scheduler.step()
        >>> round(optimizer.param_groups[0]["lr"], 6)  # 0.01 x (0.1 + 0.9 x 0.5)
        0.0055
    """

    def __init__(self, optimizer: Optimizer, schedule: Callable[[int], float], last_epoch: int = -1):
        if not callable(schedule):
            raise TypeError(f"schedule must be callable tokens -> LR multiplier, got {schedule!r}")
        self.schedule = schedule
        self.tokens_seen: int | None = None
        super().__init__(optimizer, self._multiplier, last_epoch)

    def _multiplier(self, step: int) -> float:  # LambdaLR passes the step; the multiplier follows the tokens
        return self.schedule(self.tokens_seen or 0)

    def step(self, epoch: int | None = None) -> None:
        if self.last_epoch >= 0 and self.tokens_seen is None:
            raise LitCBSConfigError(
                "TokenLRScheduler.step() was called but tokens_seen was never set: add lit_cbs.BatchWarmup (a growing "
                "batch) or lit_cbs.callbacks.BatchAccounting(seq_len=...) (a fixed one) to the Trainer's callbacks, "
                "or set scheduler.tokens_seen before each step in a loop of your own"
            )
        super().step(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Without ``schedule``, so the checkpoint loads with ``torch.load(weights_only=True)``."""
        return {key: value for key, value in super().state_dict().items() if key != "schedule"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({**state_dict, "schedule": self.schedule})
