"""What side-job probes cost the main run on its own clock: each probe point's checkpoint write, the look for
results after every optimizer step, and the wait for the last readings when training ends.

Three short recipe runs of the default job's tiny model (``--tokens``, 524,288 by default), each with a probe every
65,536 tokens over windows of 16,384 (k = 1, 2) whose branches train as side jobs, read from each run's
``summary.json`` (``probe.side_jobs``: seconds and counts the main run measured on its own clock):

- ``local``: one process, ``side_jobs=local side_jobs.launcher.threads=1``;
- ``local, 2 processes``: two DDP processes on the CPU (``torchrun``), the same jobs: every look ends in a broadcast
  from rank 0, so that every rank learns an outcome at the same step;
- ``SLURM``: one process, ``side_jobs=slurm`` on the cluster ``SLURM_CONF`` points at (``tests/slurm/cluster.sh up``
  starts one on this machine; skipped where ``sinfo`` finds none): each look asks SLURM (``squeue``) about every job
  that has not written its scores.

Each look's cost is set against the main run's median optimizer step (``perf/step_seconds`` in metrics.csv).

Usage::

    python -m benchmarks.side_waits                        # about 3 minutes (SLURM: when a cluster is up)
    python -m benchmarks.side_waits --quick --out /tmp/sw  # 131,072 tokens, no SLURM
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    ROOT,
    check_run,
    git_commit,
    machine,
    refuse_unless_checked,
    replace_section,
    run_logged,
    train_command,
)

NAME = "side_waits"
PROBE = [
    "callbacks.cbs_probe.geometric=null",
    "callbacks.cbs_probe.every_tokens=65536",
    "callbacks.cbs_probe.window_tokens=16384",
    "callbacks.cbs_probe.multipliers=[1,2]",
    "callbacks.cbs_probe.heldout_batches=4",
    "callbacks.checkpoint=null",
    "callbacks.progress_bar=null",
    "trainer.enable_progress_bar=false",
    "trainer.limit_val_batches=4",
    "plots=false",
]
WAYS = {
    "local": ["side_jobs=local", "side_jobs.launcher.threads=1"],
    "local, 2 processes": [
        "side_jobs=local",
        "side_jobs.launcher.threads=1",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        "trainer.devices=2",
    ],
    "SLURM": ["side_jobs=slurm", "side_jobs.launcher.cpus_per_task=1", "side_jobs.launcher.timeout_min=10"],
}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def slurm_is_up() -> bool:
    return shutil.which("sinfo") is not None and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0


def run(way: str, tokens: int, out: Path) -> dict:
    run_dir = (out / way.replace(", ", "_").replace(" ", "_")).resolve()
    warmup = f"lr_schedule.warmup_tokens={min(262_144, tokens // 8)}"
    overrides = [*WAYS[way], *PROBE, f"max_tokens={tokens}", warmup, f"hydra.run.dir={run_dir}"]
    command = train_command(overrides)
    if "trainer.devices=2" in overrides:
        command = [*TORCHRUN, *command[1:]]
    print(f"[{NAME}] {way}: {' '.join(command[1:])}", flush=True)
    run_logged(command, run_dir / "stdout.log", threads=1)
    summary = json.loads((run_dir / "summary.json").read_text())
    waits = summary["probe"]["side_jobs"]
    return {
        "way": way,
        "waits": waits,
        "step_seconds": median_step_seconds(run_dir),
        "run_seconds": summary["run_seconds"],
        "run_dir": str(run_dir),
    }


def median_step_seconds(run_dir: Path) -> float:
    """The main run's median optimizer step (seconds), from the gaps of metrics.csv's fit_seconds."""
    from lit_cbs.analysis.curves import read_metrics_csv
    from lit_cbs.metrics import FIT_SECONDS

    _, seconds = read_metrics_csv(run_dir / "metrics.csv")[FIT_SECONDS]
    return float(statistics.median(later - earlier for earlier, later in zip(seconds, seconds[1:])))


def report(results: list[dict], args, seconds: float, skipped: list[str]) -> str:
    lines = [
        f"Command: `python -m benchmarks.{NAME}{' ' + ' '.join(args.argv) if args.argv else ''}` at commit "
        f"{args.commit} ({args.date}; {machine()}; {seconds / 60:.1f} minutes). {args.tokens:,} tokens per run, a "
        "probe every 65,536 tokens, the main run on one thread.",
        "",
        "| side jobs | checkpoint write per probe point, ms | one look for results, ms (x the median step) | looks | "
        "looking, share of the run's time | waited at the end, s |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        waits = result["waits"]
        per_write = 1000 * waits["checkpoint"] / max(1, waits["checkpoints"])
        per_look = 1000 * waits["poll"] / max(1, waits["polls"])
        step = per_look / 1000 / result["step_seconds"]
        lines.append(
            f"| {result['way']} | {per_write:.1f} ({waits['checkpoints']} points) | {per_look:.2f} ({step:.3f}) | "
            f"{waits['polls']:,} | {waits['poll'] / result['run_seconds']:.2%} | {waits['at_end']:.1f} |"
        )
    lines += [f"- {way}: not measured ({why})" for way, why in skipped]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="131,072 tokens, no SLURM, no markdown")
    parser.add_argument("--tokens", type=int, default=524_288)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / NAME)
    parser.add_argument("--markdown", type=Path, default=None, help="default: docs/RESULTS.md (none with --quick)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.date, args.commit = time.strftime("%Y-%m-%d"), git_commit()
    if args.quick:
        args.tokens = 131_072
    if args.markdown is None and not args.quick:
        args.markdown = ROOT / "docs" / "RESULTS.md"
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    ways, skipped = list(WAYS), []
    if args.quick:
        ways, skipped = ["local"], [("local, 2 processes", "--quick"), ("SLURM", "--quick")]
    elif not slurm_is_up():
        ways.remove("SLURM")
        skipped.append(("SLURM", "no cluster answers sinfo here: tests/slurm/cluster.sh up starts one"))
    results = [run(way, args.tokens, args.out) for way in ways]
    refuse_unless_checked([p for r in results for p in check_run(Path(r["run_dir"]), probes=True)], NAME)
    text = report(results, args, time.perf_counter() - started, skipped)
    print(text)
    (args.out / f"{NAME}.json").write_text(json.dumps(results, indent=1))
    if args.markdown is not None:
        replace_section(args.markdown, NAME, text)
    return {"results": results, "text": text}


if __name__ == "__main__":
    main()
