"""The probe engine: a probe point's life, written once, whatever trains its branches.

A due point is planned (``start.plan_probe``) and opened (``ProbeEngine.open``: its runner starts); the main run's
own window is recorded as k = 1 (``ProbeEngine.main_step``); the branches train where the runner trains them
(``Runner``: in process, as side jobs, from a checkpoint) and their scores arrive (``ProbeEngine.poll``); the
reading is decided (``ProbeEngine.reading``), recorded and fed to ``CBSAdaptive``. No Lightning here: the callback
hands the engine the run's counts and a scorer of the main run's model. docs/design.md, "The probe engine".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lit_cbs.probe.config import ProbeConfig
from lit_cbs.probe.reading import BranchScore, ProbeReading
from lit_cbs.rules.batch_schedules import CBSAdaptive

__all__ = ["ProbeEngine"]


def score_to_json(score: BranchScore) -> dict[str, Any]:
    """``score`` as JSON-able fields (a failed branch's loss, inf or NaN, as None).

    Examples:
        >>> score_to_json(BranchScore.heldout([2.0, 2.5]))
        {'loss': 2.25, 'batch_losses': [2.0, 2.5], 'se': None, 'replicate_losses': []}
        >>> score_from_json(score_to_json(BranchScore(float("nan")))).failed
        True
    """
    return {
        "loss": score.loss if math.isfinite(score.loss) else None,
        "batch_losses": list(score.batch_losses),
        "se": score.se,
        "replicate_losses": [list(window) for window in score.replicate_losses],
    }


def score_from_json(content: dict[str, Any]) -> BranchScore:
    """The score ``score_to_json`` wrote; a None loss reads back as inf (a failed branch)."""
    loss = content["loss"]
    return BranchScore(
        math.inf if loss is None else float(loss),
        tuple(content["batch_losses"]),
        content["se"],
        tuple(tuple(window) for window in content["replicate_losses"]),
    )


@dataclass
class ProbePoint:
    """One probe point, from its start until its reading is recorded; JSON-able (a side job's point is in the main
    run's checkpoint). Samples and tokens global (all ranks)."""

    index: int  # which probe point (0-based)
    tokens: int  # tokens trained when its window began
    step: int  # optimizer steps then
    batch_size: int  # the main run's global batch B then (samples)
    seq_len: int
    multipliers: list[float]
    window_samples: int  # each replicate window
    folder: str  # the point's files (a side job's job.json, start.ckpt, scores.json, logs); "" in process
    main_baseline: bool  # the main run's own first window stands in for k = 1 there
    window_end_samples: int  # samples_seen where the main run's first window ends
    interrupted_at_tokens: int | None = None
    replicates: int = 1
    main_end_samples: int | None = None  # samples_seen where the main run's part ends (None: with the first window)
    looks: list[int] = field(default_factory=list)  # samples_seen of early looks inside the first window
    main_step_losses: list[float] = field(default_factory=list)  # this rank's, over the window so far
    main_score: dict[str, Any] | None = None  # k = 1's score (score_to_json) where the window (or a look) ended
    window_end_step: int | None = None  # the optimizer step that ended the main run's window (or a look)
    window_end_row: int | None = None  # the loggers' row of that step (where the reading is logged)
    main_changed_batch: bool = False  # the batch changed inside the window: k = 1 trains as a branch
    window_done: bool = False  # the main run trained the first window
    main_open: bool = True  # the main run still trains this point's part
    handle: dict[str, Any] | None = None  # the launcher's, while a side job runs
    job_done: bool = False  # its side job wrote its scores
    attempts: int = 0
    failures: list[str] = field(default_factory=list)  # why each failed attempt ended

    @property
    def window_tokens(self) -> int:
        return self.window_samples * self.seq_len

    def baseline(self) -> BranchScore | None:
        """k = 1's score where the main run's own stands in for it (bisection without cooldown, the batch unchanged
        over the window), else None: k = 1 trains as a branch."""
        if not self.main_baseline or self.main_changed_batch or self.main_score is None:
            return None
        return score_from_json(self.main_score)


@dataclass
class BranchOutcome:
    """What a runner hands back for a point: each measured k's score, which ks trained and failed, their tokens."""

    scores: dict[float, BranchScore]
    trained: list[float]  # multipliers trained as branches, once per data window
    failed: list[float]
    tokens_trained: int  # branch tokens (global)
    window_tokens: int  # tokens of one window the branches trained on (fewer at an early look)
    final: bool = True  # False: an early look, after which an undetermined reading lets the window go on


class Runner(Protocol):
    """Where a probe's branches train: ``start`` a point; ``step`` after each main-run optimizer step while the main
    run trains the point's part (``samples_seen`` after the step); ``window_ended`` when the main run's own score of
    the window (or of an early look) is in; ``poll`` the outcomes that arrived (a ``BranchOutcome``, or why the
    point failed); ``close`` a point whose reading is recorded or that failed."""

    mode: str  # ProbeReading.mode of its readings: "in_process", "side_jobs" or "checkpoint"
    late: bool  # its outcomes arrive after the main run's window ended (the reading records when)

    def start(self, point: ProbePoint) -> None: ...

    def step(self, point: ProbePoint, samples_seen: int) -> None: ...

    def window_ended(self, point: ProbePoint) -> None: ...

    def poll(self) -> list[tuple[ProbePoint, BranchOutcome | str]]: ...

    def close(self, point: ProbePoint) -> None: ...


def _say_nothing(*_: Any) -> None:
    """The default listener of a reading or a failure."""


def _none_yet() -> int:
    """The default count of what a schedule consumed and of the tokens seen."""
    return 0


@dataclass
class ProbeEngine:
    """A run's probe points: those open, the readings decided (``history``) and the points that failed.

    Args:
        config: the probe's settings.
        runner: where the branches train.
        on_reading: told each reading (and its point) once it is recorded: the callback logs and writes it.
        on_failure: told each failed point's record (``tokens``, ``step``, ``reason``) once.
        schedule: the run's ``CBSAdaptive``, which determined readings feed; ``consumed()`` counts in its unit.
        tokens_seen: the main run's tokens so far (a late reading records where it arrived).

    Examples:
        A point at batch 16 whose k = 2 branch, trained elsewhere, recovers the main run's held-out loss: the reading
        is determined, and ``CBSAdaptive`` doubles the batch where it arrives (here at 65,536 tokens).

        >>> class Elsewhere:  # a runner whose branch scores are in as soon as the window ends
        ...     mode, late, outcomes = "side_jobs", True, []
        ...     def start(self, point): pass
        ...     def step(self, point, samples_seen): pass
        ...     def window_ended(self, point):
        ...         k2 = BranchScore.heldout([2.001, 2.101, 2.199, 2.302])
        ...         self.outcomes.append((point, BranchOutcome({2.0: k2}, [2.0], [], 16_384, 16_384)))
        ...     def poll(self): outcomes, self.outcomes = self.outcomes, []; return outcomes
        ...     def close(self, point): pass
        >>> schedule = CBSAdaptive(start=16, final=64)
        >>> engine = ProbeEngine(ProbeConfig(every_tokens=32_768, multipliers=[1, 2], epsilon=0.02,
        ...     evaluate="heldout", search="bisect"), Elsewhere(), schedule=schedule,
        ...     consumed=lambda: 65_536, tokens_seen=lambda: 65_536)
        >>> engine.open(ProbePoint(index=0, tokens=32_768, step=16, batch_size=16, seq_len=128, multipliers=[1.0, 2.0],
        ...     window_samples=128, folder="", main_baseline=True, window_end_samples=256 + 128))
        >>> main_score = lambda point: BranchScore.heldout([2.0, 2.1, 2.2, 2.3])  # the main run's model, scored
        >>> for step in range(17, 25):  # the main run's steps of 16 samples over the window
        ...     engine.main_step(2.5, samples_seen=step * 16, global_batch=16, step=step, row=step, score=main_score)
        >>> engine.poll()
        >>> (reading,) = engine.history
        >>> reading.bracket, reading.adaptive_batch, reading.arrived_at_tokens, schedule.batch_size(65_536)
        ('[32, beyond the grid]', 32, 65536, 32)
        >>> status = engine.status()
        >>> status["read"], status["determined"], status["failed"], status["pending"], status["adaptive"]
        (1, 1, [], [], {'decisions': [[65536, 32]], 'why_not': None})
    """

    config: ProbeConfig
    runner: Runner
    on_reading: Callable[[ProbeReading, ProbePoint], None] = _say_nothing
    on_failure: Callable[[dict[str, Any]], None] = _say_nothing
    schedule: CBSAdaptive | None = None
    consumed: Callable[[], int] = _none_yet
    tokens_seen: Callable[[], int] = _none_yet
    history: list[ProbeReading] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)  # tokens, step, reason
    points: dict[int, ProbePoint] = field(default_factory=dict)  # open: no reading yet

    @property
    def tokens_spent(self) -> int:
        """Branch tokens (global) of the readings recorded."""
        return sum(reading.tokens_spent for reading in self.history)

    def open(self, point: ProbePoint) -> None:
        """Start ``point``: its runner starts, and the main run's next steps are its window."""
        self.points[point.index] = point
        self.runner.start(point)

    def recording(self) -> list[ProbePoint]:
        """The points whose part of the main run is still being trained."""
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
        """After a main-run optimizer step (its loss in nats; ``samples_seen`` and ``global_batch`` after it): each
        open window takes the step; where a window or an early look ends, the main run's model is scored there
        (``score``) and the runner told; then each runner steps (in process: trains where the main run's part ends)."""
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
            reading = self.reading(point, outcome)
            if not (outcome.final or reading.determined):
                continue  # an early look the data do not decide: the window goes on
            del self.points[point.index]
            self.runner.close(point)
            self._feed(reading)
            self.history.append(reading)
            self.history.sort(key=lambda reading: reading.tokens)  # late readings may arrive out of order
            self.on_reading(reading, point)

    def reading(self, point: ProbePoint, outcome: BranchOutcome) -> ProbeReading:
        """The reading of ``point`` from its branches' ``outcome``: the k* rule, the CBS bracket, the costs.
        ``overhead`` is the branch tokens of this reading and every earlier one over the main run's tokens at the
        window's end: the same whichever runner trained the branches and whenever they reported."""
        earlier = sum(reading.tokens_spent for reading in self.history if reading.tokens < point.tokens)
        main = score_from_json(point.main_score) if point.main_score is not None else outcome.scores[1.0]
        main_tokens = point.tokens + outcome.window_tokens * point.replicates
        return self.config.decide(
            outcome.scores,
            point.multipliers,
            point.batch_size,
            tokens=point.tokens,
            step=point.step,
            seq_len=point.seq_len,
            window_tokens=outcome.window_tokens,
            main_loss=main.loss,
            branches_trained=list(outcome.trained),
            failed=list(outcome.failed),
            tokens_spent=outcome.tokens_trained,
            overhead=(earlier + outcome.tokens_trained) / max(1, main_tokens),
            planned_window_tokens=point.window_tokens,
            interrupted_at_tokens=point.interrupted_at_tokens,
            replicates=point.replicates,
            mode=self.runner.mode,
            arrived_at_tokens=self.tokens_seen() if self.runner.late else None,
        )

    def fail(self, point: ProbePoint, reason: str) -> None:
        """``point`` gives no reading: recorded with ``reason`` (said whole, once)."""
        self.points.pop(point.index, None)
        self.runner.close(point)
        failure = {"tokens": point.tokens, "step": point.step, "reason": reason}
        self.failures.append(failure)
        self.on_failure(failure)

    def drop(self, point: ProbePoint) -> None:
        """``point`` ends with neither a reading nor a failure (the run stopped inside its window)."""
        self.points.pop(point.index, None)
        self.runner.close(point)

    def _feed(self, reading: ProbeReading) -> None:
        """A determined reading tells ``CBSAdaptive`` the CBS lower bound; the batch it moves to is noted."""
        if self.schedule is None or not reading.determined:
            return
        consumed = self.consumed()
        if self.schedule.observe(consumed, reading.cbs_lower):
            reading.adaptive_batch = self.schedule.batch_size(consumed)

    def status(self) -> dict[str, Any]:
        """How the probe points fared: readings (and how many determined), failures with their reasons, the points
        still pending (tokens) and, with a ``CBSAdaptive``, its decisions and why it never moved if it did not."""
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
        """Why the ``CBSAdaptive`` the readings feed never moved, in words; None where there is none, it moved, or it
        could not (its start is its final batch)."""
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
