"""Fit E(S) to a constant-batch sweep: B_crit (McCandlish et al. 2018), B_min and B_opt (Zhou et al. 2026).

    python recipes/fit_es.py multirun/2026-01-01_12-00-00              # a Hydra multirun folder
    python recipes/fit_es.py runs/b16 runs/b32 runs/b64 --targets 4.2 4.0 3.8 --out es_fit
    python recipes/fit_es.py SWEEP --loss-column val/loss --probe outputs/tiny_warmup/cbs_probe.jsonl

For each target loss it finds the tokens E and steps S every run needed (smoothed loss, linear
interpolation), fits both models, prints a table (target, B_crit, B_min, B_opt, runs used; the
runs left out of a target are named in warnings) and, where the runs logged a noise scale or a
probe file is given, the same targets side by side with the runs' median gradient noise scale at
that loss and the CBS probe's reading nearest it (lit_cbs.analysis.fits; also side_by_side.md).
It writes into --out (default SWEEP/fit_es): es_fits.png (E vs S with the fits), batch_sizes.png
(the batch sizes vs target loss and vs tokens, with the CBS probe's brackets and the runs'
gradient noise scale where logged), fits.json (every fitted parameter) and schedule.yaml, a
`# @package _global_` recipe whose PiecewiseBatch follows B_opt (copy it to conf/recipe/ and run
`python recipes/train.py +recipe=NAME`). Batch sizes are in samples. Bad input ends the run with
one line naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from lit_cbs.analysis import read_readings
from lit_cbs.analysis.curves import METRICS_FILE, check_units, default_targets, find_crossings, read_sweep
from lit_cbs.analysis.fits import (
    POOR_FIT,
    WSD_FREE_PARAMETERS,
    TargetFit,
    fit_targets,
    propose_schedule,
    side_by_side,
    side_by_side_markdown,
    write_schedule_yaml,
)
from lit_cbs.analysis.plots import plot_batch_sizes, plot_es
from lit_cbs.metrics import TRAIN_LOSS as LOSS_COLUMN

PROBE_FILE = "cbs_probe.jsonl"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "sweep", nargs="+", type=Path, help="a Hydra multirun folder (one subfolder per run), or several run folders"
    )
    parser.add_argument(
        "--targets", type=float, nargs="+", help="target losses (default: --num-targets evenly spaced ones)"
    )
    parser.add_argument("--num-targets", type=int, default=6, help="how many default targets (default: 6)")
    parser.add_argument(
        "--out", type=Path, help="output folder (default: SWEEP/fit_es, or ./fit_es for a list of runs)"
    )
    parser.add_argument("--loss-column", default=LOSS_COLUMN, help=f"loss column (default: {LOSS_COLUMN})")
    parser.add_argument(
        "--metrics-file", default=METRICS_FILE, help=f"metrics CSV name in each run (default: {METRICS_FILE})"
    )
    parser.add_argument(
        "--smoothing", choices=("rolling", "none"), default="rolling", help="loss smoothing (default: rolling)"
    )
    parser.add_argument(
        "--window", type=int, default=9, help="rolling: centered window, logged points, odd (default: 9)"
    )
    parser.add_argument(
        "--probe", type=Path, nargs="*", help=f"CBS probe JSONL files (default: every {PROBE_FILE} under SWEEP)"
    )
    parser.add_argument(
        "--multiple-of", type=int, default=1, help="round scheduled batch sizes to this many samples (micro x world)"
    )
    return parser.parse_args(argv)


def format_table(fits: list[TargetFit]) -> str:
    """One row per target loss: B_crit, B_min, B_opt (nan: no fit) and how many runs reached it."""
    lines = [f"{'target loss':>11}  {'B_crit':>11}  {'B_min':>11} {'B_opt':>11} {'runs':>4}   (batch sizes in samples)"]
    poor = False
    for fit in fits:
        crit_mark = "*" if fit.mccandlish is not None and fit.mccandlish.rms_log_residual > POOR_FIT else " "
        wsd_mark = "*" if fit.wsd is not None and fit.wsd.rms_log_residual > POOR_FIT else " "
        poor = poor or "*" in crit_mark + wsd_mark
        lines.append(
            f"{fit.target:>11.4g}  {fit.b_crit:>10.4g}{crit_mark}  {fit.b_min:>10.4g}{wsd_mark} "
            f"{fit.b_opt:>10.4g}{wsd_mark} {len(fit.crossings):>4}"
        )
    if poor:
        lines.append(f"* that E(S) fit misses the runs by more than {POOR_FIT:.0%} (rms of log E): unreliable")
    return "\n".join(lines)


def fits_record(fits: list[TargetFit]) -> list[dict[str, Any]]:
    return [
        {
            "target": fit.target,
            "unit": "samples",
            "tokens_per_sample": fit.tokens_per_sample,
            "b_crit": fit.b_crit,
            "b_min": fit.b_min,
            "b_opt": fit.b_opt,
            "runs": [dataclasses.asdict(c) for c in fit.crossings],
            "mccandlish": dataclasses.asdict(fit.mccandlish) if fit.mccandlish else None,
            "wsd": dataclasses.asdict(fit.wsd) if fit.wsd else None,
        }
        for fit in fits
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    smoothing = dict(window=None if args.smoothing == "none" else args.window)
    sweep_folder = args.sweep[0] if len(args.sweep) == 1 else None
    try:
        runs = read_sweep(sweep_folder or args.sweep, metrics_file=args.metrics_file, loss_column=args.loss_column)
        tokens_per_sample = check_units(runs)
        targets = args.targets or default_targets(runs, args.num_targets, WSD_FREE_PARAMETERS, **smoothing)
        fits = fit_targets(find_crossings(runs, targets, **smoothing), tokens_per_sample)
        if not fits:
            raise ValueError(f"no target loss in {[f'{t:.4g}' for t in targets]} is reached by at least 3 runs")
        probe_files = (
            args.probe if args.probe is not None else sorted(sweep_folder.rglob(PROBE_FILE)) if sweep_folder else []
        )
        probe = [reading for path in probe_files for reading in read_readings(path)]
        out = args.out or (sweep_folder / "fit_es" if sweep_folder else Path("fit_es"))
        out.mkdir(parents=True, exist_ok=True)
        print(f"{len(runs)} runs, {len(fits)} target losses; tokens per sample: {tokens_per_sample}")
        print(format_table(fits))
        compared = side_by_side(fits, runs, probe)
        has_comparison = bool(probe) or any(row.b_simple_runs for row in compared)
        if has_comparison:
            table = side_by_side_markdown(compared)
            print("side by side (samples):\n" + table)
            (out / "side_by_side.md").write_text(table + "\n")
        written = [
            plot_es(fits, out / "es_fits.png"),
            plot_batch_sizes(
                fits, out / "batch_sizes.png", probe=probe, gns_runs=runs, compared=compared if has_comparison else ()
            ),
        ]
        record = fits_record(fits)
        for entry, row in zip(record, compared):
            entry["b_simple"] = row.b_simple
            entry["probe"] = (
                None if row.probe is None else {**dataclasses.asdict(row.probe), "run_tokens": row.probe_run_tokens}
            )
        (out / "fits.json").write_text(json.dumps(record, indent=2))
        written.append(out / "fits.json")
        try:
            schedule = propose_schedule(fits, multiple_of=args.multiple_of)
        except ValueError as error:
            print(f"no schedule proposed: {error}")
        else:
            source = sweep_folder or ", ".join(map(str, args.sweep))
            comment = (
                "Batch schedule following B_opt (Zhou et al. 2026, arXiv 2601.05034), fitted by recipes/fit_es.py\n"
                f"from {source}."
            )
            written.append(write_schedule_yaml(schedule, out / "schedule.yaml", comment))
            print(f"proposed schedule: {schedule}")
    except ValueError as error:
        print(f"fit_es.py: {error}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"warning: {message}\n"
    sys.exit(main())
