"""How the optimizer moves when the global batch changes by ``ratio = new / old``: ``OptimizerRules``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch.optim import Optimizer
from torch.optim import lr_scheduler as torch_sched

from lit_cbs import metrics
from lit_cbs._internals import inner_schedulers, scale_last_lr
from lit_cbs.errors import LitCBSConfigError

__all__ = ["BETA2_FLOOR", "LR_RULES", "OptimizerRules", "ScalingRule", "get_clip_rule", "get_lr_rule"]


def _unchanged(ratio: float) -> float:
    return 1.0


# Module-level functions, not lambdas, so rules pickle (ddp_spawn, checkpoints of callbacks).
RATIO_FUNCTIONS: dict[str, Callable[[float], float]] = {"sqrt": math.sqrt, "linear": float, "none": _unchanged}
LR_RULES = ("adam_sde", *RATIO_FUNCTIONS)  # adam_sde: LR x sqrt(k), 1 - beta -> k (1 - beta), eps -> eps / sqrt(k)
BETA2_FLOOR = 0.95  # the lowest beta2 the half_life rule moves Adam's beta2 to (docs/design.md, "Optimizer rules")


class ScalingRule:
    """A batch ratio (new / old global batch) -> a multiplier, of the LR or the gradient-clipping threshold."""

    def __init__(self, name: str, factor: Callable[[float], float]):
        self.name, self._factor = name, factor

    def factor(self, ratio: float) -> float:
        """The multiplier (finite, > 0) for a change by ``ratio`` (> 0)."""
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

    def adjust_optimizer(self, optimizer: Optimizer, ratio: float) -> None:
        """What an LR rule moves beside the LR: adam_sde's betas and eps."""
        if self.name == "adam_sde":
            for group in optimizer.param_groups:
                group["betas"] = tuple(1.0 - ratio * (1.0 - b) for b in group["betas"])
                group["eps"] = group["eps"] / math.sqrt(ratio)


LRRule = ScalingRule  # the LR's rule


def _rule(argument: str, rule: Any, names: Iterable[str], tail: str = "") -> ScalingRule:
    if isinstance(rule, ScalingRule):
        return rule
    if callable(rule):
        return ScalingRule(getattr(rule, "__name__", repr(rule)), rule)
    if not isinstance(rule, str):
        raise LitCBSConfigError(
            f"{argument} must be one of {sorted(names)}, a callable ratio -> factor{tail}, got {rule!r}"
        )
    if rule not in names:
        raise LitCBSConfigError(
            f"{argument}={rule!r} is unknown; use one of {sorted(names)} or a callable ratio -> factor{tail}"
        )
    return ScalingRule(rule, RATIO_FUNCTIONS.get(rule, math.sqrt))


def get_lr_rule(rule: str | Callable[[float], float] | ScalingRule) -> ScalingRule:
    """The LR rule ``rule`` names ("sqrt", "linear", "none", "adam_sde"), or a callable ratio -> factor as one."""
    return _rule("lr_rule", rule, LR_RULES)


def get_clip_rule(rule: str | Callable[[float], float] | ScalingRule | None) -> ScalingRule | None:
    """The gradient-clipping threshold's rule ("sqrt", "linear", a callable); None or "none": unchanged (None)."""
    return None if rule is None or rule == "none" else _rule("clip_rule", rule, RATIO_FUNCTIONS, ", or None")


# LR = base_lrs * f(step), or chained on the current LR: scaling the LRs and floors scales every later LR exactly.
_PROPORTIONAL = tuple(
    getattr(torch_sched, name)
    for name in ("LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR")
    + ("PolynomialLR", "CosineAnnealingLR", "ReduceLROnPlateau")
)
_CONTAINERS = (torch_sched.SequentialLR, torch_sched.ChainedScheduler)


def check_scheduler_supported(scheduler: Any, who: str) -> None:
    """LitCBSConfigError (from ``who``) if ``scale_learning_rate`` cannot compose with ``scheduler`` exactly."""
    if isinstance(scheduler, _CONTAINERS):
        for inner in inner_schedulers(scheduler):
            check_scheduler_supported(inner, who)
    elif isinstance(scheduler, torch_sched.OneCycleLR):
        raise LitCBSConfigError(
            f"{who}: OneCycleLR writes absolute LR values that a batch change cannot rescale; for the same LR curve "
            "set the optimizer's lr to max_lr and use LambdaLR(optimizer, lit_cbs.rules.lr_schedules.OneCycle("
            f"total={scheduler.total_steps}, pct_start=..., div_factor=..., final_div_factor=...)) with your "
            "OneCycleLR arguments (momentum is not cycled)"
        )
    elif not isinstance(scheduler, _PROPORTIONAL):  # TokenLRScheduler is a LambdaLR
        supported = [t.__name__ for t in _PROPORTIONAL + _CONTAINERS]
        raise LitCBSConfigError(
            f"{who}: {type(scheduler).__name__} keeps absolute LR values that a batch change cannot rescale exactly; "
            f"use one of {sorted(supported) + ['lit_cbs.rules.lr_schedules.TokenLRScheduler']}"
        )


