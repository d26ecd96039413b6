"""Files lit_cbs 0.1.0 wrote (tests/fixtures/0.1, written by that version) read with today's names through
lit_cbs.legacy alone: its probe file, a checkpoint a run resumes from to the uninterrupted run's end, and its
batch history; no other module spells an old key."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from toys import GlobalOrderRegressionData, RegressionModule, fit_quietly, trainer_kwargs

from lit_cbs import BatchWarmup, CBSProbeCallback, PiecewiseBatch, legacy
from lit_cbs.callbacks.batch_change import BatchChange
from lit_cbs.probe.reading import ProbeReading
from lit_cbs.rules.guard import GuardVerdict
from lit_cbs.run.report import read_batch_history

FIXTURES = Path(__file__).parent / "fixtures" / "0.1"
ROOT = Path(__file__).resolve().parents[1]


def old_lines() -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / "cbs_probe.jsonl").read_text().splitlines()]


def test_the_readings_of_a_0_1_probe_file_read_with_search():
    *lines, oldest = old_lines()
    readings = [ProbeReading.from_record(line) for line in lines]
    assert [r.search for r in readings] == ["grid"] * 6 and all("strategy" in line for line in lines)
    assert [r.tokens for r in readings] == [160, 320, 480, 640, 800, 960] and readings[0].seq_len == 4
    # The oldest shape: no seq_len, epsilon or error bars; judged by the means, its bracket as it was.
    first = ProbeReading.from_record(oldest)
    assert (first.search, first.seq_len, first.epsilon) == ("grid", None, None)
    assert (first.determined, first.confidence) == (True, 0.5)
    assert (first.k_star, first.cbs_lower, first.cbs_upper, first.losses) == (1.0, 2.0, 4.0, readings[0].losses)


def test_a_0_1_checkpoint_resumes_to_where_its_run_ended(tmp_path):
    pl.seed_everything(0, verbose=False)
    guard = {"min_steps": 8, "hold": 100_000}
    warmup = BatchWarmup(PiecewiseBatch([2, 4], [0, 64], unit="samples"), lr_rule="sqrt", seq_len=4, guard=guard)
    probe = CBSProbeCallback(every_tokens=160, multipliers=(1, 2), window_tokens=64, epsilon=0.01, output_dir=tmp_path)
    trainer = pl.Trainer(callbacks=[warmup, probe], **trainer_kwargs(max_epochs=3))
    module = RegressionModule(lr=0.05, optimizer="adam")
    data = GlobalOrderRegressionData(n=96, batch_size=2)
    fit_quietly(trainer, module, datamodule=data, ckpt_path=FIXTURES / "step44.ckpt")

    final = json.loads((FIXTURES / "final.json").read_text())
    assert trainer.global_step == final["global_step"] == 88
    assert module.layer.weight.flatten().tolist() == final["weight"]  # bitwise the run 0.1.0 trained through
    # Two readings came from the checkpoint, four from this run: all six are the uninterrupted run's.
    assert probe.history == [ProbeReading.from_record(line) for line in old_lines()[:-1]]
    written = [json.loads(line) for line in (tmp_path / "cbs_probe.jsonl").read_text().splitlines()]
    assert all(line["search"] == "grid" and "strategy" not in line for line in written)
    history = read_batch_history(FIXTURES / "batch_history.json")
    assert warmup.history == [BatchChange(**change) for change in history["changes"]]
    assert warmup.guard.verdicts == [GuardVerdict(**verdict) for verdict in history["guard_verdicts"]]
    assert warmup.guard.verdicts[0].watch_steps == 8


def test_a_0_1_batch_history_reads_with_watch_steps():
    (verdict,) = read_batch_history(FIXTURES / "batch_history.json")["guard_verdicts"]
    assert "window_steps" not in verdict and GuardVerdict(**verdict).watch_steps == 8
    old = json.loads((FIXTURES / "batch_history.json").read_text())
    assert old["guard_verdicts"][0]["window_steps"] == 8  # as 0.1.0 wrote it


def test_the_checkpoint_holds_the_old_keys_it_is_read_through():
    states = torch.load(FIXTURES / "step44.ckpt", weights_only=True)["callbacks"]
    assert all("strategy" in reading for reading in states["CBSProbeCallback"]["history"])
    assert "window_steps" in states["BatchWarmup"]["guard"]["verdicts"][0]


def test_no_module_but_lit_cbs_legacy_spells_an_old_key():
    old = {*legacy.READING_KEYS, *legacy.VERDICT_KEYS, *legacy.WATCH_KEYS}
    trainer_setting = {"strategy"}  # the Trainer's own key, which these read from its config or report
    trainer_readers = {"recipes/train.py", "lit_cbs/run/job.py", "benchmarks/gpu_check.py"}
    found = []
    for path in sorted([*ROOT.glob("lit_cbs/**/*.py"), *ROOT.glob("recipes/*.py"), *ROOT.glob("benchmarks/*.py")]):
        name = str(path.relative_to(ROOT))
        if name == "lit_cbs/legacy.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in old:  # a key of a record read as a dict
                if not (node.value in trainer_setting and name in trainer_readers):
                    found.append(f"{name}:{node.lineno} {node.value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in old - trainer_setting:  # not trainer.strategy
                found.append(f"{name}:{node.lineno} .{node.attr}")
    assert not found
