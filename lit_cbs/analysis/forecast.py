"""A CBS(D) curve fitted to the probe readings' brackets, its posterior predictive band and a schedule following it."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, special, stats

from lit_cbs import metrics
from lit_cbs.analysis.curves import read_metrics_csv, tokens_at
from lit_cbs.analysis.probe_schedule import check_growth, grow_batch
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.reading import ProbeReading, judged_multipliers
from lit_cbs.rules.batch_schedules import PiecewiseBatch

MODELS = ("power", "plateau")
# Weak priors; s and the ceiling c in log CBS (natural log of samples), b per log token.
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
    """The CBS at ``tokens`` lies in [``lower``, ``upper``] samples (``upper`` inf: no upper end); ``run``: the run
    read (the model choice leaves runs out by it)."""

    tokens: float
    lower: float
    upper: float
    run: str
    determined: bool = True


def _number(reading: ProbeReading, key: str, where: str, minimum: float = 0.0) -> float:
    value = getattr(reading, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= minimum:
        raise ValueError(f"{where}: {key}={value!r} must be a number > {minimum:g}; not a reading of cbs_probe.jsonl?")
    return float(value)


def supported_interval(
    reading: ProbeReading, where: str = "reading", epsilon: float | None = None
) -> tuple[float, float]:
    """(lower, upper) samples of the CBS, judged again from the per-batch losses at the reading's epsilon (else
    ``epsilon``); without them its bracket, or [smallest k B, inf) if undetermined; one measured elsewhere: its own."""
    batch = _number(reading, "batch_size", where)
    if reading.mode == "elsewhere":
        return batch, math.inf if reading.cbs_upper is None else float(reading.cbs_upper)
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
    readings: Iterable[ProbeReading], run: str = "run", epsilon: float | None = None
) -> list[Bracket]:
    """One ``Bracket`` per probe reading of one run, sorted by tokens; ``epsilon`` (nats) judges readings that do not
    hold theirs. Raises ValueError naming a bad reading, or for readings of different seq_len.

    Examples:
        >>> from lit_cbs.probe.reading import BranchScore, ProbeReading
        >>> where = dict(step=0, seq_len=1024, window_tokens=10**6, search="grid", evaluate="train_ema", main_loss=3.0,
        ...              branches_trained=[2, 4], failed=[], tokens_spent=0, overhead=0.0)
        >>> def reading(tokens, loss_at_4):  # k = 1, 2, 4 of B = 32 samples, judged by the mean losses alone
        ...     scores = {1: BranchScore(3.0), 2: BranchScore(3.0), 4: BranchScore(loss_at_4)}
        ...     return ProbeReading.decide(scores, 0.01, 0.5, [1, 2, 4], 32, tokens=tokens, **where)
        >>> [(b.tokens, b.lower, b.upper) for b in brackets_from_records([reading(4e8, 3.0), reading(1e8, 3.1)])]
        [(100000000.0, 64.0, 128.0), (400000000.0, 128.0, inf)]
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
        raise ValueError(
            f"{run}: readings of seq_len {sorted(map(str, seq_lens))} mixed; fit one sequence length at a time"
        )
    return sorted(brackets, key=lambda b: b.tokens)


def _curve(params: np.ndarray, log_d: np.ndarray, model: str) -> np.ndarray:
    """log CBS at log(D / D0): shaped as ``log_d`` for one parameter vector, [draws, *log_d.shape] for a stack."""
    params = np.asarray(params, dtype=float)  # each parameter against log D: [draws, 1] columns for a stack
    columns = params.T[..., None] if params.ndim > 1 else params
    power: np.ndarray = columns[0] + columns[1] * log_d
    if model == "power":
        return power
    return np.asarray(-np.logaddexp(-power, -columns[3]))  # 1 / CBS = 1 / power + 1 / c


