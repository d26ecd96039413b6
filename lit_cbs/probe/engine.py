"""The probe engine: its settings (``ProbeConfig``) and a point's life to its reading (``ProbeEngine``)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lit_cbs.errors import LitCBSConfigError, one_of, positive_int, positive_number
from lit_cbs.probe.reading import EVALUATIONS, SEARCHES, BranchScore, ProbeReading
from lit_cbs.rules.batch_schedules import CBSAdaptive
from lit_cbs.rules.scaling import BETA2_FLOOR, OptimizerRules

__all__: list[str] = []  # the probe's own parts: CBSProbeCallback and probe_checkpoint take these settings as keywords

MAX_EPSILON = 0.5  # nats: a tolerance this wide lets every batch "recover" the loss


def _require(ok: bool, refusal: str) -> None:
    if not ok:
        raise LitCBSConfigError(refusal)


@dataclass(frozen=True)
class ProbeConfig:
    """The keyword arguments of ``CBSProbeCallback`` and ``probe_checkpoint``, checked once, in a normal form."""

    every_tokens: int | None = None
    at_tokens: Sequence[int] | None = None
    geometric: tuple[int, float] | None = None
    multipliers: Sequence[float] = (1, 2, 4, 8)
    window_tokens: int = 1_000_000
    epsilon: float = 0.01
    confidence: float = 0.9
    ema_alpha: float = 0.5
    lr_rule: Any = "sqrt"
    weight_decay_rule: str | None = None
    beta2_rule: str | None = None
    search: str = "grid"
    evaluate: str = "train_ema"
    heldout_batches: int = 8
    cooldown_fraction: float = 0.0
    early_stop: Sequence[float] | None = None
    replicates: int = 1
    max_overhead: float | None = None
    snapshot_device: str = "cpu"
    side_jobs: Any = None
    output_dir: str | os.PathLike[str] | None = None
    beta2_floor: float | None = BETA2_FLOOR
    rules: OptimizerRules = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = (self.every_tokens, self.at_tokens, self.geometric)
        _require(
            sum(x is not None for x in where) <= 1,
            "give one of every_tokens, at_tokens or geometric=(first_tokens, ratio), not several",
        )
        positive_int("every_tokens", self.every_tokens, "tokens", optional=True)
        at_tokens = sorted(int(t) for t in self.at_tokens) if self.at_tokens is not None else None
        geometric = tuple(self.geometric) if self.geometric is not None else None
        ks = list(self.multipliers)
        early_stop = sorted(float(f) for f in self.early_stop or ())
        replicates = positive_int("replicates", self.replicates, "data windows per measured k")
        one_of("search", self.search, SEARCHES)
        one_of("evaluate", self.evaluate, EVALUATIONS)
        for ok, refusal in (
            (at_tokens is None or (at_tokens and at_tokens[0] > 0),
             f"at_tokens={at_tokens!r} must be a non-empty list of positive token counts"),
            (geometric is None or (geometric[0] > 0 and geometric[1] > 1),
             f"geometric={self.geometric!r} needs first_tokens > 0 and ratio > 1"),
            (ks and all(not isinstance(k, bool) and isinstance(k, (int, float)) and k > 0 for k in ks),
             f"multipliers={ks!r} must be a non-empty list of positive numbers"),
            (len(set(ks)) == len(ks), f"multipliers={ks!r} has duplicates"),
            (len(ks) >= 2,
             f"multipliers={ks!r} has one batch size, which brackets no CBS: give at least two, e.g. [1, 2]"),
            (0.5 <= self.confidence < 1,
             f"confidence={self.confidence} must lie in [0.5, 1) (0.9: 90% one-sided; 0.5: the means alone)"),
            (0 <= self.cooldown_fraction < 1,
             f"cooldown_fraction={self.cooldown_fraction} must lie in [0, 1) (share of a branch's steps)"),
            (all(0 < f < 1 for f in early_stop),
             f"early_stop={early_stop!r} must be fractions of the window in (0, 1), e.g. [0.25, 0.5]"),
            (not (early_stop and self.cooldown_fraction),
             "early_stop and cooldown_fraction cannot be combined (a branch cut short has not cooled down): drop one"),
            (0 <= self.epsilon < MAX_EPSILON,
             f"epsilon={self.epsilon} must lie in [0, {MAX_EPSILON}) nats: the tolerance within which a larger batch "
             f"counts as recovering the loss (the paper: 0.01); at {MAX_EPSILON} nats or more every batch recovers "
             "and the reading means nothing"),
            (0 < self.ema_alpha <= 1,
             f"ema_alpha={self.ema_alpha} must lie in (0, 1] (weight of the newest step loss)"),
            (self.search != "bisect" or 1 in ks,
             "search='bisect' uses the main run as the k=1 baseline: include 1 in multipliers"),
            (1 in ks,
             f"multipliers={ks!r} has no k = 1: a reading asks which larger batch k x B recovers the loss of the "
             "run's own batch B within epsilon, so without k = 1 it compares the branches among themselves and says "
             "nothing about the run: include 1"),
            (replicates == 1 or self.evaluate == "heldout",
             f"replicates={replicates} compares each k on the same held-out batches across data windows: set "
             "evaluate='heldout' (or replicates=1)"),
            (replicates == 1 or not early_stop,
             f"early_stop={early_stop!r} and replicates={replicates} cannot be combined (a reading cut short has not "
             "trained its later windows): drop one"),
        ):  # fmt: skip
            _require(bool(ok), refusal)
        positive_int("window_tokens", self.window_tokens, "tokens")
        positive_int("heldout_batches", self.heldout_batches, "validation batches")
        overhead = positive_number("max_overhead", self.max_overhead, "probe tokens / training tokens", optional=True)
        rules = OptimizerRules.build(self.lr_rule, self.weight_decay_rule, self.beta2_rule, self.beta2_floor)
        output_dir = Path(self.output_dir) if self.output_dir is not None else None
        normal: dict[str, Any] = dict(multipliers=sorted(float(k) for k in ks), early_stop=early_stop, rules=rules)
        normal |= dict(at_tokens=at_tokens, geometric=geometric, max_overhead=overhead, output_dir=output_dir)
        normal |= {
            name: float(getattr(self, name)) for name in ("epsilon", "confidence", "cooldown_fraction", "ema_alpha")
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)  # a checked field in its normal form (the dataclass is frozen)
        if self.side_jobs is not None:
            from lit_cbs.probe.side_jobs.launchers import SideJobs  # with side jobs only: Lightning comes with them

            for ok, refusal in (
                (isinstance(self.side_jobs, SideJobs),
                 f"side_jobs={self.side_jobs!r} must be a lit_cbs.probe.SideJobs (or None: in process)"),
                (isinstance(self.lr_rule, str),
                 "side jobs rebuild the probe's rules by name: give lr_rule as a name ('sqrt', 'linear', ...), not "
                 f"{self.lr_rule!r} (or drop side_jobs)"),
                (not early_stop,
                 f"early_stop={early_stop!r} ends a probe's window early so that the main run waits less; with "
                 "side_jobs it never waits: drop early_stop (or side_jobs)"),
            ):  # fmt: skip
                _require(ok, refusal)

    @property
    def span_tokens(self) -> int:
        return self.window_tokens * self.replicates

    def probe_point(self, index: int) -> float:
        """Tokens of the index-th probe point (0-based); inf where there is none."""
        if self.every_tokens is not None:
            return self.every_tokens * (index + 1)
        if self.at_tokens is not None:
            return self.at_tokens[index] if index < len(self.at_tokens) else math.inf
        if self.geometric is None:  # a probe of a saved checkpoint probes at its step
            return math.inf
        first, ratio = self.geometric
        return round(first * ratio**index)

    def check_inside_run(
        self,
        run_end_tokens: int,
        limit: str,
        *,
        whole_span: bool = False,
        next_probe: int = 0,
        window_tokens: int | None = None,
    ) -> None:
        """Refuse a ``next_probe``-th point at or past the run's end (``whole_span``: its windows)."""
        point = self.probe_point(next_probe)
        window = self.window_tokens if window_tokens is None else window_tokens
        if whole_span and point + window * self.replicates > run_end_tokens:
            windows = f"{self.replicates} x " if self.replicates > 1 else ""
            rounded = f", {window:,} in whole steps of its largest branch" if window != self.window_tokens else ""
            raise LitCBSConfigError(
                f"the first probe ({point:,} tokens + {windows}window_tokens={self.window_tokens:,}{rounded}) "
                f"ends past {limit}, so it never runs; probe earlier (every_tokens, at_tokens or geometric)"
            )
        if point >= run_end_tokens:
            raise LitCBSConfigError(
                f"no probe point lies inside the run: the first is at {point:,.0f} tokens but the run ends by "
                f"{limit} at {run_end_tokens:,} tokens or sooner; probe earlier (every_tokens, at_tokens or geometric)"
            )


