"""The simple noise scale B_simple = tr(Sigma) / |G|^2 from squared gradient norms at two batch sizes (torch only).

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv
1812.06162), appendix A: a gradient averaged over a batch of B samples has
E|G_B|^2 = |G|^2 + tr(Sigma) / B (G: the true gradient, Sigma: the per-sample gradient
covariance). Two measured squared norms at batch sizes B_small < B_big give unbiased estimates

    |G|^2     = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

whose ratio is B_simple. Both are noisy (|G|^2 can come out negative), so each is averaged by its
own bias-corrected exponential moving average (``NoiseAverages``) and B_simple is the ratio of the
two averages, not an average of per-step ratios.

Batches of unequal size enter through effective sizes: over small batches of b_i samples,
1 / E[1/b] makes E|G_b|^2 = |G|^2 + tr(Sigma) / b hold on average; the mean of M micro-batch
gradients has the effective size M^2 / sum(1/b_i). Both squared norms are sums over the
parameters, so every estimate here is kept per group of parameters (one tensor entry per group)
and the groups' |G|^2 and tr(Sigma) add up to the whole model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lit_cbs import metrics

__all__ = ["NoiseAverages", "NoiseMeasurement", "two_batch_estimates"]


def two_batch_estimates(
    small_grad_sq: torch.Tensor | float,
    big_grad_sq: torch.Tensor | float,
    small_batch_size: torch.Tensor | float,
    big_batch_size: torch.Tensor | float,
) -> tuple[Any, Any]:
    """Unbiased estimates ``(|G|^2, tr(Sigma))`` from squared gradient norms at two batch sizes.

    McCandlish et al. 2018, appendix A. ``small_grad_sq`` is |G_small|^2 (averaged over however
    many small batches were measured), ``big_grad_sq`` is |G_big|^2; batch sizes in samples, with
    ``small_batch_size < big_batch_size``. For unequal micro-batches use the effective sizes
    1 / E[1/b] that make E|G_b|^2 = |G|^2 + tr(Sigma) / b hold (see ``StepSums``).

    Args:
        small_grad_sq: |G_small|^2, squared gradient norm at the small batch (per group when a tensor).
        big_grad_sq: |G_big|^2, squared gradient norm at the big batch.
        small_batch_size: the small batch (samples, effective).
        big_batch_size: the big batch (samples, effective), larger than ``small_batch_size``.

    Returns:
        ``(|G|^2, tr(Sigma))``: the true gradient's squared norm and the per-sample gradient covariance's
        trace (squared gradient norm per sample), of the type of the inputs; B_simple is their ratio
        tr(Sigma) / |G|^2 (samples).

    Examples:
        With |G|^2 = 1 and tr(Sigma) = 8: E|G_2|^2 = 1 + 8/2 = 5 and E|G_8|^2 = 1 + 8/8 = 2.

        >>> two_batch_estimates(5.0, 2.0, small_batch_size=2, big_batch_size=8)
        (1.0, 8.0)
    """
    inv_small, inv_big = 1.0 / small_batch_size, 1.0 / big_batch_size
    trace_sigma = (small_grad_sq - big_grad_sq) / (inv_small - inv_big)
    grad_sq = (inv_small * big_grad_sq - inv_big * small_grad_sq) / (inv_small - inv_big)
    return grad_sq, trace_sigma


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """|tensor|^2 as float32; half-precision tensors are reduced in float32 so their norm is not rounded."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(tensor, dtype=torch.float32) ** 2
    return torch.linalg.vector_norm(tensor).float() ** 2


@dataclasses.dataclass
class NoiseMeasurement:
    """One optimizer step's raw measurement; tensors hold one entry per measured group.

    The entries follow ``GradientNoiseScale.group_names``: the groups, then (entry ``None``) the
    parameters in no group, if any; without ``groups`` the single entry is the whole model.

    Args:
        small_grad_sq: mean squared norm of the small-batch gradients, per group.
        big_grad_sq: squared norm of the step's gradient (the mean over the global batch), per group.
        small_batch_size: effective size of the small batches in samples, 1 / E[1/b].
        big_batch_size: effective size of the step's batch in samples, M^2 / sum(1/b_i) over its M micro-batches.
        grad_sq: this step's unbiased estimate of |G|^2 per group, before averaging.
        trace_sigma: this step's unbiased estimate of tr(Sigma) per group (per sample), before averaging.

    Examples:
        A step of 4 micro-batches of 2 samples, each with squared norm 5, whose mean has squared norm 2:

        >>> import torch
        >>> sums = StepSums(groups=1, device=torch.device("cpu"))
        >>> for _ in range(4):
        ...     sums.add_small_batches(torch.tensor([5.0]), count=1.0, inverse_size_sum=1 / 2)
        ...     sums.add_micro_batch(2)
        >>> measurement = sums.measurement(big_grad_sq=torch.tensor([2.0]))
        >>> measurement.small_batch_size, measurement.big_batch_size
        (2.0, 8.0)
        >>> measurement.grad_sq.tolist(), measurement.trace_sigma.tolist()
        ([1.0], [8.0])
    """

    small_grad_sq: torch.Tensor
    big_grad_sq: torch.Tensor
    small_batch_size: float
    big_batch_size: float
    grad_sq: torch.Tensor
    trace_sigma: torch.Tensor