def _scale_scheduler(scheduler: Any, factor: float) -> None:
    for inner in inner_schedulers(scheduler) if isinstance(scheduler, _CONTAINERS) else []:
        _scale_scheduler(inner, factor)
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    scale_last_lr(scheduler, factor)
    if isinstance(scheduler, torch_sched.CosineAnnealingLR):
        scheduler.eta_min *= factor
    if isinstance(scheduler, torch_sched.ReduceLROnPlateau):
        scheduler.min_lrs = [lr * factor for lr in scheduler.min_lrs]


def scale_learning_rate(optimizer: Optimizer, schedulers: Iterable[Any], factor: float) -> None:
    """Multiply the LR by ``factor`` now and in everything the LR ``schedulers`` will compute from it."""
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
    for scheduler in schedulers:
        _scale_scheduler(scheduler, factor)


def optimizer_settings(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Each param group's betas, eps and weight decay (those it has): what ``restore_settings`` puts back."""
    return [{key: g[key] for key in ("betas", "eps", "weight_decay") if key in g} for g in optimizer.param_groups]


def restore_settings(optimizer: Optimizer, settings: list[dict[str, Any]]) -> None:
    for group, saved in zip(optimizer.param_groups, settings):
        group.update({key: tuple(value) if key == "betas" else value for key, value in saved.items()})


@dataclasses.dataclass
class OptimizerRules:
    """What a batch change by ``ratio`` k = new / old moves in an optimizer: the LR, the weight decay ("timescale":
    lambda -> lambda k / f(k)) and beta2 ("half_life": beta2 -> beta2 ** k, not below ``beta2_floor``)."""

    lr: LRRule
    weight_decay_rule: str | None = None
    beta2_rule: str | None = None
    beta2_floor: float | None = None
    floor_said: bool = dataclasses.field(default=False, repr=False, compare=False)  # said once per owner

    @classmethod
    def build(
        cls,
        lr_rule: str | Callable[[float], float] | LRRule = "sqrt",
        weight_decay_rule: str | None = None,
        beta2_rule: str | None = None,
        beta2_floor: float | None = BETA2_FLOOR,
    ) -> OptimizerRules:
        """From the keyword arguments BatchWarmup and CBSProbeCallback take."""
        for argument, rule, name in (
            ("weight_decay_rule", weight_decay_rule, "timescale"),
            ("beta2_rule", beta2_rule, "half_life"),
        ):
            if rule not in (None, "none", name):
                raise LitCBSConfigError(f"{argument}={rule!r} is unknown; use one of {[name]} or None (unchanged)")
        lr = get_lr_rule(lr_rule)
        weight_decay, beta2 = (None if rule == "none" else rule for rule in (weight_decay_rule, beta2_rule))
        floor = None if beta2 is None else beta2_floor
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 < floor < 1):
            raise LitCBSConfigError(f"beta2_floor={floor!r} must lie in (0, 1) (Adam's beta2), or be None for no floor")
        if beta2 is not None and lr.name == "adam_sde":
            raise LitCBSConfigError(
                "lr_rule='adam_sde' already moves beta2 (1 - beta2 -> k (1 - beta2)) and beta2_rule='half_life' "
                "would move it again: use lr_rule='sqrt' with beta2_rule='half_life', or beta2_rule=None"
            )
        return cls(lr, weight_decay, beta2, None if floor is None else float(floor))

    @property
    def settings(self) -> list[str]:
        """The settings moved beside the LR: ``"weight_decay"``, ``"beta2"`` (logged as ``batch/<key>``)."""
        return [key for key in ("weight_decay", "beta2") if self.rule_name(key)]

    def rule_name(self, key: str) -> str | None:
        return self.weight_decay_rule if key == "weight_decay" else self.beta2_rule

    def names(self) -> dict[str, str | float | None]:
        """The rules by the keyword arguments that name them (``beta2_floor`` with a beta2 rule)."""
        names: dict[str, str | float | None] = {"lr_rule": self.lr.name, "weight_decay_rule": self.weight_decay_rule}
        names["beta2_rule"] = self.beta2_rule
        return names if self.beta2_rule is None else {**names, "beta2_floor": self.beta2_floor}

    def describe(self) -> str:
        """The rules as keyword arguments, for messages (the LR rule always, the others when given)."""
        return ", ".join(f"{k}={v!r}" for k, v in self.names().items() if v is not None or k == "lr_rule")

    @staticmethod
    def get(key: str, group: dict[str, Any]) -> float:
        """Setting ``key`` of param group ``group``."""
        return cast(float, group["betas"][1] if key == "beta2" else group[key])

    def value(self, key: str, optimizer: Optimizer) -> float:
        """Setting ``key`` now, as logged: the largest param group's weight decay, param group 0's beta2."""
        if key == "weight_decay":
            return float(max(group["weight_decay"] for group in optimizer.param_groups))
        return float(self.get(key, optimizer.param_groups[0]))

    def values(self, optimizer: Optimizer) -> dict[str, float]:
        """The settings these rules move, by metric name (``batch/weight_decay``, ``batch/beta2``)."""
        return {metrics.batch_setting(key): self.value(key, optimizer) for key in self.settings}

    def check(
        self, optimizer: Optimizer, schedulers: Iterable[Any], ratios: Iterable[float], who: str, compose: bool = False
    ) -> None:
        """LitCBSConfigError (from ``who``) unless the rules apply at each ratio, alone or (``compose``) in turn."""
        ratios, name, groups = list(ratios), type(optimizer).__name__, optimizer.param_groups
        if any(self.lr.factor(ratio) != 1.0 for ratio in ratios):
            for scheduler in schedulers:
                check_scheduler_supported(scheduler, who)
        if ratios and self.lr.name == "adam_sde":
            for i, group in enumerate(groups):
                if "betas" not in group or "eps" not in group:
                    raise LitCBSConfigError(
                        f"{who}: lr_rule='adam_sde' needs an Adam-type optimizer (param group {i} of "
                        f"{name} has no 'betas'/'eps'); use lr_rule='sqrt' or 'linear'"
                    )
            # The largest batch ratio, one change or several compounded, that keeps every beta >= 0.
            limit = float(min(1.0 / (1.0 - beta) for group in groups for beta in group["betas"]))
            total = 1.0
            for ratio in ratios:
                total = total * ratio if compose else ratio  # compounded: 1 - beta -> r1 r2 ... (1 - beta)
                if total > limit:
                    reached = f"the batch grows {total:g}x over its changes" if compose else f"batch ratio {ratio:g}"
                    betas = ", ".join(str(b) for b in sorted({tuple(group["betas"]) for group in groups}))
                    raise LitCBSConfigError(
                        f"{who}: {reached} is above {limit:.4g}, the largest safe batch ratio for {name} betas {betas} "
                        "(beta becomes 1 - ratio x (1 - beta), which must stay >= 0): keep batch ratios "
                        f"<= {limit:.4g}, start from larger betas, or use lr_rule='sqrt'"
                    )
        if all(ratio == 1 for ratio in ratios):
            return
        if self.weight_decay_rule is not None:
            if any("weight_decay" not in group for group in groups):
                raise LitCBSConfigError(f"{who}: {name} has no weight_decay to scale; set weight_decay_rule=None")
            if not any(group["weight_decay"] for group in groups):
                raise LitCBSConfigError(
                    f"{who}: every param group of {name} has weight_decay=0, so the rule would change nothing: give "
                    "the optimizer a weight decay (e.g. AdamW(weight_decay=0.1)), or set weight_decay_rule=None"
                )
            if isinstance(optimizer, torch.optim.Adam) and not all(g.get("decoupled_weight_decay") for g in groups):
                raise LitCBSConfigError(
                    f"{who}: {name}'s weight_decay is an L2 penalty that Adam's normalisation rescales, not the "
                    "decoupled decay whose timescale the rule keeps: use torch.optim.AdamW (or "
                    "Adam(decoupled_weight_decay=True)), or set weight_decay_rule=None"
                )
        if self.beta2_rule is not None:
            for i, group in enumerate(groups):
                if group.get("betas") is None or len(group["betas"]) < 2:
                    raise LitCBSConfigError(
                        f"{who}: param group {i} of {name} has no Adam betas (beta1, beta2) to scale; "
                        "set beta2_rule=None"
                    )
                if isinstance(group["betas"][1], torch.Tensor):
                    raise LitCBSConfigError(
                        f"{who}: {name}'s beta2 is a tensor; give betas as floats, or set beta2_rule=None"
                    )
            if not any(group["betas"][1] for group in groups):
                raise LitCBSConfigError(
                    f"{who}: every param group of {name} has beta2=0, which the rule leaves 0; set beta2_rule=None"
                )

    def apply(
        self, optimizer: Optimizer, schedulers: Iterable[Any], ratio: float, warn: Callable[[str], None] | None = None
    ) -> float:
        """Move every setting for a change by ``ratio``; return the LR factor. ``warn``: the beta2 floor held (once)."""
        factor = self.lr.factor(ratio)
        scale_learning_rate(optimizer, schedulers, factor)
        self.lr.adjust_optimizer(optimizer, ratio)
        for key in self.settings:
            for group in optimizer.param_groups:
                value = float(self.get(key, group))
                if key == "weight_decay":
                    group[key] = value * ratio / factor  # AdamW's timescale B / (eta lambda D) stays
                    continue
                moved = float(value**ratio)  # beta2's half-life in tokens stays
                new = moved if self.beta2_floor is None else max(moved, min(value, self.beta2_floor))
                group["betas"] = (group["betas"][0], new, *group["betas"][2:])
                if new != moved and warn is not None and not self.floor_said:
                    self.floor_said = True
                    warn(
                        f"beta2_rule='half_life' would take beta2 from {value:.4g} to {value**ratio:.4g} "
                        f"({value:.4g} ** {ratio:g}), below beta2_floor={self.beta2_floor:g}, so it stays at "
                        f"{new:.4g}; set beta2_floor lower (or None) to let it fall"
                    )
        return factor
