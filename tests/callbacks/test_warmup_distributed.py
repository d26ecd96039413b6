"""BatchWarmup with 2 CPU processes: DDP (forked from the test process, gloo) and FSDP2 (ModelParallelStrategy).

Both runs use the same batch growth, 4 -> 8 -> 16 global samples with micro-batch 2 on 2 ranks
(accumulate 1 -> 2 -> 4), over 2 epochs of 96 samples. Each rank saves what it recorded; the test
joins the ranks and checks the invariants that every step averages exactly the scheduled samples and
none is lost on global quantities: every optimizer step averages exactly the scheduled global batch,
split across ranks with no overlap, in the sampler's order, and the gradient both ranks step with is
the exact mean over those samples; the LR follows lr_rule="linear" (invariant 3) identically on both
ranks.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import in_process_ddp, run_forked
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DistributedSampler
from toys import (
    GlobalOrderRegressionData,
    IndexedRegression,
    RegressionData,
    RegressionModule,
    SummedRegressionModule,
    mean_gradient,
    trainer_kwargs,
)

from lit_cbs import BatchWarmup, ConstantBatch, PiecewiseBatch
from lit_cbs.rules import Seesaw, StepDecay

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
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


class SaveRecords(Callback):
    """Saves each rank's RegressionModule and BatchWarmup records to ``outdir/rank{rank}.pt``.

    The ranks run fit in child processes, which return no callback or module state to the parent.
    """

    def __init__(self, outdir: Path):
        self.outdir = outdir

    def on_train_end(self, trainer: pl.Trainer, pl_module: RegressionModule) -> None:
        warmup = next(cb for cb in trainer.callbacks if isinstance(cb, BatchWarmup))
        steps = [
            {"indices": s["indices"], "grads": [s["grad"]], "weights": [s["weight"]], "lr": s["lr"]}
            for s in pl_module.steps
        ]
        records = {
            "steps": steps,
            "history": warmup.state_dict()["history"],
            "samples_seen": warmup.accounting.samples_seen,
            "tokens_seen": warmup.accounting.tokens_seen,
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
    # Seesaw on a step decay that halves the LR at 40 and 120 samples: PiecewiseBatch([4, 8, 16], [0, 160, 480]).
    schedule = Seesaw(
        StepDecay(0, [40 * SEQ_LEN, 120 * SEQ_LEN], total_tokens=EPOCHS * SAMPLES * SEQ_LEN), start=4, max_batch_size=16
    )
    assert (schedule.batch_sizes, schedule.thresholds) == ([4, 8, 16], [0, 40 * SEQ_LEN, 120 * SEQ_LEN])
    data = RegressionData(n=SAMPLES, batch_size=MICRO_BATCH_SIZE)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[BatchWarmup(schedule, lr_rule="linear", seq_len=SEQ_LEN), SaveRecords(tmp_path)],
        **trainer_kwargs(devices=WORLD_SIZE, strategy=in_process_ddp(), max_epochs=EPOCHS),
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
    # A forked copy of this process (tests/launch.py); Lightning starts the second rank as a fresh process.
    result = run_forked(SCRIPTS / "fsdp_warmup.py", str(tmp_path), capture_output=True, timeout=180)
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


# ---------------------------------------------------------------- resume on another number of ranks
# 4 -> 8 -> 16 samples at 40 and 120 samples, micro-batch at most 4: micro 4 x accumulation 1, 2, 4 on one rank,
# micro 2, 4, 4 x accumulation 1, 1, 2 on two. Checkpoints every 3 steps; step 18 falls 8 samples into the second
# epoch, at batch 8: two ranks have taken one micro-batch of 4 there, which one rank's accumulation 2 does not
# divide, so Lightning's count is moved on, not the data.
ELASTIC_SCHEDULE = PiecewiseBatch([4, 8, 16], [0, 40, 120], unit="samples")


class SaveSteps(Callback):
    """Saves this rank's per-step sample indices, LRs and final weight to ``outdir/rank{rank}.pt``."""

    def __init__(self, outdir: Path):
        self.outdir = outdir

    def on_train_end(self, trainer, pl_module):
        warmup = next(cb for cb in trainer.callbacks if isinstance(cb, BatchWarmup))
        records = {
            "indices": [s["indices"] for s in pl_module.steps],
            "lrs": [s["lr"] for s in pl_module.steps],
            "weight": pl_module.layer.weight.detach().clone(),
            "history": warmup.state_dict()["history"],
            "global_step": trainer.global_step,
        }
        torch.save(records, self.outdir / f"rank{trainer.global_rank}.pt")


