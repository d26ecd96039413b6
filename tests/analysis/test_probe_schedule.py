"""schedule_from_probe on hand-made probe records, and recipes/schedule_from_probe.py end to end: the
batch config it writes composes with train.py's config and instantiates to the schedule, with the
measured run's micro-batch growth; a forecast from too few readings warns in one line each."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from launch import run_forked
from recipe_runs import compose_config
from toys import probe_reading

from lit_cbs import BatchWarmup
from lit_cbs.analysis import schedule_from_probe
from lit_cbs.probe.reading import ProbeReading
from lit_cbs.rules.batch_schedules import PiecewiseBatch
from lit_cbs.run.job import batch_warmup_of

ROOT = Path(__file__).resolve().parents[2]


def reading(tokens: int, lower: float, **fields) -> ProbeReading:
    """A reading at batch 16 of the CBS in [lower, 2 x lower] samples, without its sequence length (as the first
    readings were) unless ``fields`` give it."""
    return probe_reading(tokens, lower, 2 * lower, **{"seq_len": None, **fields})


def write_jsonl(path: Path, readings: list[ProbeReading]) -> Path:
    path.write_text("".join(json.dumps(dataclasses.asdict(reading)) + "\n" for reading in readings))
    return path


def test_batch_doubles_where_the_lower_bound_reaches_it_in_any_order():
    records = [reading(2_000_000, 128), reading(65_536, 16), reading(1_000_000, 64), reading(500_000, 32)]
    schedule = schedule_from_probe(records, start=16)
    assert isinstance(schedule, PiecewiseBatch) and schedule.unit == "tokens"
    assert schedule.batch_sizes == [16, 32, 64, 128]
    assert schedule.thresholds == [0, 500_000, 1_000_000, 2_000_000]
    assert schedule.batch_size(499_999) == 16 and schedule.batch_size(500_000) == 32


def test_a_jump_skips_sizes_and_a_bound_between_sizes_rounds_down():
    schedule = schedule_from_probe([reading(100, 16), reading(300, 100)], start=16)
    assert schedule.batch_sizes == [16, 64] and schedule.thresholds == [0, 300]  # 100 -> the largest 16 x 2^n below it


def test_a_dip_keeps_the_batch():
    records = [reading(100, 64), reading(200, 16), reading(300, 32), reading(400, 128)]
    schedule = schedule_from_probe(records, start=16)
    assert schedule.batch_sizes == [16, 64, 128] and schedule.thresholds == [0, 100, 400]
    assert [schedule.batch_size(t) for t in (150, 250, 350)] == [64, 64, 64]


def test_final_caps_the_batch():
    schedule = schedule_from_probe([reading(100, 64), reading(200, 1024)], start=16, final=32)
    assert schedule.batch_sizes == [16, 32] and schedule.thresholds == [0, 100]


def test_factor_4_and_a_reading_at_zero_tokens_sets_the_first_batch():
    schedule = schedule_from_probe([reading(0, 64), reading(100, 1000)], start=16, factor=4)
    assert schedule.batch_sizes == [64, 256] and schedule.thresholds == [0, 100]


def test_undetermined_readings_are_skipped():
    records = [
        reading(100, 64, determined=False),
        reading(200, 32, determined=True),
        reading(300, 256, determined=False),
        reading(400, 64),
    ]
    schedule = schedule_from_probe(records, start=16)
    assert schedule.batch_sizes == [16, 32, 64] and schedule.thresholds == [0, 200, 400]


def test_only_undetermined_readings_keep_start_and_warn():
    message = "every reading in probe readings is undetermined; the schedule stays at start=16"
    with pytest.warns(UserWarning, match=message):
        schedule = schedule_from_probe([reading(100, 64, determined=False)], start=16)
    assert schedule.batch_sizes == [16] and schedule.thresholds == [0]


def test_two_seeds_at_the_same_point_count_by_the_smaller_bound():
    records = [reading(100, 64), reading(100, 32), reading(200, 128), reading(200, 128)]
    schedule = schedule_from_probe(records, start=16)
    assert schedule.batch_sizes == [16, 32, 128] and schedule.thresholds == [0, 100, 200]


def test_margin_switches_only_where_the_bound_clears_the_batch():
    records = [reading(100, 32), reading(200, 64), reading(300, 128)]
    assert schedule_from_probe(records, start=16).batch_sizes == [16, 32, 64, 128]
    cautious = schedule_from_probe(records, start=16, margin=2)
    assert cautious.batch_sizes == [16, 32, 64] and cautious.thresholds == [0, 200, 300]
    # 1.5: 48 clears 1.5 x 32 but not 1.5 x 64.
    assert schedule_from_probe([reading(100, 48), reading(200, 95)], start=16, margin=1.5).batch_sizes == [16, 32]


def test_sequence_length_is_converted_through_tokens():
    # 128 samples of 128 tokens (16,384 tokens) are 32 samples of 512 and 512 samples of 32.
    records = [reading(100, 128)]
    assert schedule_from_probe(records, start=8, seq_len=512, measured_seq_len=128).batch_sizes == [8, 32]
    assert schedule_from_probe(records, start=16, seq_len=32, measured_seq_len=128).batch_sizes == [16, 512]
    # The record's own seq_len serves as the measured one.
    assert schedule_from_probe([reading(100, 128, seq_len=128)], start=8, seq_len=512).batch_sizes == [8, 32]
    # Without seq_len the target reads samples of the measured length.
    assert schedule_from_probe(records, start=16, measured_seq_len=128).batch_sizes == [16, 128]


def test_reads_a_jsonl_file(tmp_path):
    path = write_jsonl(tmp_path / "cbs_probe.jsonl", [reading(300, 64), reading(100, 32)])
    schedule = schedule_from_probe(path, start=16)
    assert schedule.batch_sizes == [16, 32, 64] and schedule.thresholds == [0, 100, 300]


@pytest.mark.parametrize(
    "records, kwargs, message",
    [
        ([], {}, r"source holds no CBS probe reading"),
        ([{"cbs_lower": 32}], {}, r"probe readings\[0\]: \{'cbs_lower': 32\} is not a ProbeReading; read a"),
        (
            [reading(None, 32)],
            {},
            r"probe readings\[0\]: tokens=None is not a number >= 0; every determined probe reading needs tokens",
        ),
        ([reading(1, 4)], {"start": 0}, r"start=0 must be an int >= 1"),
        ([reading(1, 4)], {"factor": 1}, r"factor=1 must be an int >= 2"),
        ([reading(1, 4)], {"factor": 1.5}, r"factor=1.5 must be an int >= 2"),
        ([reading(1, 4)], {"final": 8}, r"final=8 must be an int >= 16"),
        ([reading(1, 4)], {"final": 48}, r"final=48 must be start=16 times a power of factor=2; nearest: 32 or 64"),
        ([reading(1, 4)], {"margin": 0.5}, r"margin=0.5 must be a number >= 1"),
        (
            [reading(1, 4)],
            {"seq_len": 512},
            r"seq_len=512 needs the measured run's sequence length: pass measured_seq_len",
        ),
        (
            [reading(1, 4, seq_len=128)],
            {"seq_len": 512, "measured_seq_len": 256},
            r"seq_len=128 but measured_seq_len=256",
        ),
        ([reading(1, 4)], {"seq_len": 0, "measured_seq_len": 128}, r"seq_len=0 must be an int >= 1"),
    ],
)
def test_bad_input_is_named(records, kwargs, message):
    with pytest.raises(ValueError, match=message):
        schedule_from_probe(records, **{"start": 16, **kwargs})


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read CBS probe readings from .*missing.jsonl"):
        schedule_from_probe(tmp_path / "missing.jsonl", start=16)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty.jsonl holds no CBS probe reading"):
        schedule_from_probe(empty, start=16)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(dataclasses.asdict(reading(1, 4))) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not JSON"):
        schedule_from_probe(broken, start=16)


def run_command(*args) -> subprocess.CompletedProcess:
    """recipes/schedule_from_probe.py as a forked copy of this process (tests/launch.py)."""
    return run_forked(ROOT / "recipes" / "schedule_from_probe.py", *map(str, args), cwd=ROOT, capture_output=True)


@pytest.mark.slow
def test_command_writes_a_batch_config_train_py_composes_with(tmp_path):
    seed1 = write_jsonl(tmp_path / "seed1.jsonl", [reading(65_536, 16), reading(524_288, 32), reading(1_048_576, 128)])
    seed2 = write_jsonl(tmp_path / "seed2.jsonl", [reading(65_536, 16), reading(524_288, 64), reading(1_048_576, 64)])
    conf = tmp_path / "conf"
    done = run_command(seed1, seed2, "--start", 16, "--final", 64, "--out", conf / "batch" / "measured.yaml")
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "measured.yaml" in done.stdout
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "output_dir=/nonexistent/run",
                f"hydra.searchpath=[file://{conf}]",
                "+recipe=tiny4x_warmup",
                "batch=measured",
            ],
            return_hydra_config=True,
        )
    assert cfg.model.config.preset == "tiny4x" and "cbs_probe" not in cfg.callbacks  # train the big one with no probe
    warmup = batch_warmup_of(cfg)  # BatchWarmup from the batch group, as recipes/train.py builds it
    assert isinstance(warmup, BatchWarmup)
    schedule = warmup.schedule
    assert isinstance(schedule, PiecewiseBatch) and schedule.unit == "tokens"
    # 524,288 tokens: the seeds read 32 and 64, the smaller counts; 1,048,576: 64 and 128, capped at 64 anyway.
    assert schedule.batch_sizes == [16, 32, 64] and schedule.thresholds == [0, 524_288, 1_048_576]


def test_command_bad_input_is_one_line(tmp_path, capsys, recipe_script):
    # In-process (the command's main), so the check does not pay for a Python start per case.
    command = recipe_script("schedule_from_probe")
    probe = write_jsonl(tmp_path / "cbs_probe.jsonl", [reading(100, 64)])
    assert command.main([str(probe), "--start", "16", "--final", "48", "--out", str(tmp_path / "measured.yaml")]) == 2
    assert not (tmp_path / "measured.yaml").exists()
    assert (
        capsys.readouterr().err.strip()
        == "schedule_from_probe.py: final=48 must be start=16 times a power of factor=2; nearest: 32 or 64"
    )
    assert (
        command.main([str(tmp_path / "nothing.jsonl"), "--start", "16", "--out", str(tmp_path / "measured.yaml")]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read CBS probe readings" in err


RUN_CONFIGS = {  # what a recipe run saved beside its cbs_probe.jsonl, reduced to the key the command reads
    "resolved_config.yaml": "batch:\n  max_micro_batch_size: 32\n",
    # Hydra's own copy keeps interpolations: the olmo recipes set the cap to the micro-batch.
    ".hydra/config.yaml": "data:\n  batch_size: 8\nbatch:\n  max_micro_batch_size: ${data.batch_size}\n",
}


@pytest.mark.parametrize(
    "config, cap, said",
    [
        (None, 64, "max_micro_batch_size 64: the default of conf/batch/warmup.yaml"),
        ("resolved_config.yaml", 32, "max_micro_batch_size 32: the measured run's batch.max_micro_batch_size"),
        (".hydra/config.yaml", 8, "max_micro_batch_size 8: the measured run's batch.max_micro_batch_size"),
    ],
)
def test_the_written_config_keeps_the_measured_runs_micro_batch_growth(tmp_path, recipe_script, config, cap, said):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    probe = write_jsonl(run / "cbs_probe.jsonl", [reading(65_536, 16), reading(524_288, 32)])
    if config is not None:
        (run / config).write_text(RUN_CONFIGS[config])
    out = tmp_path / "conf" / "batch" / "measured.yaml"
    command = recipe_script("schedule_from_probe")
    assert command.main([str(probe), "--start", "16", "--final", "64", "--out", str(out)]) == 0
    assert said in out.read_text()
    # What the file makes a recipe run do: BatchWarmup grows the micro-batch up to the cap, as batch=warmup does.
    warmup = batch_warmup_of(
        compose_config(f"hydra.searchpath=[file://{out.parents[1]}]", "+recipe=tiny4x_warmup", "batch=measured")
    )
    assert warmup.max_micro_batch_size == cap and warmup.schedule.batch_sizes == [16, 32]


def test_runs_that_grew_their_micro_batch_differently_need_the_option(tmp_path, capsys, recipe_script):
    command = recipe_script("schedule_from_probe")
    probes = []
    for name, cap in (("a", 32), ("b", 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "resolved_config.yaml").write_text(f"batch:\n  max_micro_batch_size: {cap}\n")
        probes.append(str(write_jsonl(tmp_path / name / "cbs_probe.jsonl", [reading(65_536, 16)])))
    out = tmp_path / "measured.yaml"
    assert command.main([*probes, "--start", "16", "--out", str(out)]) == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the measured runs' batch.max_micro_batch_size differ: 32" in err
    assert err.strip().endswith("pick one with --max-micro-batch-size")
    assert command.main([*probes, "--start", "16", "--out", str(out), "--max-micro-batch-size", "16"]) == 0
    assert "max_micro_batch_size: 16" in out.read_text().splitlines()


@pytest.mark.slow
def test_a_forecast_from_two_readings_far_past_them_warns_in_one_line_each(tmp_path):
    # The default job's two readings, forecast 8x past the last: what the command prints, from its own process.
    # Readings without per-batch losses keep their own brackets: [32, 64] and [128, 256].
    readings = [reading(524_288, 32), reading(2_097_152, 128)]
    probe = write_jsonl(tmp_path / "cbs_probe.jsonl", readings)
    done = run_command(probe, "--start", 16, "--forecast-to", 16_777_216, "--out", tmp_path / "forecast.yaml")
    assert done.returncode == 0, done.stderr
    first, second = done.stderr.splitlines()
    assert first.startswith("warning: forecast_cbs: readings at 2 token counts") and "probe at 3 or more" in first
    assert second.startswith("warning: schedule_from_forecast: until_tokens=16,777,216 is 8.0x past the last reading")
    assert "posterior predictive band" in (tmp_path / "forecast.yaml").read_text()
