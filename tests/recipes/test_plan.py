"""lit_cbs.run.plan and .memory: memory counted by hand on a model small enough to count, against what torch really
allocates on the CPU (for AdamW and for the optimizers whose state it measures), the batch phases
against a real BatchWarmup run, and train.py's plan of a recipe, which reads no data."""

from __future__ import annotations

import functools
import itertools
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from recipe_runs import compose_config, train
from toys import GlobalOrderRegressionData, RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, PiecewiseBatch
from lit_cbs._internals import checkpoint_wrapper
from lit_cbs.data.synthetic import RandomTokenData
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.models.lm import CausalLM
from lit_cbs.models.olmo import OLMo, OLMoConfig, get_config
from lit_cbs.probe import CBSProbeCallback
from lit_cbs.probe.branch import TrainingSnapshot
from lit_cbs.rules.batch_schedules import micro_batch_for
from lit_cbs.run.memory import ADAMW_STATE, GIB, ModelShape, OptimizerState, device_memory
from lit_cbs.run.plan import RunPlan, batch_phases

# vocab 8, d_model 4, one block, 2 heads (head dim 2), SwiGLU width 8, untied head.
COUNTABLE = OLMoConfig(
    vocab_size=8, d_model=4, n_layers=1, n_heads=2, mlp_hidden=8, context_length=4, tie_embeddings=False
)


def test_countable_model_by_hand():
    shape = ModelShape.measure(COUNTABLE)
    # embedding 8x4 = 32; q, k, v, out 4 x 4x4 = 64; gate, up, down 3 x 4x8 = 96; head 8x4 = 32.
    assert (shape.parameters, shape.block_parameters, shape.root_parameters) == (224, 160, 64)
    assert shape.parameter_tensors == 1 + 4 + 3 + 1

    # One sequence of 2 tokens, fp32, one process.
    memory = device_memory(
        shape,
        micro_batch=1,
        seq_len=2,
        precision="32-true",
        strategy="single",
        data_parallel_size=1,
        activation_checkpointing=False,
    )
    assert (memory.parameters, memory.gradients, memory.working_buffers) == (224 * 4, 224 * 4, 0)
    assert memory.optimizer_state == 2 * 224 * 4 + 9 * 4  # exp_avg, exp_avg_sq, and one fp32 step per tensor
    # The block, 2 tokens: 8 d-wide (block input, 2 LayerNorm outputs, q, k, v, attention output, residual)
    # and 4 f-wide (gate, up, silu, product) fp32 vectors per token; mean and rstd of 2 LayerNorms per
    # token, and a log-sum-exp per head and token.
    block = 4 * 2 * (8 * 4 + 4 * 8) + 4 * (2 * 2 * 2 + 2 * 2)
    # Outside it: ids [1, 3] (the input a view of them) and the targets [2] as int64; cos and sin [2, 2];
    # the final LayerNorm's input, mean and rstd, and output; log-softmax [2, 8]; the loss.
    outside = 8 * 3 + 8 * 2 + 2 * 4 * 2 * 2 + (4 * 2 * 4 + 4 * 2 * 2 + 4 * 2 * 4) + 4 * 2 * 8 + 4
    assert memory.activations == block + outside == 560 + 220
    assert memory.activation_peak_extra == 2 * 8 * (4 + 4)  # the logits and their fp32 copy

    checkpointed = device_memory(shape, 1, 2, "32-true", "single", 1, activation_checkpointing=True)
    assert checkpointed.activations == 4 * 2 * 4 + outside  # the block keeps only its input
    assert checkpointed.activation_peak_extra == block + 2 * 8 * 8  # backward recomputes it

    # FSDP2 over 2 ranks: model state halves; gathered: root + the one block in bf16, the block's grad + fp32 buffer.
    sharded = device_memory(shape, 1, 2, "bf16-mixed", "fsdp", 2, activation_checkpointing=False)
    assert (sharded.parameters, sharded.optimizer_state) == (112 * 4, 2 * 112 * 4 + 9 * 4)
    assert sharded.working_buffers == (64 + 160) * 2 + 160 * (2 + 4)
    # DDP: a bucket copy of the gradients, and autocast's bf16 copies of the matmul weights (all but the embedding).
    ddp = device_memory(shape, 1, 2, "bf16-mixed", "ddp", 2, activation_checkpointing=False)
    assert ddp.parameters == 224 * 4 and ddp.working_buffers == 224 * 4 + (224 - 32) * 2
    ddp_checkpointed = device_memory(shape, 1, 2, "bf16-mixed", "ddp", 2, activation_checkpointing=True)
    assert ddp_checkpointed.working_buffers == ddp.working_buffers  # one block: all of them here