def fit_on_ranks(
    ranks: int, callbacks: list, module, data, epochs: int, checkpoints: tuple[Path | None, int], ckpt_path: Path | None
) -> None:
    """Fit on ``ranks`` processes (forked beyond one); ``checkpoints``: (folder, every so many steps), or (None, _)."""
    folder, every = checkpoints
    if folder is not None:
        callbacks = [
            *callbacks,
            ModelCheckpoint(dirpath=folder, every_n_train_steps=every, save_top_k=-1, filename="{step}"),
        ]
    kwargs = trainer_kwargs(devices=ranks, max_epochs=epochs, enable_checkpointing=folder is not None)
    if ranks > 1:
        kwargs["strategy"] = in_process_ddp()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(callbacks=callbacks, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data, ckpt_path=ckpt_path)


def elastic_run(
    ranks: int,
    outdir: Path,
    ckpt_path: Path | None = None,
    checkpoints: Path | None = None,
    max_micro_batch_size: int | None = 4,
    data=GlobalOrderRegressionData,
) -> dict:
    """A run on ``ranks`` processes; returns the steps joined over the ranks (samples, LR), its weight and history."""
    outdir.mkdir(parents=True, exist_ok=True)
    callbacks = [
        BatchWarmup(ELASTIC_SCHEDULE, lr_rule="sqrt", max_micro_batch_size=max_micro_batch_size),
        SaveSteps(outdir),
    ]
    fit_on_ranks(
        ranks, callbacks, RegressionModule(), data(n=SAMPLES, batch_size=2), EPOCHS, (checkpoints, 3), ckpt_path
    )
    per_rank = [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in range(ranks)]
    steps = [
        sorted(i for records in per_rank for i in records["indices"][number])
        for number in range(len(per_rank[0]["indices"]))
    ]
    assert all(records["lrs"] == per_rank[0]["lrs"] for records in per_rank)
    return {
        "steps": steps,
        "lrs": per_rank[0]["lrs"],
        "weight": per_rank[0]["weight"],
        "history": per_rank[0]["history"],
    }


def batch_changes(history: list[dict]) -> list[tuple]:
    """What a change is whatever the ranks: where it was asked, where it happened, the global batches, the LR factor."""
    keys = ("step", "samples_seen", "requested_at_samples", "old_global_batch", "new_global_batch", "lr_factor")
    return [tuple(change[key] for key in keys) for change in history]


@pytest.mark.slow
def test_a_run_resumed_on_another_number_of_ranks_trains_every_sample_once(tmp_path):
    one = elastic_run(1, tmp_path / "one", checkpoints=tmp_path / "one_ckpt")
    two = elastic_run(2, tmp_path / "two", checkpoints=tmp_path / "two_ckpt")
    # The same samples in every step, the same LRs and batch changes, on one rank as on two.
    assert one["steps"] == two["steps"] and one["lrs"] == pytest.approx(two["lrs"], rel=1e-12)
    assert batch_changes(one["history"]) == batch_changes(two["history"])
    assert [len(step) for step in one["steps"]] == [4] * 10 + [8] * 11 + [16] * 4  # 16 asked at 120, applied at 128
    for ranks, checkpoint in ((1, tmp_path / "two_ckpt" / "step=18.ckpt"), (2, tmp_path / "one_ckpt" / "step=18.ckpt")):
        resumed = elastic_run(ranks, tmp_path / f"resumed_on_{ranks}", ckpt_path=checkpoint)
        assert resumed["steps"] == one["steps"][18:] and resumed["lrs"] == pytest.approx(one["lrs"][18:], rel=1e-12)
        assert batch_changes(resumed["history"]) == batch_changes(one["history"])
        # Sample ids over the whole run: every one of the 96 exactly once per epoch, as without the resume.
        counts = torch.bincount(
            torch.tensor([i for step in one["steps"][:18] + resumed["steps"] for i in step]), minlength=SAMPLES
        )
        assert counts.tolist() == [EPOCHS] * SAMPLES
        torch.testing.assert_close(resumed["weight"], one["weight"], rtol=1e-12, atol=1e-14)
    # Where the run cannot go on exactly, it stops before its first step, with the fix: a loader that splits its
    # samples by rank (a DistributedSampler's DataLoader, trained on one rank, resumed on two) ...
    elastic_run(
        1, tmp_path / "plain", checkpoints=tmp_path / "plain_ckpt", max_micro_batch_size=None, data=RegressionData
    )
    with pytest.raises(
        Exception,
        match=r"the checkpoint was trained on 1 data-parallel ranks and this run has 2: the train "
        r"loader \(DataLoader\) splits its samples by rank.*GlobalOrderLoader.*or resume on 1 ranks",
    ):
        elastic_run(
            2,
            tmp_path / "refused",
            tmp_path / "plain_ckpt" / "step=3.ckpt",
            max_micro_batch_size=None,
            data=RegressionData,
        )
    # One rank trained micro-batches of 4 at batch 4, which two ranks cannot split without changing the micro-batch.
    with pytest.raises(
        Exception, match=r"global batch on 2 ranks 4 is not a multiple of micro-batch 4 x data-parallel size 2"
    ):
        elastic_run(2, tmp_path / "refused", tmp_path / "one_ckpt" / "step=3.ckpt", max_micro_batch_size=None)


