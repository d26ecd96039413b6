"""Forecast the critical batch size past the last probe: a curve CBS(D) fitted to probe brackets.

A probe reading does not measure the CBS; it brackets it: the CBS at D tokens lies in
[lower, upper] samples. ``supported_interval`` reads that interval off a reading at the reading's own
confidence and epsilon: ``lower`` is the largest batch k B whose loss is within epsilon of every
smaller k's with that confidence, ``upper`` the smallest k B that is beyond epsilon of a smaller k's
with that confidence (none measured: no upper end). For a determined reading of the grid search
that is its bracket [k* B, next k B] (bisection measures fewer k, so there the upper end is the next
measured k, which the data support, not the next k of the grid); an undetermined one gets the
wider interval its data support.

``forecast_cbs`` models log CBS(D) = mu(D) + noise, noise ~ Normal(0, s): each interval contributes
P(log lower < log CBS < log upper) = Phi((log upper - mu) / s) - Phi((log lower - mu) / s) (an
interval-censored likelihood; an open upper end contributes 1 - Phi(...)). Two curves:

- ``power``: CBS(D) = a (D / D0)^b (Zhang et al. 2024, Bergsma et al. 2025: the critical batch
  grows as a power of the tokens seen, nearly independent of model size);
- ``plateau``: 1 / CBS(D) = 1 / (a (D / D0)^b) + 1 / c, a power law that levels off at c samples
  (Merrill et al. 2025 see the CBS grow fast, then slowly, then stay near a ceiling).

D0 is the geometric mean of the readings' token counts (the fit's scale only).

The band is a posterior predictive band: the interval in which a run would read the CBS at D with
probability ``coverage``, given the readings. Brackets a factor of 2 wide leave the parameters
(log a, b, log s) far from pinned when the readings are few: two brackets of one run are met by
any curve that threads them, and the likelihood then drives s to 0. So the parameters get weak
priors, and the band carries their uncertainty:

- log s ~ Normal(log 0.15, 0.5): the fit to tiny's 10 readings of 2 runs measured s = 0.21
  (docs/RESULTS.md, transfer); the prior's 95% range, 0.06 to 0.4, lets the data move it. Readings
  noisier than it expects are held less often than ``coverage`` (benchmarks.forecast_coverage);
- b ~ Normal(0, 1): only matters where the brackets leave b open (two token counts, or a last
  bracket with no upper end, where a steeper curve always fits better); centred on no growth, so
  that an open end does not grow the batch by itself;
- log c ~ Normal(log of the largest lower end read, 2) for the plateau, which the readings bound
  only from below (a ceiling far above them fits as well as none);
- log a: flat.

The posterior of the parameters is sampled by importance sampling: proposals from a Student t (4
degrees of freedom) centred on the posterior mode with the covariance of its Laplace approximation
(the inverse Hessian there), weighted by posterior / proposal, the proposal refitted to the
weighted draws while their effective number is small. The Laplace approximation alone would not
do: an interval-censored likelihood is flat inside the brackets and falls off at their edges, so the
curvature at the mode says little about the spread; the weights correct the proposal to the
posterior itself. At each D the band is the central ``coverage`` interval of the mixture over the draws of
Normal(mu_i(D), s_i): the curve's uncertainty, which grows with the distance from the readings,
plus one run's spread around the curve. Its coverage, on real readings cut short and on simulated
curves, is measured by ``python -m benchmarks.forecast_coverage`` (docs/RESULTS.md).

What the band cannot hold is a curve that changes shape past the readings (an early flat stretch
followed by growth is the common case). ``forecast_cbs`` warns once when the readings lie at fewer
than 3 token counts or span less than a factor of 4 in tokens (the curve's shape is then untested),
and ``schedule_from_forecast`` when it reaches farther past the last reading than the readings span.

``model="auto"`` compares the curves' held-out log likelihood (each run left out in turn when the
readings come from two or more runs, else each reading left out in turn; each fit the posterior's
mode) and takes the plateau only when it gains more than ``PLATEAU_MARGIN`` (1 nat, its one extra
parameter's worth) over the power law. Pure numpy/scipy: no Lightning, no plotting
(``lit_cbs.analysis.plots.plot_forecast``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable, Sequence

import numpy as np
from scipy import optimize, special, stats

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.reading import ProbeReading, judged_multipliers

__all__ = [
    "Bracket",
    "CBSForecast",
    "ForecastChange",
    "brackets_from_records",
    "forecast_cbs",
    "growth_exponent",
    "noise_scale_over_tokens",
    "schedule_from_forecast",
    "supported_interval",
]

MODELS = ("power", "plateau")
# Weak priors (see the module docstring); s and the ceiling c in log CBS (natural log of samples), b per log token.
SPREAD_PRIOR_MEDIAN = 0.15  # s
SPREAD_PRIOR_SD = 0.5  # of log s
EXPONENT_PRIOR_SD = 1.0  # of b, around 0
CEILING_PRIOR_SD = 2.0  # of log c, around the log of the largest lower end read
# Where the parameters may lie at all: b in [-3, 3], s in [0.01, 5] (the optimizer's bounds and the priors' support).
EXPONENT_BOUND = 3.0
SPREAD_BOUNDS = (0.01, 5.0)
PLATEAU_MARGIN = 1.0  # held-out log likelihood the plateau must gain over the power law to be chosen
POSTERIOR_DRAWS = 400  # posterior draws the band mixes over
PROPOSALS = 4000  # importance-sampling proposals per round
# Below these the readings cannot test the curve's shape: forecast_cbs warns.
MIN_TOKEN_COUNTS = 3
MIN_SPAN = 4.0  # largest / smallest token count of the readings


@dataclasses.dataclass(frozen=True)
class Bracket:
    """The CBS at ``tokens`` lies in [``lower``, ``upper``] samples (``upper`` inf: no upper end).

    Examples:
        >>> Bracket(tokens=1e8, lower=64.0, upper=128.0, run="run")
        Bracket(tokens=100000000.0, lower=64.0, upper=128.0, run='run', determined=True)
    """

    tokens: float
    lower: float
    upper: float
    run: str  # which run the reading came from (the model choice leaves runs out by it; plots colour by it)
    determined: bool = True


def _number(reading: ProbeReading, key: str, where: str, minimum: float = 0.0) -> float:
    value = getattr(reading, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= minimum:
        raise ValueError(f"{where}: {key}={value!r} must be a number > {minimum:g}; not a reading of cbs_probe.jsonl?")
    return float(value)


def supported_interval(
    reading: ProbeReading,
    where: str = "reading",
    epsilon: float | None = None,
) -> tuple[float, float]:
    """(lower, upper) in samples: where the CBS lies at the reading's confidence (see the module docstring).

    Uses the per-batch held-out losses when the reading has them (``evaluate="heldout"``; with
    replicate windows, their spread too, as the probe judged them), judged at the reading's own
    ``epsilon`` (nats); ``epsilon`` is for readings written before readings stored theirs (the run's
    ``callbacks.cbs_probe.epsilon``), and such a reading without it is refused rather than judged at
    a guess. A reading without per-batch losses keeps its own bracket when determined, and an
    undetermined one without them supports only [smallest k B, no upper end).

    Args:
        reading: one probe reading.
        where: names the reading in messages.
        epsilon: the k* rule's tolerance (nats) for a reading that does not hold its own.

    Returns:
        ``(lower, upper)`` in samples; ``upper`` is ``math.inf`` where nothing bounds the CBS from above.

    Raises:
        LitCBSConfigError: the reading needs an epsilon it does not hold and ``epsilon`` is None.
        ValueError: the reading lacks a batch size or losses.

    Examples:
        >>> from lit_cbs.probe.reading import ProbeReading
        >>> def reading(tokens, cbs_lower, cbs_upper):  # a determined train_ema reading at B = 32 samples
        ...     return ProbeReading(
        ...         tokens=tokens, step=0, batch_size=32, seq_len=1024, window_tokens=10**6, search="grid",
        ...         evaluate="train_ema", losses={"1": 3.0, "2": 3.0, "4": 3.1}, main_loss=3.0,
        ...         branches_trained=[2.0, 4.0], failed=[], k_star=cbs_lower / 32, cbs_lower=cbs_lower,
        ...         cbs_upper=cbs_upper, tokens_spent=0, overhead=0.0)
        >>> supported_interval(reading(10**8, 64, 128))  # no per-batch losses: its own bracket
        (64.0, 128.0)
    """
    batch = _number(reading, "batch_size", where)
    if not isinstance(reading.losses, dict) or not reading.losses:
        raise ValueError(f"{where}: losses={reading.losses!r} must map each multiplier to its loss")
    ks = sorted(float(k) for k in reading.losses)
    if not all(f"{k:g}" in reading.batch_losses for k in ks):
        if reading.determined:
            lower = _number(reading, "cbs_lower", where)
            return lower, math.inf if reading.cbs_upper is None else float(reading.cbs_upper)
        return ks[0] * batch, math.inf
    epsilon = reading.epsilon if reading.epsilon is not None else epsilon
    if epsilon is None:
        raise LitCBSConfigError(
            f"{where} holds no epsilon (written before probe readings stored theirs), so its interval cannot be read; "
            "pass the run's callbacks.cbs_probe.epsilon (nats) as epsilon= (recipes/schedule_from_probe.py: --epsilon)"
        )
    admissible, rejected = judged_multipliers(reading.scores(), float(epsilon), reading.confidence)
    lower = max(admissible, default=ks[0]) * batch
    above = [k for k in rejected if k * batch > lower]
    return lower, (min(above) * batch if above else math.inf)


def brackets_from_records(
    readings: Iterable[ProbeReading],
    run: str = "run",
    epsilon: float | None = None,
) -> list[Bracket]:
    """One ``Bracket`` per probe reading of one run (``supported_interval``, ``epsilon`` nats for readings
    without their own), in tokens order.

    Raises ValueError naming the reading for one that is not a ``ProbeReading`` or lacks tokens, batch_size or
    losses, or readings of different seq_len (a CBS in samples means another number of tokens at another
    length); a ``LitCBSConfigError`` for a reading that needs an epsilon when none is given.

    Args:
        readings: one run's probe readings (``read_readings``).
        run: the run's name, kept in each bracket.
        epsilon: the k* rule's tolerance (nats) for readings that do not hold their own.

    Returns:
        The brackets (samples), sorted by tokens.

    Examples:
        >>> from lit_cbs.probe.reading import ProbeReading
        >>> def reading(tokens, cbs_lower, cbs_upper):  # a determined train_ema reading at B = 32 samples
        ...     return ProbeReading(
        ...         tokens=tokens, step=0, batch_size=32, seq_len=1024, window_tokens=10**6, search="grid",
        ...         evaluate="train_ema", losses={"1": 3.0, "2": 3.0, "4": 3.1}, main_loss=3.0,
        ...         branches_trained=[2.0, 4.0], failed=[], k_star=cbs_lower / 32, cbs_lower=cbs_lower,
        ...         cbs_upper=cbs_upper, tokens_spent=0, overhead=0.0)
        >>> for bracket in brackets_from_records([reading(4 * 10**8, 128, None), reading(10**8, 64, 128)], run="a"):
        ...     print(bracket.tokens, bracket.lower, bracket.upper)
        100000000.0 64.0 128.0
        400000000.0 128.0 inf
    """
    brackets, seq_lens = [], set()
    for number, reading in enumerate(readings, start=1):
        where = f"{run}: reading {number}"
        if not isinstance(reading, ProbeReading):
            raise ValueError(f"{where}: {reading!r} is not a ProbeReading; read a cbs_probe.jsonl with read_readings")
        tokens = _number(reading, "tokens", where)
        seq_lens.add(reading.seq_len)
        lower, upper = supported_interval(reading, where, epsilon)
        brackets.append(Bracket(tokens, lower, upper, run, reading.determined))
    if not brackets:
        raise ValueError(f"{run}: no probe reading; a forecast needs readings")
    if len(seq_lens) > 1:
        mixed = sorted(map(str, seq_lens))
        raise ValueError(f"{run}: readings of seq_len {mixed} mixed; fit one sequence length at a time")
    return sorted(brackets, key=lambda b: b.tokens)


# ---------------------------------------------------------------------- the posterior
def _columns(params: np.ndarray) -> np.ndarray:
    """The parameters, each against log D: numbers for one vector, [draws, 1] columns for a stack of them."""
    params = np.asarray(params, dtype=float)
    return params.T[..., None] if params.ndim > 1 else params


def _curve(params: np.ndarray, log_d: np.ndarray, model: str) -> np.ndarray:
    """log CBS at log(D / D0): shaped as ``log_d`` for one parameter vector, [draws, *log_d.shape] for a stack."""
    columns = _columns(params)
    power = columns[0] + columns[1] * log_d
    if model == "power":
        return power
    return -np.logaddexp(-power, -columns[3])  # 1 / CBS = 1 / power + 1 / c


def _log_likelihood(params: np.ndarray, log_d, log_lo, log_hi, model: str) -> np.ndarray:
    """Per bracket (last axis): log P(log_lo < log CBS < log_hi) under Normal(curve, s)."""
    scale = np.exp(_columns(params)[2])
    mu = _curve(params, log_d, model)
    upper = special.log_ndtr((log_hi - mu) / scale)  # log Phi; log_hi = inf gives 0
    lower = special.log_ndtr((log_lo - mu) / scale)
    # log(exp(upper) - exp(lower)), kept finite where the two are close.
    return upper + np.log1p(-np.exp(np.minimum(lower - upper, -1e-12)))


def _bounds(model: str) -> list[tuple[float | None, float | None]]:
    spread = (math.log(SPREAD_BOUNDS[0]), math.log(SPREAD_BOUNDS[1]))
    return [(None, None), (-EXPONENT_BOUND, EXPONENT_BOUND), spread] + ([(None, None)] if model == "plateau" else [])


def _log_prior(params: np.ndarray, model: str, log_ceiling: float) -> np.ndarray:
    """The weak priors' log density (up to a constant) of each parameter vector; -inf outside ``_bounds``."""
    params = np.asarray(params, dtype=float)
    b, log_s = params[..., 1], params[..., 2]
    spread = (log_s - math.log(SPREAD_PRIOR_MEDIAN)) / SPREAD_PRIOR_SD
    density = -0.5 * spread**2 - 0.5 * (b / EXPONENT_PRIOR_SD) ** 2
    if model == "plateau":
        density = density - 0.5 * ((params[..., 3] - log_ceiling) / CEILING_PRIOR_SD) ** 2
    (_, b_high), (s_low, s_high) = _bounds(model)[1:3]
    inside = (np.abs(b) <= b_high) & (log_s >= s_low) & (log_s <= s_high)
    return np.where(inside, density, -np.inf)


