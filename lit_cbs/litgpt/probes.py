"""``LitGPTProbes``: a ``litgpt pretrain`` run's probe points, the probe engine with side jobs fed from its steps."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lit_cbs import metrics
from lit_cbs.probe.engine import ProbeConfig, ProbeEngine, ProbePoint
from lit_cbs.probe.plan import ProbeSkip, RunEnd, plan_at
from lit_cbs.probe.reading import ProbeReading
from lit_cbs.probe.side_jobs import Host, SideJobRunner
from lit_cbs.rules.batch_schedules import BatchSchedule, CBSAdaptive

__all__: list[str] = []  # LitGPTRun's part

BUILD = "lit_cbs.litgpt.parts:checkpoint_parts"  # how a side job rebuilds the run: from the point's checkpoint
JSONL_FILE = "cbs_probe.jsonl"


class LitGPTProbes:
    """The probe points of a ``litgpt pretrain`` run: opened after its optimizer steps, read by side jobs from its
    checkpoints, their readings written, logged and fed to a ``CBSAdaptive`` schedule. ``counts``: (samples,
    tokens) trained."""

    def __init__(self, config: ProbeConfig, schedule: BatchSchedule, counts: Callable[[], tuple[int, int]]):
        assert config.side_jobs is not None, "LitGPTRun refuses a probe without side jobs"
        self.config, self.probes_started = config, 0
        self.deferred = False  # a due point the run's end would cut: left to a resumed run
        self.runner = SideJobRunner(config.side_jobs, config)  # its jobs' build: FabricHost's, from the checkpoints
        adaptive = schedule if isinstance(schedule, CBSAdaptive) else None
        self.engine = ProbeEngine(config, self.runner, self._said_reading, self._said_failure, adaptive)
        self.engine.consumed = lambda: counts()[0 if schedule.unit == "samples" else 1]
        self.engine.tokens_seen = lambda: counts()[1]
        self.fabric: Any = None
        self.out_dir: Path | None = None
        self.log_step: Callable[[], int] = int  # the logger's step now

    def attach(self, host: Host, fabric: Any, out_dir: Path, log_step: Callable[[], int]) -> None:
        """At the loop's start: the side jobs' folder and heartbeat; cbs_probe.jsonl as this timeline has it."""
        self.fabric, self.out_dir, self.log_step = fabric, out_dir, log_step
        self.runner.attach(host, out_dir)
        self._write_readings()

    def after_step(self, step: int, samples: int, tokens: int, batch: int, facts: dict[str, Any]) -> None:
        """Take the readings that arrived; open a point that is due (or say why it is skipped)."""
        config, engine = self.config, self.engine
        engine.poll()
        if self.deferred or tokens < config.probe_point(self.probes_started):
            return
        index = self.probes_started
        while config.probe_point(self.probes_started) <= tokens:
            self.probes_started += 1
        out, final = engine.adaptive_asks(batch)
        if out is not None:
            self.fabric.print(
                f"CBS probe at {tokens:,} tokens skipped: the reading at {out:,} tokens, at this batch ({batch}), is "
                "still out"
            )
            return
        unit, budget = facts["micro_batch_size"] * facts["world_size"], facts["max_tokens"]
        end = RunEnd(facts["max_iters"] * unit * facts["seq_len"], None, f"--train.max_tokens={budget}")
        plan = plan_at(
            config,
            tokens,
            batch,
            facts["seq_len"],
            facts["world_size"],
            lambda k: None if k * batch % unit else facts["micro_batch_size"],  # the batch grows by accumulation
            end=end,
            tokens_spent=engine.tokens_spent,
            adaptive_final=final,
        )
        if isinstance(plan, ProbeSkip):
            if plan.stays_due:  # a run resumed from this one's last checkpoint (with a larger budget) takes it
                self.probes_started, self.deferred = index, True
            self.fabric.print(
                f"CBS probe at {tokens:,} tokens {'not started' if plan.stays_due else 'skipped'}: {plan.reason}"
            )
            return
        point = ProbePoint(
            index=index,
            tokens=tokens,
            step=step,
            batch_size=batch,
            seq_len=facts["seq_len"],
            multipliers=plan.multipliers,
            window_samples=plan.window_samples,
            folder=self.runner.folder_for(index, tokens),
            main_baseline=False,  # the job trains k = 1 too: litgpt's loop scores no window of its own
            window_end_samples=samples + plan.window_samples * config.replicates,
            replicates=config.replicates,
            window_done=True,
            main_open=False,
        )
        engine.open(point)

    def finish(self) -> None:
        """The loop ended: wait for the readings still out (``side_jobs.wait_at_end``), stop the heartbeat."""
        if self.runner.pending:
            self.runner.wait_at_end(self.engine.poll)
        self.runner.detach()

    def _said_reading(self, reading: ProbeReading, point: ProbePoint) -> None:
        self.fabric.print(
            f"CBS probe at {reading.tokens:,} tokens (batch {reading.batch_size}): k*={reading.k_star:g}, CBS in "
            f"{reading.bracket} samples; arrived at {self.engine.tokens_seen():,} tokens"
            + (f"; global batch -> {reading.adaptive_batch}" if reading.adaptive_batch is not None else "")
        )
        logged = {metrics.CBS_LOWER: reading.cbs_lower, metrics.CBS_DETERMINED: float(reading.determined)}
        if reading.cbs_upper is not None:
            logged[metrics.CBS_UPPER] = reading.cbs_upper
        self.fabric.log_dict(logged, step=self.log_step())
        self._write_readings()

    def _said_failure(self, failure: dict[str, Any]) -> None:
        self.fabric.print(f"CBS probe at {failure['tokens']:,} tokens failed: {failure['reason']}")

    def _write_readings(self) -> None:
        """cbs_probe.jsonl holds exactly the readings taken (none: no file)."""
        assert self.out_dir is not None, "attached"
        path = self.out_dir / JSONL_FILE
        if self.fabric.is_global_zero:
            lines = "".join(json.dumps(reading.to_record()) + "\n" for reading in self.engine.history)
            path.write_text(lines) if lines else path.unlink(missing_ok=True)

    def summary(self) -> list[str]:
        """Probe points that failed or are out first, then why a CBSAdaptive never moved, then the count."""
        status = self.engine.status()
        lines = [f"lit_cbs: CBS probe at {f['tokens']:,} tokens failed: {f['reason']}" for f in status["failed"]]
        if status["pending"]:
            lines.append(f"lit_cbs: CBS probes still out at {status['pending']} tokens (a resumed run collects them)")
        if (why := self.engine.why_not_adapted()) is not None:
            lines.append(f"lit_cbs: CBSAdaptive never grew the batch: {why}")
        return [*lines, f"lit_cbs: {status['read']} CBS reading(s), {status['determined']} determined"]

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [reading.to_record() for reading in self.engine.history],
            "failures": [dict(failure) for failure in self.engine.failures],
            "probes_started": self.probes_started,
            "side_jobs": self.runner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.history[:] = [ProbeReading.from_record(copy.deepcopy(record)) for record in state["history"]]
        self.engine.failures[:] = [dict(failure) for failure in state["failures"]]
        self.probes_started = state["probes_started"]
        self.engine.points = {point.index: point for point in self.runner.load_state_dict(state["side_jobs"])}
