"""Forecast the critical batch size past the last probe: a curve CBS(D) fitted to probe brackets.

A probe reading does not measure the CBS; it brackets it: the CBS at D tokens lies in
[lower, upper] samples. ``supported_interval`` reads that interval off a record at the record's own
confidence and epsilon: ``lower`` is the largest batch k B whose loss is within epsilon of every
smaller k's with that confidence, ``upper`` the smallest k B that is beyond epsilon of a smaller k's
with that confidence (none measured: no upper end). For a determined reading of the grid strategy
that is its bracket [k* B, next k B] (bisection measures fewer k, so there the upper end is the next
measured k, which the data support, not the next k of the grid); an undetermined one gets the
wider interval its data support.

``forecast_cbs`` fits log CBS(D) = mu(D) + noise, noise ~ Normal(0, s), to those intervals by
maximum likelihood (s at least ``MIN_SPREAD``): each interval contributes P(log lower < log CBS < log upper) =
Phi((log upper - mu) / s) - Phi((log lower - mu) / s) (an interval-censored likelihood; an open
upper end contributes 1 - Phi(...)). Two curves:

- ``power``: CBS(D) = a (D / D0)^b (Zhang et al. 2024, Bergsma et al. 2025: the critical batch
  grows as a power of the tokens seen, nearly independent of model size);
- ``plateau``: 1 / CBS(D) = 1 / (a (D / D0)^b) + 1 / c, a power law that levels off at c samples
  (Merrill et al. 2025 see the CBS grow fast, then slowly, then stay near a ceiling).

D0 is the geometric mean of the readings' token counts (the fit's scale only). ``model="auto"``
compares the curves' held-out log likelihood (each run left out in turn when the readings come
from two or more runs, else each reading left out in turn) and takes the plateau only when it
gains more than ``PLATEAU_MARGIN`` (1 nat, its one extra parameter's worth) over the power law. The band at ``coverage``
is a bootstrap: resample the runs (with replacement), then the readings within each, refit, and
take the quantiles of CBS(D) at each D; the noise scale s adds the spread of one run's CBS around
the curve. Pure numpy/scipy: no Lightning, no plotting (``lit_cbs.analysis.plots.plot_forecast``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from scipy import optimize, special

from lit_cbs.errors import LitCBSConfigError

MODELS = ("power", "plateau")
# The least spread s of log CBS around the curve the fit allows. Brackets a factor of 2 wide cannot
# resolve a smaller one, and without a floor a curve threading every bracket drives s to 0: a band
# of no width, and a held-out run that misses it by a little scores as impossible.
MIN_SPREAD = 0.1
PLATEAU_MARGIN = 1.0  # held-out log likelihood the plateau must gain over the power law to be chosen


@dataclasses.dataclass(frozen=True)
class Bracket:
    """The CBS at ``tokens`` lies in [``lower``, ``upper``] samples (``upper`` inf: no upper end)."""

    tokens: float
    lower: float
    upper: float
    run: str  # which run the reading came from (bootstrap and model choice group by it)
    determined: bool = True


def _number(record: Mapping, key: str, where: str, minimum: float = 0.0) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= minimum:
        raise ValueError(
            f"{where}: {key}={value!r} must be a number > {minimum:g}; pass records a CBSProbeCallback wrote (cbs_probe.jsonl)"
        )
    return float(value)


def supported_interval(record: Mapping, where: str = "record", epsilon: float | None = None) -> tuple[float, float]:
    """(lower, upper) in samples: where the CBS lies at the record's confidence (see the module docstring).

    Uses the per-batch held-out losses when the record has them (``evaluate="heldout"``; with
    replicate windows, their spread too, as the probe judged them), judged at the record's own
    ``epsilon`` (nats); ``epsilon`` is for records written before readings stored theirs (the run's
    ``callbacks.cbs_probe.epsilon``), and such a record without it is refused rather than judged at
    a guess. A record without per-batch losses keeps its own bracket when determined, and an
    undetermined one without them supports only [smallest k B, no upper end).

    Raises:
        LitCBSConfigError: the record needs an epsilon it does not hold and ``epsilon`` is None.
    """
    from lit_cbs.probe.reading import judged_multipliers, record_scores

    batch = _number(record, "batch_size", where)
    losses = record.get("losses")
    if not isinstance(losses, Mapping) or not losses:
        raise ValueError(
            f"{where}: losses={losses!r} must map each multiplier to its loss; pass records a CBSProbeCallback wrote"
        )
    ks = sorted(float(k) for k in losses)
    batch_losses = record.get("batch_losses") or {}
    confidence = float(record.get("confidence", 0.5))
    if not all(f"{k:g}" in batch_losses for k in ks):
        if record.get("determined", True):
            lower = _number(record, "cbs_lower", where)
            upper = record.get("cbs_upper")
            return lower, math.inf if upper is None else float(upper)
        return ks[0] * batch, math.inf
    epsilon = record.get("epsilon", epsilon)
    if epsilon is None:
        raise LitCBSConfigError(
            f"{where} holds no epsilon (written before probe records stored theirs), so its interval cannot be read; "
            "pass the run's callbacks.cbs_probe.epsilon (nats) as epsilon= (recipes/schedule_from_probe.py: --epsilon)"
        )
    scores = record_scores(losses, batch_losses, record.get("replicate_batch_losses") or {})
    admissible, rejected = judged_multipliers(scores, float(epsilon), confidence)
    lower = max(admissible, default=ks[0]) * batch
    above = [k for k in rejected if k * batch > lower]
    return lower, (min(above) * batch if above else math.inf)


def brackets_from_records(records: Iterable[Mapping], run: str = "run", epsilon: float | None = None) -> list[Bracket]:
    """One ``Bracket`` per probe record of one run (``supported_interval``, ``epsilon`` nats for records
    without their own), in tokens order.

    Raises ValueError naming the record for a record without tokens, batch_size or losses, or records
    of different seq_len (a CBS in samples means another number of tokens at another length); a
    ``LitCBSConfigError`` for a record that needs an epsilon when none is given."""
    brackets, seq_lens = [], set()
    for number, record in enumerate(records, start=1):
        where = f"{run}: record {number}"
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: {record!r} is not a probe record (a JSON object with tokens, batch_size, losses, ...)")
        tokens = _number(record, "tokens", where)
        seq_lens.add(record.get("seq_len"))
        lower, upper = supported_interval(record, where, epsilon)
        brackets.append(Bracket(tokens, lower, upper, run, bool(record.get("determined", True))))
    if not brackets:
        raise ValueError(f"{run}: no probe record; a forecast needs readings")
    if len(seq_lens) > 1:
        raise ValueError(f"{run}: records of seq_len {sorted(map(str, seq_lens))} mixed; fit one sequence length at a time")
    return sorted(brackets, key=lambda b: b.tokens)


# ---------------------------------------------------------------------- the likelihood
def _curve(params: np.ndarray, log_d: np.ndarray, model: str) -> np.ndarray:
    """log CBS at log(D / D0)."""
    log_a, b = params[0], params[1]
    power = log_a + b * log_d
    if model == "power":
        return power
    log_c = params[3]
    return -np.logaddexp(-power, -log_c)  # 1 / CBS = 1 / power + 1 / c


def _log_likelihood(params: np.ndarray, log_d, log_lo, log_hi, model: str) -> np.ndarray:
    """Per bracket: log P(log_lo < log CBS < log_hi) under Normal(curve, s)."""
    scale = math.exp(params[2])
    mu = _curve(params, log_d, model)
    upper = special.log_ndtr((log_hi - mu) / scale)  # log Phi; log_hi = inf gives 0
    lower = special.log_ndtr((log_lo - mu) / scale)
    # log(exp(upper) - exp(lower)), kept finite where the two are close.
    return upper + np.log1p(-np.exp(np.minimum(lower - upper, -1e-12)))


def _fit(brackets: Sequence[Bracket], model: str, d0: float, start: np.ndarray | None = None) -> np.ndarray:
    log_d = np.log(np.array([b.tokens for b in brackets]) / d0)
    log_lo = np.log(np.array([b.lower for b in brackets]))
    log_hi = np.log(np.array([b.upper for b in brackets]))

    def loss(params):
        value = -float(np.sum(_log_likelihood(params, log_d, log_lo, log_hi, model)))
        return value if math.isfinite(value) else 1e12

    bounds = [(None, None), (-3.0, 3.0), (math.log(MIN_SPREAD), math.log(5.0))] + ([(None, None)] if model == "plateau" else [])
    if start is not None:
        starts = [start]
    else:
        centre = np.where(np.isfinite(log_hi), (log_lo + np.where(np.isfinite(log_hi), log_hi, 0)) / 2, log_lo + math.log(2))
        slope = np.polyfit(log_d, centre, 1)[0] if len(set(log_d)) > 1 else 0.0
        line = np.array([float(np.mean(centre - slope * log_d)), float(slope), math.log(0.5)])
        if model == "power":
            starts = [line]
        else:  # from the power law's fit, with the ceiling near, at and above the largest reading
            power = _fit(brackets, "power", d0)
            starts = [np.append(power, float(np.max(centre)) + shift) for shift in (-0.5, 0.5, 2.0)]
    results = [optimize.minimize(loss, x0, method="L-BFGS-B", bounds=bounds) for x0 in starts]
    return min(results, key=lambda result: result.fun).x


@dataclasses.dataclass(frozen=True)
class CBSForecast:
    """A fitted CBS(D) curve, its band at ``coverage``, and what it was fitted on.

    ``params``: log a, b, log s (and log c for the plateau), with D in units of ``d0`` tokens.
    ``heldout_log_likelihood``: per model, the summed log likelihood of each left-out run's (or
    reading's) brackets under the fit to the rest. ``band_draws``: the bootstrap fits' parameters.
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
        """s: the spread of log CBS around the curve (one run's readings against the curve)."""
        return math.exp(self.params[2])

    def predict(self, tokens) -> np.ndarray:
        """The fitted CBS (samples) at ``tokens`` (a number or an array)."""
        log_d = np.log(np.asarray(tokens, dtype=float) / self.d0)
        return np.exp(_curve(np.asarray(self.params), log_d, self.model))

    def band(self, tokens) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) samples at ``tokens``: the ``coverage`` interval of the CBS a run would read
        there: quantiles of the mixture, over the bootstrap fits, of each fit's normal spread s
        around its curve (so both the curve's uncertainty and one run's spread around it count)."""
        log_d = np.log(np.atleast_1d(np.asarray(tokens, dtype=float)) / self.d0)
        curves = np.stack([_curve(draw, log_d, self.model) for draw in self.band_draws])  # [draws, D]
        spreads = np.exp(self.band_draws[:, 2])[:, None]
        tail = (1.0 - self.coverage) / 2
        return np.exp(_mixture_quantile(curves, spreads, tail)), np.exp(_mixture_quantile(curves, spreads, 1.0 - tail))

    def covers(self, bracket: Bracket) -> bool:
        """True if the band at the bracket's tokens overlaps [lower, upper]."""
        low, high = self.band(bracket.tokens)
        return bool(low[0] <= bracket.upper and high[0] >= bracket.lower)

    def describe(self) -> str:
        runs = sorted({b.run for b in self.brackets})
        shape = f"CBS = {math.exp(self.params[0]):.4g} x (D / {self.d0:.4g})^{self.exponent:.3f} samples"
        if self.model == "plateau":
            shape += f", levelling off at {self.plateau:.4g}"
        return (
            f"{self.model} fit to {len(self.brackets)} readings of {len(runs)} run(s) "
            f"({self.brackets[0].tokens:,.0f} to {self.brackets[-1].tokens:,.0f} tokens): {shape}; "
            f"spread of log CBS {self.noise_scale:.3f}; band at {self.coverage:.0%}"
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
        log_d = np.log(np.array([b.tokens for b in group]) / d0)
        total += float(
            np.sum(_log_likelihood(params, log_d, np.log([b.lower for b in group]), np.log([b.upper for b in group]), model))
        )
    return total


def forecast_cbs(
    brackets: Sequence[Bracket],
    model: str = "auto",
    coverage: float = 0.8,
    bootstrap: int = 200,
    seed: int = 0,
) -> CBSForecast:
    """Fit CBS(D) to ``brackets`` (``brackets_from_records`` of one or more runs; see the module docstring).

    ``model``: "power", "plateau" or "auto" (the one with the higher held-out log likelihood;
    the plateau needs readings at 4 or more token counts). ``coverage``: of the band, in (0, 1).
    ``bootstrap``: refits for the band. Raises ValueError for fewer than 2 token counts, a bad
    bracket or argument, naming it.
    """
    if model not in (*MODELS, "auto"):
        raise ValueError(f"model={model!r} must be one of {(*MODELS, 'auto')}")
    if not 0 < coverage < 1:
        raise ValueError(f"coverage={coverage!r} must lie in (0, 1), e.g. 0.8")
    if not (isinstance(bootstrap, int) and bootstrap >= 20):
        raise ValueError(f"bootstrap={bootstrap!r} must be an int >= 20 (refits for the band)")
    brackets = sorted(brackets, key=lambda b: b.tokens)
    for bracket in brackets:
        if not (bracket.tokens > 0 and 0 < bracket.lower < bracket.upper):
            raise ValueError(f"{bracket}: needs tokens > 0 and 0 < lower < upper (upper inf for no upper end)")
    if len({b.tokens for b in brackets}) < 2:
        raise ValueError(
            f"readings at {len({b.tokens for b in brackets})} token count(s); a curve in D needs readings at 2 or more"
        )
    if all(math.isinf(b.upper) for b in brackets):
        raise ValueError(
            "no reading has an upper end (every CBS is beyond its probe's grid): nothing bounds the curve from above"
        )
    d0 = float(np.exp(np.mean(np.log([b.tokens for b in brackets]))))
    candidates = [m for m in MODELS if m == "power" or len({b.tokens for b in brackets}) >= 4]
    heldout = {m: _heldout(brackets, m, d0) for m in candidates}
    if model != "auto":
        chosen = model
    else:  # the plateau's one more parameter must earn more than 1 in held-out log likelihood
        chosen = "plateau" if heldout.get("plateau", -math.inf) > heldout["power"] + PLATEAU_MARGIN else "power"
    if chosen == "plateau" and "plateau" not in candidates:
        raise ValueError(
            f"model='plateau' needs readings at 4 or more token counts; these have {len({b.tokens for b in brackets})}"
        )
    params = _fit(brackets, chosen, d0)

    rng = np.random.default_rng(seed)
    runs = sorted({b.run for b in brackets})
    by_run = {run: [b for b in brackets if b.run == run] for run in runs}
    draws, tries = [], 0
    while len(draws) < bootstrap:
        tries += 1
        if tries > 20 * bootstrap:
            raise ValueError(
                f"only {len(draws)} of {tries} resamples of the readings could be fitted (each needs 2 token counts "
                "and an upper end); probe at more points or with a wider grid"
            )
        sample = []
        for run in rng.choice(runs, size=len(runs)) if len(runs) > 1 else runs:
            members = by_run[run]
            sample += [members[i] for i in rng.integers(0, len(members), size=len(members))]
        if len({b.tokens for b in sample}) < 2 or all(math.isinf(b.upper) for b in sample):
            continue  # a resample the curve cannot be fitted to
        draws.append(_fit(sample, chosen, d0, start=params))
    return CBSForecast(chosen, tuple(float(p) for p in params), d0, coverage, tuple(brackets), heldout, np.array(draws))


@dataclasses.dataclass(frozen=True)
class ForecastChange:
    """Where a forecast schedule moves to ``batch`` samples: the band's lower edge reaches ``margin x batch``."""

    tokens: int
    batch: int
    band_low: float
    band_high: float


def schedule_from_forecast(
    forecast: CBSForecast, start: int, until_tokens: int, *, factor: int = 2, final: int | None = None, margin: float = 1.0
):
    """A token-indexed ``PiecewiseBatch`` that follows the band's lower edge up to ``until_tokens``, and its changes.

    At D tokens the batch is the largest ``start x factor**n`` (never above ``final``) with
    ``margin x batch <= low(D)``, the band's lower edge: the batch a run would read as below its CBS
    with the band's probability. It never decreases. Returns ``(schedule, [ForecastChange, ...])``.
    """
    from lit_cbs.rules.batch_schedules import PiecewiseBatch

    if not (isinstance(until_tokens, int) and until_tokens > 0):
        raise ValueError(f"until_tokens={until_tokens!r} must be a positive int (the run's budget, tokens)")
    if not (isinstance(start, int) and start >= 1) or not (isinstance(factor, int) and factor >= 2):
        raise ValueError(f"start={start!r} must be an int >= 1 and factor={factor!r} an int >= 2")
    if not (isinstance(margin, (int, float)) and margin >= 1):
        raise ValueError(f"margin={margin!r} must be a number >= 1")
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
    against the tokens seen at that step (``curves.tokens_at``). Raises ValueError naming the missing column."""
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
    in values ~ tokens^x. For the noise scale beside ``CBSForecast.exponent``. ValueError under 2 points."""
    tokens, values = np.asarray(tokens, dtype=float), np.asarray(values, dtype=float)
    keep = np.isfinite(tokens) & np.isfinite(values) & (tokens > 0) & (values > 0)
    if len(set(tokens[keep])) < 2:
        raise ValueError(
            f"{int(keep.sum())} positive finite point(s) at {len(set(tokens[keep]))} token count(s); a growth exponent needs 2"
        )
    return float(np.polyfit(np.log(tokens[keep]), np.log(values[keep]), 1)[0])
