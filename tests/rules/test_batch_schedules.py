"""Batch-size schedules (pure): semantics, Megatron's ramp, and argument validation."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from toys import megatron_reference

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.rules.batch_schedules import ConstantBatch, ExponentialRamp, LinearRamp, PiecewiseBatch, Seesaw
from lit_cbs.rules.lr_schedules import CosineSchedule, OneCycle, StepDecay, WarmupStableDecay


def test_piecewise_qwen3_style_token_schedule():
    # Zhou et al.: 2M -> 4M -> 5M -> 6M tokens per batch, switching every 125B tokens (4096-token sequences).
    seq = 4096
    sizes = [2_000_000 // seq * 1, 4_000_000 // seq, 5_000_000 // seq, 6_000_000 // seq]
    schedule = PiecewiseBatch(sizes, [0, 125_000_000_000, 250_000_000_000, 375_000_000_000], unit="tokens")
    assert schedule.batch_size(0) == sizes[0]
    assert schedule.batch_size(124_999_999_999) == sizes[0]
    assert schedule.batch_size(125_000_000_000) == sizes[1]
    assert schedule.batch_size(10**15) == sizes[3]
    assert schedule.sizes(200_000_000_000) == sizes[1:]


def test_piecewise_olmo_doubling_schedule():
    schedule = PiecewiseBatch([1024, 2048, 4096], [0, 168_000_000_000, 503_000_000_000], unit="tokens")
    assert [schedule.batch_size(t) for t in (0, 168e9 - 1, 168e9, 503e9)] == [1024, 1024, 2048, 4096]
    assert not schedule.is_constant and ConstantBatch(8).is_constant


@given(
    start=st.integers(1, 64),
    steps=st.integers(1, 40),
    increment=st.integers(1, 32),
    ramp=st.integers(1, 10**7),
    consumed=st.integers(0, 2 * 10**7),
)
def test_linear_ramp_equals_megatron(start, steps, increment, ramp, consumed):
    final = start + steps * increment
    schedule = LinearRamp(start=start, increment=increment, ramp=ramp, final=final)
    expected = megatron_reference(consumed, start, increment, ramp, final)
    assert schedule.batch_size(consumed) == expected
    assert schedule.batch_size(consumed) in schedule.sizes(0)


def test_linear_ramp_gpt3_like_numbers():
    schedule = LinearRamp(start=16, increment=8, ramp=300_000, final=1024, unit="samples")
    per_increment = 300_000 * 8 / (1024 - 16)
    assert schedule.batch_size(0) == 16
    assert schedule.batch_size(math.ceil(per_increment)) == 24
    assert schedule.batch_size(300_001) == 1024


@given(consumed=st.lists(st.integers(0, 10**6), min_size=2, max_size=20))
def test_exponential_ramp_is_monotone_and_rounded(consumed):
    schedule = ExponentialRamp(start=16, final=256, ramp=500_000, unit="tokens", multiple_of=16)
    values = [schedule.batch_size(c) for c in sorted(consumed)]
    assert values == sorted(values)
    assert all(v % 16 == 0 and 16 <= v <= 256 for v in values)


def test_exponential_ramp_is_geometric():
    schedule = ExponentialRamp(start=16, final=256, ramp=1000, multiple_of=1)
    assert schedule.batch_size(500) == 64  # halfway in log space: sqrt(16 * 256)
    assert schedule.batch_size(250) == 32
    assert schedule.batch_size(1000) == 256


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: PiecewiseBatch([], [], unit="tokens"), ValueError, "batch_sizes is empty"),
        (lambda: PiecewiseBatch([1, 2], [0], unit="tokens"), ValueError, "one threshold"),
        (lambda: PiecewiseBatch([1, 2], [5, 10]), ValueError, r"thresholds\[0\]=5 must be 0"),
        (lambda: PiecewiseBatch([1, 2, 4], [0, 10, 10]), ValueError, "strictly increase"),
        (lambda: PiecewiseBatch([1, 0], [0, 10]), ValueError, r"batch_sizes\[1\]=0 must be a positive"),
        (lambda: PiecewiseBatch([1, 2.5], [0, 10]), TypeError, r"batch_sizes\[1\]=2.5 must be a positive int"),
        (lambda: PiecewiseBatch([1, 2], [0, 10], unit="steps"), ValueError, "unit='steps'"),
        (lambda: ConstantBatch(-2), ValueError, "batch_size=-2"),
        (lambda: LinearRamp(16, 8, 1000, 16), ValueError, "final=16 must be larger than start=16"),
        (lambda: LinearRamp(16, 8, 1000, 100), ValueError, "multiple of increment=8"),
        (lambda: LinearRamp(16, 8, 0, 64), ValueError, "ramp=0"),
        (
            lambda: ExponentialRamp(16, 100, 1000, multiple_of=16),
            ValueError,
            "final=100 must be a multiple of multiple_of=16; nearest: 96 or 112",
        ),
        (lambda: ExponentialRamp(16, 8, 1000), ValueError, "final=8 must be larger"),
    ],
)
def test_bad_schedules_fail_with_the_field_named(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_negative_consumed_is_refused():
    with pytest.raises(ValueError, match="consumed=-1"):
        ConstantBatch(4).batch_size(-1)


# ---------------------------------------------------------------- Seesaw
@pytest.mark.parametrize(
    "lr_schedule",
    [
        CosineSchedule(262_144, 4_194_304, min_lr_ratio=0.1),
        WarmupStableDecay(262_144, 4_194_304, decay_tokens=838_861),
        WarmupStableDecay(1000, 10_000, decay_tokens=5000, decay_shape="sqrt"),
    ],
)
def test_seesaw_grows_the_batch_where_the_lr_schedule_first_falls_by_each_factor(lr_schedule):
    seesaw = Seesaw(lr_schedule, start=16, max_batch_size=128)
    assert seesaw.unit == "tokens" and seesaw.batch_sizes == [16, 32, 64, 128]
    for j, threshold in enumerate(seesaw.thresholds[1:], start=1):
        assert lr_schedule(threshold) <= 2.0**-j < lr_schedule(threshold - 1)
    assert seesaw.sizes(seesaw.thresholds[2]) == [64, 128]


def test_seesaw_stops_at_its_cap_and_a_step_decay_past_two_levels_grows_once():
    cosine = CosineSchedule(0, 1000, min_lr_ratio=0.0)
    assert Seesaw(cosine, start=8, max_batch_size=40).batch_sizes == [8, 16, 32]  # 64 > 40
    step = StepDecay(0, [300, 600], total_tokens=1000, gamma=0.25)
    seesaw = Seesaw(step, start=8, max_batch_size=64)
    assert (seesaw.batch_sizes, seesaw.thresholds) == (
        [8, 32, 64],
        [0, 300, 600],
    )  # 1/4 at once, then 1/8 (1/16 over the cap)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: Seesaw(WarmupStableDecay(100, 1000), 16, 64),
            r"never falls to 1/2 of its peak before 1,000 tokens.*lr_schedule=cosine",
        ),
        (lambda: Seesaw(CosineSchedule(0, 1000, min_lr_ratio=0.6), 16, 64), r"never falls to 1/2"),
        (lambda: Seesaw(OneCycle(1000), 16, 64, total_tokens=1000), r"only decays after its warmup \(0 tokens\)"),
        (lambda: Seesaw(CosineSchedule(0, 1000), 16, 24), r"max_batch_size=24 is below start x factor = 32"),
        (lambda: Seesaw(lambda tokens: 1.0, 16, 64), r"total_tokens=None must be"),
        (lambda: Seesaw(CosineSchedule(0, 1000), 16, 64, factor=1.5), r"factor=1.5 must be an int >= 2"),
    ],
)
def test_bad_seesaw_settings_fail_with_the_field_named(make, match):
    with pytest.raises(LitCBSConfigError, match=match):
        make()
