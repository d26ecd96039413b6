"""LR rules and their composition with PyTorch LR schedulers (pure torch, no Trainer)."""

import math

import pytest
import torch
from torch.optim import lr_scheduler as sched

from lit_cbs.lr_rules import check_scheduler_supported, get_lr_rule, scale_learning_rate
from lit_cbs.lr_schedules import CosineSchedule, TokenLRScheduler, WarmupStableDecay


@pytest.mark.parametrize("name, ratio, factor", [("sqrt", 4, 2.0), ("linear", 4, 4.0), ("none", 4, 1.0), ("adam_sde", 4, 2.0), ("sqrt", 0.25, 0.5)])
def test_named_rules(name, ratio, factor):
    assert get_lr_rule(name).lr_factor(ratio) == pytest.approx(factor)


def test_callable_rule_and_bad_rules():
    assert get_lr_rule(lambda r: r**0.25).lr_factor(16) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="lr_rule='cubic' is unknown"):
        get_lr_rule("cubic")
    with pytest.raises(TypeError, match="callable"):
        get_lr_rule(3)
    with pytest.raises(ValueError, match="finite and > 0"):
        get_lr_rule(lambda r: -1.0).lr_factor(2)


def test_adam_sde_refuses_betas_out_of_range():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters(), betas=(0.5, 0.999))
    with pytest.raises(ValueError, match="betas"):
        get_lr_rule("adam_sde").check_optimizer(optimizer, [2.0, 2.0])  # 1 - 4 * 0.5 < 0
    with pytest.raises(TypeError, match="Adam-type"):
        get_lr_rule("adam_sde").check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), [2.0])


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
        o, [sched.LinearLR(o, start_factor=0.1, total_iters=6), sched.CosineAnnealingLR(o, T_max=20, eta_min=0.002)], milestones=[6]
    ),
    "ChainedScheduler": lambda o: sched.ChainedScheduler([sched.ConstantLR(o, factor=0.5, total_iters=4), sched.ExponentialLR(o, gamma=0.9)]),
    "TokenWSD": lambda o: TokenLRScheduler(o, WarmupStableDecay(warmup_tokens=500, total_tokens=3000, decay_tokens=1000)),
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
    with pytest.raises(TypeError, match="CyclicLR"):
        check_scheduler_supported(sched.CyclicLR(optimizer, base_lr=0.01, max_lr=0.1))
    check_scheduler_supported(SCHEDULERS["SequentialLR"](optimizer))
