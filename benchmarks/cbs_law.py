"""Does the CBS follow the tokens or the loss? Read the CBS of runs of several model sizes on two corpora, fit a
law to the readings, and check it on a larger size it never saw.

    python -m benchmarks.cbs_law                        # the whole study; docs/RESULTS.md section cbs_law + figure
    python -m benchmarks.cbs_law --quick --out /tmp/law # a few minutes: the same code on a small budget -> law.json

Each run is a user's two commands: ``recipes/train.py +recipe=tiny_warmup`` at a batch that starts at one sequence
(so that the first readings are not at the floor of the grid), saving a checkpoint at token counts doubling from
the first point; then ``recipes/probe.py`` reads the CBS at each of those checkpoints, each window a share of the
tokens the checkpoint holds. The law (lit_cbs.analysis.law) is fitted in the tokens and in the loss to the
readings of the fitted sizes, its intervals over the seeds from a bootstrap that resamples each cell's runs, and
checked on the held-out size's readings. A run whose readings are not all there, at the study's batch, with no
failed branch, is refused before anything is written.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import (
    ROOT,
    check_run,
    git_commit,
    json_default,
    machine,
    recipe_benchmark_arguments,
    refuse_unless_checked,
    replace_section,
    run_logged,
    train_command,
)
from lit_cbs.analysis.law import CBSLaw, fit_law, law_points
from lit_cbs.probe import read_readings

NAME = "cbs_law"
SEQ_LEN = 128  # conf/data/default.yaml's, the corpora's both
LR_AT_16 = 3e-3  # the tiny recipes' LR, tuned at batch 16
LIKELIHOOD_RATIO_90 = 1.353  # half the chi-square quantile at 90%, one degree of freedom: what c must add to stay


@dataclass(frozen=True)
class Study:
    corpora: dict[str, str]  # name -> the data= option
    sizes: dict[str, list[str]]  # name -> the model overrides
    seeds: tuple[int, ...]
    heldout_size: tuple[str, list[str]]
    heldout_corpus: str
    heldout_seeds: tuple[int, ...]
    batches: list[int]  # samples, from each of thresholds on (tokens)
    thresholds: list[int]
    first_point: int  # tokens
    points: int  # token counts doubling from first_point
    window_fraction: float
    min_window: int  # tokens
    multipliers: list[int] = field(default_factory=list)
    heldout_batches: int = 32  # each branch's score, the same batches for all
    train_extra: tuple[str, ...] = ()  # further train.py overrides

    @property
    def point_tokens(self) -> list[int]:
        return [self.first_point * 2**i for i in range(self.points)]

    def step_at(self, tokens: int) -> int:
        """The optimizer steps a run of the study has taken at ``tokens``."""
        ends = [*self.thresholds[1:], math.inf]
        return sum(
            (min(tokens, end) - start) // (batch * SEQ_LEN)
            for batch, start, end in zip(self.batches, self.thresholds, ends)
            if tokens > start
        )


def _shape(d_model: int, n_heads: int) -> list[str]:  # the tiny preset's 4 layers, its MLP ratio of 2.75
    return [
        f"+model.config.d_model={d_model}",
        f"+model.config.n_heads={n_heads}",
        f"+model.config.mlp_hidden={d_model * 11 // 4}",
    ]


CORPORA = {"stdlib": "default", "kjv": "kjv"}
FULL = Study(
    corpora=CORPORA,
    sizes={"d32": _shape(32, 2), "d64": ["model=tiny"]},
    seeds=(1, 2),
    heldout_size=("d128", ["model=tiny4x"]),
    heldout_corpus="stdlib",
    heldout_seeds=(1, 2),
    batches=[1, 2, 4],  # at a constant 4 the first readings sat at the floor of the grid, [4, 8]
    thresholds=[0, 131072, 524288],
    first_point=32768,
    points=8,  # to 4,194,304
    window_fraction=0.125,
    min_window=16384,
    multipliers=[1, 2, 4, 8, 16, 32, 64, 128],
)
QUICK = Study(
    corpora=CORPORA,
    sizes={"d16": _shape(16, 2), "d32": _shape(32, 2)},
    seeds=(1, 2),
    heldout_size=("d48", _shape(48, 4)),
    heldout_corpus="stdlib",
    heldout_seeds=(1,),
    batches=[1, 2],
    thresholds=[0, 16384],
    first_point=4096,
    points=4,  # to 32,768
    window_fraction=0.125,
    min_window=2048,
    multipliers=[1, 2, 4, 8, 16],
    heldout_batches=4,
    train_extra=("trainer.limit_val_batches=4",),
)


@dataclass(frozen=True)
class Run:
    corpus: str
    size: str
    seed: int
    model: list[str]
    heldout: bool = False

    @property
    def name(self) -> str:
        return f"{self.corpus}_{self.size}_s{self.seed}"


def runs_of(study: Study) -> list[Run]:
    fitted = [
        Run(corpus, size, seed, model)
        for corpus in study.corpora
        for size, model in study.sizes.items()
        for seed in study.seeds
    ]
    size, model = study.heldout_size
    return fitted + [Run(study.heldout_corpus, size, seed, model, True) for seed in study.heldout_seeds]


def commands(study: Study, run: Run, folder: Path) -> tuple[list[str], list[str]]:
    """The train.py and probe.py command lines of ``run`` in ``folder``."""
    every = math.gcd(*(study.step_at(tokens) for tokens in study.point_tokens))
    train = train_command(
        [
            "+recipe=tiny_warmup",
            "callbacks=default",
            *run.model,
            f"data={study.corpora[run.corpus]}",
            f"seed={run.seed}",
            f"batch.schedule.batch_sizes=[{','.join(map(str, study.batches))}]",
            f"batch.schedule.thresholds=[{','.join(map(str, study.thresholds))}]",
            f"model.optimizer.lr={LR_AT_16 / 4:g}",  # the sqrt rule from 3e-3 at batch 16 to batch 1
            f"max_tokens={study.point_tokens[-1]}",
            f"lr_schedule.warmup_tokens={study.first_point}",
            f"callbacks.checkpoint.every_n_train_steps={every}",
            "callbacks.checkpoint.save_last=false",
            f"val_check_tokens={study.point_tokens[-1]}",
            "plots=false",
            "trainer.enable_progress_bar=false",
            "callbacks.progress_bar=null",
            f"hydra.run.dir={folder}",
            *study.train_extra,
        ]
    )
    probe = [
        sys.executable,
        str(ROOT / "recipes" / "probe.py"),
        f"ckpt_path={folder / 'checkpoints'}",
        f"window_fraction={study.window_fraction}",
        f"probe.window_tokens={study.min_window}",
        f"probe.heldout_batches={study.heldout_batches}",
        f"probe.multipliers=[{','.join(map(str, study.multipliers))}]",
        f"hydra.run.dir={folder / 'probe'}",
    ]
    return train, probe


def keep_the_points(study: Study, folder: Path) -> None:
    """Delete the run's checkpoints but those at the study's token counts (a checkpoint every first_point tokens)."""
    steps = {study.step_at(tokens) for tokens in study.point_tokens}
    for path in (folder / "checkpoints").glob("step*.ckpt"):
        if int(path.stem.removeprefix("step")) not in steps:
            path.unlink()


def measure(study: Study, run: Run, out: Path, threads: int) -> float:
    """Train and probe ``run`` unless its folder holds the readings of these very commands; its wall seconds."""
    folder = out / "runs" / run.name
    train, probe = commands(study, run, folder)
    said = json.dumps({"train": train[1:], "probe": probe[1:]})
    done = folder / "done.json"
    if done.is_file() and json.loads(done.read_text())["commands"] == said:
        return float(json.loads(done.read_text())["seconds"])
    started = time.perf_counter()
    print(f"{run.name}: training", flush=True)
    run_logged(train, folder / "train.log", threads)
    keep_the_points(study, folder)
    print(f"{run.name}: probing {len(study.point_tokens)} checkpoints", flush=True)
    run_logged(probe, folder / "probe.log", threads)
    seconds = time.perf_counter() - started
    done.write_text(json.dumps({"commands": said, "seconds": seconds}))
    return seconds


def parameters(folder: Path) -> int:
    """The parameter count the run's train.log header states."""
    found = re.search(r"\(([\d,]+) parameters\)", (folder / "train.log").read_text())
    if found is None:
        raise SystemExit(f"{NAME}: {folder / 'train.log'} states no parameter count; did the run start?")
    return int(found.group(1).replace(",", ""))