def _log_likelihood(
    params: np.ndarray, log_d: np.ndarray, log_lo: np.ndarray, log_hi: np.ndarray, model: str
) -> np.ndarray:
    """Per bracket (last axis): log P(log_lo < log CBS < log_hi) under Normal(curve, s)."""
    scale = np.exp(np.asarray(params, dtype=float)[..., 2:3])  # s, as a column for a stack
    mu = _curve(params, log_d, model)
    upper = special.log_ndtr((log_hi - mu) / scale)  # log Phi; log_hi = inf gives 0
    lower = special.log_ndtr((log_lo - mu) / scale)
    # log(exp(upper) - exp(lower)), kept finite where the two are close.
    return np.asarray(upper + np.log1p(-np.exp(np.minimum(lower - upper, -1e-12))))


def _bounds(model: str) -> list[tuple[float | None, float | None]]:
    spread = (math.log(SPREAD_BOUNDS[0]), math.log(SPREAD_BOUNDS[1]))
    return [(None, None), (-EXPONENT_BOUND, EXPONENT_BOUND), spread] + ([(None, None)] if model == "plateau" else [])


def _log_prior(params: np.ndarray, model: str, log_ceiling: float, spread_median: float) -> np.ndarray:
    """The weak priors' log density (up to a constant) of each parameter vector; -inf outside ``_bounds``."""
    params = np.asarray(params, dtype=float)
    b, log_s = params[..., 1], params[..., 2]
    spread = (log_s - math.log(spread_median)) / SPREAD_PRIOR_SD
    density = -0.5 * spread**2 - 0.5 * (b / EXPONENT_PRIOR_SD) ** 2
    if model == "plateau":
        density = density - 0.5 * ((params[..., 3] - log_ceiling) / CEILING_PRIOR_SD) ** 2
    (_, b_high), (s_low, s_high) = _bounds(model)[1:3]
    inside = (np.abs(b) <= b_high) & (log_s >= s_low) & (log_s <= s_high)
    return np.asarray(np.where(inside, density, -np.inf))