def fsdp_elastic_run(outdir: Path, processes: int, ckpt_path: Path | None = None) -> dict:
    """tests/scripts/fsdp_elastic.py on ``processes`` processes; the steps joined over the ranks."""
    outdir.mkdir(parents=True, exist_ok=True)
    arguments = [str(outdir), str(processes), *([str(ckpt_path)] if ckpt_path else [])]
    result = run_forked(SCRIPTS / "fsdp_elastic.py", *arguments, capture_output=True, timeout=300)  # rank 0 forked
    assert result.returncode == 0, result.stderr[-5000:]
    per_rank = [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in range(processes)]
    steps = [
        sorted(i for records in per_rank for i in records["steps"][number]["indices"])
        for number in range(len(per_rank[0]["steps"]))
    ]
    return {
        "steps": steps,
        "lrs": [step["lr"] for step in per_rank[0]["steps"]],
        "last": per_rank[0]["steps"][-1]["weights"],
        "history": per_rank[0]["history"],
        "log": result.stdout + result.stderr,
    }


@pytest.mark.slow
def test_fsdp2_resumes_a_distributed_checkpoint_on_another_number_of_processes(tmp_path):
    two = fsdp_elastic_run(tmp_path / "two", 2)
    one = fsdp_elastic_run(tmp_path / "one", 1, tmp_path / "two" / "checkpoints" / "step=18.ckpt")
    assert "resumed on 1 data-parallel rank(s) (the checkpoint's run had 2)" in one["log"]
    assert one["steps"] == two["steps"][18:] and one["lrs"] == pytest.approx(two["lrs"][18:], rel=1e-12)
    assert batch_changes(one["history"]) == batch_changes(two["history"])
    counts = torch.bincount(
        torch.tensor([i for step in two["steps"][:18] + one["steps"] for i in step]), minlength=SAMPLES
    )
    assert counts.tolist() == [EPOCHS] * SAMPLES
    for resumed, uninterrupted in zip(one["last"], two["last"]):  # the weights the last step started from, resharded
        torch.testing.assert_close(resumed, uninterrupted, rtol=1e-10, atol=1e-12)
    back_on_two = fsdp_elastic_run(tmp_path / "back", 2, tmp_path / "one" / "checkpoints" / "step=21.ckpt")
    assert back_on_two["steps"] == two["steps"][21:]


# ---------------------------------------------------------------- an epoch's last round, dealt over the ranks
# 105 samples on 2 ranks: every epoch ends in a round that leaves the ranks different numbers of samples. Epoch 0
# ends with rounds of 8 (57 - 7 x 8 = 1 sample left: rank 1 gets none), epochs 1 and 2 with rounds of 12 (9 left:
# 5 and 4).
UNEVEN_SAMPLES = 105


class SaveMicroBatches(Callback):
    """Saves this rank's micro-batches (sample indices), the micro-batches it had read at each epoch's end,
    its steps (samples, gradient, weight) and the counts to ``outdir/rank{rank}.pt``."""

    def __init__(self, outdir: Path):
        self.outdir, self.epoch_ends = outdir, []

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_ends.append(len(pl_module.micro_batches))

    def on_train_end(self, trainer, pl_module):
        warmup = next(cb for cb in trainer.callbacks if isinstance(cb, BatchWarmup))
        records = {
            "micro_batches": pl_module.micro_batches,
            "epoch_ends": self.epoch_ends,
            "steps": [{key: s[key] for key in ("indices", "grad", "weight", "epoch")} for s in pl_module.steps],
            "samples_seen": warmup.accounting.samples_seen,
            "tokens_seen": warmup.accounting.tokens_seen,
        }
        torch.save(records, self.outdir / f"rank{trainer.global_rank}.pt")