def measured_step(
    config: OLMoConfig,
    micro_batch: int,
    seq_len: int,
    autocast: bool,
    checkpointing: bool,
    optimizer_factory=torch.optim.AdamW,
):
    """Bytes autograd saves for backward in one forward, and the bytes of parameters, gradients and
    optimizer state after a real optimizer step, on the CPU."""
    torch.manual_seed(0)
    model = OLMo(config)
    if checkpointing:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = checkpoint_wrapper(block)
    parameter_storage = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storage:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len + 1))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    optimizer = optimizer_factory(model.parameters())
    optimizer.step()
    parameters = sum(p.nbytes for p in model.parameters())
    gradients = sum(p.grad.nbytes for p in model.parameters())
    state = sum(value.nbytes for per_param in optimizer.state.values() for value in per_param.values())
    return sum(saved.values()), parameters, gradients, state


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_memory_matches_real_allocation_on_cpu(precision, checkpointing):
    config = OLMoConfig(
        vocab_size=96, d_model=32, n_layers=3, n_heads=4, mlp_hidden=80, context_length=64, tie_embeddings=False
    )
    saved, parameters, gradients, state = measured_step(config, 3, 24, precision == "bf16-mixed", checkpointing)
    shape = ModelShape.measure(config)
    memory = device_memory(shape, 3, 24, precision, "single", 1, checkpointing)
    assert (memory.parameters, memory.gradients, memory.optimizer_state) == (parameters, gradients, state)
    # Autocast's weight copies are saved for backward too: the plan counts them as working buffers,
    # with checkpointing also the copies of the block being recomputed, which forward does not save.
    autocast_copies = memory.working_buffers - (
        2 * shape.block_parameters if checkpointing and precision == "bf16-mixed" else 0
    )
    assert memory.activations + autocast_copies == saved


@pytest.mark.parametrize(
    ("optimizer", "state"),
    [
        (torch.optim.AdamW, ADAMW_STATE),
        (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), OptimizerState("SGD", 1, 0)),  # momentum buffer
        (functools.partial(torch.optim.SGD, lr=0.1), OptimizerState("SGD", 0, 0)),
        (torch.optim.Adagrad, OptimizerState("Adagrad", 1, 4)),  # sum of squares, step
    ],
)
def test_optimizer_state_is_measured_and_matches_real_allocation(optimizer, state):
    assert OptimizerState.measure(optimizer) == state
    config = OLMoConfig(
        vocab_size=96, d_model=32, n_layers=2, n_heads=4, mlp_hidden=80, context_length=64, tie_embeddings=True
    )
    _, _, _, allocated = measured_step(config, 2, 16, autocast=False, checkpointing=False, optimizer_factory=optimizer)
    memory = device_memory(ModelShape.measure(config), 2, 16, "32-true", "single", 1, False, optimizer=state)
    assert memory.optimizer_state == allocated


def test_tied_embeddings_are_one_tensor():
    shape = ModelShape.measure(get_config("olmo_1b"))
    assert shape.parameters == 1_176_764_416 and shape.autocast_weights == shape.parameters