@dataclasses.dataclass(frozen=True)
class _Readings:
    """Brackets as the likelihood reads them: log(D / D0), log lower, log upper, and the plateau prior's centre."""

    log_d: np.ndarray
    log_lo: np.ndarray
    log_hi: np.ndarray
    log_ceiling: float

    @classmethod
    def of(cls, brackets: Sequence[Bracket], d0: float) -> _Readings:
        log_d = np.log(np.array([b.tokens for b in brackets]) / d0)
        lower, upper = np.log([b.lower for b in brackets]), np.log([b.upper for b in brackets])
        return cls(log_d, lower, upper, float(lower.max()))

    def log_posterior(self, params: np.ndarray, model: str) -> np.ndarray:
        """Summed log likelihood plus log prior (up to a constant), per parameter vector."""
        likelihood = np.sum(_log_likelihood(params, self.log_d, self.log_lo, self.log_hi, model), axis=-1)
        return likelihood + _log_prior(params, model, self.log_ceiling)


def _fit(brackets: Sequence[Bracket], model: str, d0: float) -> np.ndarray:
    """The posterior's mode (log a, b, log s[, log c]) for D in units of ``d0`` tokens."""
    readings = _Readings.of(brackets, d0)

    def loss(params):
        value = -float(readings.log_posterior(params, model))
        return value if math.isfinite(value) else 1e12

    log_d, log_lo, log_hi = readings.log_d, readings.log_lo, readings.log_hi
    upper = np.where(np.isfinite(log_hi), log_hi, log_lo + 2 * math.log(2))  # an open end's centre: twice its lower
    centre = (log_lo + upper) / 2
    slope = np.polyfit(log_d, centre, 1)[0] if len(set(log_d)) > 1 else 0.0
    slope = float(np.clip(slope, -EXPONENT_BOUND, EXPONENT_BOUND))
    line = np.array([float(np.mean(centre - slope * log_d)), slope, math.log(SPREAD_PRIOR_MEDIAN)])
    if model == "power":
        starts = [line]
    else:  # from the power law's fit, with the ceiling near, at and above the largest reading
        power = _fit(brackets, "power", d0)
        starts = [np.append(power, float(np.max(centre)) + shift) for shift in (-0.5, 0.5, 2.0)]
    results = [optimize.minimize(loss, x0, method="L-BFGS-B", bounds=_bounds(model)) for x0 in starts]
    return min(results, key=lambda result: result.fun).x