class StepSums:
    """What one optimizer step's micro-batches add up to on one rank, in one tensor so one all-reduce
    sums it over ranks.

    ``values`` holds, per group, the small batches' squared gradient norms; then the number of small
    batches, the sum of 1/b over them, the number of micro-batches and the sum of 1/b over them (b in
    samples). ``micro_batches`` counts this rank's micro-batches on the host (no device sync).
    """

    def __init__(self, groups: int, device: torch.device):
        self.groups = groups
        self.values = torch.zeros(groups + 4, device=device)
        self.micro_batches = 0

    def add_small_batches(self, grad_sq: torch.Tensor, count: float, inverse_size_sum: float) -> None:
        """``count`` small batches whose squared norms per group sum to ``grad_sq`` and whose 1/b sum to
        ``inverse_size_sum``."""
        self.values[: self.groups] += grad_sq
        self.values[self.groups] += count
        self.values[self.groups + 1] += inverse_size_sum

    def add_micro_batch(self, size: float) -> None:
        """One micro-batch of ``size`` samples, a part of the step's big batch; one of no sample (an epoch's
        last round can leave a rank none) adds nothing to the gradient or the sizes, and counts on the host only."""
        if size > 0:
            self.values[self.groups + 2] += 1.0
            self.values[self.groups + 3] += 1.0 / size
        self.micro_batches += 1

    def unscale(self, loss_scale: float) -> None:
        """Divide out an AMP loss scale the small-batch gradients were read under (their squares: by its square)."""
        self.values[: self.groups] /= loss_scale**2

    def measurement(
        self,
        big_grad_sq: torch.Tensor,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        averaged_over: int | None = None,
    ) -> NoiseMeasurement:
        """The step's measurement from these sums and the step's squared norm per group ``big_grad_sq``;
        ``reduce`` first sums ``values`` over the data-parallel ranks (None: one process). ``averaged_over``:
        the micro-batches the step's gradient was divided among (Lightning divides each loss by the
        accumulation, DDP by the ranks), for a step with fewer or empty ones (an epoch's last): its squared
        norm is rescaled to that of the mean over the micro-batches of samples counted here."""
        values = self.values if reduce is None else reduce(self.values)
        small_count, small_inv_sum, micro_count, micro_inv_sum = values[self.groups :]
        if averaged_over is not None:
            big_grad_sq = big_grad_sq * (averaged_over / micro_count) ** 2
        small_grad_sq = values[: self.groups] / small_count
        small_batch_size = small_count / small_inv_sum
        big_batch_size = micro_count**2 / micro_inv_sum
        grad_sq, trace_sigma = two_batch_estimates(small_grad_sq, big_grad_sq, small_batch_size, big_batch_size)
        return NoiseMeasurement(
            small_grad_sq=small_grad_sq,
            big_grad_sq=big_grad_sq,
            small_batch_size=float(small_batch_size),
            big_batch_size=float(big_batch_size),
            grad_sq=grad_sq,
            trace_sigma=trace_sigma,
        )


