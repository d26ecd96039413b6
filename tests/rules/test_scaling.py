"""LR rules and their composition with PyTorch LR schedulers (pure torch, no Trainer)."""

import math

import pytest
import torch
from torch.optim import lr_scheduler as sched

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.rules.lr_schedules import CosineSchedule, TokenLRScheduler, WarmupStableDecay
from lit_cbs.rules.scaling import (
    OptimizerRules,
    ScalingRule,
    check_scheduler_supported,
    get_clip_rule,
    get_lr_rule,
    scale_learning_rate,
)


@pytest.mark.parametrize(
    "name, ratio, factor",
    [("sqrt", 4, 2.0), ("linear", 4, 4.0), ("none", 4, 1.0), ("adam_sde", 4, 2.0), ("sqrt", 0.25, 0.5)],
)
def test_named_rules(name, ratio, factor):
    assert get_lr_rule(name).factor(ratio) == pytest.approx(factor)


def test_callable_rule_and_bad_rules():
    assert get_lr_rule(lambda r: r**0.25).factor(16) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="lr_rule='cubic' is unknown"):
        get_lr_rule("cubic")
    with pytest.raises(TypeError, match="callable"):
        get_lr_rule(3)
    with pytest.raises(ValueError, match="finite and > 0"):
        get_lr_rule(lambda r: -1.0).factor(2)


def test_the_clip_rule_is_a_scaling_rule_not_an_lr_rule():
    rule = get_clip_rule("sqrt")
    assert type(rule) is ScalingRule and rule.factor(4) == 2.0 and repr(rule) == "ScalingRule('sqrt')"
    assert get_clip_rule(lambda r: r).factor(3) == 3.0 and get_clip_rule(rule) is rule
    assert get_clip_rule("none") is None and isinstance(get_lr_rule("sqrt"), ScalingRule)


ADAM_SDE = "CBSProbeCallback(lr_rule='adam_sde')"


def test_adam_sde_names_the_largest_safe_ratio_for_each_ratio_on_its_own():
    rule = OptimizerRules.build("adam_sde")
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), betas=(0.9, 0.95))
    message = (
        r"^CBSProbeCallback\(lr_rule='adam_sde'\): batch ratio 16 is above 10, the largest safe batch ratio for "
        r"AdamW betas \(0.9, 0.95\) .* keep batch ratios <= 10, start from larger betas, or use lr_rule='sqrt'$"
    )
    with pytest.raises(LitCBSConfigError, match=message):
        rule.check(optimizer, [], [1, 2, 4, 8, 16], ADAM_SDE)
    # Each ratio on its own (a probe's branches all start from the same state): 2 x 4 x 8 = 64 is not reached.
    rule.check(optimizer, [], [1, 2, 4, 8], ADAM_SDE)
    rule.check(optimizer, [], [10], ADAM_SDE)  # the limit itself: beta1 becomes 0, still valid
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)  # checking changes nothing
    # Composed (BatchWarmup's changes one after another), the running product counts.
    with pytest.raises(LitCBSConfigError, match="the batch grows 16x over its changes is above 10"):
        rule.check(optimizer, [], [2, 2, 2, 2], "BatchWarmup(lr_rule='adam_sde')", compose=True)
    rule.check(optimizer, [], [2, 2, 2, 0.5, 2], "BatchWarmup(lr_rule='adam_sde')", compose=True)


def test_adam_sde_limit_is_the_smallest_over_param_groups():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam([{"params": [model.weight]}, {"params": [model.bias], "betas": (0.5, 0.999)}])
    with pytest.raises(LitCBSConfigError, match=r"batch ratio 4 is above 2, .*betas \(0.5, 0.999\), \(0.9, 0.999\)"):
        OptimizerRules.build("adam_sde").check(optimizer, [], [4], ADAM_SDE)


def test_adam_sde_refuses_an_optimizer_without_betas():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(
        LitCBSConfigError, match=r"^CBSProbeCallback\(lr_rule='adam_sde'\): .*needs an Adam-type optimizer"
    ):
        OptimizerRules.build("adam_sde").check(optimizer, [], [2], ADAM_SDE)


def test_plain_rules_have_no_ratio_limit():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    OptimizerRules.build("sqrt").check(optimizer, [], [1024], "CBSProbeCallback(lr_rule='sqrt')")
    OptimizerRules.build("linear").check(optimizer, [], [1024, 1024], "BatchWarmup(lr_rule='linear')", compose=True)