def _laplace_covariance(log_posterior, mode: np.ndarray, step: float = 1e-3) -> np.ndarray:
    """The inverse of the negative log posterior's Hessian at ``mode`` (central differences), its
    eigenvalues floored so that no direction gets a standard deviation above 3 (a flat likelihood)."""
    size = len(mode)
    offsets = np.eye(size) * step
    hessian = np.empty((size, size))
    for i in range(size):
        for j in range(size):
            corners = [mode + si * offsets[i] + sj * offsets[j] for si, sj in ((1, 1), (1, -1), (-1, 1), (-1, -1))]
            costs = [-float(log_posterior(corner)) for corner in corners]
            hessian[i, j] = (costs[0] - costs[1] - costs[2] + costs[3]) / (4 * step * step)
    values, vectors = np.linalg.eigh((hessian + hessian.T) / 2)
    return (vectors / np.maximum(values, 1 / 9)) @ vectors.T


def _posterior_draws(brackets: Sequence[Bracket], model: str, d0: float, mode: np.ndarray, rng) -> np.ndarray:
    """``POSTERIOR_DRAWS`` parameter vectors from the posterior (importance sampling, see the module docstring)."""
    readings = _Readings.of(brackets, d0)

    def log_posterior(params):
        return readings.log_posterior(params, model)

    centre, shape = mode, _laplace_covariance(log_posterior, mode)
    for _ in range(3):
        proposal = stats.multivariate_t(loc=centre, shape=shape, df=4)
        draws = proposal.rvs(size=PROPOSALS, random_state=rng)
        log_weights = log_posterior(draws) - proposal.logpdf(draws)
        weights = np.exp(log_weights - np.max(log_weights))
        weights /= weights.sum()
        if 1.0 / float(np.sum(weights**2)) >= PROPOSALS / 5:  # the effective number of proposals
            break
        # Too few proposals carry the weight: centre the next round on the weighted draws, a little wider.
        centre = weights @ draws
        shape = 1.5 * np.cov(draws.T, aweights=weights) + 1e-6 * np.eye(len(mode))
    return draws[rng.choice(PROPOSALS, size=POSTERIOR_DRAWS, p=weights)]


