"""A side job, ``python -m lit_cbs.probe.side_jobs JOB.json``: branches from a checkpoint, scores to a file."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lit_cbs.probe.engine import ProbeConfig, score_from_json, score_to_json
from lit_cbs.probe.from_checkpoint import CheckpointProbe, run_checkpoint_probe
from lit_cbs.probe.plan import ProbePlan
from lit_cbs.probe.reading import BranchScore
from lit_cbs.probe.side_jobs import build_parts, main_is_gone, write_json


class MainRunGone(RuntimeError):
    """The main run whose score a bisecting job waits for has ended or gone silent: nobody waits for this job."""


def run_job(description: dict[str, Any]) -> None:
    started = time.time()
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    config = ProbeConfig(**description["config"])
    plan = ProbePlan(description["multipliers"], description["window_samples"], [])
    main_score, main = Path(description["main_score"]), description["main"]

    def main_baseline() -> BranchScore | None:  # k = 1's score from the main run's main_score.json, waited for
        while not main_score.is_file():
            if (gone := main_is_gone(main)) is not None:
                raise MainRunGone(
                    f"{gone} before its score over the window was written ({main_score.name}): no one waits"
                )
            time.sleep(2.0)
        content = json.loads(main_score.read_text())
        return None if content["changed_batch"] else score_from_json(content["score"])

    probe = CheckpointProbe(config, plan, main_baseline if description["main_baseline"] else None)
    trainer = run_checkpoint_probe(
        description["checkpoint"], build_parts(description["build"], description["build_args"]), probe
    )
    if trainer.is_global_zero:
        outcome = probe.outcome
        assert outcome is not None, "the fit's start ran the probe"
        usage = resource.getrusage(resource.RUSAGE_SELF)
        write_json(
            Path(description["scores"]),
            {
                "scores": {f"{k:g}": score_to_json(score) for k, score in outcome.scores.items()},
                "trained": outcome.trained,
                "failed": outcome.failed,
                "tokens_trained": outcome.tokens_trained,
                "seconds": probe.seconds,  # the branches' training and scoring
                "job_seconds": time.time() - started,  # from the job's start (after its imports) to here
                "cpu_seconds": usage.ru_utime + usage.ru_stime,  # this process, imports included (rank 0)
                "ranks": trainer.world_size,
            },
        )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m lit_cbs.probe.side_jobs JOB.json")
    run_job(json.loads(Path(sys.argv[1]).read_text()))
