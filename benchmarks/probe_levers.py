"""Evidence per token: what each lever of a CBS reading buys and costs (held-out batches, data windows, the window's
length, the confidence), read off the same branches.

One run of the hand warmup (``recipes/train.py callbacks.cbs_probe=null``, seed 3, a checkpoint every 64 optimizer
steps), then, from each checkpoint, two readings of k = 1 and 2 by ``recipes/probe.py``
(``probe_checkpoint``: the run's next tokens, its held-out batches): windows of 65,536 tokens on 4 disjoint data
windows and windows of 262,144 tokens on 2, both scored on 55 held-out batches (the whole split). Each lever is read
off these readings by keeping part of their data (the first H held-out batches, the first R windows) or by judging
them at another confidence, so every row sees the same branches.

Per row: the branch tokens one reading costs where the main run is k = 1 on its first window (k = 2 on R windows,
k = 1 on R - 1), the mean standard error of L_2 - L_1 (nats), the share of readings determined at the row's
confidence, and the first token count at which a reading at batch 16 says, determined, that the CBS is at least 32
(where ``CBSAdaptive`` would double the batch).

Usage::

    python -m benchmarks.probe_levers                        # about 15 minutes
    python -m benchmarks.probe_levers --quick --out /tmp/pl  # 1/16 of the budget, 1/4 of the windows, no markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
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
from lit_cbs.probe.reading import BranchScore, ProbeReading, decide, read_readings

NAME = "probe_levers"
SEED = 3  # no closed-loop run uses it: the recipe chosen from these rows is judged on other seeds
EPSILON = 0.01  # nats, the tiny_adaptive recipe's


@dataclass(frozen=True)
class Lever:
    label: str
    window: int  # which readings (their window, tokens)
    replicates: int
    heldout: int
    confidence: float = 0.9


def levers(short: int, long: int) -> list[Lever]:
    return [
        Lever("16 held-out batches", short, 1, 16),
        Lever("32 held-out batches", short, 1, 32),
        Lever("55 held-out batches (the whole split)", short, 1, 55),
        Lever("2 data windows", short, 2, 32),
        Lever("4 data windows, 55 batches", short, 4, 55),
        Lever("confidence 0.75", short, 1, 32, 0.75),
        Lever("confidence 0.95", short, 1, 32, 0.95),
        Lever("a 4x longer window", long, 1, 32),
        Lever("a 4x longer window, 2 data windows", long, 2, 55),
    ]


def judged(reading: ProbeReading, lever: Lever) -> tuple[float | None, bool, bool]:
    """(SE of L_2 - L_1, determined, says CBS >= 2B) of ``reading`` on the lever's part of its data."""
    scores = {}
    for k in ("1", "2"):
        windows = [
            BranchScore.heldout(w[: lever.heldout]) for w in reading.replicate_batch_losses[k][: lever.replicates]
        ]
        scores[float(k)] = BranchScore.replicated(windows)
    decision = decide(scores, EPSILON, lever.confidence)
    return decision.loss_se[2.0], decision.determined, decision.k_star == 2.0