def score_to_json(score: BranchScore) -> dict[str, Any]:
    """``score`` as JSON-able fields (a failed branch's loss as None)."""
    return {**dataclasses.asdict(score), "loss": score.loss if math.isfinite(score.loss) else None}


def score_from_json(content: dict[str, Any]) -> BranchScore:
    """The score ``score_to_json`` wrote; a None loss reads back as inf (a failed branch)."""
    loss, batch_losses, se, windows = (content[name] for name in ("loss", "batch_losses", "se", "replicate_losses"))
    return BranchScore(math.inf if loss is None else float(loss), tuple(batch_losses), se, tuple(map(tuple, windows)))


@dataclass
class ProbePoint:
    """One probe point from its start to its reading; JSON-able (a side job's is in the run's checkpoint)."""

    index: int
    tokens: int  # when its window began
    step: int
    batch_size: int  # the main run's global batch B then
    seq_len: int
    multipliers: list[float]
    window_samples: int  # each replicate window
    folder: str  # a side job's files; "" in process
    main_baseline: bool  # the main run's own first window stands in for k = 1
    window_end_samples: int  # samples_seen where the main run's first window ends
    interrupted_at_tokens: int | None = None
    replicates: int = 1
    main_end_samples: int | None = None  # samples_seen where the main run's part ends (None: with the first window)
    looks: list[int] = field(default_factory=list)  # samples_seen of early looks inside the first window
    main_step_losses: list[float] = field(default_factory=list)  # this rank's, over the window so far
    main_score: dict[str, Any] | None = None  # k = 1's (score_to_json) where the window (or a look) ended
    window_end_step: int | None = None  # the optimizer step that ended the window (or a look)
    window_end_row: int | None = None  # the loggers' row of that step (where the reading is logged)
    main_changed_batch: bool = False  # the batch changed inside the window: k = 1 trains as a branch
    window_done: bool = False
    main_open: bool = True  # the main run still trains this point's part
    handle: dict[str, Any] | None = None  # the launcher's, while a side job runs
    job_done: bool = False
    attempts: int = 0
    failures: list[str] = field(default_factory=list)  # why each failed attempt ended

    @property
    def window_tokens(self) -> int:
        return self.window_samples * self.seq_len

    def baseline(self) -> BranchScore | None:
        """k = 1's score where the main run's stands in for it (bisection, no cooldown, the batch unchanged)."""
        if not self.main_baseline or self.main_changed_batch or self.main_score is None:
            return None
        return score_from_json(self.main_score)