def read_study_run(study: Study, run: Run, out: Path) -> dict:
    """The run's readings and law points; SystemExit naming what it did not do (a reading at each point, at the
    study's batch, nothing failed)."""
    folder = out / "runs" / run.name
    problems = check_run(folder)
    readings = read_readings(folder / "probe" / "cbs_probe.jsonl") if not problems else []
    tokens = [reading.tokens for reading in readings]
    if not problems and tokens != study.point_tokens:
        problems.append(f"{folder}: readings at {tokens} tokens, not the study's {study.point_tokens}")
    for reading in readings:
        expected = study.batches[sum(reading.tokens >= t for t in study.thresholds) - 1]
        if reading.batch_size != expected:
            problems.append(f"{folder}: the reading at {reading.tokens:,} tokens is at batch {reading.batch_size}")
        if reading.failed:
            problems.append(f"{folder}: branches {reading.failed} failed at {reading.tokens:,} tokens")
    refuse_unless_checked(problems, NAME)
    params = parameters(folder)
    return {
        "run": run,
        "params": params,
        "readings": readings,
        "points": law_points(readings, params, run.corpus, run.name),
        "seconds": json.loads((folder / "done.json").read_text())["seconds"],
    }


def bootstrap(runs: list[dict], covariate: str, draws: int, per_corpus: bool = False) -> dict[str, tuple[float, float]]:
    """90% intervals of the slope b and size slope c over the seeds: each draw refits on the cells' seeds resampled
    with replacement (cell: corpus and size)."""
    rng = np.random.default_rng(0)
    cells: dict[tuple[str, str], list[dict]] = {}
    for result in runs:
        cells.setdefault((result["run"].corpus, result["run"].size), []).append(result)
    found: dict[str, list[float]] = {}
    for _ in range(draws):
        points = [
            p for cell in cells.values() for i in rng.integers(len(cell), size=len(cell)) for p in cell[i]["points"]
        ]
        for corpus in sorted({p.corpus for p in points}) if per_corpus else [None]:
            chosen = [p for p in points if corpus is None or p.corpus == corpus]
            law = fit_law(chosen, covariate)
            found.setdefault(f"slope {corpus}" if corpus else "slope", []).append(law.slope)
            found.setdefault(f"size {corpus}" if corpus else "size", []).append(law.size_slope)
    return {key: (float(np.quantile(v, 0.05)), float(np.quantile(v, 0.95))) for key, v in found.items()}


