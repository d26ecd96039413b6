"""A CBS law over model sizes and corpora: log CBS linear in log D (or in log loss) and in log N, fitted to the
readings' intervals; its band at a size it never saw, its file, and the schedule it gives a target run."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence

import numpy as np
from scipy import optimize, special, stats

from lit_cbs.analysis.forecast import (
    SPREAD_PRIOR_MEDIAN,
    SPREAD_PRIOR_SD,
    ForecastChange,
    follow_band,
    laplace_covariance,
    supported_interval,
)
from lit_cbs.probe.reading import ProbeReading
from lit_cbs.rules.batch_schedules import PiecewiseBatch

COVARIATES = ("tokens", "loss")
SPREAD_BOUNDS = (0.01, 5.0)  # of log CBS


@dataclasses.dataclass(frozen=True)
class LawPoint:
    """One reading for a law: the CBS in [lower, upper] tokens (upper inf: no upper end) at ``tokens`` D of a run of
    ``params`` N on ``corpus``; ``loss``: the run's held-out loss there (nats; None: not measured). ``floor``: the
    probe read k* at its smallest k, which bounds the CBS from above only (``lower`` is 0)."""

    tokens: float
    lower: float
    upper: float
    params: float
    corpus: str
    run: str
    loss: float | None = None
    determined: bool = True
    floor: bool = False


def law_points(
    readings: Iterable[ProbeReading],
    params: float,
    corpus: str = "corpus",
    run: str = "run",
    *,
    seq_len: int | None = None,
    epsilon: float | None = None,
) -> list[LawPoint]:
    """The ``LawPoint`` of each reading of one run: its interval in tokens (samples x seq_len, the reading's else
    ``seq_len``; from 0 where the probe's k* is its smallest k), its loss the k = 1 branch's (held-out, at the window's
    end) where measured.

    Examples:
        >>> reading = ProbeReading.from_record({"tokens": 65536, "cbs_lower": 8, "cbs_upper": 16, "seq_len": 128})
        >>> law_points([reading], params=233472)[0]
        LawPoint(tokens=65536.0, lower=1024.0, upper=2048.0, params=233472, corpus='corpus', run='run', loss=None, \
determined=True, floor=False)
    """
    points = []
    for number, reading in enumerate(readings, 1):
        where = f"{run}: reading {number}"
        per_sample = reading.seq_len if reading.seq_len is not None else seq_len
        if per_sample is None:
            raise ValueError(
                f"{where} holds no seq_len; a law counts the CBS in tokens: add seq_len to it, or pass one"
            )
        lower, upper = supported_interval(reading, where, epsilon)
        loss = (reading.losses or {}).get("1")
        floor = reading.mode != "elsewhere" and lower <= min(float(k) for k in reading.losses) * reading.batch_size
        points.append(
            LawPoint(
                float(reading.tokens), 0.0 if floor else lower * per_sample, upper * per_sample, params, corpus, run,
                None if loss is None or not math.isfinite(loss) else float(loss), reading.determined, floor,
            )
        )  # fmt: skip
    return points


@dataclasses.dataclass(frozen=True)
class CBSLaw:
    """log CBS (tokens) = a[corpus] + b log(x / x0) + c log(N / n0), spread ``spread``, where x is D (tokens) or the
    loss (nats); ``covariance`` of (a..., b, c) at the fit (Laplace). ``size_term`` False: c is 0.
    ``log_likelihood``: at the fit, with the spread's prior (the same in every fit, so differences compare laws).

    Examples:
        A law saved by ``benchmarks.cbs_law`` (or ``recipes/schedule_from_probe.py --fit-law``), written by hand here:
        CBS = 4,096 x (D / 1M)^0.5 tokens, whatever the size, read with a spread of 0.1 and no fit uncertainty:

        >>> import math, os, tempfile
        >>> no_uncertainty = ((0.0,) * 3,) * 3
        >>> law = CBSLaw("tokens", ("text",), (math.log(4096),), 0.5, 0.0, 0.1, no_uncertainty, 1e6, 1e8, True, 40, 0.0)
        >>> low, high = law.band([4e6], params=1e9, coverage=0.9)
        >>> round(low[0]), round(high[0])
        (6950, 9657)
        >>> path = os.path.join(tempfile.mkdtemp(), "law.json")
        >>> law.save(path)
        >>> CBSLaw.load(path) == law
        True
    """

    covariate: str
    corpora: tuple[str, ...]
    intercepts: tuple[float, ...]
    slope: float
    size_slope: float
    spread: float
    covariance: tuple[tuple[float, ...], ...]
    x0: float
    n0: float
    size_term: bool
    points: int
    log_likelihood: float

    def _design(self, x: np.ndarray, params: float, corpus: str | None) -> tuple[np.ndarray, float]:
        """Rows of the gradient of the mean in (a..., b, c), and the extra variance an unfitted corpus adds."""
        rows = np.zeros((len(x), len(self.corpora) + 2))
        if corpus is None:  # a corpus the law never saw: the corpora's mean, plus their spread
            rows[:, : len(self.corpora)] = 1 / len(self.corpora)
            extra = float(np.var(self.intercepts, ddof=1)) if len(self.corpora) > 1 else 0.0
        elif corpus in self.corpora:
            rows[:, self.corpora.index(corpus)], extra = 1.0, 0.0
        else:
            raise ValueError(f"corpus={corpus!r} is not one of the law's {list(self.corpora)} (None: another one)")
        rows[:, -2] = np.log(x / self.x0)
        rows[:, -1] = math.log(params / self.n0) if self.size_term else 0.0
        return rows, extra

    def band(
        self, x: Sequence[float] | np.ndarray, params: float, coverage: float = 0.9, corpus: str | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) CBS in tokens at ``x`` (D, or the loss) for a model of ``params``: the ``coverage`` interval of
        what a run reads there (the spread and the fit's own uncertainty)."""
        rows, extra = self._design(np.atleast_1d(np.asarray(x, dtype=float)), params, corpus)
        mean = rows @ np.array([*self.intercepts, self.slope, self.size_slope])
        sd = np.sqrt(self.spread**2 + extra + np.einsum("ij,jk,ik->i", rows, np.array(self.covariance), rows))
        z = stats.norm.ppf(0.5 + coverage / 2)
        return np.exp(mean - z * sd), np.exp(mean + z * sd)

    def describe(self) -> str:
        shape = f"CBS = e^a[corpus] x ({self.covariate} / {self.x0:.4g})^{self.slope:.3f}"
        if self.size_term:
            shape += f" x (N / {self.n0:.4g})^{self.size_slope:.3f}"
        per = ", ".join(f"{c} {math.exp(a):.4g}" for c, a in zip(self.corpora, self.intercepts))
        return f"{shape} tokens (e^a: {per}); spread of log CBS {self.spread:.3f}; {self.points} readings"

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as out:
            json.dump(dataclasses.asdict(self), out, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CBSLaw:
        """The law a ``save`` wrote; ValueError naming the file and what is wrong."""
        try:
            with open(path) as f:
                fields = json.load(f)
            fields["corpora"], fields["intercepts"] = tuple(fields["corpora"]), tuple(fields["intercepts"])
            fields["covariance"] = tuple(tuple(row) for row in fields["covariance"])
            return cls(**fields)
        except OSError as error:
            raise ValueError(f"cannot read the CBS law {path}: {error.strerror}") from None
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{path} is not a CBS law ({error!r}); write one with fit_law(...).save(path)") from None


def _x(point: LawPoint, covariate: str) -> float:
    if covariate == "tokens":
        return point.tokens
    if point.loss is None:
        raise ValueError(f"{point.run} at {point.tokens:,.0f} tokens holds no loss; a law in the loss needs each's")
    return point.loss


def fit_law(points: Sequence[LawPoint], covariate: str = "tokens", size_term: bool = True) -> CBSLaw:
    """The law on ``points`` most likely given that each reading's interval holds log CBS ~ Normal(mean, spread), under
    the forecast's weak prior on the spread (readings that all fit their intervals leave it at no width otherwise).

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> points = []
        >>> for n, seed in [(1e5, 1), (1e5, 2), (4e5, 1), (4e5, 2)]:  # 2 sizes, 2 runs of each
        ...     for d in np.geomspace(3e4, 4e6, 8):
        ...         cbs = 40 * d**0.5 * np.exp(rng.normal(0, 0.2))  # tokens; the size does not matter
        ...         lower = 2.0 ** np.floor(np.log2(cbs))
        ...         points.append(LawPoint(d, lower, 2 * lower, n, "text", f"N={n:g} seed {seed}"))
        >>> law = fit_law(points)
        >>> round(law.slope, 1), abs(law.size_slope) < 0.2
        (0.5, True)
    """
    if covariate not in COVARIATES:
        raise ValueError(f"covariate={covariate!r} must be one of {COVARIATES}")
    if not points:
        raise ValueError("no readings: a law needs readings of runs")
    corpora = tuple(sorted({p.corpus for p in points}))
    sizes = sorted({p.params for p in points})
    if size_term and len(sizes) < 2:
        raise ValueError(f"every reading is of one size ({sizes[0]:g} parameters); fit with size_term=False")
    if size_term and all(len({p.params for p in points if p.corpus == c}) < 2 for c in corpora):
        raise ValueError(
            "each corpus was read at one size, so the size term and the corpora's intercepts cannot be told apart: "
            "read two sizes on one corpus, or fit with size_term=False"
        )
    x = np.array([_x(p, covariate) for p in points])
    x0, n0 = float(np.exp(np.log(x).mean())), float(np.exp(np.log(sizes).mean()))
    rows = np.zeros((len(points), len(corpora) + 2))
    for i, p in enumerate(points):
        rows[i, corpora.index(p.corpus)] = 1.0
        rows[i, -2], rows[i, -1] = math.log(x[i] / x0), math.log(p.params / n0) if size_term else 0.0
    with np.errstate(divide="ignore"):  # a reading at the floor of its grid: from log 0 = -inf
        low = np.log([p.lower for p in points])
    high = np.log([p.upper for p in points])
    columns = len(corpora) + (2 if size_term else 1)

    def negative_log_likelihood(theta: np.ndarray) -> float:
        coef = np.append(theta[:columns], 0.0) if not size_term else theta[:columns]
        mean, spread = rows @ coef, math.exp(theta[-1])
        mass = special.ndtr((high - mean) / spread) - special.ndtr((low - mean) / spread)
        prior = ((theta[-1] - math.log(SPREAD_PRIOR_MEDIAN)) / SPREAD_PRIOR_SD) ** 2 / 2  # keeps s off 0
        return float(-np.log(np.maximum(mass, 1e-300)).sum() + prior)

    start = np.zeros(columns + 1)
    middles = [p.upper / 2 if p.lower == 0 else 2 * p.lower if math.isinf(p.upper) else math.sqrt(p.lower * p.upper)
               for p in points]  # fmt: skip
    start[: len(corpora)] = np.log([m for m in middles if 0 < m < math.inf]).mean()
    bounds = [(None, None)] * columns + [tuple(math.log(b) for b in SPREAD_BOUNDS)]
    best = optimize.minimize(negative_log_likelihood, start, method="L-BFGS-B", bounds=bounds)
    covariance = laplace_covariance(lambda theta: np.asarray(-negative_log_likelihood(theta)), best.x)[
        :columns, :columns
    ]
    if not size_term:  # c = 0 exactly: no variance
        covariance = np.pad(covariance, ((0, 1), (0, 1)))
    coef = np.append(best.x[:columns], 0.0) if not size_term else best.x[:columns]
    return CBSLaw(
        covariate, corpora, tuple(map(float, coef[: len(corpora)])), float(coef[-2]), float(coef[-1]),
        math.exp(best.x[-1]), tuple(tuple(map(float, row)) for row in covariance), x0, n0, size_term, len(points),
        -float(best.fun),
    )  # fmt: skip


def schedule_from_law(
    law: CBSLaw,
    params: float,
    until_tokens: int,
    start: int,
    seq_len: int,
    *,
    factor: int = 2,
    final: int | None = None,
    margin: float = 1.0,
    coverage: float = 0.8,
    corpus: str | None = None,
) -> tuple[PiecewiseBatch, list[ForecastChange]]:
    """The batch schedule (samples of ``seq_len`` tokens) of a run of ``params`` over ``until_tokens``, following
    the lower edge of the law's ``coverage`` band, and its changes: the points worth a probe reading that checks it.

    Examples:
        >>> law = CBSLaw("tokens", ("text",), (math.log(4096),), 0.5, 0.0, 0.1, ((0.0, 0.0, 0.0),) * 3, 1e6, 1e8,
        ...              True, 40, 0.0)
        >>> schedule, changes = schedule_from_law(law, 1e9, 16_000_000, start=8, seq_len=256, final=64)
        >>> schedule.batch_sizes, [c.tokens for c in changes]
        ([8, 16, 32], [1294642, 5176005])
    """
    if law.covariate != "tokens":
        raise ValueError(f"this law is in the {law.covariate}; a schedule over tokens needs a law in the tokens")

    def band(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        low, high = law.band(tokens, params, coverage, corpus)
        return low / seq_len, high / seq_len

    return follow_band(band, start, until_tokens, factor=factor, final=final, margin=margin)