@dataclass
class BranchOutcome:
    """A point's branches: scores per k, the ks trained and failed, tokens; ``final`` False: an early look."""

    scores: dict[float, BranchScore]
    trained: list[float]
    failed: list[float]
    tokens_trained: int
    window_tokens: int
    final: bool = True


def point_reading(
    config: ProbeConfig,
    point: ProbePoint,
    outcome: BranchOutcome,
    history: list[ProbeReading],
    mode: str,
    arrived_at_tokens: int | None,
) -> ProbeReading:
    """The reading of ``point``; its overhead counts every earlier reading's branch tokens in ``history``."""
    earlier = sum(reading.tokens_spent for reading in history if reading.tokens < point.tokens)
    main = score_from_json(point.main_score) if point.main_score is not None else outcome.scores[1.0]
    main_tokens = point.tokens + outcome.window_tokens * point.replicates
    return ProbeReading.decide(
        outcome.scores,
        config.epsilon,
        config.confidence,
        point.multipliers,
        point.batch_size,
        **{name: getattr(config, name) for name in ("search", "evaluate", "cooldown_fraction")},
        **{name: getattr(point, name) for name in ("tokens", "step", "seq_len", "interrupted_at_tokens", "replicates")},
        window_tokens=outcome.window_tokens,
        main_loss=main.loss,
        branches_trained=list(outcome.trained),
        failed=list(outcome.failed),
        tokens_spent=outcome.tokens_trained,
        overhead=(earlier + outcome.tokens_trained) / max(1, main_tokens),
        planned_window_tokens=point.window_tokens,
        mode=mode,
        arrived_at_tokens=arrived_at_tokens,
    )


class Runner(Protocol):
    """Where a point's branches train, told of its life by the engine; ``step``, ``window_ended``: no-ops here."""

    mode: str  # ProbeReading.mode of its readings
    late: bool  # its outcomes arrive after the main run's window ended

    def start(self, point: ProbePoint) -> None: ...
    def poll(self) -> list[tuple[ProbePoint, BranchOutcome | str]]: ...
    def close(self, point: ProbePoint) -> None: ...

    def step(self, point: ProbePoint, samples_seen: int) -> None:
        """After each main-run step of the point's window (side jobs train on their own)."""
        return None

    def window_ended(self, point: ProbePoint) -> None:
        """The main run's score over the window is in (the engine keeps it, ``point.baseline``)."""
        return None


