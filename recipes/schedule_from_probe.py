r"""Write a batch size warmup read off a measured CBS curve as a Hydra batch config: measure on a small
model, train the big one with no probe.

    python recipes/train.py +recipe=tiny_cbs_curve hydra.run.dir=runs/tiny_curve
    python recipes/schedule_from_probe.py runs/tiny_curve/cbs_probe.jsonl --start 16 --final 64 \
        --out conf/batch/measured.yaml
    python recipes/train.py +recipe=tiny4x_warmup batch=measured

With --forecast-to TOKENS the schedule reaches past the last probe: a CBS curve is fitted to the
readings' brackets (lit_cbs.analysis.forecast_cbs: a power law, or one with a plateau, by held-out
likelihood) and the batch follows the lower edge of its --coverage band up to TOKENS; --plot draws
the brackets, the curve and the band, and --noise-scale METRICS_CSV adds a run's GradientNoiseScale
B_simple over tokens to the plot and prints its growth exponent beside the CBS's. Otherwise the batch
starts at --start samples and grows by --factor at the token count of each probe reading whose CBS
lower bound allows it (lit_cbs.analysis.schedule_from_probe: never decreasing, capped at --final,
undetermined readings skipped, a --margin to switch later). Several files (e.g. two seeds) are read
together; at a token count read twice the smaller lower bound counts. --seq-len converts a curve
measured at another sequence length (--measured-seq-len) through tokens. The output is a conf/batch/
option (like batch/warmup.yaml): select it with `batch=NAME` in any recipe that runs a PiecewiseBatch
(tiny_warmup, tiny4x_warmup, olmo1b_warmup, ...); the recipes read conf/ of the folder they run from
beside the package's, so write it there. It keeps the measured run's micro-batch growth: its
max_micro_batch_size is --max-micro-batch-size, else batch.max_micro_batch_size of the run's saved
configuration beside the probe files (resolved_config.yaml, or .hydra/config.yaml), else the default
of conf/batch/warmup.yaml; the file's comment says which. Records written before probe records stored
their epsilon are read at the run's callbacks.cbs_probe.epsilon from the same configuration, or
--epsilon. Bad input ends the run with one line naming it; a warning is one line too.

A CBS law over model sizes (lit_cbs.analysis.law, docs/guides/cbs_law.md) plans a run no probe has seen:
--fit-law LAW.json fits one to the files (one run each, --params N of each; --corpus names each's data) and
--law LAW.json --target-params N --target-tokens D gives the schedule of a run of N parameters over D tokens
(following the lower edge of the law's --coverage band; --corpus: the intercept of one of the law's corpora, else
their mean with their spread) and the probe points worth checking it at.

    python recipes/schedule_from_probe.py small/cbs_probe.jsonl big/cbs_probe.jsonl --params 66560 233472 \
        --fit-law law.json
    python recipes/schedule_from_probe.py --law law.json --target-params 868352 --target-tokens 16000000 \
        --seq-len 128 --start 4 --out conf/batch/from_law.yaml

Files may hold readings measured elsewhere, one JSON object a line: {"tokens": 2e9, "cbs_lower": 1024,
"cbs_upper": 2048} (samples; cbs_upper null for no upper end), optionally "determined", "seq_len", "epsilon".
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from omegaconf import OmegaConf

from lit_cbs.analysis import brackets_from_records, forecast_cbs, plot_forecast, read_readings, schedule_from_probe
from lit_cbs.analysis.fits import batch_group_yaml
from lit_cbs.analysis.forecast import growth_exponent, noise_scale_over_tokens, schedule_from_forecast
from lit_cbs.analysis.law import CBSLaw, fit_law, law_points, schedule_from_law
from lit_cbs.analysis.probe_schedule import run_config_value
from lit_cbs.errors import LitCBSConfigError, positive_int, positive_number
from lit_cbs.rules.batch_schedules import PiecewiseBatch
from lit_cbs.rules.scaling import LR_RULES

WARMUP_BATCH = Path(__file__).resolve().parents[1] / "conf" / "batch" / "warmup.yaml"  # the default micro-batch growth


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("probe", nargs="*", type=Path, help="cbs_probe.jsonl files (CBSProbeCallback's or others)")
    parser.add_argument("--start", type=int, help="the target run's first global batch, samples")
    parser.add_argument("--factor", type=int, default=2, help="ratio between consecutive batch sizes (default: 2)")
    parser.add_argument(
        "--final", type=int, help="the largest global batch, samples: start x factor^n (default: no cap)"
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=1.0,
        help="move to batch B only where the CBS lower bound >= margin x B (default: 1)",
    )
    parser.add_argument(
        "--seq-len", type=int, help="the target run's data.seq_len, tokens (default: the measured run's)"
    )
    parser.add_argument(
        "--measured-seq-len", type=int, help="data.seq_len of the run that wrote the probe files, tokens"
    )
    parser.add_argument(
        "--lr-rule",
        default="sqrt",
        choices=sorted(LR_RULES),
        help="batch.lr_rule: LR factor per batch change (default: sqrt)",
    )
    parser.add_argument("--out", type=Path, help="the config to write, e.g. conf/batch/measured.yaml")
    parser.add_argument(
        "--max-micro-batch-size",
        type=int,
        help="batch.max_micro_batch_size to write, samples per rank (default: the measured run's, from its saved "
        "configuration beside the probe files, else conf/batch/warmup.yaml's)",
    )
    parser.add_argument(
        "--forecast-to", type=int, help="fit a CBS curve to the readings and schedule up to this many tokens"
    )
    parser.add_argument(
        "--coverage",
        type=float,
        default=0.8,
        help="--forecast-to: the band's coverage; the batch follows its lower edge (default 0.8)",
    )
    parser.add_argument(
        "--epsilon",
        type=float,
        help="--forecast-to: epsilon (nats) of records that do not store theirs (default: callbacks.cbs_probe.epsilon "
        "of the run's saved configuration beside each file)",
    )
    parser.add_argument("--plot", type=Path, help="--forecast-to: write the forecast plot here (e.g. forecast.png)")
    parser.add_argument(
        "--noise-scale",
        type=Path,
        help="--forecast-to: a metrics.csv with gns/b_simple: its growth beside the CBS's, and on the plot",
    )
    law = parser.add_argument_group("a CBS law over model sizes")
    law.add_argument("--fit-law", type=Path, help="fit a law to the files and write it here (JSON)")
    law.add_argument("--params", type=float, nargs="+", help="--fit-law: each file's model size, parameters")
    law.add_argument(
        "--corpus", nargs="+", help="--fit-law: each file's corpus name (default: one corpus); --law: the target's"
    )
    law.add_argument("--law", type=Path, help="schedule the target run from this law (--fit-law's file)")
    law.add_argument("--target-params", type=float, help="--law: the target model's parameters")
    law.add_argument("--target-tokens", type=int, help="--law: the target run's budget, tokens")
    return parser.parse_args(argv)


def check_modes(args: argparse.Namespace) -> None:
    """One line for what the chosen mode lacks or should not have, before any work."""
    if args.fit_law is not None:
        if not args.probe or args.params is None or len(args.params) != len(args.probe):
            raise ValueError("--fit-law needs the probe files and --params with one model size (parameters) each")
        if args.corpus is not None and len(args.corpus) != len(args.probe):
            raise ValueError(f"--corpus names {len(args.corpus)} corpora for {len(args.probe)} files: one each")
        return
    if args.law is not None:
        if args.probe:
            raise ValueError("--law schedules from the law alone: leave out the probe files (or fit with --fit-law)")
        if args.target_params is None or args.target_tokens is None or args.seq_len is None:
            raise ValueError("--law needs --target-params N, --target-tokens D and --seq-len (the target run's)")
        if args.forecast_to is not None or (args.corpus is not None and len(args.corpus) != 1):
            raise ValueError("--law takes no --forecast-to (--target-tokens is the budget) and at most one --corpus")
    elif not args.probe:
        raise ValueError("give cbs_probe.jsonl files, or --law LAW.json for a run no probe has seen")
    if args.start is None or args.out is None:
        raise ValueError("--start (the first global batch, samples) and --out (the config to write) are needed")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_modes(args)
        if args.fit_law is not None:
            return fit_law_to_files(args)
        if args.out.suffix != ".yaml":
            raise ValueError(f"--out {args.out} must end in .yaml (Hydra reads conf/batch/NAME.yaml as batch=NAME)")
        if args.forecast_to is not None and args.seq_len is not None:
            raise ValueError("--forecast-to fits the curve at the measured sequence length; leave out --seq-len")
        forecast_only = (args.plot, args.noise_scale, args.epsilon)
        if args.forecast_to is None and any(option is not None for option in forecast_only):
            raise ValueError("--plot, --noise-scale and --epsilon go with the forecast: give --forecast-to TOKENS too")
        positive_int("--max-micro-batch-size", args.max_micro_batch_size, "samples per rank", optional=True)
        positive_number("--epsilon", args.epsilon, "nats", optional=True)
        micro_batch = micro_batch_growth(args)
        if args.law is not None:
            return write_from_law(args, micro_batch)
        readings = [reading for path in args.probe for reading in read_readings(path)]
        if args.forecast_to is not None:
            return write_forecast(args, micro_batch)
        schedule = schedule_from_probe(
            readings,
            args.start,
            factor=args.factor,
            final=args.final,
            margin=args.margin,
            seq_len=args.seq_len,
            measured_seq_len=args.measured_seq_len,
        )
    except ValueError as error:
        print(f"schedule_from_probe.py: {error}", file=sys.stderr)
        return 2
    sources = ", ".join(str(path) for path in args.probe)
    options = f"start {args.start}, factor {args.factor}, final {args.final}, margin {args.margin:g}"
    if args.seq_len is not None:
        measured = args.measured_seq_len or "the readings' seq_len"
        options += f", seq_len {args.seq_len} from {measured}"
    comment = [
        f"Batch size warmup read off a measured CBS curve by recipes/schedule_from_probe.py ({options})",
        f"from {sources}.",
    ]
    write_batch_config(args, schedule, comment, micro_batch)
    print(f"{schedule} from {len(readings)} probe readings; wrote {args.out}")
    return 0


def write_batch_config(
    args: argparse.Namespace, schedule: PiecewiseBatch, comment: list[str], micro_batch: tuple[int | None, str]
) -> None:
    """Write --out: the batch group running ``schedule``, its comment ``comment``, where its micro-batch growth
    came from (``micro_batch``: the value and that line) and how to use it."""
    value, source = micro_batch
    use = f"python recipes/train.py +recipe=... batch={args.out.stem}"
    lines = [*comment, source, f"Global batches in samples, thresholds in tokens. Use: {use}"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(batch_group_yaml(schedule, "\n".join(lines), args.lr_rule, max_micro_batch_size=value))


def micro_batch_growth(args: argparse.Namespace) -> tuple[int | None, str]:
    """The max_micro_batch_size to write (samples per rank) and a line saying where it came from:
    --max-micro-batch-size, else the measured runs' batch.max_micro_batch_size (their saved
    configurations beside the probe files must agree), else conf/batch/warmup.yaml's."""
    key = "batch.max_micro_batch_size"
    if args.max_micro_batch_size is not None:
        return args.max_micro_batch_size, f"max_micro_batch_size {args.max_micro_batch_size}: --max-micro-batch-size."
    configs = {path: run_config_value(path.parent, key) for path in args.probe}
    found = {path: value_and_file for path, value_and_file in configs.items() if value_and_file is not None}
    if len({value for value, _ in found.values()}) > 1:
        values = ", ".join(f"{value} ({file})" for value, file in found.values())
        raise LitCBSConfigError(f"the measured runs' {key} differ: {values}; pick one with --max-micro-batch-size")
    if found:
        value, file = next(iter(found.values()))
        return value, f"max_micro_batch_size {'null' if value is None else value}: the measured run's {key} ({file})."
    value = OmegaConf.load(WARMUP_BATCH).max_micro_batch_size
    return value, f"max_micro_batch_size {value}: the default of conf/batch/warmup.yaml (no run configuration found)."


