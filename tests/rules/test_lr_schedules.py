"""Token-indexed LR schedules."""

import io
import math

import pytest
import torch

from lit_cbs.errors import LitCBSConfigError, LitCBSConfigWarning
from lit_cbs.rules.lr_schedules import CosineSchedule, StepDecay, TokenLRScheduler, WarmupStableDecay


def test_wsd_shape():
    wsd = WarmupStableDecay(warmup_tokens=100, total_tokens=1000, decay_tokens=200, min_lr_ratio=0.1)
    assert wsd(0) == pytest.approx(1 / 101)
    assert wsd(99) == pytest.approx(100 / 101)
    assert wsd(100) == wsd(500) == wsd(800) == 1.0
    assert wsd(900) == pytest.approx(0.1 + 0.9 * 0.5)
    assert wsd(1000) == wsd(5000) == pytest.approx(0.1)


@pytest.mark.parametrize("shape, midpoint", [("linear", 0.5), ("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5))])
def test_wsd_decay_shapes(shape, midpoint):
    wsd = WarmupStableDecay(warmup_tokens=0, total_tokens=100, decay_tokens=100, decay_shape=shape)
    assert wsd(50) == pytest.approx(midpoint)


def test_cosine_shape():
    cosine = CosineSchedule(warmup_tokens=10, total_tokens=110, min_lr_ratio=0.1)
    assert cosine(10) == pytest.approx(1.0)
    assert cosine(60) == pytest.approx(0.55)
    assert cosine(110) == cosine(10_000) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: WarmupStableDecay(600, 1000, 500), "exceeds total_tokens=1000"),
        (lambda: WarmupStableDecay(0, 0), "total_tokens=0"),
        (lambda: WarmupStableDecay(0, 100, min_lr_ratio=1.5), "min_lr_ratio=1.5"),
        (lambda: WarmupStableDecay(0, 100, 10, decay_shape="step"), "decay_shape='step'"),
        (
            lambda: CosineSchedule(100, 100),
            r"warmup_tokens=100 leaves no tokens of total_tokens=100 for the cosine decay; shorten the warmup "
            r"\(a tenth of the run: warmup_tokens=10\) or lengthen total_tokens",
        ),
        (lambda: StepDecay(200, [], 100), "warmup_tokens=200 exceeds total_tokens=100: the LR never reaches its peak"),
        (lambda: CosineSchedule(-1, 100), "warmup_tokens=-1"),
    ],
)
def test_bad_schedules(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make", [lambda: WarmupStableDecay(100, 100), lambda: StepDecay(100, [], 100)])
def test_a_warmup_as_long_as_the_run_trains_with_a_warning_naming_the_fix(make):
    with pytest.warns(LitCBSConfigWarning) as caught:
        schedule = make()
    (warning,) = caught
    assert str(warning.message) == (
        "warmup_tokens=100 is the whole run (total_tokens=100): the LR rises until the last token and never trains at "
        "its base value; shorten the warmup (a tenth of the run: warmup_tokens=10) or lengthen total_tokens"
    )
    assert schedule(99) < 1.0 == schedule(100)


def test_a_warmup_that_leaves_room_for_the_decay_alone_is_a_schedule_like_any_other(recwarn):
    WarmupStableDecay(warmup_tokens=50, total_tokens=100, decay_tokens=50)  # up, then straight down
    assert not [w for w in recwarn if issubclass(w.category, LitCBSConfigWarning)]


def test_token_scheduler_follows_tokens_not_steps():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.2)
    scheduler = TokenLRScheduler(optimizer, WarmupStableDecay(warmup_tokens=0, total_tokens=1000, decay_tokens=1000))
    for tokens in (100, 300, 700):  # uneven tokens per step, as after a batch change
        optimizer.step()
        scheduler.tokens_seen = tokens
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * (1 - tokens / 1000))
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # plain values only: the schedule is rebuilt with the scheduler
    restored = TokenLRScheduler(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.2), scheduler.schedule)
    restored.load_state_dict(state)
    assert restored.tokens_seen == 700 and restored.get_last_lr() == scheduler.get_last_lr()


def test_token_scheduler_refuses_to_step_blind():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.2)
    scheduler = TokenLRScheduler(optimizer, CosineSchedule(10, 100))
    optimizer.step()
    with pytest.raises(
        LitCBSConfigError,
        match=r"add lit_cbs.BatchWarmup \(a growing batch\) or lit_cbs.callbacks.BatchAccounting\(seq_len=...\)",
    ):
        scheduler.step()


def test_batch_accounting_alone_feeds_the_token_scheduler_of_a_fixed_batch_run():
    import lightning.pytorch as pl
    from toys import RegressionData, RegressionModule, trainer_kwargs

    from lit_cbs.callbacks import BatchAccounting

    def schedule(tokens):
        return 1.0 - tokens / 1000

    module = RegressionModule(scheduler_factory=lambda optimizer: TokenLRScheduler(optimizer, schedule))
    pl.Trainer(**trainer_kwargs(callbacks=[BatchAccounting(seq_len=3)], max_steps=10)).fit(
        module, RegressionData(n=96, batch_size=4)
    )
    # Step i trains at the LR of the tokens before it: 4 samples x 3 tokens per step.
    assert [step["lr"] for step in module.steps] == pytest.approx([0.05 * schedule(12 * i) for i in range(10)])
    with pytest.raises(
        LitCBSConfigError, match="tokens_seen was never set"
    ):  # no lit_cbs callback: the first step says so
        pl.Trainer(**trainer_kwargs(max_steps=10)).fit(
            RegressionModule(scheduler_factory=module.scheduler_factory), RegressionData(n=96, batch_size=4)
        )
