"""WarmupCore driven by a plain PyTorch loop (no Lightning): the batch follows the schedule, the LR its rule,
and a run resumed from the core's state_dict goes on exactly."""

import copy
import math

import pytest
import torch

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.rules.batch_schedules import PiecewiseBatch
from lit_cbs.rules.warmup_core import WarmupCore

LR = 1e-2
SCHEDULE = dict(batch_sizes=[8, 16, 48], thresholds=[0, 48, 160], unit="samples")


def build():
    torch.manual_seed(0)
    data = torch.randn(2048, 6)
    targets = data @ torch.randn(6, 1) + 0.1 * torch.randn(2048, 1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    core = WarmupCore(PiecewiseBatch(**SCHEDULE), lr_rule="sqrt", max_micro_batch_size=8, weight_decay_rule="timescale")
    core.start(micro_batch_size=4)
    return data, targets, model, optimizer, scheduler, core


def train(steps, resume_at=None):
    """Train ``steps`` optimizer steps; at step ``resume_at`` save everything, rebuild and load it, as a new
    process would. Each step's row: (global batch, accumulation, micro-batch, samples before it, LR)."""
    data, targets, model, optimizer, scheduler, core = build()
    samples, rows = 0, []
    for step in range(1, steps + 1):
        if step == resume_at:
            saved = copy.deepcopy(
                (core.state_dict(), model.state_dict(), optimizer.state_dict(), scheduler.state_dict(), samples)
            )
            data, targets, model, optimizer, scheduler, core = build()
            core.load_state_dict(saved[0])
            model.load_state_dict(saved[1])
            optimizer.load_state_dict(saved[2])
            scheduler.load_state_dict(saved[3])
            samples = saved[4]
        rows.append(
            (core.global_batch, core.accumulate, core.micro_batch_size, samples, optimizer.param_groups[0]["lr"])
        )
        for _ in range(core.accumulate):
            x, y = data[samples : samples + core.micro_batch_size], targets[samples : samples + core.micro_batch_size]
            (torch.nn.functional.mse_loss(model(x), y) / core.accumulate).backward()
            samples += core.micro_batch_size
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        core.after_step([optimizer], step, samples_seen=samples, schedulers=[scheduler])
    return rows, model, optimizer, core


def test_a_plain_loop_follows_the_schedule_and_the_lr_rule():
    rows, _, optimizer, core = train(20)
    schedule = PiecewiseBatch(**SCHEDULE)
    for global_batch, accumulate, micro, before, lr in rows:
        assert micro * accumulate == global_batch and micro == 8  # max_micro_batch_size, then accumulation
        # The batch the schedule asked for, from the first step where the samples so far are a multiple of it.
        wanted = schedule.batch_size(before)
        assert global_batch == wanted or (before % wanted and global_batch < wanted)
        assert lr == pytest.approx(LR * math.sqrt(global_batch / 8), rel=1e-12)
    assert [(c.step, c.old_global_batch, c.new_global_batch) for c in core.history] == [(6, 8, 16), (15, 16, 48)]
    assert core.history[1].requested_at_samples == 160 and core.history[1].samples_seen == 192  # 4 x 48
    # timescale: weight decay x k / sqrt(k) = x sqrt(k) at each change
    assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.1 * math.sqrt(6))
    assert core.lr_factor == pytest.approx(math.sqrt(6))


@pytest.mark.parametrize("resume_at", [3, 6, 7, 14, 15, 16])
def test_resuming_from_the_core_state_dict_gives_the_same_run(resume_at):
    rows, model, _, core = train(20)
    resumed_rows, resumed_model, _, resumed_core = train(20, resume_at=resume_at)
    assert resumed_rows == rows and resumed_core.history == core.history
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def test_the_core_refuses_what_it_cannot_split():
    core = WarmupCore(PiecewiseBatch([8, 12], [0, 40], unit="samples"))
    with pytest.raises(LitCBSConfigError, match="scheduled global batch 12 is not a multiple of micro-batch 8"):
        core.start(micro_batch_size=8)
    with pytest.raises(LitCBSConfigError, match="max_micro_batch_size=2 is smaller than"):
        WarmupCore(PiecewiseBatch(**SCHEDULE), max_micro_batch_size=2).start(micro_batch_size=4)
    core = WarmupCore(PiecewiseBatch(**SCHEDULE), lr_rule="sqrt")
    core.start(micro_batch_size=8)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    assert core.check_optimizers([optimizer], [], consumed=0) == [2.0, 3.0]  # 8 -> 16 -> 48
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=100)
    with pytest.raises(LitCBSConfigError, match=r"^BatchWarmup\(lr_rule='sqrt'\): OneCycleLR writes absolute LR"):
        core.check_optimizers([optimizer], [one_cycle], consumed=0)