@dataclass
class ProbeEngine:
    """A run's probe points: those open, the readings (``history``), the failures; readings feed ``schedule``."""

    config: ProbeConfig
    runner: Runner
    on_reading: Callable[[ProbeReading, ProbePoint], None]
    on_failure: Callable[[dict[str, Any]], None]
    schedule: CBSAdaptive | None = None
    consumed: Callable[[], int] = int  # what the schedule counts; tokens seen (both 0 before the fit)
    tokens_seen: Callable[[], int] = int
    history: list[ProbeReading] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)  # tokens, step, reason
    points: dict[int, ProbePoint] = field(default_factory=dict)  # open: no reading yet

    @property
    def tokens_spent(self) -> int:
        return sum(reading.tokens_spent for reading in self.history)

    def open(self, point: ProbePoint) -> None:
        self.points[point.index] = point
        self.runner.start(point)

    def recording(self) -> list[ProbePoint]:
        return [point for point in self.points.values() if point.main_open]

    def main_step(
        self,
        step_loss: float | None,
        samples_seen: int,
        global_batch: int,
        step: int,
        row: int | None,
        score: Callable[[ProbePoint], BranchScore],
    ) -> None:
        """After a main-run step: open windows take it, are scored where they (or a look) end; runners step."""
        for point in self.recording():
            if not point.window_done:
                assert step_loss is not None, "every micro-batch of an open window's step returned its loss"
                point.main_step_losses.append(step_loss)
                point.main_changed_batch |= global_batch != point.batch_size
                point.window_done = samples_seen >= point.window_end_samples
                if point.window_done or samples_seen in point.looks:
                    point.main_score = score_to_json(score(point))
                    point.window_end_step, point.window_end_row = step, row
                    self.runner.window_ended(point)
            end = point.main_end_samples if point.main_end_samples is not None else point.window_end_samples
            point.main_open = samples_seen < end
            self.runner.step(point, samples_seen)

    def poll(self) -> None:
        """Decide and record the readings whose outcomes arrived; record the points that failed."""
        for point, outcome in self.runner.poll():
            if isinstance(outcome, str):
                self.fail(point, outcome)
                continue
            arrived = self.tokens_seen() if self.runner.late else None
            reading = point_reading(self.config, point, outcome, self.history, self.runner.mode, arrived)
            if not (outcome.final or reading.determined):
                continue  # an early look the data do not decide: the window goes on
            self.drop(point)
            self._feed(reading)
            self.history.append(reading)
            self.history.sort(key=lambda reading: reading.tokens)  # late readings may arrive out of order
            self.on_reading(reading, point)

    def fail(self, point: ProbePoint, reason: str) -> None:
        self.drop(point)
        failure = {"tokens": point.tokens, "step": point.step, "reason": reason}
        self.failures.append(failure)
        self.on_failure(failure)

    def drop(self, point: ProbePoint) -> None:
        self.points.pop(point.index, None)
        self.runner.close(point)

    def _feed(self, reading: ProbeReading) -> None:
        if self.schedule is None or not reading.determined:
            return
        consumed = self.consumed()
        if self.schedule.observe(consumed, reading.cbs_lower):
            reading.adaptive_batch = self.schedule.batch_size(consumed)

    def adaptive_asks(self, batch_size: int) -> tuple[int | None, int | None]:
        """A ``CBSAdaptive``'s answer at ``batch_size``: (tokens of a reading out, its final batch)."""
        schedule = self.schedule
        if schedule is None:
            return None, None
        if not schedule.wants_readings(self.consumed()):
            return None, schedule.final
        out = [point.tokens for point in self.points.values() if point.batch_size == batch_size]
        return (out[0] if out else None), None

    def status(self) -> dict[str, Any]:
        """Readings, how many determined, failures, points pending and a ``CBSAdaptive``'s decisions."""
        status: dict[str, Any] = {
            "read": len(self.history),
            "determined": sum(reading.determined for reading in self.history),
            "failed": [dict(failure) for failure in self.failures],
            "pending": sorted(point.tokens for point in self.points.values()),
        }
        if self.schedule is not None:
            decisions = [list(decision) for decision in self.schedule.decisions]
            status["adaptive"] = {"decisions": decisions, "why_not": self.why_not_adapted()}
        return status

    def why_not_adapted(self) -> str | None:
        """Why the ``CBSAdaptive`` the readings feed never moved, in words; None where it moved or could not."""
        schedule = self.schedule
        if schedule is None or schedule.decisions or schedule.start >= schedule.final:
            return None
        determined = [reading for reading in self.history if reading.determined]
        why = [f"{len(self.history)} reading(s), {len(determined)} determined"]
        if len(self.history) > len(determined):
            why.append("an undetermined reading never acts")
        if determined:
            top = max(reading.cbs_lower for reading in determined)
            why.append(f"the highest determined CBS was {top:g} samples, below {schedule.factor:g} x {schedule.start}")
        if self.failures:
            why.append(f"{len(self.failures)} probe point(s) failed, the first: {self.failures[0]['reason']}")
        if self.points:
            why.append(f"{len(self.points)} still pending")
        return "; ".join(why)
