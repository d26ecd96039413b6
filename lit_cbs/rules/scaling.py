"""Learning-rate scaling rules for a global batch that changes by ``ratio = new / old``.

- ``"sqrt"``: LR * sqrt(ratio), the rule for Adam (Merrill et al. 2025 double the batch and
  multiply the LR by sqrt(2)).
- ``"linear"``: LR * ratio, the rule for SGD (Goyal et al. 2017).
- ``"none"``: LR unchanged.
- ``"adam_sde"``: the square-root SDE scaling rule for Adam (Malladi et al. 2022): LR * sqrt(ratio),
  1 - beta_i -> ratio * (1 - beta_i), eps -> eps / sqrt(ratio).
- any callable ``ratio -> factor``.

Every such rule is a ``ScalingRule``: ``factor(ratio)`` is the multiplier. ``LRRule`` is the one for
the LR (it may also move other optimizer settings: adam_sde); ``get_clip_rule`` resolves a plain
``ScalingRule`` ("sqrt", "linear", "none" or a callable) for the gradient-clipping threshold, which
``BatchWarmup(clip_rule=...)`` multiplies at each change.

``scale_learning_rate`` multiplies the LR where the optimizer and every supported LR scheduler keep
it, so the rescaled base LR composes with the user's schedule instead of being overwritten by it.
``LRRule.check_ratios`` refuses, before training, batch ratios a rule cannot apply to an optimizer
and its LR schedulers (an LR scheduler that keeps absolute LRs; adam_sde beyond its betas' limit).

Settings beside the LR, each with its own rule (``OptimizerRules`` composes them with the LR rule):

- weight decay, ``"timescale"``: lambda -> lambda * k / f(k), where f(k) is the LR rule's factor. It
  keeps AdamW's timescale tau = B / (eta * lambda * D) (batch B in samples, D the dataset in
  samples), whose optimum Bergsma et al. 2025 ("Power Lines") find nearly independent of B at a
  fixed number of tokens per parameter. Under the sqrt LR rule a doubling gives lambda * sqrt(2).
- Adam's beta2, ``"half_life"``: beta2 -> beta2 ** k, so the second-moment average keeps its
  half-life in tokens (Marek et al. 2025): a step of k x B samples weighs as k steps of B. Never
  below ``BETA2_FLOOR`` (0.95 unless set): 0.95 ** 16 = 0.44 at 16x the batch averages the second
  moment over about a step and a half, and runs that scaled beta2 with the batch saw loss spikes there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import torch
from torch.optim import lr_scheduler as torch_sched

from lit_cbs import metrics
from lit_cbs._internals import inner_schedulers, scale_last_lr
from lit_cbs.errors import LitCBSConfigError

__all__ = [
    "AdamSDERule",
    "Beta2HalfLife",
    "LRRule",
    "OptimizerRules",
    "ScalingRule",
    "SettingRule",
    "WeightDecayTimescale",
    "get_clip_rule",
    "get_lr_rule",
    "scale_learning_rate",
]


class ScalingRule:
    """A rule turning a batch ratio (new / old global batch) into a multiplier: of the LR (``LRRule``)
    or of the gradient-clipping threshold (``BatchWarmup(clip_rule=...)``).

    Args:
        name: the rule's name, as logged and in messages.
        factor: batch ratio -> multiplier; a module-level function, so the rule pickles.

    Examples:
        >>> import math
        >>> ScalingRule("sqrt", math.sqrt).factor(4.0)
        2.0
    """

    def __init__(self, name: str, factor: Callable[[float], float]):
        self.name = name
        self._factor = factor

    def factor(self, ratio: float) -> float:
        """The multiplier for a batch change by ``ratio``.

        Args:
            ratio: new / old global batch (> 0).

        Returns:
            The multiplier (unitless, finite and > 0).

        Raises:
            LitCBSConfigError: ``ratio <= 0``, or the rule returned a factor that is not finite and > 0.
        """
        if not ratio > 0:
            raise LitCBSConfigError(f"batch ratio must be > 0, got {ratio}")
        factor = float(self._factor(ratio))
        if not (math.isfinite(factor) and factor > 0):
            raise LitCBSConfigError(
                f"rule {self.name!r} returned factor {factor} for ratio {ratio}; it must be finite and > 0"
            )
        return factor

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class LRRule(ScalingRule):
    """The LR's ``ScalingRule``; a subclass may move other optimizer settings with it (``adjust_optimizer``).

    Args:
        name: the rule's name, as logged and in messages (``"sqrt"``).
        factor: batch ratio -> LR multiplier; a module-level function, so the rule pickles.

    Examples:
        >>> rule = get_lr_rule("sqrt")
        >>> rule, round(rule.factor(2.0), 4)
        (LRRule('sqrt'), 1.4142)
    """

    def adjust_optimizer(self, optimizer: torch.optim.Optimizer, ratio: float) -> None:
        """Change hyperparameters other than the LR (none for plain LR rules)."""

    def check_optimizer(self, optimizer: torch.optim.Optimizer, ratios: list[float], who: str, compose: bool) -> None:
        """LitCBSConfigError, its message starting with ``who``, if ``adjust_optimizer`` cannot apply
        ``ratios`` to ``optimizer`` (``check_ratios`` says how they apply); nothing for plain LR rules."""

    def check_ratios(
        self,
        optimizer: torch.optim.Optimizer,
        schedulers: Iterable,
        ratios: Iterable[float],
        who: str,
        compose: bool = False,
    ) -> None:
        """Before training: LitCBSConfigError, its message starting with ``who``, unless the rule can
        scale ``optimizer`` and every one of its LR ``schedulers`` at each batch ratio (new / old
        global batch) in ``ratios``.

        compose=False: each ratio applies on its own to the optimizer as it is now (a CBS probe's
        branches all start from the main run's state). compose=True: the ratios apply one after
        another (BatchWarmup's changes). Schedulers are checked only if some ratio changes the LR:
        a factor of 1 composes with any.
        """
        ratios = list(ratios)
        if any(self.factor(ratio) != 1.0 for ratio in ratios):
            for scheduler in schedulers:
                check_scheduler_supported(scheduler, who)
        if ratios:
            self.check_optimizer(optimizer, ratios, who, compose)


class AdamSDERule(LRRule):
    """Malladi et al. 2022: LR * sqrt(k), 1 - beta -> k (1 - beta), eps -> eps / sqrt(k).

    A beta stays a valid Adam beta (in [0, 1)) while k (1 - beta) <= 1: ``max_ratio`` is
    1 / (1 - beta) for the smallest beta of any param group (10 for AdamW's betas (0.9, 0.95)).

    Examples:
        >>> import torch
        >>> optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], betas=(0.9, 0.95), eps=1e-8)
        >>> rule = AdamSDERule()
        >>> round(rule.max_ratio(optimizer), 4)  # 1 / (1 - 0.9)
        10.0
        >>> rule.adjust_optimizer(optimizer, 2.0)  # the batch doubles
        >>> [round(beta, 4) for beta in optimizer.param_groups[0]["betas"]], optimizer.param_groups[0]["eps"]
        ([0.8, 0.9], 7.07...e-09)
    """

    def __init__(self):
        super().__init__("adam_sde", math.sqrt)

    @staticmethod
    def _scaled_betas(betas, ratio: float) -> tuple[float, ...]:
        return tuple(1.0 - ratio * (1.0 - b) for b in betas)

    def max_ratio(self, optimizer: torch.optim.Optimizer) -> float:
        """The largest batch ratio (new / old global batch) that keeps every beta of ``optimizer``
        as it is now >= 0, in one change or several compounded."""
        return min(1.0 / (1.0 - beta) for group in optimizer.param_groups for beta in group["betas"])

    def check_optimizer(self, optimizer, ratios, who, compose):
        for i, group in enumerate(optimizer.param_groups):
            if "betas" not in group or "eps" not in group:
                raise LitCBSConfigError(
                    f"{who}: lr_rule='adam_sde' needs an Adam-type optimizer (param group {i} of "
                    f"{type(optimizer).__name__} has no 'betas'/'eps'); use lr_rule='sqrt' or 'linear'"
                )
        limit = self.max_ratio(optimizer)
        total = 1.0
        for ratio in ratios:
            total = total * ratio if compose else ratio  # compounded: 1 - beta -> r1 r2 ... (1 - beta)
            if total > limit:
                reached = f"the batch grows {total:g}x over its changes" if compose else f"batch ratio {ratio:g}"
                betas = ", ".join(str(b) for b in sorted({tuple(group["betas"]) for group in optimizer.param_groups}))
                raise LitCBSConfigError(
                    f"{who}: {reached} is above {limit:.4g}, the largest safe batch ratio for "
                    f"{type(optimizer).__name__} betas {betas} "
                    "(beta becomes 1 - ratio x (1 - beta), which must stay >= 0): keep batch ratios "
                    f"<= {limit:.4g}, start from larger betas, or use lr_rule='sqrt'"
                )

    def adjust_optimizer(self, optimizer, ratio):
        for group in optimizer.param_groups:
            group["betas"] = self._scaled_betas(group["betas"], ratio)
            group["eps"] = group["eps"] / math.sqrt(ratio)


def _linear(ratio: float) -> float:
    return ratio


def _unchanged(ratio: float) -> float:
    return 1.0


# Module-level functions, not lambdas, so rules pickle (ddp_spawn, checkpoints of callbacks).
RATIO_FUNCTIONS = {"sqrt": math.sqrt, "linear": _linear, "none": _unchanged}
LR_RULES: dict[str, Callable[[], LRRule]] = {
    **{name: functools.partial(LRRule, name, function) for name, function in RATIO_FUNCTIONS.items()},
    "adam_sde": AdamSDERule,
}


def get_lr_rule(rule: str | Callable[[float], float] | LRRule) -> LRRule:
    """Resolve ``rule`` (a name in ``LR_RULES``, an ``LRRule`` or a callable ratio -> factor).

    Args:
        rule: ``"sqrt"``, ``"linear"``, ``"none"``, ``"adam_sde"``, an ``LRRule``, or a callable batch ratio
            -> LR multiplier.

    Returns:
        The ``LRRule`` (a callable's named by its ``__name__``).

    Raises:
        LitCBSConfigError: an unknown name, or neither a name, a rule nor a callable.

    Examples:
        >>> round(get_lr_rule("sqrt").factor(2.0), 4), get_lr_rule("linear").factor(2.0)
        (1.4142, 2.0)
        >>> get_lr_rule("cubic")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: lr_rule='cubic' is unknown; use one of ['adam_sde', 'linear', ...
    """
    if isinstance(rule, LRRule):
        return rule
    if isinstance(rule, str):
        if rule not in LR_RULES:
            raise LitCBSConfigError(
                f"lr_rule={rule!r} is unknown; use one of {sorted(LR_RULES)} or a callable ratio -> factor"
            )
        return LR_RULES[rule]()
    if callable(rule):
        return LRRule(getattr(rule, "__name__", repr(rule)), rule)
    raise LitCBSConfigError(f"lr_rule must be a name in {sorted(LR_RULES)} or a callable ratio -> factor, got {rule!r}")


CLIP_RULES = tuple(RATIO_FUNCTIONS)


def get_clip_rule(rule: str | Callable[[float], float] | ScalingRule | None) -> ScalingRule | None:
    """The rule for the gradient-clipping threshold at a batch change by ``ratio = new / old``: "sqrt",
    "linear", a callable ratio -> factor or a ``ScalingRule``; None or "none" leave the threshold
    unchanged (None returned).

    Args:
        rule: ``"sqrt"``, ``"linear"``, ``"none"``, None, a ``ScalingRule``, or a callable batch ratio ->
            multiplier of the clipping threshold.

    Returns:
        The rule, or None when the threshold stays as it is.

    Raises:
        LitCBSConfigError: an unknown name, or neither a name, a rule, a callable nor None.

    Examples:
        >>> get_clip_rule("linear").factor(2.0), get_clip_rule(None)
        (2.0, None)
    """
    if rule is None or rule == "none":
        return None
    if isinstance(rule, ScalingRule):
        return rule
    if isinstance(rule, str):
        if rule not in CLIP_RULES:
            raise LitCBSConfigError(
                f"clip_rule={rule!r} is unknown; use one of {CLIP_RULES}, a callable ratio -> factor, or None"
            )
        return ScalingRule(rule, RATIO_FUNCTIONS[rule])
    if callable(rule):
        return ScalingRule(getattr(rule, "__name__", repr(rule)), rule)
    raise LitCBSConfigError(f"clip_rule must be one of {CLIP_RULES}, a callable ratio -> factor or None, got {rule!r}")


# Schedulers whose LR is either base_lrs * f(step) or chained multiplicatively on the optimizer's
# current LR: scaling the group LR, base_lrs and absolute floors by a factor scales every later LR
# by exactly that factor.
_PROPORTIONAL = (
    torch_sched.LambdaLR,
    torch_sched.MultiplicativeLR,
    torch_sched.StepLR,
    torch_sched.MultiStepLR,
    torch_sched.ConstantLR,
    torch_sched.LinearLR,
    torch_sched.ExponentialLR,
    torch_sched.PolynomialLR,
    torch_sched.CosineAnnealingLR,
    torch_sched.ReduceLROnPlateau,
)
_CONTAINERS = (torch_sched.SequentialLR, torch_sched.ChainedScheduler)


def check_scheduler_supported(scheduler, who: str) -> None:
    """LitCBSConfigError, its message starting with ``who``, if ``scale_learning_rate`` cannot
    compose with ``scheduler`` exactly.

    Examples:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> from torch.optim import lr_scheduler
        >>> check_scheduler_supported(lr_scheduler.StepLR(optimizer, step_size=10), "BatchWarmup")  # composes
        >>> check_scheduler_supported(lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=100), "BatchWarmup")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: BatchWarmup: OneCycleLR writes absolute LR values that a batch change ...
    """
    if isinstance(scheduler, _CONTAINERS):
        for inner in inner_schedulers(scheduler):
            check_scheduler_supported(inner, who)
        return
    if isinstance(scheduler, _PROPORTIONAL):  # TokenLRScheduler is a LambdaLR
        return
    supported = sorted(t.__name__ for t in _PROPORTIONAL + _CONTAINERS) + [
        "lit_cbs.rules.lr_schedules.TokenLRScheduler"
    ]
    if isinstance(scheduler, torch_sched.OneCycleLR):
        raise LitCBSConfigError(
            f"{who}: OneCycleLR writes absolute LR values that a batch change cannot rescale; for the same LR curve "
            "set the optimizer's lr to max_lr and use LambdaLR(optimizer, lit_cbs.rules.lr_schedules.OneCycle("
            f"total={scheduler.total_steps}, pct_start=..., div_factor=..., final_div_factor=...)) with your "
            "OneCycleLR arguments (momentum is not cycled)"
        )
    raise LitCBSConfigError(
        f"{who}: {type(scheduler).__name__} keeps absolute LR values that a batch change cannot rescale exactly; "
        f"use one of {supported}"
    )


def _scale_scheduler(scheduler, factor: float) -> None:
    if isinstance(scheduler, _CONTAINERS):
        for inner in inner_schedulers(scheduler):
            _scale_scheduler(inner, factor)
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    scale_last_lr(scheduler, factor)
    if isinstance(scheduler, torch_sched.CosineAnnealingLR):
        scheduler.eta_min *= factor
    if isinstance(scheduler, torch_sched.ReduceLROnPlateau):
        scheduler.min_lrs = [lr * factor for lr in scheduler.min_lrs]


def scale_learning_rate(optimizer: torch.optim.Optimizer, schedulers: Iterable, factor: float) -> None:
    """Multiply the LR by ``factor`` now and in everything the schedulers will compute from it.

    Args:
        optimizer: its param groups' ``lr`` (and ``initial_lr``) are multiplied.
        schedulers: its LR schedulers (``check_scheduler_supported`` says which compose); their base LRs
            and floors are multiplied.
        factor: the LR multiplier (unitless).

    Examples:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
        >>> scale_learning_rate(optimizer, [scheduler], 2.0)
        >>> optimizer.param_groups[0]["lr"], scheduler.base_lrs
        (0.2, [0.2])
    """
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
    for scheduler in schedulers:
        _scale_scheduler(scheduler, factor)


# ---------------------------------------------------------------------- settings beside the LR
class SettingRule(ABC):
    """A rule for one optimizer setting beside the LR, at a batch change by ``ratio`` = new / old
    global batch while the LR is multiplied by ``lr_factor``. Subclasses set ``name``, ``key`` (the
    setting, logged as ``batch/<key>``) and ``argument`` (the BatchWarmup / CBSProbeCallback argument),
    and implement ``scaled``, applied change by change (a plan applies it phase by phase as BatchWarmup
    does, so a rule with a floor, which forgets how far below it the rule alone would have gone, is
    planned exactly).

    ``OptimizerRules.settings`` returns them; BatchWarmup and CBSProbeCallback take the two kinds
    ``weight_decay_rule`` and ``beta2_rule`` name (``WeightDecayTimescale``, ``Beta2HalfLife``, or objects of them).

    Attributes:
        name: the rule's name, as users give it (``"timescale"``).
        key: the param-group entry it moves (``"weight_decay"``), logged as ``batch/<key>``.
        argument: the BatchWarmup / CBSProbeCallback argument that names it (``"weight_decay_rule"``).

    Examples:
        A minimal subclass: Adam's eps divided by sqrt(ratio), as adam_sde moves it:

        >>> class EpsSqrt(SettingRule):
        ...     name, key, argument = "sqrt", "eps", "eps_rule"
        ...     def scaled(self, value, ratio, lr_factor):
        ...         return value / ratio**0.5
        ...     def check(self, optimizer, who):
        ...         if "eps" not in optimizer.param_groups[0]:
        ...             raise LitCBSConfigError(f"{who}: {type(optimizer).__name__} has no eps")
        >>> group = {"lr": 1e-3, "eps": 1e-8}  # a param group
        >>> EpsSqrt().apply(group, ratio=4.0, lr_factor=2.0)  # the batch grew 4-fold
        >>> group["eps"], EpsSqrt().held(1e-8, ratio=4.0, lr_factor=2.0)
        (5e-09, None)
    """

    name: str
    key: str
    argument: str

    @abstractmethod
    def scaled(self, value: float, ratio: float, lr_factor: float) -> float:
        """The setting after a change by ``ratio`` with LR factor ``lr_factor``, from ``value``."""

    def get(self, group: dict) -> float:
        return group[self.key]

    def set(self, group: dict, value: float) -> None:
        group[self.key] = value

    def apply(self, group: dict, ratio: float, lr_factor: float) -> None:
        self.set(group, self.scaled(float(self.get(group)), ratio, lr_factor))

    def held(self, value: float, ratio: float, lr_factor: float) -> str | None:
        """Why ``scaled`` keeps the setting from where the rule alone would take it from ``value`` (a
        floor), with the setting that changes that; None when it does not."""
        return None

    def value(self, optimizer: torch.optim.Optimizer) -> float:
        """The setting now, as logged: param group 0's."""
        return float(self.get(optimizer.param_groups[0]))

    @abstractmethod
    def check(self, optimizer: torch.optim.Optimizer, who: str) -> None:
        """LitCBSConfigError, its message starting with ``who``, if the rule does not apply to ``optimizer``."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class WeightDecayTimescale(SettingRule):
    """lambda -> lambda * k / f(k): AdamW's timescale B / (eta * lambda * D) stays as it was.

    Examples:
        Doubling the batch under the sqrt LR rule (LR x sqrt(2)):

        >>> import math
        >>> round(WeightDecayTimescale().scaled(0.1, ratio=2.0, lr_factor=math.sqrt(2)), 4)
        0.1414
    """

    name, key, argument = "timescale", "weight_decay", "weight_decay_rule"

    def scaled(self, value, ratio, lr_factor):
        return value * ratio / lr_factor

    def value(self, optimizer):
        """The largest param group's (a group without decay stays at 0)."""
        return float(max(group["weight_decay"] for group in optimizer.param_groups))

    def check(self, optimizer, who):
        name = type(optimizer).__name__
        if any("weight_decay" not in group for group in optimizer.param_groups):
            raise LitCBSConfigError(f"{who}: {name} has no weight_decay to scale; set weight_decay_rule=None")
        if not any(group["weight_decay"] for group in optimizer.param_groups):
            raise LitCBSConfigError(
                f"{who}: every param group of {name} has weight_decay=0, so the rule would change nothing: give the "
                "optimizer a weight decay (e.g. AdamW(weight_decay=0.1)), or set weight_decay_rule=None"
            )
        if isinstance(optimizer, torch.optim.Adam) and not all(
            group.get("decoupled_weight_decay") for group in optimizer.param_groups
        ):
            raise LitCBSConfigError(
                f"{who}: {name}'s weight_decay is an L2 penalty that Adam's normalisation rescales, not the decoupled "
                "decay whose timescale the rule keeps: use torch.optim.AdamW (or Adam(decoupled_weight_decay=True)), "
                "or set weight_decay_rule=None"
            )


# The lowest beta2 the half_life rule moves Adam's beta2 to. Large-model recipes train at 0.95 and
# above (GPT-3, Llama, OLMo); below it the second-moment average spans few steps (a half-life of 13.5 at
# 0.95), and runs that scaled beta2 with the batch saw loss spikes once it fell lower and capped it at 0.95
# (the marin project: marin-community/marin#2447, and its recipe's clip to [0.95, 0.9999]).
BETA2_FLOOR = 0.95


class Beta2HalfLife(SettingRule):
    """beta2 -> beta2 ** k, never below ``floor``: the second-moment average keeps its half-life in tokens.

    ``floor`` (unitless; default ``BETA2_FLOOR``, 0.95; None: none): where beta2 ** k would fall below it,
    beta2 stays at the floor, or where it is already, at its value now (the rule never raises beta2 for a
    growing batch). A batch that shrinks after the floor held starts from the floor, not from where the
    rule alone would have been.

    Args:
        floor: the lowest beta2 the rule moves to, in (0, 1); None for no floor.

    Raises:
        LitCBSConfigError: ``floor`` outside (0, 1) and not None.

    Examples:
        >>> rule = Beta2HalfLife()
        >>> round(rule.scaled(0.99, ratio=2.0, lr_factor=1.0), 4)  # 0.99 ** 2
        0.9801
        >>> rule.scaled(0.96, ratio=4.0, lr_factor=1.0)  # 0.96 ** 4 = 0.849 is below the floor
        0.95
    """

    name, key, argument = "half_life", "beta2", "beta2_rule"

    def __init__(self, floor: float | None = BETA2_FLOOR):
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 < floor < 1):
            raise LitCBSConfigError(f"beta2_floor={floor!r} must lie in (0, 1) (Adam's beta2), or be None for no floor")
        self.floor = None if floor is None else float(floor)

    def scaled(self, value, ratio, lr_factor):
        moved = value**ratio
        return moved if self.floor is None else max(moved, min(value, self.floor))

    def held(self, value, ratio, lr_factor):
        moved, kept = value**ratio, self.scaled(value, ratio, lr_factor)
        if kept == moved:
            return None
        return (
            f"beta2_rule='half_life' would take beta2 from {value:.4g} to {moved:.4g} ({value:.4g} ** {ratio:g}), "
            f"below beta2_floor={self.floor:g}, so it stays at {kept:.4g}; "
            "set beta2_floor lower (or None) to let it fall"
        )

    def get(self, group):
        return group["betas"][1]

    def set(self, group, value):
        beta1, _, *rest = group["betas"]
        group["betas"] = (beta1, value, *rest)

    def check(self, optimizer, who):
        name = type(optimizer).__name__
        for i, group in enumerate(optimizer.param_groups):
            betas = group.get("betas")
            if betas is None or len(betas) < 2:
                raise LitCBSConfigError(
                    f"{who}: param group {i} of {name} has no Adam betas (beta1, beta2) to scale; set beta2_rule=None"
                )
            if isinstance(betas[1], torch.Tensor):
                raise LitCBSConfigError(
                    f"{who}: {name}'s beta2 is a tensor; give betas as floats, or set beta2_rule=None"
                )
        if not any(group["betas"][1] for group in optimizer.param_groups):
            raise LitCBSConfigError(
                f"{who}: every param group of {name} has beta2=0, which the rule leaves 0; set beta2_rule=None"
            )


WEIGHT_DECAY_RULES = {"timescale": WeightDecayTimescale}
BETA2_RULES = {"half_life": Beta2HalfLife}


_Rule = TypeVar("_Rule", bound=SettingRule)


def _get_setting_rule(argument: str, rule, rules: Mapping[str, type[_Rule]], **settings) -> _Rule | None:
    """The rule ``rule`` names (built with ``settings``), a rule object of those kinds, or None."""
    if rule is None or rule == "none":
        return None
    for kind in rules.values():  # a rule object of one of those kinds
        if isinstance(rule, kind):
            return rule
    if isinstance(rule, str) and rule in rules:
        return rules[rule](**settings)
    raise LitCBSConfigError(f"{argument}={rule!r} is unknown; use one of {sorted(rules)} or None (unchanged)")


# Entries of a param group that the LR rule (adam_sde) and the setting rules write.
SETTING_KEYS = ("betas", "eps", "weight_decay")


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's betas, eps and weight decay (those it has): what ``restore_settings`` puts back.

    Examples:
        >>> import torch
        >>> optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], betas=(0.9, 0.95), weight_decay=0.1)
        >>> saved = optimizer_settings(optimizer)
        >>> saved
        [{'betas': (0.9, 0.95), 'eps': 1e-08, 'weight_decay': 0.1}]
        >>> optimizer.param_groups[0]["weight_decay"] = 0.2  # a rule moved it
        >>> restore_settings(optimizer, saved)
        >>> optimizer.param_groups[0]["weight_decay"]
        0.1
    """
    return [{key: group[key] for key in SETTING_KEYS if key in group} for group in optimizer.param_groups]


def restore_settings(optimizer: torch.optim.Optimizer, settings: list[dict]) -> None:
    for group, saved in zip(optimizer.param_groups, settings):
        group.update({key: tuple(value) if key == "betas" else value for key, value in saved.items()})


@dataclasses.dataclass
class OptimizerRules:
    """Everything a batch change by ``ratio`` = new / old moves in an optimizer: the LR (``lr``, which
    for adam_sde also moves the betas and eps), and, when given, the weight decay and beta2.

    BatchWarmup applies it at every change and a CBS probe to each branch, so a branch at k x B
    trains as the run would after growing its batch k-fold.

    Examples:
        >>> import torch
        >>> optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, betas=(0.9, 0.99))
        >>> rules = OptimizerRules.build(lr_rule="sqrt", weight_decay_rule="timescale", beta2_rule="half_life")
        >>> rules.describe()
        "lr_rule='sqrt', weight_decay_rule='timescale', beta2_rule='half_life', beta2_floor=0.95"
        >>> round(rules.apply(optimizer, [], ratio=2.0), 4)  # the LR factor
        1.4142
        >>> {name: round(value, 4) for name, value in rules.values(optimizer).items()}
        {'batch/weight_decay': 0.0141, 'batch/beta2': 0.9801}
    """

    lr: LRRule
    weight_decay: WeightDecayTimescale | None = None
    beta2: Beta2HalfLife | None = None
    # Whether a setting's floor was said to hold (once per owner: BatchWarmup, or a probe's branches).
    floor_said: bool = dataclasses.field(default=False, repr=False, compare=False)

    @classmethod
    def build(cls, lr_rule="sqrt", weight_decay_rule=None, beta2_rule=None, beta2_floor=BETA2_FLOOR) -> OptimizerRules:
        """From the arguments BatchWarmup and CBSProbeCallback take (names, None, or rule objects);
        ``beta2_floor`` is the half_life rule's floor when ``beta2_rule`` names it.

        Args:
            lr_rule: as for ``get_lr_rule``.
            weight_decay_rule: ``"timescale"``, a ``WeightDecayTimescale``, or None/``"none"`` (unchanged).
            beta2_rule: ``"half_life"``, a ``Beta2HalfLife``, or None/``"none"`` (unchanged).
            beta2_floor: the half_life rule's floor (unitless, in (0, 1), or None).

        Returns:
            The rules.

        Raises:
            LitCBSConfigError: an unknown rule, or ``lr_rule="adam_sde"`` with a beta2 rule (both would move
                beta2).
        """
        rules = cls(
            get_lr_rule(lr_rule),
            _get_setting_rule("weight_decay_rule", weight_decay_rule, WEIGHT_DECAY_RULES),
            _get_setting_rule("beta2_rule", beta2_rule, BETA2_RULES, floor=beta2_floor),
        )
        if isinstance(rules.lr, AdamSDERule) and rules.beta2 is not None:
            raise LitCBSConfigError(
                "lr_rule='adam_sde' already moves beta2 (1 - beta2 -> k (1 - beta2)) and beta2_rule='half_life' would "
                "move it again: use lr_rule='sqrt' with beta2_rule='half_life', or beta2_rule=None"
            )
        return rules

    @property
    def settings(self) -> list[SettingRule]:
        """The rules for settings beside the LR."""
        return [rule for rule in (self.weight_decay, self.beta2) if rule is not None]

    def names(self) -> dict[str, str | float | None]:
        """``{"lr_rule": ..., "weight_decay_rule": ..., "beta2_rule": ...}``: the rules by the names users give,
        and with a beta2 rule its ``beta2_floor``."""
        names = {
            "lr_rule": self.lr.name,
            "weight_decay_rule": getattr(self.weight_decay, "name", None),
            "beta2_rule": getattr(self.beta2, "name", None),
        }
        if self.beta2 is not None:
            names["beta2_floor"] = self.beta2.floor
        return names

    def describe(self) -> str:
        """The rules as keyword arguments, for messages (the LR rule always, the others when given)."""
        return ", ".join(
            f"{argument}={name!r}"
            for argument, name in self.names().items()
            if name is not None or argument == "lr_rule"
        )

    def check(
        self,
        optimizer: torch.optim.Optimizer,
        schedulers: Iterable,
        ratios: Iterable[float],
        who: str,
        compose: bool = False,
    ) -> None:
        """Before training: LitCBSConfigError, its message starting with ``who``, unless every rule
        applies to ``optimizer`` and its LR ``schedulers`` at each batch ratio (``LRRule.check_ratios``)."""
        ratios = list(ratios)
        self.lr.check_ratios(optimizer, schedulers, ratios, who, compose)
        if any(ratio != 1 for ratio in ratios):
            for rule in self.settings:
                rule.check(optimizer, who)

    def apply(
        self,
        optimizer: torch.optim.Optimizer,
        schedulers: Iterable,
        ratio: float,
        warn: Callable[[str], None] | None = None,
    ) -> float:
        """Move every setting for a batch change by ``ratio``; return the LR factor applied. The first time a
        floor keeps a setting from where its rule alone would go, ``warn`` is called with why (once per rules)."""
        factor = self.lr.factor(ratio)
        scale_learning_rate(optimizer, schedulers, factor)
        self.lr.adjust_optimizer(optimizer, ratio)
        for rule in self.settings:
            for group in optimizer.param_groups:
                held = rule.held(float(rule.get(group)), ratio, factor)
                if held is not None and warn is not None and not self.floor_said:
                    self.floor_said = True
                    warn(held)
                rule.apply(group, ratio, factor)
        return factor

    def values(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """The settings these rules move, by metric name (``metrics.batch_setting``: ``batch/weight_decay``, ...)."""
        return {metrics.batch_setting(rule.key): rule.value(optimizer) for rule in self.settings}