def held_out(law: CBSLaw, runs: list[dict]) -> dict:
    """How many determined readings of the held-out runs the law's 90% band holds (overlaps; and by the bracket's
    geometric middle), those at the floor of the grid (an upper bound only, which any low band meets) apart."""
    rows, counts = [], {"inside": 0, "inside_by_middle": 0, "determined": 0, "floor": 0, "floor_inside": 0}
    for result in runs:
        for point in result["points"]:
            if not point.determined:
                continue
            x = point.tokens if law.covariate == "tokens" else point.loss
            low, high = (float(v[0]) for v in law.band([x], point.params, 0.9, point.corpus))
            hit = low <= point.upper and high >= point.lower
            rows.append((point.run, point.tokens, point.lower, point.upper, low, high, hit))
            if point.floor:
                counts["floor"], counts["floor_inside"] = counts["floor"] + 1, counts["floor_inside"] + hit
                continue
            centre = math.sqrt(point.lower * point.upper) if math.isfinite(point.upper) else point.lower
            counts["determined"] += 1
            counts["inside"] += hit
            counts["inside_by_middle"] += low <= centre <= high
    return {**counts, "rows": rows}


def analyse(study: Study, results: list[dict], draws: int) -> dict:
    fitted = [r for r in results if not r["run"].heldout]
    heldout = [r for r in results if r["run"].heldout]
    points = [p for r in fitted for p in r["points"]]
    fits: dict[str, dict] = {}
    for covariate in ("tokens", "loss"):
        with_size, one_curve = fit_law(points, covariate), fit_law(points, covariate, size_term=False)
        intervals = bootstrap(fitted, covariate, draws)
        fits[covariate] = {
            "law": with_size,
            "one_curve": one_curve,
            "slope": with_size.slope,
            "slope_interval": intervals["slope"],
            "size_slope": with_size.size_slope,
            "size_interval": intervals["size"],
            "one_curve_log_likelihood": one_curve.log_likelihood,
            "heldout": held_out(with_size, heldout),
        }
    # What the size term buys each law (log-likelihood with c less without): the sizes collapse onto one curve in
    # the covariate where it buys least; decided where a likelihood-ratio test at 90% keeps c in the other only.
    gain = {c: fits[c]["law"].log_likelihood - fits[c]["one_curve_log_likelihood"] for c in fits}
    collapse = min(gain, key=lambda c: gain[c])
    other = next(c for c in gain if c != collapse)
    # The same without the first point, where the fitted sizes read at the floor of the grid.
    later = [p for p in points if p.tokens > study.point_tokens[0]]
    without_first = {}
    for covariate in fits:
        law = fit_law(later, covariate)
        gain_later = law.log_likelihood - fit_law(later, covariate, size_term=False).log_likelihood
        without_first[covariate] = {"size_slope": law.size_slope, "gain": gain_later}
    per_corpus = bootstrap(fitted, "tokens", draws, per_corpus=True)
    exponents = {
        corpus: {
            "slope": fit_law([p for p in points if p.corpus == corpus]).slope,
            "interval": per_corpus[f"slope {corpus}"],
        }
        for corpus in study.corpora
    }
    lows, highs = zip(*(e["interval"] for e in exponents.values()))
    return {
        "fits": fits,
        "collapse": collapse,
        "decided": gain[collapse] < LIKELIHOOD_RATIO_90 <= gain[other],
        "gain": gain,
        "without_first": without_first,
        "exponents": exponents,
        "same_exponent": max(lows) <= min(highs),
    }