@dataclasses.dataclass(frozen=True)
class CBSForecast:
    """A fitted CBS(D) curve, its band at ``coverage``, and what it was fitted on.

    ``params``: the posterior's mode of log a, b, log s (and log c for the plateau), with D in units
    of ``d0`` tokens and a, c, the CBS in samples. ``heldout_log_likelihood``: per model, the summed
    log likelihood of each left-out run's (or reading's) brackets under the fit to the rest.
    ``band_draws``: the posterior draws of the parameters the band mixes over.

    Examples:
        >>> brackets = [Bracket(tokens=d, lower=0.75 * cbs, upper=1.5 * cbs, run="run")  # CBS = 64 (D / 1e8)^0.5
        ...             for d, cbs in [(1e8, 64), (4e8, 128), (1.6e9, 256), (6.4e9, 512)]]
        >>> forecast = forecast_cbs(brackets, model="power")
        >>> forecast.model, round(forecast.exponent, 2), forecast.plateau
        ('power', 0.49, None)
        >>> low, high = forecast.band(2.56e10)  # 4x past the last reading
        >>> bool(low[0] < forecast.predict(2.56e10) < high[0]), forecast.covers(brackets[0])
        (True, True)
    """

    model: str
    params: tuple[float, ...]
    d0: float
    coverage: float
    brackets: tuple[Bracket, ...]
    heldout_log_likelihood: dict[str, float]
    band_draws: np.ndarray = dataclasses.field(repr=False)

    @property
    def exponent(self) -> float:
        """b: the power law's exponent in tokens."""
        return self.params[1]

    @property
    def plateau(self) -> float | None:
        """c in samples for the plateau model; None for the power law."""
        return math.exp(self.params[3]) if self.model == "plateau" else None

    @property
    def noise_scale(self) -> float:
        """s: the spread of log CBS around the curve (one run's readings against the curve), at the posterior's mode."""
        return math.exp(self.params[2])

    def predict(self, tokens) -> np.ndarray:
        """The fitted CBS (samples) at ``tokens`` (a number or an array): the posterior mode's curve.

        Args:
            tokens: token counts D (a number or an array).

        Returns:
            The CBS in samples, an array of the shape of ``tokens``.
        """
        log_d = np.log(np.asarray(tokens, dtype=float) / self.d0)
        return np.exp(_curve(np.asarray(self.params), log_d, self.model))

    def band(self, tokens) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) samples at ``tokens``: the ``coverage`` interval of the CBS a run would read
        there given the readings (posterior predictive): quantiles of the mixture, over the posterior
        draws, of each draw's normal spread s around its curve. It widens with the distance from the readings.

        Args:
            tokens: token counts D (a number or an array).

        Returns:
            ``(low, high)``: arrays of samples, one entry per token count.
        """
        log_d = np.log(np.atleast_1d(np.asarray(tokens, dtype=float)) / self.d0)
        curves = _curve(self.band_draws, log_d, self.model)  # [draws, D]
        spreads = np.exp(self.band_draws[:, 2])[:, None]
        tail = (1.0 - self.coverage) / 2
        return np.exp(_mixture_quantile(curves, spreads, tail)), np.exp(_mixture_quantile(curves, spreads, 1.0 - tail))

    def covers(self, bracket: Bracket) -> bool:
        """True if the band at the bracket's tokens overlaps [lower, upper]."""
        low, high = self.band(bracket.tokens)
        return bool(low[0] <= bracket.upper and high[0] >= bracket.lower)

    def describe(self) -> str:
        """One line for logs and reports: the model, the readings it was fitted on, the curve (samples against
        tokens), the spread of log CBS and the band's coverage."""
        runs = sorted({b.run for b in self.brackets})
        shape = f"CBS = {math.exp(self.params[0]):.4g} x (D / {self.d0:.4g})^{self.exponent:.3f} samples"
        if self.model == "plateau":
            shape += f", levelling off at {self.plateau:.4g}"
        return (
            f"{self.model} fit to {len(self.brackets)} readings of {len(runs)} run(s) "
            f"({self.brackets[0].tokens:,.0f} to {self.brackets[-1].tokens:,.0f} tokens): {shape}; "
            f"spread of log CBS {self.noise_scale:.3f}; {self.coverage:.0%} posterior predictive band"
        )