def uneven_run(
    outdir: Path,
    module: RegressionModule,
    ranks: int = WORLD_SIZE,
    checkpoints: Path | None = None,
    ckpt_path: Path | None = None,
) -> list[dict]:
    """4 -> 8 -> 24 samples at 40 and 120 (on 2 ranks micro-batch 2 -> 4 -> 6 x 2 per rank) over 3 epochs of 105
    samples, checkpointed after every step into ``checkpoints``; each rank's records."""
    outdir.mkdir(parents=True, exist_ok=True)
    warmup = BatchWarmup(
        PiecewiseBatch([4, 8, 24], [0, 40, 120], unit="samples"),
        lr_rule="sqrt",
        seq_len=SEQ_LEN,
        max_micro_batch_size=8,
    )
    data = GlobalOrderRegressionData(n=UNEVEN_SAMPLES, batch_size=2)
    fit_on_ranks(ranks, [warmup, SaveMicroBatches(outdir)], module, data, 3, (checkpoints, 1), ckpt_path)
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in range(ranks)]


@pytest.mark.slow
def test_on_two_ranks_every_sample_trains_once_per_epoch_and_each_step_is_the_mean_over_its_samples(tmp_path):
    ranks = uneven_run(tmp_path / "two", SummedRegressionModule(), checkpoints=tmp_path / "checkpoints")
    data = GlobalOrderRegressionData(n=UNEVEN_SAMPLES)
    # Both ranks read as many micro-batches in every epoch (their collectives pair up) ...
    assert ranks[0]["epoch_ends"] == ranks[1]["epoch_ends"] and len(ranks[0]["epoch_ends"]) == 3
    bounds = [0, *ranks[0]["epoch_ends"]]
    for epoch, (start, end) in enumerate(zip(bounds, bounds[1:])):
        rounds = zip(ranks[0]["micro_batches"][start:end], ranks[1]["micro_batches"][start:end])
        # ... and round by round, rank 0's run then rank 1's, they read the epoch's order, every sample once.
        assert [i for first, second in rounds for i in first + second] == data.epoch_order(epoch)
        last = (len(ranks[0]["micro_batches"][end - 1]), len(ranks[1]["micro_batches"][end - 1]))
        assert last == [(1, 0), (5, 4), (5, 4)][epoch]  # the last round: rank 0 one sample more (105 is odd)
    for records in ranks:
        assert records["samples_seen"] == 3 * UNEVEN_SAMPLES and records["tokens_seen"] == 3 * UNEVEN_SAMPLES * SEQ_LEN
    # token_mean_loss: every step's gradient is the exact mean over the samples it holds, the short ones too.
    for step_0, step_1 in zip(ranks[0]["steps"], ranks[1]["steps"]):
        assert torch.equal(step_0["grad"], step_1["grad"])
        expected = mean_gradient(data.dataset, step_0["indices"] + step_1["indices"], step_0["weight"])
        torch.testing.assert_close(step_0["grad"], expected, rtol=1e-10, atol=1e-12)
    # Resumed on one rank from right before epoch 0's last step: the same samples in every step from there on.
    steps = [
        sorted(step_0["indices"] + step_1["indices"]) for step_0, step_1 in zip(ranks[0]["steps"], ranks[1]["steps"])
    ]
    before_last = max(number for number, step in enumerate(ranks[0]["steps"]) if step["epoch"] == 0)
    checkpoint = tmp_path / "checkpoints" / f"step={before_last}.ckpt"
    (one,) = uneven_run(tmp_path / "one", SummedRegressionModule(), ranks=1, ckpt_path=checkpoint)
    assert [sorted(step["indices"]) for step in one["steps"]] == steps[before_last:]
    assert one["samples_seen"] == 3 * UNEVEN_SAMPLES
    torch.testing.assert_close(one["steps"][-1]["weight"], ranks[0]["steps"][-1]["weight"], rtol=1e-10, atol=1e-12)
    # A mean over no sample is NaN: a module that gives one is refused before its first step, with the fix.
    with pytest.raises(
        Exception,
        match=r"the train loader's 105 samples do not divide over 2 data-parallel ranks, so an epoch's last "
        r"micro-batch can hold no sample on some rank.*training_step on such a zero-sample batch gives the loss "
        r"nan.*token_mean_loss",
    ):
        uneven_run(tmp_path / "refused", RegressionModule())