def law_summary(study: Study, results: list[dict], found: dict) -> dict:
    """law.json: the corpora, sizes, the covariate the sizes collapse in, the exponent, the held-out count."""
    tokens = found["fits"]["tokens"]
    best = found["fits"][found["collapse"]]["heldout"]
    return {
        "corpora": list(study.corpora),
        "sizes": sorted({r["params"] for r in results if not r["run"].heldout}),
        "seeds": list(study.seeds),
        "points": study.point_tokens,
        "collapse": found["collapse"],
        "collapse_decided": found["decided"],
        "size_slope": {c: {"value": f["size_slope"], "interval": f["size_interval"]} for c, f in found["fits"].items()},
        "exponent": {"value": tokens["slope"], "interval": tokens["slope_interval"]},
        "exponent_per_corpus": found["exponents"],
        "same_exponent": found["same_exponent"],
        "heldout": {
            "size": next(r["params"] for r in results if r["run"].heldout),
            "corpus": study.heldout_corpus,
            "law": found["collapse"],
            "inside": best["inside"],
            "inside_by_middle": best["inside_by_middle"],
            "determined": best["determined"],
            "floor": best["floor"],
            "floor_inside": best["floor_inside"],
            "by_law": {
                c: {k: f["heldout"][k] for k in ("inside", "inside_by_middle", "determined", "floor", "floor_inside")}
                for c, f in found["fits"].items()
            },
        },
    }