def _mixture_quantile(means: np.ndarray, spreads: np.ndarray, q: float) -> np.ndarray:
    """Per column, the q-quantile of the equal mixture of Normal(means[i], spreads[i]) (by bisection)."""
    low = (means - 6 * spreads).min(axis=0)
    high = (means + 6 * spreads).max(axis=0)
    for _ in range(60):
        mid = (low + high) / 2
        below = special.ndtr((mid - means) / spreads).mean(axis=0) < q
        low, high = np.where(below, mid, low), np.where(below, high, mid)
    return (low + high) / 2


def _heldout(brackets: Sequence[Bracket], model: str, d0: float) -> float:
    """Summed log likelihood of each left-out group (a run, or with one run a reading) under the fit to the rest."""
    runs = sorted({b.run for b in brackets})
    groups = [[b for b in brackets if b.run == run] for run in runs] if len(runs) > 1 else [[b] for b in brackets]
    total = 0.0
    for group in groups:
        rest = [b for b in brackets if b not in group]
        if len({b.tokens for b in rest}) < 2:
            continue
        params = _fit(rest, model, d0)
        held = _Readings.of(group, d0)
        total += float(np.sum(_log_likelihood(params, held.log_d, held.log_lo, held.log_hi, model)))
    return total


def forecast_cbs(brackets: Sequence[Bracket], model: str = "auto", coverage: float = 0.8, seed: int = 0) -> CBSForecast:
    """Fit CBS(D) to ``brackets`` (``brackets_from_records`` of one or more runs; see the module docstring).

    ``model``: "power", "plateau" or "auto" (the one with the higher held-out log likelihood;
    the plateau needs readings at 4 or more token counts). ``coverage``: of the band, in (0, 1).
    ``seed``: of the posterior's importance sampling (the band's draws). Raises ValueError for fewer
    than 2 token counts, a bad bracket or argument, naming it; warns once where the readings cannot
    test the curve's shape (fewer than ``MIN_TOKEN_COUNTS`` token counts, or a span under ``MIN_SPAN``).

    Args:
        brackets: the readings' brackets (samples), of one run or several.
        model: ``"power"``, ``"plateau"`` or ``"auto"``.
        coverage: the band's probability, in (0, 1).
        seed: of the posterior's importance sampling.

    Returns:
        The forecast: the curve (samples against tokens) and its band.

    Raises:
        ValueError: as above.

    Examples:
        Brackets around CBS = 64 (D / 1e8)^0.5 samples, a factor of 2 wide:

        >>> brackets = [Bracket(tokens=d, lower=0.75 * cbs, upper=1.5 * cbs, run="run")  # CBS = 64 (D / 1e8)^0.5
        ...             for d, cbs in [(1e8, 64), (4e8, 128), (1.6e9, 256), (6.4e9, 512)]]
        >>> forecast = forecast_cbs(brackets)
        >>> forecast.model, round(forecast.exponent, 2)
        ('power', 0.49)
        >>> forecast.predict([1e8, 6.4e9]).round().tolist()  # samples, inside [48, 96] and [384, 768]
        [69.0, 531.0]
    """
    if model not in (*MODELS, "auto"):
        raise ValueError(f"model={model!r} must be one of {(*MODELS, 'auto')}")
    if not 0 < coverage < 1:
        raise ValueError(f"coverage={coverage!r} must lie in (0, 1), e.g. 0.8")
    brackets = sorted(brackets, key=lambda b: b.tokens)
    for bracket in brackets:
        if not (bracket.tokens > 0 and 0 < bracket.lower < bracket.upper):
            raise ValueError(f"{bracket}: needs tokens > 0 and 0 < lower < upper (upper inf for no upper end)")
    token_counts = sorted({b.tokens for b in brackets})
    if len(token_counts) < 2:
        raise ValueError(f"readings at {len(token_counts)} token count(s); a curve in D needs readings at 2 or more")
    if all(math.isinf(b.upper) for b in brackets):
        raise ValueError(
            "no reading has an upper end (every CBS is beyond its probe's grid): nothing bounds the curve from above"
        )
    span = token_counts[-1] / token_counts[0]
    if len(token_counts) < MIN_TOKEN_COUNTS or span < MIN_SPAN:
        first, last = token_counts[0], token_counts[-1]
        readings = f"{len(token_counts)} token counts spanning {span:.1f}x ({first:,.0f} to {last:,.0f})"
        warnings.warn(
            f"forecast_cbs: readings at {readings} cannot test the curve's shape, so its band holds only if the CBS "
            f"keeps to a power law; probe at {MIN_TOKEN_COUNTS} or more points spanning {MIN_SPAN:g}x or more in tokens"
        )
    d0 = float(np.exp(np.mean(np.log([b.tokens for b in brackets]))))
    candidates = [m for m in MODELS if m == "power" or len(token_counts) >= 4]
    heldout = {m: _heldout(brackets, m, d0) for m in candidates}
    if model != "auto":
        chosen = model
    else:  # the plateau's one more parameter must earn more than 1 in held-out log likelihood
        chosen = "plateau" if heldout.get("plateau", -math.inf) > heldout["power"] + PLATEAU_MARGIN else "power"
    if chosen == "plateau" and "plateau" not in candidates:
        raise ValueError(f"model='plateau' needs readings at 4 or more token counts; these have {len(token_counts)}")
    params = _fit(brackets, chosen, d0)
    draws = _posterior_draws(brackets, chosen, d0, params, np.random.default_rng(seed))
    return CBSForecast(chosen, tuple(float(p) for p in params), d0, coverage, tuple(brackets), heldout, draws)