def _logs(brackets: Sequence[Bracket], d0: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Brackets as the likelihood reads them: log(D / D0), log lower, log upper."""
    log_d = np.log(np.array([b.tokens for b in brackets]) / d0)
    return log_d, np.log([b.lower for b in brackets]), np.log([b.upper for b in brackets])


def _log_posterior(
    params: np.ndarray, logs: tuple[np.ndarray, np.ndarray, np.ndarray], model: str, spread_median: float
) -> np.ndarray:
    """Summed log likelihood plus log prior (up to a constant; the plateau's centred on the largest lower end)."""
    likelihood = np.sum(_log_likelihood(params, *logs, model), axis=-1)
    return np.asarray(likelihood + _log_prior(params, model, float(logs[1].max()), spread_median))


def _fit(brackets: Sequence[Bracket], model: str, d0: float, spread_median: float) -> np.ndarray:
    """The posterior's mode (log a, b, log s[, log c]) for D in units of ``d0`` tokens."""
    logs = _logs(brackets, d0)

    def loss(params: np.ndarray) -> float:
        value = -float(_log_posterior(params, logs, model, spread_median))
        return value if math.isfinite(value) else 1e12

    log_d, log_lo, log_hi = logs
    upper = np.where(np.isfinite(log_hi), log_hi, log_lo + 2 * math.log(2))  # an open end's centre: twice its lower
    centre = (log_lo + upper) / 2
    slope = np.polyfit(log_d, centre, 1)[0] if len(set(log_d)) > 1 else 0.0
    slope = float(np.clip(slope, -EXPONENT_BOUND, EXPONENT_BOUND))
    line = np.array([float(np.mean(centre - slope * log_d)), slope, math.log(spread_median)])
    # The plateau starts from the power law's fit, with the ceiling near, at and above the largest reading.
    power = _fit(brackets, "power", d0, spread_median) if model == "plateau" else line
    starts = [line] if model == "power" else [np.append(power, float(np.max(centre)) + s) for s in (-0.5, 0.5, 2.0)]
    results = [optimize.minimize(loss, x0, method="L-BFGS-B", bounds=_bounds(model)) for x0 in starts]
    return np.asarray(min(results, key=lambda result: result.fun).x)


def laplace_covariance(
    log_posterior: Callable[[np.ndarray], np.ndarray], mode: np.ndarray, step: float = 1e-3
) -> np.ndarray:
    """The inverse Hessian of -log posterior at ``mode``, no direction's standard deviation above 3."""
    size = len(mode)
    offsets = np.eye(size) * step
    hessian = np.empty((size, size))
    for i in range(size):
        for j in range(size):
            corners = [mode + si * offsets[i] + sj * offsets[j] for si, sj in ((1, 1), (1, -1), (-1, 1), (-1, -1))]
            costs = [-float(log_posterior(corner)) for corner in corners]
            hessian[i, j] = (costs[0] - costs[1] - costs[2] + costs[3]) / (4 * step * step)
    values, vectors = np.linalg.eigh((hessian + hessian.T) / 2)
    return np.asarray((vectors / np.maximum(values, 1 / 9)) @ vectors.T)


def _posterior_draws(
    brackets: Sequence[Bracket],
    model: str,
    d0: float,
    mode: np.ndarray,
    rng: np.random.Generator,
    spread_median: float = SPREAD_PRIOR_MEDIAN,
) -> np.ndarray:
    """``POSTERIOR_DRAWS`` parameter vectors from the posterior, by importance sampling from a Student t."""
    log_posterior = functools.partial(
        _log_posterior, logs=_logs(brackets, d0), model=model, spread_median=spread_median
    )
    centre, shape = mode, laplace_covariance(log_posterior, mode)
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
    return np.asarray(draws[rng.choice(PROPOSALS, size=POSTERIOR_DRAWS, p=weights)])


@dataclasses.dataclass(frozen=True)
class CBSForecast:
    """A fitted CBS(D) curve and its band at ``coverage``. ``params``: the posterior's mode of log a, b, log s (and
    log c), D in units of ``d0`` tokens, the CBS in samples; ``heldout_log_likelihood``: per model choice."""

    model: str
    params: tuple[float, ...]
    d0: float
    coverage: float
    brackets: tuple[Bracket, ...]
    heldout_log_likelihood: dict[str, float]
    band_draws: np.ndarray = dataclasses.field(repr=False)

    @property
    def exponent(self) -> float:
        return self.params[1]

    @property
    def plateau(self) -> float | None:
        """c in samples for the plateau model; None for the power law."""
        return math.exp(self.params[3]) if self.model == "plateau" else None

    def predict(self, tokens: ArrayLike) -> np.ndarray:
        """The posterior mode's CBS (samples) at ``tokens``."""
        log_d = np.log(np.asarray(tokens, dtype=float) / self.d0)
        return np.asarray(np.exp(_curve(np.asarray(self.params), log_d, self.model)))

    def band(self, tokens: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) samples at ``tokens``: the ``coverage`` interval of the CBS a run would read there."""
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
        """One line: the model, its readings, the curve, the spread and the band."""
        runs = sorted({b.run for b in self.brackets})
        shape = f"CBS = {math.exp(self.params[0]):.4g} x (D / {self.d0:.4g})^{self.exponent:.3f} samples"
        if self.model == "plateau":
            shape += f", levelling off at {self.plateau:.4g}"
        return (
            f"{self.model} fit to {len(self.brackets)} readings of {len(runs)} run(s) "
            f"({self.brackets[0].tokens:,.0f} to {self.brackets[-1].tokens:,.0f} tokens): {shape}; "
            f"spread of log CBS {math.exp(self.params[2]):.3f}; {self.coverage:.0%} posterior predictive band"
        )


def _mixture_quantile(means: np.ndarray, spreads: np.ndarray, q: float) -> np.ndarray:
    """Per column, the q-quantile of the equal mixture of Normal(means[i], spreads[i]) (by bisection)."""
    low = (means - 6 * spreads).min(axis=0)
    high = (means + 6 * spreads).max(axis=0)
    for _ in range(60):
        mid = (low + high) / 2
        below = special.ndtr((mid - means) / spreads).mean(axis=0) < q
        low, high = np.where(below, mid, low), np.where(below, high, mid)
    return np.asarray((low + high) / 2)


def _heldout(brackets: Sequence[Bracket], model: str, d0: float, spread_median: float) -> float:
    """Summed log likelihood of each left-out group (a run, or with one run a reading) under the fit to the rest."""
    runs = sorted({b.run for b in brackets})
    groups = [[b for b in brackets if b.run == run] for run in runs] if len(runs) > 1 else [[b] for b in brackets]
    total = 0.0
    for group in groups:
        rest = [b for b in brackets if b not in group]
        if len({b.tokens for b in rest}) < 2:
            continue
        params = _fit(rest, model, d0, spread_median)
        total += float(np.sum(_log_likelihood(params, *_logs(group, d0), model)))
    return total


def forecast_cbs(
    brackets: Sequence[Bracket],
    model: str = "auto",
    coverage: float = 0.8,
    seed: int = 0,
    spread_prior: float = SPREAD_PRIOR_MEDIAN,
) -> CBSForecast:
    """CBS(D) fitted to ``brackets`` of one or more runs. ``model``: "power", "plateau" (readings at 4 or more token
    counts) or "auto": the plateau where its held-out log likelihood beats the power law's by ``PLATEAU_MARGIN``.
    ``seed``: of the band's sampling; ``spread_prior``: the prior's median spread of log CBS (fitted on other runs).
    Warns where the readings cannot test the curve's shape.

    Examples:
        >>> from lit_cbs.analysis.forecast import Bracket
        >>> brackets = [Bracket(tokens=d, lower=0.75 * cbs, upper=1.5 * cbs, run="run")  # CBS = 64 (D / 1e8)^0.5
        ...             for d, cbs in [(1e8, 64), (4e8, 128), (1.6e9, 256), (6.4e9, 512)]]
        >>> forecast = forecast_cbs(brackets)
        >>> forecast.model, round(forecast.exponent, 2), forecast.predict([1e8, 6.4e9]).round().tolist()
        ('power', 0.49, [69.0, 531.0])
    """
    if model not in (*MODELS, "auto"):
        raise ValueError(f"model={model!r} must be one of {(*MODELS, 'auto')}")
    if not 0 < coverage < 1:
        raise ValueError(f"coverage={coverage!r} must lie in (0, 1), e.g. 0.8")
    brackets = sorted(brackets, key=lambda b: b.tokens)
    if bad := [b for b in brackets if not (b.tokens > 0 and 0 < b.lower < b.upper)]:
        raise ValueError(f"{bad[0]}: needs tokens > 0 and 0 < lower < upper (upper inf for no upper end)")
    token_counts = sorted({b.tokens for b in brackets})
    if len(token_counts) < 2:
        raise ValueError(f"readings at {len(token_counts)} token count(s); a curve in D needs readings at 2 or more")
    if all(math.isinf(b.upper) for b in brackets):
        raise ValueError(
            "no reading has an upper end (every CBS is beyond its probe's grid): nothing bounds the curve from above"
        )
    first, last, span = token_counts[0], token_counts[-1], token_counts[-1] / token_counts[0]
    if len(token_counts) < MIN_TOKEN_COUNTS or span < MIN_SPAN:
        readings = f"{len(token_counts)} token counts spanning {span:.1f}x ({first:,.0f} to {last:,.0f})"
        warnings.warn(
            f"forecast_cbs: readings at {readings} cannot test the curve's shape, so its band holds only if the CBS "
            f"keeps to a power law; probe at {MIN_TOKEN_COUNTS} or more points spanning {MIN_SPAN:g}x or more in tokens"
        )
    d0 = float(np.exp(np.mean(np.log([b.tokens for b in brackets]))))
    candidates = [m for m in MODELS if m == "power" or len(token_counts) >= 4]
    heldout = {m: _heldout(brackets, m, d0, spread_prior) for m in candidates}
    # "auto": the plateau's one more parameter must earn more than PLATEAU_MARGIN in held-out log likelihood.
    beats_power = heldout.get("plateau", -math.inf) > heldout["power"] + PLATEAU_MARGIN
    chosen = model if model != "auto" else "plateau" if beats_power else "power"
    if chosen == "plateau" and "plateau" not in candidates:
        raise ValueError(f"model='plateau' needs readings at 4 or more token counts; these have {len(token_counts)}")
    params = _fit(brackets, chosen, d0, spread_prior)
    draws = _posterior_draws(brackets, chosen, d0, params, np.random.default_rng(seed), spread_prior)
    return CBSForecast(chosen, tuple(float(p) for p in params), d0, coverage, tuple(brackets), heldout, draws)


@dataclasses.dataclass(frozen=True)
class ForecastChange:
    """Where ``schedule_from_forecast``'s schedule moves to ``batch`` samples, and the band there (samples)."""

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
) -> tuple[PiecewiseBatch, list[ForecastChange]]:
    """(a token-indexed ``PiecewiseBatch``, its changes) up to ``until_tokens``, following the band's lower edge as
    ``schedule_from_probe`` follows readings; warns when extrapolating farther than the readings span."""
    followed = follow_band(forecast.band, start, until_tokens, factor=factor, final=final, margin=margin)
    first, last = forecast.brackets[0].tokens, forecast.brackets[-1].tokens
    if until_tokens / last > last / first:
        reach = f"until_tokens={until_tokens:,} is {until_tokens / last:.1f}x past the last reading ({last:,.0f})"
        warnings.warn(
            f"schedule_from_forecast: {reach}, farther than the readings span ({last / first:.1f}x): the band assumes "
            "the curve keeps its fitted shape that far; probe later in the run, or forecast a shorter one"
        )
    return followed


def follow_band(
    band: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
    start: int,
    until_tokens: int,
    *,
    factor: int = 2,
    final: int | None = None,
    margin: float = 1.0,
) -> tuple[PiecewiseBatch, list[ForecastChange]]:
    """The schedule (and its changes) whose batch follows the lower edge of ``band`` (tokens -> samples)."""
    if not (isinstance(until_tokens, int) and until_tokens > 0):
        raise ValueError(f"until_tokens={until_tokens!r} must be a positive int (the run's budget, tokens)")
    check_growth(start, factor, margin)
    grid = np.unique(np.geomspace(1, until_tokens, 2000).astype(np.int64))
    low, high = band(grid)
    changes = [
        ForecastChange(int(grid[i]), batch, float(low[i]), float(high[i]))
        for i, batch in grow_batch(low, start, factor, final, margin)
    ]
    sizes, thresholds = [start] + [c.batch for c in changes], [0] + [c.tokens for c in changes]
    return PiecewiseBatch(sizes, thresholds, unit="tokens"), changes


def noise_scale_over_tokens(metrics_csv: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, B_simple) where a run's metrics.csv logged ``gns/b_simple``."""
    series = read_metrics_csv(metrics_csv)
    for name in (metrics.GNS_B_SIMPLE, metrics.TOKENS_SEEN):
        if name not in series:
            raise ValueError(
                f"{metrics_csv} has no {name!r}; pass the metrics.csv of a run with GradientNoiseScale and BatchWarmup"
            )
    steps, b_simple = series[metrics.GNS_B_SIMPLE]
    return tokens_at(series, steps), np.asarray(b_simple, dtype=float)


def growth_exponent(tokens: ArrayLike, values: ArrayLike) -> float:
    """x in values ~ tokens^x: the least-squares slope of log(values) against log(tokens), positive finite points."""
    tokens, values = np.asarray(tokens, dtype=float), np.asarray(values, dtype=float)
    keep = np.isfinite(tokens) & np.isfinite(values) & (tokens > 0) & (values > 0)
    if len(set(tokens[keep])) < 2:
        raise ValueError(
            f"{int(keep.sum())} positive finite point(s) at {len(set(tokens[keep]))} token count(s); "
            "a growth exponent needs 2"
        )
    return float(np.polyfit(np.log(tokens[keep]), np.log(values[keep]), 1)[0])
