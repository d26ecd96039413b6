"""A side job: ``python -m lit_cbs.probe.side_jobs JOB.json`` (the launcher starts it; ``lit_cbs.probe.side_jobs`` is
the main run's side).

It rebuilds the run (``SideJobs.build``: a function of the user's, or a recipe run's ``resolved_config.yaml``,
which the recipes rebuild), resumes it from the probe's checkpoint as a ``CheckpointProbe`` told the main run's
plan, trains the branches and writes their scores to ``scores.json``. A program, like the recipes: it sits above
the library it runs (docs/design.md, Architecture).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.branch import no_baseline
from lit_cbs.probe.config import ProbeConfig
from lit_cbs.probe.from_checkpoint import CheckpointProbe, run_checkpoint_probe
from lit_cbs.probe.reading import BranchScore
from lit_cbs.probe.side_jobs import score_from_json, score_to_json, write_json
from lit_cbs.probe.start import ProbePlan


def wait_for_main_score(path: Path, poll_seconds: float = 2.0) -> Callable[[], BranchScore | None]:
    """k = 1's first-window score from the main run (its ``main_score.json``), waited for when first asked; None
    where the main run's batch changed inside the window (k = 1 then trains as a branch)."""

    def baseline() -> BranchScore | None:
        while not path.is_file():
            time.sleep(poll_seconds)
        content = json.loads(path.read_text())
        return None if content["changed_batch"] else score_from_json(content["score"])

    return baseline


def build_parts(build: str) -> Any:
    """The run's parts (``RunParts``) from ``SideJobs.build``."""
    if build.endswith((".yaml", ".yml")):
        from omegaconf import DictConfig, OmegaConf

        from lit_cbs.recipes.job import probe_parts  # Hydra's machinery, loaded only for a recipe run

        recipe = OmegaConf.load(build)
        if not isinstance(recipe, DictConfig):
            raise LitCBSConfigError(f"side job: {build} holds a list, not a recipe's config (a mapping)")
        return probe_parts(recipe)
    module, _, function = build.partition(":")
    return getattr(importlib.import_module(module), function)()


def run_job(description: dict[str, Any]) -> None:
    """Train the branches ``description`` asks for and write their scores (the side job's whole work)."""
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    config = ProbeConfig(**description["config"])
    plan = ProbePlan(description["multipliers"], description["window_samples"], [])
    baseline = wait_for_main_score(Path(description["main_score"])) if description["main_baseline"] else no_baseline
    probe = CheckpointProbe(config, plan, baseline)
    trainer = run_checkpoint_probe(description["checkpoint"], build_parts(description["build"]), probe)
    if trainer.is_global_zero:
        measurer = probe.measurer
        assert measurer is not None, "the fit's start ran the probe, which made its measurer"
        write_json(
            Path(description["scores"]),
            {
                "scores": {f"{k:g}": score_to_json(score) for k, score in probe.scores.items()},
                "trained": measurer.trained,
                "failed": measurer.failed,
                "tokens_trained": probe.tokens_trained,
                "seconds": probe.seconds,
                "ranks": trainer.world_size,
            },
        )


def main(argv: list[str] | None = None) -> None:
    """``python -m lit_cbs.probe.side_jobs JOB.json``: a side job."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m lit_cbs.probe.side_jobs JOB.json")
    run_job(json.loads(Path(args[0]).read_text()))


if __name__ == "__main__":
    main()