def fit_law_to_files(args: argparse.Namespace) -> int:
    """--fit-law: the law in the tokens through every file's readings (with a size term where sizes differ)."""
    corpora = args.corpus or ["corpus"] * len(args.probe)
    points = [
        point
        for path, params, corpus in zip(args.probe, args.params, corpora)
        for point in law_points(read_readings(path), params, corpus, str(path), epsilon=args.epsilon)
    ]
    law = fit_law(points, size_term=len(set(args.params)) > 1)
    law.save(args.fit_law)
    print(f"{law.describe()}; wrote {args.fit_law}")
    return 0


def write_from_law(args: argparse.Namespace, micro_batch: tuple[int | None, str]) -> int:
    """--law: the target run's schedule along the law's band, and the probe points that would check it."""
    law = CBSLaw.load(args.law)
    schedule, changes = schedule_from_law(
        law, args.target_params, args.target_tokens, args.start, args.seq_len,
        factor=args.factor, final=args.final, margin=args.margin, coverage=args.coverage,
        corpus=args.corpus[0] if args.corpus else None,
    )  # fmt: skip
    points = ", ".join(f"{c.tokens:,}" for c in changes) or "none (the batch never grows)"
    comment = [
        f"Batch size warmup from the CBS law {args.law} by recipes/schedule_from_probe.py for",
        f"{args.target_params:,.0f} parameters over {args.target_tokens:,} tokens at seq_len {args.seq_len}:",
        f"{law.describe()}. The batch follows the lower edge of its {args.coverage:.0%} band.",
        f"Probe points worth checking it at: {points}.",
    ]
    write_batch_config(args, schedule, comment, micro_batch)
    print(f"{schedule}; wrote {args.out}\nprobe points worth checking it at (tokens): {points}")
    return 0