def plot(results: list[dict], found: dict, path: Path) -> None:
    """CBS against D and against the loss, per size (colour) and corpus (marker), with the fitted laws."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    sizes = sorted({r["params"] for r in results})
    colours = dict(zip(sizes, plt.get_cmap("viridis")(np.linspace(0.1, 0.85, len(sizes)))))
    markers = dict(zip(sorted({r["run"].corpus for r in results}), "os^"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, covariate in zip(axes, ("tokens", "loss")):
        for r in results:
            for p in r["points"]:
                if not p.lower and math.isinf(p.upper):
                    continue  # an interval that says nothing
                x = p.tokens if covariate == "tokens" else p.loss
                top = p.upper if math.isfinite(p.upper) else 2 * p.lower
                bottom = p.lower or top / 4  # at the floor of the grid: an upper bound, drawn down to a quarter
                width = 2 if p.determined else 0.8
                ax.plot(
                    [x, x], [bottom, top], color=colours[r["params"]], alpha=0.5, lw=width, ls=":" if p.floor else "-"
                )
                ax.plot(
                    x,
                    math.sqrt(bottom * top),
                    markers[p.corpus],
                    color=colours[r["params"]],
                    ms=4,
                    mfc="none" if r["run"].heldout else colours[r["params"]],
                )
        law = found["fits"][covariate]["law"]
        for corpus in law.corpora:
            mine = [p for r in results for p in r["points"] if p.corpus == corpus]
            for n in sizes:
                xs = [p.tokens if covariate == "tokens" else p.loss for p in mine if p.params == n]
                if xs:
                    grid = np.geomspace(min(xs), max(xs), 50)
                    low, high = law.band(grid, n, 0.9, corpus)
                    ax.plot(
                        grid, np.sqrt(low * high), color=colours[n], lw=1, ls="-" if corpus == law.corpora[0] else "--"
                    )
        ax.set(
            xscale="log",
            yscale="log",
            ylabel="CBS (tokens per step)",
            xlabel="tokens trained D" if covariate == "tokens" else "held-out loss (nats)",
            title=f"against {'D' if covariate == 'tokens' else 'the loss'}: size slope "
            f"{found['fits'][covariate]['size_slope']:+.2f}",
        )
        if covariate == "loss":
            ax.invert_xaxis()
            ax.xaxis.set_major_locator(FixedLocator([1.2, 1.4, 1.6, 1.8, 2.0, 2.4, 2.8, 3.2]))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
    handles = [plt.Line2D([], [], color=colours[n], marker="o", ls="", label=f"{n:,} parameters") for n in sizes]
    handles += [plt.Line2D([], [], color="grey", marker=m, ls="", label=c) for c, m in markers.items()]
    axes[0].legend(handles=handles, fontsize=8, loc="upper left")
    fig.suptitle(
        "The CBS read at each checkpoint (bars: intervals; hollow: the held-out size), and each law's "
        f"middle per size (solid: {found['fits']['tokens']['law'].corpora[0]}, dashed: the other corpus)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--draws", type=int, default=200, help="bootstrap draws over the seeds (default 200)")

    args = recipe_benchmark_arguments(
        NAME, __doc__.split("\n\n")[0], "2 tiny sizes, 4 points from 4,096 tokens: the code, not the answer", argv, add
    )
    study = QUICK if args.quick else FULL
    runs = runs_of(study)
    runs = [r for r in runs if r.heldout] + [r for r in runs if not r.heldout]  # the slowest first
    started, done = time.perf_counter(), 0
    if not args.report_only:

        def one(run: Run) -> float:
            nonlocal done
            seconds = measure(study, run, args.out, args.threads)
            done += 1
            print(f"[{done}/{len(runs)}] {run.name}: {seconds:.0f} s ({100 * done // len(runs)}%)", flush=True)
            return seconds

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, runs))
    results = [read_study_run(study, run, args.out) for run in runs_of(study)]
    found = analyse(study, results, 50 if args.quick else args.draws)
    summary = law_summary(study, results, found)
    (args.out / "law.json").write_text(json.dumps(summary, indent=1, default=json_default))
    found["fits"]["tokens"]["law"].save(args.out / "fitted_law.json")
    plot(results, found, args.plot)
    text = report(study, results, found, summary, args, time.perf_counter() - started)
    print(text)
    if args.markdown is not None:
        replace_section(args.markdown, NAME, text)
    return summary


def _interval(pair: tuple[float, float]) -> str:
    return f"[{pair[0]:+.3f}, {pair[1]:+.3f}]"


def report(
    study: Study, results: list[dict], found: dict, summary: dict, args: argparse.Namespace, seconds: float
) -> str:
    threads, wall = args.threads, sum(r["seconds"] for r in results)
    fits, heldout = found["fits"], summary["heldout"]
    names = {r["params"]: r["run"].size for r in results}
    lines = [
        "## Does the CBS follow the tokens or the loss? (`benchmarks.cbs_law`)",
        "",
        f"Command: `python -m benchmarks.cbs_law {' '.join(args.argv)}` at commit {git_commit()} ({args.date}; "
        f"{machine()}); {seconds / 60:.0f} min for this command. The {len(results)} runs took {wall / 3600:.2f} "
        f"hours of wall time one by one, {args.jobs} at once with {threads} thread(s) each: at most "
        f"{wall * threads / 3600:.2f} core-hours (other jobs shared the cores part of the time). Runs already in "
        f"{args.out} are reused when their commands are the same.",
        "",
        f"Each run: `recipes/train.py +recipe=tiny_warmup` at batch {study.batches} samples from "
        f"{study.thresholds} tokens (LR {LR_AT_16:g} at 16 samples, sqrt rule), {study.point_tokens[-1]:,} tokens, a "
        f"checkpoint at {study.point_tokens[0]:,} tokens and each doubling; then `recipes/probe.py` on every "
        f"checkpoint: k in {study.multipliers}, bisection, held-out loss on {study.heldout_batches} batches, epsilon "
        f"0.02 nats, 90% confidence, "
        f"a window of {study.window_fraction:g} x the checkpoint's tokens (at least {study.min_window:,}). "
        "The CBS is counted in tokens (samples x 128); the loss is the k = 1 branch's held-out loss at the window's "
        "end. Fitted: "
        + ", ".join(f"{n} ({p:,} parameters)" for p, n in sorted(names.items()) if p in summary["sizes"])
        + f" on {', '.join(study.corpora)}, seeds {list(study.seeds)}; held out: {heldout['size']:,} parameters "
        f"on {heldout['corpus']}, seeds {list(study.heldout_seeds)}.",
        "",
        "### The readings (samples; `?` undetermined at 90%)",
        "",
        "| tokens | " + " | ".join(r["run"].name for r in results) + " |",
        "|---" * (len(results) + 1) + "|",
    ]
    for i, tokens in enumerate(study.point_tokens):
        cells = [r["readings"][i].bracket.replace(" (undetermined)", " ?") for r in results]
        lines.append(f"| {tokens:,} | " + " | ".join(cells) + " |")
    determined = " | ".join(str(sum(p.determined for p in r["points"])) for r in results)
    lines += [f"| determined | {determined} |", ""]
    lines += [
        "### The fit (log CBS = a[corpus] + b log x + c log N; 90% intervals over the seeds, "
        f"{args.draws if not args.quick else 50} bootstrap draws)",
        "",
        "| x | b | b's interval | c (size) | c's interval | spread | log-likelihood | without c |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for covariate, f in fits.items():
        lines.append(
            f"| {'log D' if covariate == 'tokens' else 'log loss'} | {f['slope']:+.3f} "
            f"| {_interval(f['slope_interval'])} "
            f"| {f['size_slope']:+.3f} | {_interval(f['size_interval'])} | {f['law'].spread:.3f} "
            f"| {f['law'].log_likelihood:.1f} | {f['one_curve_log_likelihood']:.1f} |"
        )
    collapse = found["collapse"]
    other = "loss" if collapse == "tokens" else "tokens"
    gain, late = found["gain"], found["without_first"]

    def holds(covariate: str) -> str:
        low, high = fits[covariate]["size_interval"]
        return "holds 0" if low <= 0 <= high else "does not hold 0"

    factor = math.exp(fits[collapse]["size_slope"] * math.log(summary["sizes"][-1] / summary["sizes"][0]))
    verdict = (
        f"**The sizes collapse onto one curve in the {collapse}**: the size term adds {gain[collapse]:.1f} to its "
        f"log-likelihood, {gain[other]:.1f} to the {other}'s (a likelihood-ratio test at 90% keeps a term that adds "
        f"{LIKELIHOOD_RATIO_90}): " + ("decided" if found["decided"] else "not decided") + ". Over the seeds c is "
        f"{fits[collapse]['size_slope']:+.3f} {_interval(fits[collapse]['size_interval'])} in the {collapse} "
        f"(the interval {holds(collapse)}: at the same x the larger fitted size reads {factor:.2f}x the smaller's "
        f"CBS), {fits[other]['size_slope']:+.3f} {_interval(fits[other]['size_interval'])} in the {other} "
        f"({holds(other)}). Without the {study.point_tokens[0]:,}-token readings (at the floor of the grid for the "
        f"fitted sizes): c {late[collapse]['size_slope']:+.3f} in the {collapse} (adds {late[collapse]['gain']:.1f}), "
        f"{late[other]['size_slope']:+.3f} in the {other} (adds {late[other]['gain']:.1f})."
    )
    exponents = "; ".join(
        f"{corpus} {e['slope']:+.3f} {_interval(e['interval'])}" for corpus, e in found["exponents"].items()
    )
    lines += [
        "",
        verdict,
        "",
        f"The exponent b in D per corpus: {exponents}: "
        + (
            "the intervals overlap, the same exponent within the seeds' spread."
            if found["same_exponent"]
            else "the intervals do not overlap: the exponent differs between the corpora."
        ),
        "",
        "### A size it never saw",
        "",
        f"Fitted on the sizes above, each law's 90% band at the held-out {heldout['size']:,}-parameter runs' D (and "
        "their own loss, for the law in the loss); a determined reading is inside when its bracket overlaps the band "
        "(by its middle: the bracket's geometric middle lies in the band). Readings at the floor of the grid (k* the "
        "smallest k: the CBS is below twice the batch, nothing more) are counted apart: a band low enough meets them.",
        "",
        "| law | inside | by the middle | determined readings above the floor | at the floor: inside |",
        "|---|---|---|---|---|",
    ]
    for covariate, c in heldout["by_law"].items():
        lines.append(
            f"| {covariate} | {c['inside']} | {c['inside_by_middle']} | {c['determined']} "
            f"| {c['floor_inside']} of {c['floor']} |"
        )
    share = heldout["inside"] / heldout["determined"] if heldout["determined"] else float("nan")
    lines += [
        "",
        f"**Held out: {heldout['inside']} of {heldout['determined']} determined readings (above the floor) inside the "
        f"90% band of the law in the {heldout['law']}** ({share:.0%}; goal at least 80%: "
        f"{'met' if share >= 0.8 else 'missed'}).",
        "",
        "| run | tokens | reading (tokens) | band (tokens) | inside |",
        "|---|---|---|---|---|",
    ]
    for run, tokens, low, high, band_low, band_high, hit in fits[heldout["law"]]["heldout"]["rows"]:
        lines.append(
            f"| {run} | {tokens:,.0f} | {f'[{low:,.0f}' if low else '(0'}, {high:,.0f}] "
            f"| [{band_low:,.0f}, {band_high:,.0f}] "
            f"| {'yes' if hit else '**no**'} |"
        )
    lines += ["", f"![CBS against D and against the loss, per size and corpus]({args.plot.name})"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
