"""model.compile=true: each transformer block compiled in place, through batch changes that grow the
micro-batch, a CBS probe (its branches and held-out scores), validation and a resume; torch's own
counters bound the graphs compiled."""

from __future__ import annotations

import json

import pytest
import torch
from recipe_runs import compose_config
from recipe_runs import train as train_script
from torch._dynamo.utils import counters

pytestmark = pytest.mark.slow

# A smaller decoder than tiny (d_model 32, 2 layers) to keep compiling short; batch 8 -> 16 -> 32 samples of
# 128 tokens with the micro-batch (8, 16, 32, no accumulation), a probe at batch 16 (k = 2: branch micro-batch 32),
# validation on micro-batches of 4, a checkpoint every 2 steps.
COMPILED_RUN = [
    "model.compile=true",
    "+model.config.d_model=32",
    "+model.config.n_layers=2",
    "+model.config.n_heads=2",
    "data.batch_size=4",
    "batch.schedule.batch_sizes=[8,16,32]",
    "batch.schedule.thresholds=[0,2048,6144]",
    "max_tokens=14336",
    "lr_schedule.warmup_tokens=1024",
    "val_check_tokens=4096",
    "callbacks.checkpoint.every_n_train_steps=2",
    "trainer.enable_progress_bar=false",
    "callbacks.cbs_probe.geometric=[2048,100.0]",
    "callbacks.cbs_probe.window_tokens=4096",
    "callbacks.cbs_probe.multipliers=[1,2]",
    "callbacks.cbs_probe.heldout_batches=2",
    "trainer.limit_val_batches=2",
    "data.val_fraction=0.1",
    "plots=false",
]


def test_compiled_blocks_recompile_only_for_new_shapes_across_changes_a_probe_and_a_resume(prepared, tmp_path):
    torch._dynamo.reset()
    counters.clear()
    cfg = compose_config(*COMPILED_RUN, f"data.path={prepared}", output_dir=str(tmp_path / "run"))
    run = train_script.build_run(cfg)
    run.trainer.fit(run.model, datamodule=run.datamodule)
    assert [(c.new_global_batch, c.new_micro_batch_size) for c in run.batch_warmup.history] == [(16, 16), (32, 32)]
    (reading,) = [json.loads(line) for line in (tmp_path / "run" / "cbs_probe.jsonl").read_text().splitlines()]
    assert (reading["batch_size"], reading["branches_trained"]) == (16, [2.0])
    # Training: the first micro-batch size compiles a static graph, the second a dynamic one that serves every
    # later size (the branch's 32, the main run's 32); evaluation without gradients (validation, the probe's
    # held-out batches, micro-batches of 4) one more. LR changes (warmup, sqrt(2) per doubling) add none.
    graphs = counters["stats"]["unique_graphs"]
    assert 2 <= graphs <= 3, dict(counters["stats"])
    resumed = train_script.build_run(
        compose_config(*COMPILED_RUN, f"data.path={prepared}", output_dir=str(tmp_path / "resumed"))
    )
    resumed.trainer.fit(
        resumed.model, datamodule=resumed.datamodule, ckpt_path=tmp_path / "run" / "checkpoints" / "step0000004.ckpt"
    )
    assert resumed.trainer.global_step == run.trainer.global_step
    assert counters["stats"]["unique_graphs"] == graphs  # the same blocks' code: the resumed model compiles nothing new
    final, continued = (
        torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        for folder in (tmp_path / "run", tmp_path / "resumed")
    )
    assert final.keys() == continued.keys() and not any("_orig_mod" in key for key in final)  # compiled in place
    assert all(torch.equal(final[key], continued[key]) for key in final)