def write_forecast(args: argparse.Namespace, micro_batch: tuple[int | None, str]) -> int:
    """--forecast-to: fit the curve to every file's brackets (one run per file), write the schedule and the plot."""
    brackets, judged_at = [], []
    for path in args.probe:
        readings = read_readings(path)
        epsilon, source = args.epsilon, "--epsilon"
        found = run_config_value(path.parent, "callbacks.cbs_probe.epsilon") if epsilon is None else None
        if found is not None and found[0] is not None:
            epsilon, source = float(found[0]), str(found[1])
        if epsilon is not None and any(reading.epsilon is None for reading in readings):
            judged_at.append(f"Read {path}'s records without an epsilon at {epsilon:g} nats ({source}).")
        brackets += brackets_from_records(readings, run=str(path), epsilon=epsilon)
    forecast = forecast_cbs(brackets, coverage=args.coverage)
    schedule, changes = schedule_from_forecast(
        forecast, args.start, args.forecast_to, factor=args.factor, final=args.final, margin=args.margin
    )
    at_changes = (
        "; ".join(f"{c.batch} at {c.tokens:,} tokens (band {c.band_low:.0f}-{c.band_high:.0f})" for c in changes)
        or "none"
    )
    options = f"start {args.start}, factor {args.factor}, final {args.final}, margin {args.margin:g}"
    options += f", coverage {args.coverage:g}"
    comment = [
        f"Batch size warmup forecast by recipes/schedule_from_probe.py --forecast-to {args.forecast_to:,} ({options})",
        f"from {len(brackets)} readings of {', '.join(str(path) for path in args.probe)}:",
        f"{forecast.describe()}.",
        *judged_at,
        f"The batch follows the lower edge of the {args.coverage:.0%} posterior predictive band (the CBS a run",
        "would read, given the readings: the curve's parameters and the spread of log CBS sampled by",
        f"lit_cbs.analysis.forecast); changes: {at_changes}.",
    ]
    noise = noise_scale_over_tokens(args.noise_scale) if args.noise_scale is not None else None
    write_batch_config(args, schedule, comment, micro_batch)
    if args.plot is not None:
        # numpy arrays, which plot_forecast reads as the sequences its annotation names
        plot_forecast(
            forecast,
            args.plot,
            tokens_to=args.forecast_to,
            noise_scale=cast("tuple[Sequence[float], Sequence[float]] | None", noise),
        )
    print(f"{forecast.describe()}\n{schedule}; wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    if noise is not None:
        print(
            f"noise scale B_simple grows as D^{growth_exponent(*noise):.3f} ({args.noise_scale}); "
            f"the CBS fit as D^{forecast.exponent:.3f}"
        )
    return 0


if __name__ == "__main__":
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"warning: {message}\n"
    sys.exit(main())