def test_the_half_life_rule_keeps_beta2_at_its_floor():
    floored, free = (
        OptimizerRules.build(beta2_rule="half_life"),
        OptimizerRules.build(beta2_rule="half_life", beta2_floor=None),
    )

    def beta2_after(rules, beta2, ratio):
        optimizer = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), betas=(0.9, beta2))
        rules.apply(optimizer, [], ratio)
        return optimizer.param_groups[0]["betas"][1]

    assert floored.beta2_floor == 0.95 and beta2_after(floored, 0.99, 2) == 0.99**2  # the rule alone
    assert beta2_after(floored, 0.95, 16) == 0.95 and beta2_after(free, 0.95, 16) == 0.95**16
    assert beta2_after(floored, 0.9, 2) == 0.9  # already below the floor: it does not fall further
    assert beta2_after(floored, 0.95, 0.5) == 0.95**0.5  # a smaller batch raises it as the rule says
    warnings = []
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), betas=(0.9, 0.99))
    floored.apply(optimizer, [], 2, warn=warnings.append)  # 0.99 ** 2: above the floor, nothing said
    free.apply(optimizer, [], 16, warn=warnings.append)  # no floor, nothing said
    assert not warnings
    optimizer.param_groups[0]["betas"] = (0.9, 0.95)
    floored.apply(optimizer, [], 2, warn=warnings.append)
    floored.apply(optimizer, [], 2, warn=warnings.append)  # said once
    (held,) = warnings
    assert held.startswith("beta2_rule='half_life' would take beta2 from 0.95 to 0.9025 (0.95 ** 2), below")
    assert held.endswith("so it stays at 0.95; set beta2_floor lower (or None) to let it fall")
    # Part of the rule: a probe beside a BatchWarmup with another floor is refused (its rules' names differ).
    assert OptimizerRules.build(beta2_rule="half_life", beta2_floor=0.9).names() == {
        "lr_rule": "sqrt",
        "weight_decay_rule": None,
        "beta2_rule": "half_life",
        "beta2_floor": 0.9,
    }
    for floor in (0.0, 1.0, True, "0.9"):
        with pytest.raises(LitCBSConfigError, match=r"^beta2_floor=.* must lie in \(0, 1\)"):
            OptimizerRules.build(beta2_rule="half_life", beta2_floor=floor)


def test_unsupported_scheduler_is_refused_at_every_ratio_that_changes_the_lr():
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), betas=(0.9, 0.95))
    one_cycle = sched.OneCycleLR(optimizer, max_lr=0.1, total_steps=100)
    with pytest.raises(LitCBSConfigError, match=r"^CBSProbeCallback\(lr_rule='sqrt'\): OneCycleLR writes absolute LR"):
        OptimizerRules.build("sqrt").check(optimizer, [one_cycle], [1, 2], "CBSProbeCallback(lr_rule='sqrt')")
    # A factor of 1 rescales nothing, so it composes with any scheduler.
    OptimizerRules.build("sqrt").check(optimizer, [one_cycle], [1], "CBSProbeCallback(lr_rule='sqrt')")
    OptimizerRules.build("none").check(optimizer, [one_cycle], [2, 4], "CBSProbeCallback(lr_rule='none')")


def _lrs(make_scheduler, scale_at=None, factor=1.0, steps=30):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = make_scheduler(optimizer)
    lrs = []
    for step in range(steps):
        if step == scale_at:
            scale_learning_rate(optimizer, [scheduler], factor)
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if isinstance(scheduler, TokenLRScheduler):
            scheduler.tokens_seen = (step + 1) * 100
        scheduler.step()
    return lrs


SCHEDULERS = {
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda s: 0.97**s),
    "StepLR": lambda o: sched.StepLR(o, step_size=7, gamma=0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[5, 20], gamma=0.3),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.95),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.2, total_iters=15),
    "ConstantLR": lambda o: sched.ConstantLR(o, factor=0.5, total_iters=12),
    "PolynomialLR": lambda o: sched.PolynomialLR(o, total_iters=25, power=2.0),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=25, eta_min=0.01),
    "SequentialLR": lambda o: sched.SequentialLR(
        o,
        [sched.LinearLR(o, start_factor=0.1, total_iters=6), sched.CosineAnnealingLR(o, T_max=20, eta_min=0.002)],
        milestones=[6],
    ),
    "ChainedScheduler": lambda o: sched.ChainedScheduler(
        [sched.ConstantLR(o, factor=0.5, total_iters=4), sched.ExponentialLR(o, gamma=0.9)]
    ),
    "TokenWSD": lambda o: TokenLRScheduler(
        o, WarmupStableDecay(warmup_tokens=500, total_tokens=3000, decay_tokens=1000)
    ),
    "TokenCosine": lambda o: TokenLRScheduler(o, CosineSchedule(warmup_tokens=500, total_tokens=3000)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("scale_at", [0, 3, 10])
def test_scaling_composes_with_scheduler(name, scale_at):
    """After scaling by f at step s, every later LR is f times the unscaled schedule's LR."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = _lrs(SCHEDULERS[name])
        scaled = _lrs(SCHEDULERS[name], scale_at=scale_at, factor=math.sqrt(2))
    for step, (a, b) in enumerate(zip(plain, scaled)):
        assert b == pytest.approx(a * (math.sqrt(2) if step >= scale_at else 1.0), rel=1e-9), step


def test_unsupported_schedulers_are_named():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"^BatchWarmup: CyclicLR keeps absolute LR values"):
        check_scheduler_supported(sched.CyclicLR(optimizer, base_lr=0.01, max_lr=0.1), "BatchWarmup")
    check_scheduler_supported(SCHEDULERS["SequentialLR"](optimizer), "BatchWarmup")
