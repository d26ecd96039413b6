"""Unbiased |G|^2 and tr(Sigma) per parameter group from squared norms at two batch sizes (McCandlish 2018, A)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """|tensor|^2 as float32, half precision reduced in float32 so the norm is not rounded."""
    half = tensor.dtype in (torch.float16, torch.bfloat16)
    return cast(torch.Tensor, torch.linalg.vector_norm(tensor, dtype=torch.float32 if half else None).float() ** 2)


@dataclasses.dataclass
class NoiseMeasurement:
    """One optimizer step's measurement per group; batch sizes are effective sizes (1 / E[1/b]) in samples."""

    small_grad_sq: torch.Tensor
    big_grad_sq: torch.Tensor
    small_batch_size: float
    big_batch_size: float
    grad_sq: torch.Tensor
    trace_sigma: torch.Tensor


class StepSums:
    """A step's micro-batches on one rank, one tensor: small squared norms per group, counts and sums of 1/b."""

    def __init__(self, groups: int, device: torch.device):
        self.groups = groups
        self.values = torch.zeros(groups + 4, device=device)
        self.micro_batches = 0

    def add(
        self, size: float, grad_sq: torch.Tensor | None = None, count: float = 0.0, inverse_size_sum: float = 0.0
    ) -> None:
        """A micro-batch of ``size`` samples (0: host count only) and its ``count`` small batches' squared norms."""
        if grad_sq is not None:
            self.values[: self.groups] += grad_sq
            self.values[self.groups] += count
            self.values[self.groups + 1] += inverse_size_sum
        if size > 0:
            self.values[self.groups + 2] += 1.0
            self.values[self.groups + 3] += 1.0 / size
        self.micro_batches += 1

    def measurement(
        self, big_grad_sq: torch.Tensor, reduce: Callable[[Any], Any] | None = None, averaged_over: int | None = None
    ) -> NoiseMeasurement:
        """The step's measurement; ``reduce`` sums over ranks; ``averaged_over``: micro-batches the gradient divides."""
        values = self.values if reduce is None else reduce(self.values)
        small_count, small_inv_sum, micro_count, micro_inv_sum = values[self.groups :]
        if averaged_over is not None:
            big_grad_sq = big_grad_sq * (averaged_over / micro_count) ** 2
        small_grad_sq = values[: self.groups] / small_count
        small_batch_size, big_batch_size = small_count / small_inv_sum, micro_count**2 / micro_inv_sum
        # The unbiased (|G|^2, tr(Sigma)) from the expected squared norms |G|^2 + tr(Sigma) / b at the two sizes.
        inv_small, inv_big = 1.0 / small_batch_size, 1.0 / big_batch_size
        trace_sigma = (small_grad_sq - big_grad_sq) / (inv_small - inv_big)
        grad_sq = (inv_small * big_grad_sq - inv_big * small_grad_sq) / (inv_small - inv_big)
        sizes = float(small_batch_size), float(big_batch_size)
        return NoiseMeasurement(small_grad_sq, big_grad_sq, *sizes, grad_sq, trace_sigma)