@dataclasses.dataclass(frozen=True)
class ForecastChange:
    """Where a forecast schedule moves to ``batch`` samples: the band's lower edge reaches ``margin x batch``.

    ``schedule_from_forecast`` returns one per change, in order.

    Attributes:
        tokens: where the schedule changes (tokens).
        batch: the batch from there on (samples).
        band_low: the band's lower edge there (samples).
        band_high: the band's upper edge there (samples).

    Examples:
        >>> change = ForecastChange(tokens=159_245_618, batch=64, band_low=64.39, band_high=116.38)
        >>> change.band_low >= change.batch  # the band's lower edge reached the new batch
        True
    """

    tokens: int
    batch: int
    band_low: float
    band_high: float


def schedule_from_forecast(
    forecast: CBSForecast,
    start: int,
    until_tokens: int,
    *,
    factor: int = 2,
    final: int | None = None,
    margin: float = 1.0,
):
    """A token-indexed ``PiecewiseBatch`` that follows the band's lower edge up to ``until_tokens``, and its changes.

    At D tokens the batch is the largest ``start x factor**n`` (never above ``final``) with
    ``margin x batch <= low(D)``, the band's lower edge: the batch a run would read as below its CBS
    with the band's probability. It never decreases. Returns ``(schedule, [ForecastChange, ...])``.
    Warns once when ``until_tokens`` lies farther past the last reading than the readings span (a
    ratio of token counts): the band assumes the curve keeps its fitted shape there.

    Args:
        forecast: the CBS forecast (``forecast_cbs``), samples against tokens.
        start: the first global batch (samples), an int >= 1.
        until_tokens: the run's budget (tokens): the schedule follows the band up to it.
        factor: each change multiplies the batch by this int >= 2.
        final: the largest batch (samples), or None for no cap.
        margin: a number >= 1: a batch is taken once the band's lower edge reaches ``margin x batch``.

    Returns:
        ``(schedule, changes)``: a token-indexed ``PiecewiseBatch`` and a ``ForecastChange`` per change.

    Raises:
        ValueError: ``until_tokens``, ``start``, ``factor`` or ``margin`` out of range.

    Examples:
        Brackets around CBS = 64 (D / 1e8)^0.5 samples, a factor of 2 wide (as in ``forecast_cbs``):

        >>> brackets = [Bracket(tokens=d, lower=0.75 * cbs, upper=1.5 * cbs, run="run")
        ...             for d, cbs in [(1e8, 64), (4e8, 128), (1.6e9, 256), (6.4e9, 512)]]
        >>> schedule, changes = schedule_from_forecast(forecast_cbs(brackets, model="power"), start=32,
        ...                                            until_tokens=6_400_000_000)
        >>> schedule.sizes()
        [32, 64, 128, 256]
        >>> [(f"{change.tokens:.2g}", change.batch) for change in changes]  # tokens, samples
        [('1.6e+08', 64), ('5.8e+08', 128), ('2.5e+09', 256)]
    """
    from lit_cbs.rules.batch_schedules import PiecewiseBatch

    if not (isinstance(until_tokens, int) and until_tokens > 0):
        raise ValueError(f"until_tokens={until_tokens!r} must be a positive int (the run's budget, tokens)")
    if not (isinstance(start, int) and start >= 1) or not (isinstance(factor, int) and factor >= 2):
        raise ValueError(f"start={start!r} must be an int >= 1 and factor={factor!r} an int >= 2")
    if not (isinstance(margin, (int, float)) and margin >= 1):
        raise ValueError(f"margin={margin!r} must be a number >= 1")
    first, last = forecast.brackets[0].tokens, forecast.brackets[-1].tokens
    if until_tokens / last > last / first:
        reach = f"until_tokens={until_tokens:,} is {until_tokens / last:.1f}x past the last reading ({last:,.0f})"
        warnings.warn(
            f"schedule_from_forecast: {reach}, farther than the readings span ({last / first:.1f}x): the band assumes "
            "the curve keeps its fitted shape that far; probe later in the run, or forecast a shorter one"
        )
    grid = np.unique(np.geomspace(1, until_tokens, 2000).astype(np.int64))
    low, high = forecast.band(grid)
    sizes, thresholds, changes = [start], [0], []
    for tokens, lo, hi in zip(grid, low, high):
        batch = sizes[-1]
        while margin * batch * factor <= lo and (final is None or batch * factor <= final):
            batch *= factor
        if batch > sizes[-1]:
            sizes.append(batch)
            thresholds.append(int(tokens))
            changes.append(ForecastChange(int(tokens), batch, float(lo), float(hi)))
    return PiecewiseBatch(sizes, thresholds, unit="tokens"), changes