def row(lever: Lever, readings: list[ProbeReading]) -> dict:
    judgements = [judged(r, lever) for r in readings]
    ses = [se for se, _, _ in judgements if se is not None]
    first = next((r.tokens for r, (_, det, up) in zip(readings, judgements) if r.batch_size == 16 and det and up), None)
    return {
        "lever": lever.label,
        "branch_tokens": lever.window * (2 * lever.replicates - 1),
        "heldout_batches": 2 * lever.heldout,  # scored per reading: the main run's and k = 2's
        "mean_se": statistics.fmean(ses) if ses else None,
        "determined": sum(det for _, det, _ in judgements) / len(judgements),
        "first_grow": first,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1/16 of the budget, shorter windows, no markdown")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / NAME)
    parser.add_argument("--markdown", type=Path, default=None, help="default: docs/RESULTS.md (none with --quick)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.markdown is None and not args.quick:
        args.markdown = ROOT / "docs" / "RESULTS.md"
    short, long = (16_384, 65_536) if args.quick else (65_536, 262_144)  # a window holds a step of k = 2 at batch 64
    started = time.perf_counter()
    run_dir = (args.out / f"hand_seed{SEED}").resolve()
    if not (run_dir / "summary.json").exists():
        budget = [] if not args.quick else [
            "max_tokens=163840", "lr_schedule.warmup_tokens=16384", "batch.schedule.thresholds=[0,81920,122880]",
            "val_check_tokens=65536",
        ]  # fmt: skip
        every = 32 if args.quick else 64  # steps between checkpoints: 1 in the small mode, 17 in the full one
        overrides = ["callbacks.cbs_probe=null", f"seed={SEED}", f"callbacks.checkpoint.every_n_train_steps={every}",
                     "trainer.enable_progress_bar=false", "callbacks.progress_bar=null", "plots=false", *budget,
                     f"hydra.run.dir={run_dir}"]  # fmt: skip
        print(f"[{NAME}] the hand warmup, seed {SEED}", flush=True)
        run_logged(train_command(overrides), run_dir / "stdout.log")
    readings = {}
    for window, replicates in ((short, 4), (long, 2)):
        folder = (args.out / f"window{window}").resolve()
        if not (folder / "cbs_probe.jsonl").exists():
            print(f"[{NAME}] readings over windows of {window:,} tokens, {replicates} data windows", flush=True)
            command = [
                sys.executable, str(ROOT / "recipes" / "probe.py"), f"ckpt_path={run_dir / 'checkpoints'}",
                "probe.multipliers=[1,2]", f"probe.window_tokens={window}", f"probe.replicates={replicates}",
                "probe.heldout_batches=55", "probe.search=grid", "probe.evaluate=heldout", f"hydra.run.dir={folder}",
            ]  # fmt: skip
            run_logged(command, folder / "stdout.log")
        readings[window] = read_readings(folder / "cbs_probe.jsonl")
    problems = check_run(run_dir, changes_batch=True)
    checkpoints = len(list(run_dir.glob("checkpoints/step*.ckpt")))
    problems += [
        f"{len(rs)} readings over windows of {w:,} tokens for {checkpoints} checkpoints"
        for w, rs in readings.items()
        if len(rs) != checkpoints
    ]
    refuse_unless_checked(problems, NAME)
    rows = [row(lever, readings[lever.window]) for lever in levers(short, long)]
    text = report(rows, readings, args, time.perf_counter() - started, short)
    print(text)
    (args.out / f"{NAME}.json").write_text(json.dumps(rows, indent=1))
    if args.markdown is not None:
        replace_section(args.markdown, NAME, text)
    return {"rows": rows, "text": text}


def report(rows: list[dict], readings: dict, args, seconds: float, short: int) -> str:
    points = ", ".join(f"{r.tokens:,}" for r in readings[short])
    lines = [
        f"Command: `python -m benchmarks.{NAME}{' ' + ' '.join(args.argv) if args.argv else ''}` at commit "
        f"{git_commit()} ({time.strftime('%Y-%m-%d')}; {machine()}; {seconds / 60:.0f} minutes). Readings of k = 1 "
        f"and 2 (epsilon {EPSILON} nats) at the checkpoints of the hand warmup, seed {SEED}, at {points} tokens.",
        "",
        "| lever | branch tokens per reading | held-out batches scored | mean SE of L_2 - L_1 (nats) | determined | "
        "first determined CBS >= 32 at batch 16 (tokens) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        se = "—" if r["mean_se"] is None else f"{r['mean_se']:.4f}"
        first = "never" if r["first_grow"] is None else f"{r['first_grow']:,}"
        cells = [r["lever"], f"{r['branch_tokens']:,}", str(r["heldout_batches"]), se, f"{r['determined']:.0%}", first]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