class NoiseAverages:
    """Per group, exponential moving averages of |G|^2 and tr(Sigma) over optimizer steps, bias-corrected when read.

    ``decay`` is the EMA's decay per measured step, in [0, 1); ``updates`` counts the steps averaged.

    Args:
        decay: the EMAs' decay per measured optimizer step, in [0, 1).
        grad_sq: the EMA of |G|^2 per group, not bias-corrected (squared gradient norm).
        trace_sigma: the EMA of tr(Sigma) per group, not bias-corrected (squared gradient norm per sample).
        updates: the steps averaged so far.

    Examples:
        >>> import torch
        >>> averages = NoiseAverages.zeros(decay=0.9, groups=1, device=torch.device("cpu"))
        >>> averages.b_simple is None
        True
        >>> step = NoiseMeasurement(
        ...     small_grad_sq=torch.tensor([5.0]), big_grad_sq=torch.tensor([2.0]), small_batch_size=2.0,
        ...     big_batch_size=8.0, grad_sq=torch.tensor([1.0]), trace_sigma=torch.tensor([8.0]))
        >>> averages.update(step), round(averages.b_simple, 4)
        (True, 8.0)
        >>> {name: round(value, 4) for name, value in averages.metrics([None]).items()}
        {'gns/b_simple': 8.0, 'gns/trace_sigma': 8.0, 'gns/grad_sq': 1.0}
    """

    def __init__(self, decay: float, grad_sq: torch.Tensor, trace_sigma: torch.Tensor, updates: int = 0):
        self.decay = decay
        self.grad_sq = grad_sq  # not bias-corrected
        self.trace_sigma = trace_sigma
        self.updates = updates

    @classmethod
    def zeros(cls, decay: float, groups: int, device: torch.device) -> NoiseAverages:
        """Averages of nothing yet (see the class example).

        Args:
            decay: the EMAs' decay per measured optimizer step, in [0, 1).
            groups: entries per tensor: the measured groups (and the ungrouped rest, if any).
            device: where the averages live (the gradients' device).

        Returns:
            Zero averages with ``updates == 0``.
        """
        return cls(decay, torch.zeros(groups, device=device), torch.zeros(groups, device=device))

    def update(self, measurement: NoiseMeasurement) -> bool:
        """Average in a step's estimates; False (averages unchanged) if any is not finite, as after an AMP overflow.

        One host synchronisation (the finiteness check). See the class example.

        Args:
            measurement: the step's ``NoiseMeasurement``, with one entry per group.

        Returns:
            Whether the step was averaged in.
        """
        grad_sq, trace_sigma = measurement.grad_sq, measurement.trace_sigma
        if not bool(torch.isfinite(grad_sq).all() & torch.isfinite(trace_sigma).all()):
            return False
        self.grad_sq = self.decay * self.grad_sq + (1 - self.decay) * grad_sq
        self.trace_sigma = self.decay * self.trace_sigma + (1 - self.decay) * trace_sigma
        self.updates += 1
        return True

    @property
    def b_simple(self) -> float | None:
        """The whole model's B_simple in samples (the bias correction cancels in the ratio); None before any update."""
        if not self.updates:
            return None
        return float(self.trace_sigma.sum() / self.grad_sq.sum())

    def metrics(self, group_names: Sequence[str | None]) -> dict[str, float]:
        """``gns/{b_simple,trace_sigma,grad_sq}`` for the whole model and ``gns/<group>/...`` per named group
        (the group ``None``, the parameters in no group, counts in the whole model only); empty before any update.
        See the class example.

        Args:
            group_names: a name per entry, as ``GradientNoiseScale.group_names`` (None: the ungrouped rest).

        Returns:
            The bias-corrected values by metric name: B_simple in samples, tr(Sigma) and |G|^2 as squared norms.
        """
        if not self.updates:
            return {}
        correction = 1.0 - self.decay**self.updates  # bias correction of EMAs started at zero
        grad_sq = self.grad_sq / correction
        trace_sigma = self.trace_sigma / correction
        whole = torch.stack([trace_sigma.sum() / grad_sq.sum(), trace_sigma.sum(), grad_sq.sum()])
        per_group = torch.stack([trace_sigma / grad_sq, trace_sigma, grad_sq], dim=1)
        # One device-to-host copy for all of them, however many groups.
        model, *groups = torch.cat([whole[None], per_group]).tolist()
        quantities = metrics.GNS_QUANTITIES
        logged = {metrics.gns(quantity): value for quantity, value in zip(quantities, model)}
        for group, row in zip(group_names, groups):
            if group is not None:
                logged.update({metrics.gns(quantity, group): value for quantity, value in zip(quantities, row)})
        return logged

    def to(self, device: torch.device) -> NoiseAverages:
        """Move the averages to ``device`` in place.

        Args:
            device: where they go (e.g. the gradients' device after a checkpoint load).

        Returns:
            These averages.
        """
        self.grad_sq, self.trace_sigma = self.grad_sq.to(device), self.trace_sigma.to(device)
        return self
