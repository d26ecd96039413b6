"""BatchWarmup with 2 CPU processes: DDP (ddp_spawn, gloo) and FSDP2 (ModelParallelStrategy).

Both runs use the same batch growth, 4 -> 8 -> 16 global samples with micro-batch 2 on 2 ranks
(accumulate 1 -> 2 -> 4), over 2 epochs of 96 samples. Each rank saves what it recorded; the test
joins the ranks and checks the invariants that every step averages exactly the scheduled samples and none is lost on global quantities: every optimizer step
averages exactly the scheduled global batch, split across ranks with no overlap, in the sampler's
order, and the gradient both ranks step with is the exact mean over those samples; the LR follows
lr_rule="linear" (invariant 3) identically on both ranks.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import subprocess_env
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DistributedSampler
from toys import IndexedRegression, RegressionData, RegressionModule, mean_gradient, trainer_kwargs

from lit_cbs import BatchWarmup, ConstantBatch, PiecewiseBatch

WORLD_SIZE = 2
SAMPLES = 96  # per epoch, both ranks together
MICRO_BATCH_SIZE = 2  # samples per rank
EPOCHS = 2
SEQ_LEN = 4  # tokens per sample
BASE_LR = 0.05  # both modules' SGD learning rate; lr_rule="linear" scales it with the global batch
# Global batch per optimizer step (samples): 4 until 40 samples; 8 from step 10; 16 asked for at
# 120 samples (step 20, 6 micro-batches into epoch 1, not divisible by accumulate 4), applied at step 21.
EXPECTED_GLOBAL_BATCHES = [4] * 10 + [8] * 11 + [16] * 4
EXPECTED_CHANGES = [  # (step, old, new global batch, samples requested at, samples applied at)
    (10, 4, 8, 40, 40),
    (21, 8, 16, 120, 128),
]
SCRIPTS = Path(__file__).parent / "scripts"


class SaveRecords(Callback):
    """Saves each rank's RegressionModule and BatchWarmup records to ``outdir/rank{rank}.pt``.

    ddp_spawn runs fit in child processes and returns no callback or module state to the parent.
    """

    def __init__(self, outdir: Path):
        self.outdir = outdir

    def on_train_end(self, trainer: pl.Trainer, pl_module: RegressionModule) -> None:
        warmup = next(cb for cb in trainer.callbacks if isinstance(cb, BatchWarmup))
        steps = [
            {"indices": s["indices"], "grads": [s["grad"]], "weights": [s["weight"]], "lr": s["lr"]} for s in pl_module.steps
        ]
        records = {
            "steps": steps,
            "history": warmup.state_dict()["history"],
            "samples_seen": warmup.samples_seen,
            "tokens_seen": warmup.tokens_seen,
            "global_step": trainer.global_step,
        }
        torch.save(records, self.outdir / f"rank{trainer.global_rank}.pt")


def load_ranks(outdir: Path) -> list[dict]:
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


def sampler_order(dataset, rank: int, epoch: int) -> list[int]:
    """Sample indices ``rank`` draws in ``epoch`` from the toys' seeded DistributedSampler."""
    sampler = DistributedSampler(dataset, num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=0, drop_last=True)
    sampler.set_epoch(epoch)
    return list(sampler)