class Snapshot(pl.Callback):
    """Takes the CBS probe's snapshot after the second optimizer step, as a probe would."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            self.snapshot = TrainingSnapshot(trainer, pl_module, "cpu")


def probe_plan(probe, config, max_tokens=1024):
    """The plan of ``probe`` on a one-process fp32 run of ``config`` at 16 tokens, micro-batch 4."""
    schedule, args = PiecewiseBatch([4], [0]), ("32-true", "single", "cpu", 1, 1, False, probe)
    return RunPlan("probe", config, schedule, float, max_tokens, 16, 4, 4, *args).probe


def test_probe_snapshot_matches_a_real_snapshot(tmp_path):
    config = get_config("tiny")
    snapshot = Snapshot()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=2, callbacks=[BatchWarmup(PiecewiseBatch([4], [0])), snapshot]))
    trainer.fit(CausalLM(config), datamodule=RandomTokenData(vocab_size=256, seq_len=16, batch_size=4, samples=64))
    taken = snapshot.snapshot
    real = sum(t.nbytes for t in taken.tensors) + sum(
        value.nbytes for states, _ in taken.optimizers for state in states.values() for value in state.values()
    )
    probe = CBSProbeCallback(
        at_tokens=[64, 640],
        window_tokens=256,
        multipliers=[1, 2, 4],
        search="bisect",
        evaluate="heldout",
        heldout_batches=2,
    )
    plan = probe_plan(probe, config)
    assert plan.snapshot_bytes == real
    assert plan.points == [64, 640]  # 640 + 256 <= 1,024; a window must end inside the run
    assert plan.window_bytes == 256 // 16 * 17 * 8 and plan.heldout_bytes == 2 * 4 * 17 * 8
    assert plan.max_branches == 1 + math.ceil(math.log2(3)) and plan.tokens == 2 * 3 * 256
    assert plan.snapshots == 2 and plan.host_bytes == 2 * real + plan.window_bytes + plan.heldout_bytes
    # With early stops every branch keeps its state until the window closes.
    probe = CBSProbeCallback(
        at_tokens=[64, 640],
        window_tokens=256,
        multipliers=[1, 2, 4],
        search="bisect",
        evaluate="heldout",
        heldout_batches=2,
        early_stop=[0.5],
    )
    plan = probe_plan(probe, config)
    assert plan.snapshots == 2 + 3 and plan.host_bytes == 5 * real + plan.window_bytes + plan.heldout_bytes
    # With replicate windows a probe records twice the window and trains every branch twice; 640 + 2 x 256 > 1,024.
    probe = CBSProbeCallback(
        at_tokens=[64, 640],
        window_tokens=256,
        multipliers=[1, 2, 4],
        search="bisect",
        evaluate="heldout",
        heldout_batches=2,
        replicates=2,
    )
    plan = probe_plan(probe, config)
    assert plan.points == [64] and plan.window_bytes == 2 * 256 // 16 * 17 * 8 and plan.tokens == 1 * 3 * 256 * 2


def test_batch_phases_match_a_real_batch_warmup_run():
    # Samples as tokens (seq_len 1): 4 samples per step until 24 samples, then 8, stopping at 64.
    schedule = PiecewiseBatch([4, 8], [0, 24], unit="samples")
    warmup = BatchWarmup(schedule, lr_rule="sqrt", max_tokens=64, seq_len=1)
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=3, callbacks=[warmup]))
    trainer.fit(RegressionModule(), datamodule=RegressionData(n=96, batch_size=2))
    phases = batch_phases(
        schedule, max_tokens=64, seq_len=1, micro_batch=2, data_parallel_size=1, lr_factor=warmup.lr_rule.factor
    )
    assert [(p.global_batch, p.accumulate) for p in phases] == [(4, 2), (8, 4)]
    assert phases[1].start_tokens == warmup.history[0].tokens_seen == 24
    assert phases[0].optimizer_steps == warmup.history[0].step == 6
    assert sum(p.optimizer_steps for p in phases) == trainer.global_step == 6 + 5
    assert phases[-1].end_tokens == warmup.accounting.tokens_seen == 64
    assert phases[1].lr_factor == pytest.approx(warmup.lr_factor) == pytest.approx(2**0.5)


def test_batch_phases_with_a_growing_micro_batch_match_a_real_run():
    # 4 -> 8 -> 16 samples at 40 and 120 samples, micro-batch up to 4: 16 is asked at 120, where 120 samples
    # are no multiple of 16, and applied one step later, at 128.
    schedule = PiecewiseBatch([4, 8, 16], [0, 40, 120], unit="samples")
    warmup = BatchWarmup(schedule, lr_rule="sqrt", max_tokens=192, seq_len=1, max_micro_batch_size=4)
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=3, callbacks=[warmup]))
    trainer.fit(RegressionModule(), datamodule=GlobalOrderRegressionData(n=256, batch_size=2))
    phases = batch_phases(
        schedule,
        max_tokens=192,
        seq_len=1,
        micro_batch=lambda batch: micro_batch_for(batch, 1, 4),
        data_parallel_size=1,
        lr_factor=warmup.lr_rule.factor,
    )
    assert [(p.global_batch, p.micro_batch, p.accumulate) for p in phases] == [(4, 4, 1), (8, 4, 2), (16, 4, 4)]
    assert [p.start_tokens for p in phases[1:]] == [c.tokens_seen for c in warmup.history] == [40, 128]
    assert [p.optimizer_steps for p in phases] == [10, 11, 4] and trainer.global_step == 25


def test_plan_grows_the_cluster_with_the_batch_and_says_how(tmp_path):
    cfg = compose_config(
        "+recipe=olmo1b_warmup",
        "plan=true",
        "trainer.devices=8",
        "plan_for.max_devices=32",
        "plan_for.min_micro_batch_size=8",
    )
    plan = train.plan_of(cfg)
    assert [(p.ranks, p.micro_batch, p.accumulate) for p in plan.cluster] == [(8, 8, 16), (16, 8, 16), (32, 8, 16)]
    assert [p.end_step for p in plan.cluster] == list(itertools.accumulate(p.optimizer_steps for p in plan.phases))
    report = plan.report()
    assert "1.76x sooner" in report
    commands = [line.strip() for line in report.splitlines() if line.strip().startswith("torchrun")]
    assert commands[0] == (
        f"torchrun --nnodes 1 --nproc_per_node 8 recipes/train.py +recipe=olmo1b_warmup trainer.num_nodes=1 "
        f"trainer.max_steps={plan.cluster[0].end_step} hydra.run.dir=outputs/olmo1b_warmup/phase1"
    )
    assert commands[2].endswith(
        "trainer.num_nodes=4 hydra.run.dir=outputs/olmo1b_warmup/phase3 "
        "ckpt_path=outputs/olmo1b_warmup/phase2/checkpoints/last.ckpt"
    )
    # The largest micro-batch whose step fits plan_for.gpu_memory_gib, with activation checkpointing as configured.
    fits = plan.micro_batch_limit
    memory = [device_memory(plan.shape, micro, 4096, "bf16-mixed", "fsdp", 8, True).total for micro in (fits, fits + 1)]
    assert memory[0] <= 80 * GIB < memory[1]


def test_plan_on_the_cpu_grows_the_cluster_without_made_up_times():
    report = train.plan_of(compose_config("plan=true", "plan_for.max_devices=2")).report()
    assert (
        "wall time        not estimated on cpu" in report and "TFLOP/s" not in report and "device-hours" not in report
    )
    assert (
        "gpu_memory_gib=80" not in report and "plan_for.gpu_memory_gib applies to GPUs only" in report
    )  # no GPU limit on a CPU
    commands = [line.strip() for line in report.splitlines() if line.strip().startswith("torchrun")]
    assert commands[1] == (
        "torchrun --nnodes 2 --nproc_per_node 1 recipes/train.py +recipe=tiny_warmup trainer.num_nodes=2 "
        "trainer.max_steps=920 hydra.run.dir=outputs/tiny_warmup/phase2 "
        "ckpt_path=outputs/tiny_warmup/phase1/checkpoints/last.ckpt"
    )


def test_plan_of_olmo7b_reads_no_data_and_warns_what_does_not_fit(tmp_path):
    cfg = compose_config(
        "+recipe=olmo7b_warmup",
        "plan=true",
        "trainer.devices=8",
        "model.activation_checkpointing=false",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    plan = train.plan_of(cfg)
    lines = plan.report().splitlines()
    assert plan.shape.parameters == 6_888_095_744
    # The table: 1024 -> 2048 -> 4096 sequences, micro-batch 4 on 8 GPUs, LR x sqrt(2) per doubling.
    assert [(p.global_batch, p.micro_batch, p.accumulate) for p in plan.phases] == [
        (1024, 4, 32),
        (2048, 4, 64),
        (4096, 4, 128),
    ]
    assert [p.lr_factor for p in plan.phases] == pytest.approx([1, 2**0.5, 2])
    assert any(line.startswith("WARNING:") and "set model.activation_checkpointing=true" in line for line in lines)
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_recipe_without_gpu_fails_before_data_work(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("some text " * 100)
    cfg = compose_config("+recipe=olmo1b_warmup", f"data.input_dir={texts}", f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(
        LitCBSConfigError, match="^trainer.accelerator=gpu but this machine has no CUDA GPU; add plan=true"
    ):
        train.build_run(cfg)
    assert not (tmp_path / "cache").exists()


def test_side_job_probes_are_planned_apart_from_the_run_that_does_not_wait_for_them():
    in_process = train.plan_of(compose_config("+recipe=olmo1b_cbs_probe", "plan=true", "trainer.devices=8"))
    side = train.plan_of(
        compose_config("+recipe=olmo1b_cbs_probe", "plan=true", "trainer.devices=8", "side_jobs=slurm")
    )
    alone = side._seconds(side.tokens, side.processes)
    # The in-process probe's branches pause the run; side jobs' only for their checkpoints (each rank writes its
    # FSDP2 shard of the weights and AdamW's state at plan_for.checkpoint_gib_per_s), their device-hours said apart.
    write = side.probe.snapshot_bytes / 2**30 / 1.0
    assert side.probe_checkpoint_seconds == pytest.approx(write) and 1 < write < 10
    assert side.wall_seconds == pytest.approx(alone + 14 * write) and in_process.wall_seconds > 1.3 * alone
    assert side.probe_device_hours == pytest.approx(in_process.probe_device_hours) and side.probe_device_hours > 1000
    report, waiting = side.report(), in_process.report()
    hours = f"{side.probe_device_hours:,.0f} device-hours"
    assert (
        f"as side jobs (SlurmLauncher): the branches train on {hours} beside the main run, which does not wait"
        in report
    )
    assert f"which the main run waits for: {write:.1f} s a probe point at plan_for.checkpoint_gib_per_s=1" in report
    assert f"(side-job probes pause it only for their checkpoints: {14 * write:.1f} s)" in report
    assert "for its in-process probes" in waiting and "as side jobs" not in waiting
    # No snapshots or recorded window in the run's host memory: only the held-out batches it scores itself on.
    assert side.probe.host_bytes == side.probe.heldout_bytes < in_process.probe.host_bytes