def noise_scale_over_tokens(metrics_csv) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, B_simple) from a run's metrics.csv: ``gns/b_simple`` at each step it was logged,
    against the tokens seen at that step (``curves.tokens_at``). Raises ValueError naming the missing column.

    Args:
        metrics_csv: the path of a run's ``metrics.csv`` (a run with ``GradientNoiseScale`` and ``BatchWarmup``).

    Returns:
        ``(tokens, b_simple)``: tokens seen, and B_simple (samples) at each step it was logged.

    Raises:
        ValueError: the file has no ``gns/b_simple`` or no ``tokens_seen`` column.

    Examples:
        >>> import os, tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = os.path.join(folder, "metrics.csv")
        ...     with open(path, "w") as file:
        ...         for row in ["step,tokens_seen,gns/b_simple", "0,1000,", "1,2000,5.0", "3,4000,10.0"]:
        ...             print(row, file=file)
        ...     tokens, b_simple = noise_scale_over_tokens(path)
        >>> tokens.tolist(), b_simple.tolist()
        ([2000.0, 4000.0], [5.0, 10.0])
    """
    from lit_cbs.analysis.curves import GNS_COLUMN, TOKENS_COLUMN, read_metrics_csv, tokens_at

    series = read_metrics_csv(metrics_csv)
    for name in (GNS_COLUMN, TOKENS_COLUMN):
        if name not in series:
            raise ValueError(
                f"{metrics_csv} has no {name!r}; pass the metrics.csv of a run with GradientNoiseScale and BatchWarmup"
            )
    steps, b_simple = series[GNS_COLUMN]
    return tokens_at(series, steps), np.asarray(b_simple, dtype=float)


def growth_exponent(tokens, values) -> float:
    """The slope of log(values) against log(tokens) (least squares) over positive finite points: the x
    in values ~ tokens^x. For the noise scale beside ``CBSForecast.exponent``. ValueError under 2 points.

    Args:
        tokens: token counts.
        values: the quantity at each (B_simple or a CBS, samples); points not positive and finite are left out.

    Returns:
        The exponent x (unitless).

    Raises:
        ValueError: fewer than 2 distinct token counts with a positive finite value.

    Examples:
        >>> round(growth_exponent([1e8, 4e8, 1.6e9], [10.0, 20.0, 40.0]), 4)  # doubles per 4x tokens
        0.5
    """
    tokens, values = np.asarray(tokens, dtype=float), np.asarray(values, dtype=float)
    keep = np.isfinite(tokens) & np.isfinite(values) & (tokens > 0) & (values > 0)
    if len(set(tokens[keep])) < 2:
        raise ValueError(
            f"{int(keep.sum())} positive finite point(s) at {len(set(tokens[keep]))} token count(s); "
            "a growth exponent needs 2"
        )
    return float(np.polyfit(np.log(tokens[keep]), np.log(values[keep]), 1)[0])
