"""What the benchmarks share: timing optimizer steps, running the recipes, reading their runs, and
writing each benchmark's own section of docs/RESULTS.md.

A benchmark named ``name`` owns the text between ``<!-- {name}:start -->`` and
``<!-- {name}:end -->`` of the results file; everything else in it is left as it is, so
benchmarks run at different times do not overwrite each other's results.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import numbers
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parent.parent
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # seconds; cpu: this process's CPU time


class StepTimer(pl.Callback):
    """Reads every clock and counts tokens at the end of each optimizer step.

    Put it last among the callbacks: its hook then runs after theirs, so a step's time includes
    them. On a GPU it synchronizes first, so the time includes the step's kernels. Batches are
    token tensors [B, seq_len + 1]; ``tokens`` counts this process's predictions (B x seq_len).
    """

    def __init__(self):
        self.steps: list[int] = []  # optimizer steps done at each reading
        self.ends: dict[str, list[float]] = {clock: [] for clock in CLOCKS}  # seconds, per clock
        self.tokens: list[int] = []  # tokens trained on by this process at each reading
        self._tokens = 0
        self._last_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._tokens += batch[:, 1:].numel()
        if trainer.global_step == self._last_step:
            return  # accumulating: no optimizer step after this micro-batch
        self._last_step = trainer.global_step
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        for clock, read in CLOCKS.items():
            self.ends[clock].append(read())
        self.steps.append(trainer.global_step)
        self.tokens.append(self._tokens)

    def durations(self, clock: str) -> list[float]:
        """Seconds of each optimizer step but the first (whose start is not read): end to end."""
        ends = self.ends[clock]
        return [end - start for start, end in zip(ends, ends[1:])]


def machine(load: tuple[float, float, float] | None = None) -> str:
    """Where a benchmark ran: architecture, cores, load average (when given), torch."""
    at_end = f", load average {', '.join(f'{x:.2f}' for x in load)} at the end" if load else ""
    return f"{platform.machine()}, {os.cpu_count()} cores{at_end}, torch {torch.__version__}"


def refuse_gpu_run_without_a_gpu(parser: argparse.ArgumentParser) -> None:
    """For a benchmark's --gpu variant: stop before any run where no CUDA GPU is visible."""
    if not torch.cuda.is_available():
        parser.error("--gpu: no CUDA GPU is visible here; run it on the GPU machine (benchmarks/gpu_run.sh)")


