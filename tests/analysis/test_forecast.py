"""lit_cbs.analysis.forecast: the interval each probe record supports (at the epsilon it was measured at),
the interval-censored fit of CBS(D) that recovers a known power law and a plateau from simulated brackets
within its band, and a band that carries the fit's own uncertainty: wide, or warned about, where the
readings are few or far away, and near its nominal coverage on simulated runs."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from toys import trainer_kwargs

from benchmarks.forecast_coverage import SCENARIOS, simulated_coverage, simulated_run
from lit_cbs import BatchWarmup, ConstantBatch, GradientNoiseScale
from lit_cbs.analysis.forecast import (
    Bracket,
    brackets_from_records,
    forecast_cbs,
    growth_exponent,
    noise_scale_over_tokens,
    schedule_from_forecast,
    supported_interval,
)
from lit_cbs.data.synthetic import RandomTokenData
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.models.lm import CausalLM
from lit_cbs.probe.reading import BranchScore, ProbeReading

ROOT = Path(__file__).resolve().parents[2]


# Two runs' readings (tokens, bracket in samples), as docs/benchmarks/cbs_probe.md and the transfer benchmark gave them.
FLAT_START = [(65_536, 16, 32), (591_872, 16, 32), (1_118_208, 64, 128), (2_097_152, 128, 256)]  # tiny_cbs_curve
GROWING = [(65_536, 16, 32), (329_728, 32, 64), (593_920, 64, 128), (1_048_576, 64, 128)]  # tiny4x, seed 1


def simulated_brackets(cbs, tokens, runs: int, spread: float, seed: int) -> list[Bracket]:
    """Each run reads log CBS(D) + Normal(0, spread) at each D, bracketed on the grid 1, 2, 4, ... samples."""
    rng = np.random.default_rng(seed)
    return [b for run in range(runs) for b in simulated_run(cbs, tokens, spread, rng, run=f"seed{run}")[1]]


def power(d):
    return 16 * (d / 1e6) ** 0.5


def plateau(d):
    return 1 / (1 / (16 * (d / 1e6) ** 0.7) + 1 / 256)


TOKENS = np.geomspace(1e5, 1e8, 10)


def test_a_power_law_is_recovered_within_its_band():
    forecast = forecast_cbs(simulated_brackets(power, TOKENS, runs=3, spread=0.2, seed=1), model="auto")
    assert forecast.model == "power"
    assert forecast.exponent == pytest.approx(0.5, abs=0.08)
    low, high = forecast.band(TOKENS)
    assert np.all((low <= power(TOKENS)) & (power(TOKENS) <= high))
    # Past the last reading the band widens, and still holds the true curve at 10x the tokens.
    far_low, far_high = forecast.band(1e9)
    assert far_low[0] <= power(1e9) <= far_high[0] and far_high[0] / far_low[0] > high[-1] / low[-1]
    assert np.shape(forecast.predict(1e9)) == () and forecast.predict(TOKENS).shape == TOKENS.shape  # as it was given


def test_a_plateau_is_found_and_placed():
    tokens = np.geomspace(1e5, 1e9, 12)
    forecast = forecast_cbs(simulated_brackets(plateau, tokens, runs=3, spread=0.15, seed=2), model="auto")
    assert (
        forecast.model == "plateau"
        and forecast.heldout_log_likelihood["plateau"] > forecast.heldout_log_likelihood["power"]
    )
    assert forecast.plateau == pytest.approx(256, rel=0.5)
    low, high = forecast.band(tokens)
    assert np.all((low <= plateau(tokens)) & (plateau(tokens) <= high))


def test_the_band_covers_held_out_brackets_at_about_its_coverage():
    # Fit on the first half of each of 4 runs' readings, check the later readings of 4 other runs.
    early = simulated_brackets(power, TOKENS[:6], runs=4, spread=0.2, seed=3)
    later = simulated_brackets(power, TOKENS[6:], runs=4, spread=0.2, seed=4)
    forecast = forecast_cbs(early, coverage=0.8)
    covered = sum(forecast.covers(bracket) for bracket in later) / len(later)
    assert covered >= 0.8


def test_two_readings_of_one_run_warn_and_the_band_widens_past_them():
    # tiny_cbs_curve's first two readings, both [16, 32] (65,536 and 591,872 tokens): a curve through two
    # brackets is not tested by them, and the forecast says so. The run then read [64, 128] and [128, 256],
    # where the band the forecast had before (a bootstrap of the two, its spread at its floor) said [20, 26].
    flat = [Bracket(t, lo, hi, "curve") for t, lo, hi in FLAT_START]
    with pytest.warns(UserWarning, match=r"readings at 2 token counts spanning 9.0x .* cannot test the curve's shape"):
        forecast = forecast_cbs(flat[:2])
    low, high = forecast.band([b.tokens for b in flat[2:]])
    low_there, high_there = forecast.band(flat[1].tokens)  # at the last reading
    assert np.all(high / low > 2.5) and np.all(high / low > high_there / low_there)
    # tiny4x's first two readings, [16, 32] then [32, 64] at 329,728 tokens: the band holds its two later readings.
    growing = [Bracket(t, lo, hi, "tiny4x") for t, lo, hi in GROWING]
    with pytest.warns(UserWarning, match="cannot test the curve's shape"):
        forecast = forecast_cbs(growing[:2])
    assert [forecast.covers(b) for b in growing[2:]] == [True, True]


def test_a_schedule_far_past_two_readings_follows_a_wide_band_and_warns():
    # The default job's two readings: the bootstrap band at 8x past the last was 2,436 [2,143, 2,769] samples.
    with pytest.warns(UserWarning, match="readings at 2 token counts"):
        forecast = forecast_cbs([Bracket(524_288, 32, 64, "default"), Bracket(2_097_152, 128, 256, "default")])
    low, high = forecast.band(16_777_216)
    assert high[0] / low[0] > 4
    with pytest.warns(UserWarning, match=r"until_tokens=16,777,216 is 8.0x past .* readings span \(4.0x\)"):
        schedule, changes = schedule_from_forecast(forecast, 16, 16_777_216)
    # Each change waits until the band's lower edge reaches the new batch.
    assert changes and all(change.band_low >= change.batch for change in changes)
    assert schedule.batch_sizes[-1] <= low[0]


def test_the_band_widens_with_the_distance_from_the_readings():
    brackets = simulated_brackets(power, TOKENS[:4], runs=1, spread=0.15, seed=5)  # 4 readings over 10x in tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # enough readings: no warning
        forecast = forecast_cbs(brackets)
    low, high = forecast.band(TOKENS[3] * np.array([1, 2, 4, 8, 16]))
    assert np.all(np.diff(np.log(high / low)) > 0)


def test_the_band_holds_simulated_readings_at_about_its_coverage():
    # 20 runs of a known power law read with a spread of 0.15 (like the real readings), each fitted on its first
    # 2 and on its first 3 readings: the share of the 140 values read later that the 80% band holds (the
    # bootstrap band before held 34%: none from 2 readings). benchmarks.forecast_coverage measures 200 runs
    # per row (docs/RESULTS.md); 140 points, correlated within a run, leave a loose tolerance.
    by_n = simulated_coverage(SCENARIOS[0], seeds=20, fit_sizes=(2, 3))
    assert [by_n[n]["points"] for n in (2, 3)] == [80, 60] and [by_n[n]["warned"] for n in (2, 3)] == [20, 0]
    assert all(by_n[n]["read"] / by_n[n]["points"] >= 0.7 for n in (2, 3))
    assert 0.7 <= sum(c["read"] for c in by_n.values()) / 140 <= 0.95


def reading(batch_losses: dict[float, list[float]], confidence=0.9, epsilon=0.01) -> ProbeReading:
    scores = {k: BranchScore.heldout(losses) for k, losses in batch_losses.items()}
    return ProbeReading.decide(
        scores,
        epsilon,
        confidence,
        sorted(batch_losses),
        16,
        tokens=65536,
        step=10,
        seq_len=128,
        window_tokens=8192,
        search="grid",
        evaluate="heldout",
        main_loss=3.0,
        branches_trained=sorted(batch_losses),
        failed=[],
        tokens_spent=8192,
        overhead=0.1,
    )


def jsonl(readings: list[ProbeReading], without: str | None = None) -> str:
    """The readings as lines of cbs_probe.jsonl, without the field ``without`` (as a version that wrote none)."""
    records = [{key: value for key, value in dataclasses.asdict(r).items() if key != without} for r in readings]
    return "".join(json.dumps(record) + "\n" for record in records)


def test_a_determined_record_supports_its_bracket_and_an_undetermined_one_a_wider_interval():
    rng = np.random.default_rng(0)
    base = 3.0 + rng.normal(0, 0.05, size=16)
    # k = 2 within 0.001 of k = 1 on every batch, k = 4 0.1 worse: k* = 2, determined.
    clear = reading({1: list(base), 2: list(base + 0.001), 4: list(base + 0.1)})
    assert clear.determined and supported_interval(clear) == (32.0, 64.0) == (clear.cbs_lower, clear.cbs_upper)
    # k = 2 and 4 by about epsilon, with batch noise: the means pick k* = 4, the data cannot tell k = 2 from 4.
    noisy = reading(
        {
            1: list(base),
            2: list(base + 0.009 + rng.normal(0, 0.02, 16)),
            4: list(base + 0.011 + rng.normal(0, 0.02, 16)),
        }
    )
    assert not noisy.determined
    lower, upper = supported_interval(noisy)
    assert (
        lower <= noisy.cbs_lower
        and upper >= (noisy.cbs_upper or math.inf)
        and (lower, upper) != (noisy.cbs_lower, noisy.cbs_upper)
    )
    (bracket,) = brackets_from_records([noisy], run="seed1")
    assert (bracket.tokens, bracket.lower, bracket.upper, bracket.determined) == (65536.0, lower, upper, False)


def readings_without_epsilon() -> list[ProbeReading]:
    """The default job's two readings at epsilon 0.02 nats, as the version before readings stored their epsilon
    wrote them: at 524,288 tokens k = 2 is 0.009 nats worse than k = 1 (paired SE 0.0015), surely within 0.02
    but not surely within 0.01; at 2,097,152 tokens k = 8 within 0.001 nats, k = 16 0.1 worse."""
    base = 3.0 + np.random.default_rng(0).normal(0, 0.05, size=16)
    wobble = 0.006 * (-1.0) ** np.arange(16)
    early = reading({1: list(base), 2: list(base + 0.009 + wobble), 4: list(base + 0.1)}, epsilon=0.02)
    late = reading({k: list(base + (0.001 if k <= 8 else 0.1)) for k in (1, 2, 4, 8, 16)}, epsilon=0.02)
    return [dataclasses.replace(r, tokens=tokens, epsilon=None) for r, tokens in ((early, 524_288), (late, 2_097_152))]


def test_a_record_without_its_epsilon_is_refused_not_judged_at_a_guess():
    early, late = readings_without_epsilon()
    with pytest.raises(LitCBSConfigError, match=r"run: reading 1 holds no epsilon .* as epsilon= \(recipes/"):
        brackets_from_records([early, late])
    assert [(b.lower, b.upper) for b in brackets_from_records([early, late], epsilon=0.02)] == [(32, 64), (128, 256)]
    assert supported_interval(early, epsilon=0.01) == (16.0, 64.0)  # what the 0.01 assumed before made of it
    assert supported_interval(dataclasses.replace(early, epsilon=0.02), epsilon=0.01) == (32.0, 64.0)  # its own wins


@pytest.mark.parametrize("config", [None, "resolved_config.yaml", ".hydra/config.yaml"])
def test_the_command_reads_old_records_at_the_runs_epsilon(tmp_path, capsys, recipe_script, config):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    probe = run / "cbs_probe.jsonl"
    probe.write_text(jsonl(readings_without_epsilon(), without="epsilon"))
    if config is not None:  # the run's saved configuration, reduced to the key the command reads
        (run / config).write_text("callbacks:\n  cbs_probe:\n    epsilon: 0.02\n")
    out = tmp_path / "conf" / "batch" / "forecast.yaml"
    command = recipe_script("schedule_from_probe")
    argv = [str(probe), "--start", "16", "--forecast-to", "4194304", "--out", str(out)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two readings: the forecast warns (tested above)
        done = command.main(argv)
        if config is None:
            err = capsys.readouterr().err
            assert done == 2 and not out.exists() and err.count("\n") == 1
            assert "reading 1 holds no epsilon" in err and "(recipes/schedule_from_probe.py: --epsilon)" in err
            done = command.main([*argv, "--epsilon", "0.02"])
        expected = forecast_cbs([Bracket(524_288, 32, 64, str(probe)), Bracket(2_097_152, 128, 256, str(probe))])
    assert done == 0, capsys.readouterr().err
    text = out.read_text()
    source = "--epsilon" if config is None else str(run / config)
    assert f"records without an epsilon at 0.02 nats ({source})" in text and expected.describe() in text


@pytest.mark.parametrize(
    "readings, message",
    [
        ([dataclasses.replace(reading({1: [3.0]}), tokens=None)], "run: reading 1: tokens=None must be a number > 0"),
        ([{"tokens": 1, "losses": {"1": 3.0}}], r"run: reading 1: \{'tokens': 1, .* is not a ProbeReading; read a"),
        ([], "run: no probe reading"),
    ],
)
def test_bad_readings_fail_naming_the_reading(readings, message):
    with pytest.raises(ValueError, match=message):
        brackets_from_records(readings)


def test_readings_of_two_sequence_lengths_are_refused():
    rng = np.random.default_rng(0)
    base = list(3.0 + rng.normal(0, 0.05, size=8))
    readings = [reading({1: base, 2: base}), dataclasses.replace(reading({1: base, 2: base}), seq_len=256)]
    with pytest.raises(ValueError, match=r"readings of seq_len \['128', '256'\] mixed"):
        brackets_from_records(readings)


@pytest.mark.parametrize(
    "brackets, kwargs, message",
    [
        ([Bracket(1e6, 16, 32, "a")] * 3, {}, "readings at 1 token count"),
        ([Bracket(1e6, 16, math.inf, "a"), Bracket(2e6, 32, math.inf, "a")], {}, "no reading has an upper end"),
        ([Bracket(1e6, 32, 16, "a"), Bracket(2e6, 32, 64, "a")], {}, "needs tokens > 0 and 0 < lower < upper"),
        (
            [Bracket(1e6, 16, 32, "a"), Bracket(2e6, 32, 64, "a")],
            {"coverage": 1.0},
            r"coverage=1.0 must lie in \(0, 1\)",
        ),
        (
            [Bracket(1e6, 16, 32, "a"), Bracket(2e6, 32, 64, "a")],
            {"model": "plateau"},
            "needs readings at 4 or more token counts",
        ),
    ],
)
def test_bad_brackets_and_settings_fail_clearly(brackets, kwargs, message):
    with pytest.raises(ValueError, match=message):
        forecast_cbs(brackets, **kwargs)


def run_readings(seed: int) -> list[ProbeReading]:
    """Probe readings of a run whose CBS is 16 (D / 65,536)^0.5 samples: at each probe (batch 16, k = 1..16)
    the k whose batch is within the CBS train to within 0.001 nats of k = 1, the larger ones 0.1 worse."""
    rng = np.random.default_rng(seed)
    readings = []
    for j in range(6):
        tokens = 65_536 * 2**j
        cbs = 16 * 2 ** (j / 2) * math.exp(rng.normal(0, 0.15))
        base = 3.0 - 0.1 * j + rng.normal(0, 0.05, size=16)
        losses = {
            k: list(base + (0.001 if 16 * k <= cbs else 0.1) + rng.normal(0, 0.001, 16)) for k in (1, 2, 4, 8, 16)
        }
        readings.append(dataclasses.replace(reading(losses), tokens=tokens))
    return readings


def test_the_command_writes_a_forecast_schedule_and_its_plot(tmp_path, capsys, recipe_script):
    command = recipe_script("schedule_from_probe")
    files = []
    for seed in (1, 2):
        path = tmp_path / f"seed{seed}.jsonl"
        path.write_text(jsonl(run_readings(seed)))
        files.append(str(path))
    out, plot = tmp_path / "conf" / "batch" / "forecast.yaml", tmp_path / "forecast.png"
    done = command.main(
        [*files, "--start", "16", "--final", "256", "--forecast-to", "16777216", "--out", str(out), "--plot", str(plot)]
    )
    assert done == 0, capsys.readouterr().err
    text = out.read_text()
    assert "--forecast-to 16,777,216" in text and "from 12 readings of" in text and "band" in text
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["output_dir=/nonexistent/run", f"hydra.searchpath=[file://{out.parents[1]}]", "batch=forecast"],
        )
    schedule = instantiate(cfg.batch.schedule)
    # Past the last probe (2,097,152 tokens, where the runs read [64, 128]) the forecast goes on growing the batch.
    assert schedule.batch_sizes[0] == 16 and schedule.batch_sizes[-1] >= 128 and schedule.thresholds[-1] > 2_097_152
    assert plot.stat().st_size > 10_000


def test_the_command_refuses_a_plot_without_a_forecast(tmp_path, capsys, recipe_script):
    command = recipe_script("schedule_from_probe")
    path = tmp_path / "run.jsonl"
    path.write_text(jsonl(run_readings(1)[:1]))
    assert (
        command.main([str(path), "--start", "16", "--out", str(tmp_path / "a.yaml"), "--plot", str(tmp_path / "a.png")])
        == 2
    )
    refusal = "--plot, --noise-scale and --epsilon go with the forecast: give --forecast-to TOKENS too"
    assert capsys.readouterr().err.strip() == f"schedule_from_probe.py: {refusal}"
    assert not (tmp_path / "a.yaml").exists()


def test_the_noise_scale_of_a_real_run_goes_beside_the_forecast(tmp_path, capsys, recipe_script):
    # 12 steps of 2 micro-batches of 4 sequences of 16 tokens, GradientNoiseScale and tokens_seen logged every step.
    pl.seed_everything(0, verbose=False)
    model = {
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 2,
        "mlp_hidden": 64,
        "context_length": 16,
        "tie_embeddings": False,
    }
    logger = CSVLogger(tmp_path, name="run", version=0)
    callbacks = [BatchWarmup(ConstantBatch(8), lr_rule="none"), GradientNoiseScale(ema_decay=0.5)]
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_steps=12, logger=logger, log_every_n_steps=1))
    trainer.fit(CausalLM(model), RandomTokenData(vocab_size=64, seq_len=16, batch_size=4, samples=256))
    metrics_csv = tmp_path / "run" / "version_0" / "metrics.csv"
    tokens, b_simple = noise_scale_over_tokens(metrics_csv)
    assert (
        len(tokens) == 12 and list(tokens) == [128.0 * step for step in range(1, 13)] and np.all(np.isfinite(b_simple))
    )

    files = []
    for seed in (1, 2):
        path = tmp_path / f"seed{seed}.jsonl"
        path.write_text(jsonl(run_readings(seed)))
        files.append(str(path))
    command = recipe_script("schedule_from_probe")
    done = command.main(
        [
            *files,
            "--start",
            "16",
            "--forecast-to",
            "4194304",
            "--out",
            str(tmp_path / "f.yaml"),
            "--plot",
            str(tmp_path / "f.png"),
            "--noise-scale",
            str(metrics_csv),
        ]
    )
    assert done == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert (
        f"noise scale B_simple grows as D^{growth_exponent(tokens, b_simple):.3f}" in printed
        and "the CBS fit as D^" in printed
    )
    without = tmp_path / "without_gns.csv"  # the same run's steps and tokens, no noise scale
    without.write_text("step,tokens_seen\n" + "".join(f"{step},{int(t)}\n" for step, t in enumerate(tokens)))
    with pytest.raises(
        ValueError, match="has no 'gns/b_simple'; pass the metrics.csv of a run with GradientNoiseScale"
    ):
        noise_scale_over_tokens(without)