def assert_global_steps(ranks: list[dict], dataset) -> list[list[int]]:
    """Checks counts, LR, history and data order across ranks; returns each step's global sample indices."""
    expected_lrs = [pytest.approx(BASE_LR * size / EXPECTED_GLOBAL_BATCHES[0]) for size in EXPECTED_GLOBAL_BATCHES]
    for records in ranks:
        assert [step["lr"] for step in records["steps"]] == expected_lrs
        assert records["samples_seen"] == EPOCHS * SAMPLES
        assert records["tokens_seen"] == EPOCHS * SAMPLES * SEQ_LEN
        assert records["global_step"] == len(records["steps"]) == len(EXPECTED_GLOBAL_BATCHES)
    assert ranks[0]["history"] == ranks[1]["history"]
    changes = [
        (c["step"], c["old_global_batch"], c["new_global_batch"], c["requested_at_samples"], c["samples_seen"])
        for c in ranks[0]["history"]
    ]
    assert changes == EXPECTED_CHANGES
    assert [c["tokens_seen"] for c in ranks[0]["history"]] == [c[4] * SEQ_LEN for c in EXPECTED_CHANGES]

    step_indices = []
    for number, expected_size in enumerate(EXPECTED_GLOBAL_BATCHES):
        per_rank = [records["steps"][number]["indices"] for records in ranks]
        assert [len(indices) for indices in per_rank] == [expected_size // WORLD_SIZE] * WORLD_SIZE
        union = set(per_rank[0]) | set(per_rank[1])
        assert len(union) == expected_size, f"step {number}: ranks overlap"
        step_indices.append(sorted(union))
    # Invariant 2: each rank draws its sampler's order, so across ranks every sample once per epoch.
    per_epoch = SAMPLES // WORLD_SIZE
    for rank, records in enumerate(ranks):
        drawn = [i for step in records["steps"] for i in step["indices"]]
        for epoch in range(EPOCHS):
            assert drawn[epoch * per_epoch : (epoch + 1) * per_epoch] == sampler_order(dataset, rank, epoch)
    for epoch in range(EPOCHS):
        assert sorted(sampler_order(dataset, 0, epoch) + sampler_order(dataset, 1, epoch)) == list(range(SAMPLES))
    return step_indices


def assert_ranks_step_with_the_same_tensors(ranks: list[dict]) -> None:
    for step_0, step_1 in zip(ranks[0]["steps"], ranks[1]["steps"]):
        for name in ("grads", "weights"):
            assert all(torch.equal(a, b) for a, b in zip(step_0[name], step_1[name])), f"{name} differ across ranks"


@pytest.mark.slow
def test_ddp_steps_on_exact_global_batches(tmp_path):
    schedule = PiecewiseBatch([4, 8, 16], [0, 40 * SEQ_LEN, 120 * SEQ_LEN], unit="tokens")
    data = RegressionData(n=SAMPLES, batch_size=MICRO_BATCH_SIZE)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[BatchWarmup(schedule, lr_rule="linear", seq_len=SEQ_LEN), SaveRecords(tmp_path)],
        **trainer_kwargs(devices=WORLD_SIZE, strategy="ddp_spawn", max_epochs=EPOCHS),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(RegressionModule(), data)

    ranks = load_ranks(tmp_path)
    step_indices = assert_global_steps(ranks, data.dataset)
    assert_ranks_step_with_the_same_tensors(ranks)
    # Invariant 1: DDP's all-reduced gradient is the mean over the union of both ranks' samples.
    for number, indices in enumerate(step_indices):
        step = ranks[0]["steps"][number]
        (weight,) = step["weights"]
        (grad,) = step["grads"]
        torch.testing.assert_close(grad, mean_gradient(data.dataset, indices, weight), rtol=1e-10, atol=1e-12)


def factored_mean_gradients(dataset: IndexedRegression, indices: list[int], weights: list[torch.Tensor]):
    """Gradients of mean_i (x_i W1^T W2^T - y_i)^2 over ``indices``, by autograd on unsharded weights."""
    first, second = (w.clone().requires_grad_(True) for w in weights)
    x, y = dataset.x[indices], dataset.y[indices]
    loss = torch.nn.functional.mse_loss(x @ first.T @ second.T, y)
    return torch.autograd.grad(loss, [first, second])


@pytest.mark.slow
def test_fsdp2_accumulates_without_sync_and_steps_on_exact_global_batches(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "fsdp_warmup.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr

    ranks = load_ranks(tmp_path)
    dataset = IndexedRegression(SAMPLES)
    step_indices = assert_global_steps(ranks, dataset)
    assert_ranks_step_with_the_same_tensors(ranks)
    # Gradients are reduce-scattered only on the micro-batch that steps (BatchWarmup turns FSDP2's
    # gradient sync off for the others), yet the step sees the exact mean over the global batch.
    accumulates = [size // (MICRO_BATCH_SIZE * WORLD_SIZE) for size in EXPECTED_GLOBAL_BATCHES]
    synced = [micro == accumulate - 1 for accumulate in accumulates for micro in range(accumulate)]
    assert [records["micro_batch_synced"] for records in ranks] == [synced] * WORLD_SIZE
    for number, indices in enumerate(step_indices):
        step = ranks[0]["steps"][number]
        expected = factored_mean_gradients(dataset, indices, step["weights"])
        for grad, expected_grad in zip(step["grads"], expected):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lr_rule", ["sqrt", "adam_sde", "linear", "none"])
def test_batch_warmup_pickles_for_ddp_spawn(lr_rule):
    """ddp_spawn pickles the Trainer and its callbacks into every child process."""
    pickle.dumps(BatchWarmup(ConstantBatch(4), lr_rule=lr_rule))