def run_logged(command: list[str], log_path: Path, threads: int | None = None) -> None:
    """Run ``command`` from the repository root with its output in ``log_path``; exit with its tail if it fails.

    ``threads``: OMP_NUM_THREADS for it (runs trained side by side share the cores).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(log_path, "w") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-20:])
        raise SystemExit(f"{' '.join(command[1:3])} ... failed ({done.returncode}); {log_path}:\n{tail}")


def train_command(overrides: list[str]) -> list[str]:
    """The command line of ``recipes/train.py`` with Hydra ``overrides``."""
    return [sys.executable, str(ROOT / "recipes" / "train.py"), *overrides]


def train_unless_done(command: list[str], run_dir: Path, log_path: Path, threads: int, label: str) -> None:
    """Run the train.py ``command`` that writes ``run_dir``, unless a finished run (summary.json) is there
    already; its wall time (seconds) goes to run_dir/wall_seconds.txt. ``label`` prefixes the line printed."""
    if (run_dir / "summary.json").exists():
        return
    print(f"{label}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    run_logged(command, log_path, threads)
    (run_dir / "wall_seconds.txt").write_text(f"{time.perf_counter() - started:.1f}\n")


def read_run(run_dir: Path, probes: bool = False, changes_batch: bool = False) -> dict:
    """A finished train.py run's summary.json plus its held-out loss curve (step, tokens, val_loss). With ``probes``
    or ``changes_batch``, the run is checked first (``check_run``): a run that did not do what it claims stops the
    benchmark before it writes anything."""
    from lit_cbs.analysis.curves import read_metrics_csv
    from lit_cbs.metrics import FIT_SECONDS
    from lit_cbs.metrics import TOKENS_SEEN as TOKENS_COLUMN
    from lit_cbs.metrics import VAL_LOSS as VAL_LOSS_COLUMN

    if probes or changes_batch:
        refuse_unless_checked(check_run(run_dir, probes=probes, changes_batch=changes_batch), run_dir.name)

    summary = json.loads((run_dir / "summary.json").read_text())
    series = read_metrics_csv(run_dir / "metrics.csv")
    val_steps, val_loss = series[VAL_LOSS_COLUMN]
    token_steps, tokens = series[TOKENS_COLUMN]
    # val/loss is logged at the step of the last optimizer step; tokens_seen (and fit_seconds, the wall
    # clock since the fit began, before that step's validation) every step.
    tokens_at = dict(zip(token_steps.tolist(), tokens.tolist()))
    seconds_at = dict(zip(*(column.tolist() for column in series[FIT_SECONDS]))) if FIT_SECONDS in series else {}
    curve = [
        {
            "step": int(step) + 1,
            "tokens": int(tokens_at[step]),
            "val_loss": float(loss),
            "seconds": seconds_at.get(step),
        }
        for step, loss in zip(val_steps.tolist(), val_loss.tolist())
        if step in tokens_at
    ]
    return {**summary, "val_curve": curve}


def json_default(value):
    """``json.dumps(..., default=json_default)`` for a benchmark's results: a record (a dataclass, such as a run's
    ``ProbeReading``) as its fields, a number of another type (numpy's) as a float, anything else as its text."""
    if hasattr(value, "to_record"):  # a ProbeReading: also the fields it computes, as cbs_probe.jsonl holds it
        return value.to_record()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return float(value) if isinstance(value, numbers.Number) else str(value)


def recipe_benchmark_arguments(
    name: str,
    description: str,
    quick_help: str,
    argv: list[str] | None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    resolve: Callable[[argparse.Namespace], str | None] | None = None,
) -> argparse.Namespace:
    """The command line of a benchmark that trains recipes: --quick, --jobs, --out, --markdown, --plot,
    --report-only, and what ``add_arguments`` adds. Resolved: ``out`` (default outputs/<name>), ``markdown``
    (docs/RESULTS.md, none with --quick), ``plot`` (docs/<name>.png beside it, else in OUT), ``threads``
    per run (cores / jobs), ``argv`` and ``date`` (for the report); then ``resolve(args)`` fills in the
    benchmark's own defaults and returns what is wrong with them (the usage error), or None. OUT is
    created once the arguments are valid."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument(
        "--jobs", type=int, default=2, help="runs trained at once (each with cores / jobs threads; default 2)"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "outputs" / name, help=f"folder for the runs and {name}.json"
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help=f"write the section '{name}' of this file (default: docs/RESULTS.md, none with --quick)",
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help=f"PNG (default: docs/{name}.png next to --markdown, else OUT)"
    )
    parser.add_argument("--report-only", action="store_true", help="train nothing: report the runs finished in OUT")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs} must be >= 1")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.date = str(datetime.date.today())
    if args.markdown is None and not args.quick:
        args.markdown = ROOT / "docs" / "RESULTS.md"
    if args.plot is None:
        args.plot = (args.markdown.parent / f"{name}.png") if args.markdown else args.out / f"{name}.png"
    args.threads = max(1, (os.cpu_count() or 1) // args.jobs)
    problem = resolve(args) if resolve is not None else None
    if problem:
        parser.error(problem)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def section_markers(name: str) -> tuple[str, str]:
    """The start and end marker lines of section ``name``."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(
            f"section name {name!r} must be letters, digits, '_', '.' or '-' (it goes into an HTML comment)"
        )
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_section(path: str | os.PathLike, name: str, text: str) -> None:
    """Put ``text`` between the markers of section ``name`` in the markdown file ``path``.

    A missing (or empty) file is created with a ``# Results`` heading and the section; a file
    without the section gets it appended; otherwise only the text between its markers changes.
    """
    path = Path(path)
    start, end = section_markers(name)
    if start in text or end in text:
        raise ValueError(f"the text for section {name!r} contains its own marker {start} or {end}")
    block = f"{start}\n{text.strip(chr(10))}\n{end}"
    old = path.read_text() if path.exists() else ""
    starts, ends = old.count(start), old.count(end)
    if starts == ends == 0:
        head = old.rstrip("\n") or "# Results"
        new = f"{head}\n\n{block}\n"
    elif starts == ends == 1 and old.index(start) < old.index(end):
        new = old[: old.index(start)] + block + old[old.index(end) + len(end) :]
    else:
        raise ValueError(
            f"{path} has {starts} '{start}' and {ends} '{end}'; section {name!r} needs one of each, start first: "
            "fix the markers by hand"
        )
    # Write beside it and rename, so a reader never sees half a file.
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(new)
    os.replace(partial, path)


