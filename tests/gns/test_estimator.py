"""lit_cbs.gns.estimator: the two-batch estimates and the step sums; GradientNoiseScale's averages of them."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gns.regression import (
    DELTA,
    DIM,
    NOISE_STD,
    analytic_b_simple,
)

from lit_cbs.gns import GradientNoiseScale
from lit_cbs.gns.estimator import NoiseMeasurement, StepSums

ROOT = Path(__file__).resolve().parents[2]


def test_analytic_b_simple_matches_formula():
    delta_sq = sum(d * d for d in DELTA)
    assert analytic_b_simple() == pytest.approx(DIM + 1 + DIM * NOISE_STD**2 / delta_sq)


def test_step_sums_of_unequal_micro_batches_use_effective_sizes():
    # Micro-batches of 8 and 5 samples with |G|^2 = 3, tr(Sigma) = 45: squared norms at their expectations.
    grad_sq, trace_sigma, sizes = 3.0, 45.0, (8.0, 5.0)
    sums = StepSums(groups=1, device=torch.device("cpu"))
    for size in sizes:
        sums.add(size, torch.tensor([grad_sq + trace_sigma / size]), count=1.0, inverse_size_sum=1.0 / size)
    big_batch_size = len(sizes) ** 2 / sum(1 / size for size in sizes)  # the mean of the two gradients
    measurement = sums.measurement(torch.tensor([grad_sq + trace_sigma / big_batch_size]))
    assert sums.micro_batches == 2
    assert measurement.small_batch_size == pytest.approx(2 / (1 / 8 + 1 / 5))
    assert measurement.big_batch_size == pytest.approx(big_batch_size)
    assert float(measurement.grad_sq) == pytest.approx(grad_sq) and float(measurement.trace_sigma) == pytest.approx(
        trace_sigma
    )
    # An AMP loss scale of 4 on the small-batch gradients is divided out (their squares by 16); a reduce sums ranks.
    scaled = StepSums(groups=1, device=torch.device("cpu"))
    scaled.add(8.0, torch.tensor([16.0 * (grad_sq + trace_sigma / 8)]), count=1.0, inverse_size_sum=1 / 8)
    scaled.values[:1] /= 4.0**2  # the callback divides out the AMP loss scale
    doubled = scaled.measurement(torch.tensor([grad_sq + trace_sigma / 16]), reduce=lambda values: 2 * values)
    assert (doubled.small_batch_size, doubled.big_batch_size) == (8.0, 16.0)
    assert float(doubled.grad_sq) == pytest.approx(grad_sq) and float(doubled.trace_sigma) == pytest.approx(trace_sigma)


def test_a_micro_batch_of_no_sample_leaves_the_sizes_and_the_step_mean_to_the_others():
    # Two ranks, accumulation 2: rank 0 trains 8 and 5 samples, rank 1 trains 8 and none (an epoch's last round).
    # DDP and Lightning divide the step's gradient among 4 micro-batches; its mean is over the 3 that hold samples.
    grad_sq, trace_sigma, sizes = 3.0, 45.0, (8.0, 5.0, 8.0)
    ranks = [StepSums(groups=1, device=torch.device("cpu")) for _ in range(2)]
    for sums, rank_sizes in zip(ranks, ((8.0, 5.0), (8.0, 0.0))):
        for size in rank_sizes:
            small = torch.tensor([grad_sq + trace_sigma / size]) if size else None
            sums.add(size, small, count=1.0, inverse_size_sum=1.0 / size if size else 0.0)
    assert [sums.micro_batches for sums in ranks] == [2, 2]  # counted alike on every rank
    big_batch_size = len(sizes) ** 2 / sum(1 / size for size in sizes)
    divided = (3 / 4) ** 2 * (grad_sq + trace_sigma / big_batch_size)  # the mean of 3 gradients, divided by 4
    measurement = ranks[0].measurement(
        torch.tensor([divided]), reduce=lambda values: ranks[0].values + ranks[1].values, averaged_over=4
    )
    assert measurement.big_batch_size == pytest.approx(big_batch_size)
    assert measurement.small_batch_size == pytest.approx(3 / sum(1 / size for size in sizes))
    assert float(measurement.grad_sq) == pytest.approx(grad_sq) and float(measurement.trace_sigma) == pytest.approx(
        trace_sigma
    )


def measurement_of(grad_sq: list[float], trace_sigma: list[float]) -> NoiseMeasurement:
    zeros = torch.zeros(len(grad_sq))
    return NoiseMeasurement(zeros, zeros, 1.0, 2.0, torch.tensor(grad_sq), torch.tensor(trace_sigma))


def test_averages_are_bias_corrected_skip_non_finite_steps_and_name_groups():
    averages = GradientNoiseScale(ema_decay=0.5)
    averages.group_names, averages._ema = ["first", None], [torch.zeros(2), torch.zeros(2)]  # as the fit starts
    assert averages.metrics() == {}
    assert averages._average(measurement_of([1.0, 3.0], [10.0, 30.0]))
    assert not averages._average(measurement_of([math.inf, 3.0], [10.0, 30.0]))  # an overflow: unchanged
    assert averages._average(measurement_of([2.0, 2.0], [40.0, 20.0]))
    assert averages.num_updates == 2
    # EMAs 0.5 * (0.5 * x1) + 0.5 * x2, divided by 1 - 0.5^2: the mean weighted 1:2.
    grad_sq, trace_sigma = [(1 + 2 * 2) / 3, (3 + 2 * 2) / 3], [(10 + 2 * 40) / 3, (30 + 2 * 20) / 3]
    metrics = averages.metrics()  # None: in the whole model only
    assert set(metrics) == {
        f"gns/{group}{m}" for group in ("", "first/") for m in ("b_simple", "trace_sigma", "grad_sq")
    }
    assert metrics["gns/first/grad_sq"] == pytest.approx(grad_sq[0])
    assert metrics["gns/first/b_simple"] == pytest.approx(trace_sigma[0] / grad_sq[0])
    assert metrics["gns/grad_sq"] == pytest.approx(sum(grad_sq)) and metrics["gns/trace_sigma"] == pytest.approx(
        sum(trace_sigma)
    )
    assert metrics["gns/b_simple"] == pytest.approx(sum(trace_sigma) / sum(grad_sq)) == averages.b_simple


def test_the_math_and_the_grouping_import_without_lightning():
    blocked = (
        "import sys; sys.modules['lightning'] = None; sys.modules['matplotlib'] = None; "
        "import lit_cbs.gns.estimator, lit_cbs.gns.groups"
    )
    subprocess.run([sys.executable, "-c", blocked], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
