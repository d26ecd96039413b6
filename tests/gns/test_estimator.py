"""lit_cbs.gns.estimator: the two-batch estimates, the step sums and the averages."""

from __future__ import annotations

import pytest
from gns.regression import (
    DELTA,
    DIM,
    NOISE_STD,
    analytic_b_simple,
)

from lit_cbs.gns import two_batch_estimates


def test_two_batch_estimates_invert_the_expected_norms():
    grad_sq, trace_sigma, small, big = 3.0, 45.0, 4.0, 32.0
    estimated = two_batch_estimates(grad_sq + trace_sigma / small, grad_sq + trace_sigma / big, small, big)
    assert estimated == pytest.approx((grad_sq, trace_sigma))


def test_analytic_b_simple_matches_formula():
    delta_sq = sum(d * d for d in DELTA)
    assert analytic_b_simple() == pytest.approx(DIM + 1 + DIM * NOISE_STD**2 / delta_sq)