def check_run(run_dir: Path, *, probes: bool = False, changes_batch: bool = False) -> list[str]:
    """What is wrong with a finished train.py run for the row it stands in (empty: nothing): its summary.json is
    there; where its configuration probes, its readings are, and no probe point failed or stayed pending; where its
    schedule must change the batch, it did; and its log holds no failed probe. A benchmark reports a run only once
    this is empty (``refuse_unless_checked``)."""
    problems = []
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return [f"{run_dir}: no summary.json (the run did not finish)"]
    summary = json.loads(summary_path.read_text())
    probe = summary.get("probe")
    if probes:
        points = (probe or {}).get("points") or {}
        if not probe or not probe["readings"]:
            problems.append(f"{run_dir}: the configuration probes, but the run took no reading")
        for failure in points.get("failed", []):
            problems.append(f"{run_dir}: the probe at {failure['tokens']:,} tokens failed: {failure['reason']}")
        if points.get("pending"):
            problems.append(f"{run_dir}: probes at {points['pending']} tokens never reported")
    if changes_batch and not summary["batch_changes"]:
        why = ((probe or {}).get("adaptive") or {}).get("why_not")
        problems.append(
            f"{run_dir}: the schedule must change the batch, but it never did" + (f": {why}" if why else "")
        )
    for log in run_dir.glob("*.log"):
        failed = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if re.search(r"CBS probe at [\d,]+ tokens failed", line)
        ]
        if failed:
            problems.append(f"{log}: {failed[0].strip()}")
    return problems


def refuse_unless_checked(problems: list[str], name: str) -> None:
    """Stop the benchmark ``name`` before it writes a table when any run it would report did not do what its row
    claims (``check_run``'s problems), saying each."""
    if problems:
        listed = "\n".join(f"- {problem}" for problem in problems)
        raise SystemExit(
            f"{name}: no table written: {len(problems)} run(s) did not do what their rows claim:\n{listed}"
        )


def git_commit() -> str:
    """The commit the benchmark runs at (short hash), marked "+changes" where the work tree differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    )
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def schedule_changes(run_dir: Path) -> bool:
    """Whether a recipe run's batch schedule (its ``resolved_config.yaml``) asks for another batch within its budget:
    a piecewise schedule with a threshold inside it, a ramp, or a closed loop."""
    from omegaconf import OmegaConf

    config = OmegaConf.load(run_dir / "resolved_config.yaml")
    schedule = config.batch.schedule
    kind = str(schedule["_target_"]).rsplit(".", 1)[-1]
    if kind == "PiecewiseBatch":
        return any(0 < threshold < config.max_tokens for threshold in schedule.thresholds)
    return kind != "ConstantBatch"
