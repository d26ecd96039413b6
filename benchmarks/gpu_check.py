"""One-GPU check of the training stack: OLMo-1B shape, FSDP2, bf16, a batch change mid-run.

    python -m benchmarks.gpu_check --output gpu_check.json [--peak-tflops 989] [--compile]

Trains ``lit_cbs.models.lm.CausalLM`` (olmo_1b preset, all 16 layers unless --n-layers says fewer)
through Lightning's ModelParallelStrategy (FSDP2, one process), bf16-mixed, activation
checkpointing, AdamW (fused on a GPU) and the token-indexed LR schedule, with ``BatchWarmup`` doubling the global
batch from 8 to 16 sequences of 4096 tokens after --steps-before-change optimizer steps. The
tokens are random (``lit_cbs.data.synthetic.RandomTokenData``): this measures speed and memory, not
learning. Prints, and writes to --output, JSON with tokens/s over the optimizer steps after the
first --skip-steps (wall time between steps, CUDA-synchronized), MFU = model FLOPs per token
(``OLMo.flops_per_token``: 6N + attention, recomputation not counted) x tokens/s / peak, the
peak used, peak memory and the batch change. The peak is --peak-tflops, else Lightning's
``get_available_flops`` for the GPU; that table does not know the name torch reports for an
H200, so pass ``--peak-tflops 989`` (dense bf16 of an H100/H200 SXM) there.

``--compile`` compiles each transformer block (``CausalLM(compile=True)``: regional compilation
before FSDP2 sharding), so two runs, one with and one without, give compiled against eager MFU;
the first timed step comes after the compile (--skip-steps), and the batch change keeps the
micro-batch, so nothing recompiles inside the timed steps.

``--probe`` also attaches ``CBSProbeCallback`` (grid k = 1, 2 over a window of
--probe-window-steps steps, snapshots on the CPU) right after the batch change, and reports the
branch losses, the difference between the k = 1 branch and the main run over the same window
(0 where the GPU kernels are deterministic) and the probe's seconds and tokens.

Imports only torch, lightning, torchmetrics and lit_cbs modules that need nothing else, so it
runs where hydra-core, omegaconf and litdata are not installed. ``--accelerator cpu --preset tiny``
runs the same path on a CPU (tests/benchmarks/test_gpu_check.py does, as a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import time
from pathlib import Path

import lightning
import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.strategies import ModelParallelStrategy
from torch._dynamo.utils import counters

from benchmarks.common import StepTimer
from lit_cbs import metrics
from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.data.synthetic import RandomTokenData
from lit_cbs.models.lm import ADAMW, COMPUTE_DTYPES, CausalLM
from lit_cbs.probe import CBSProbeCallback
from lit_cbs.rules.batch_schedules import PiecewiseBatch
from lit_cbs.rules.lr_schedules import WarmupStableDecay
from lit_cbs.run.memory import GIB, ModelShape, device_memory


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="where to write the JSON result")
    parser.add_argument("--preset", default="olmo_1b", help="model preset (lit_cbs.models.PRESETS)")
    parser.add_argument(
        "--n-layers", type=int, default=None, help="fewer layers than the preset (default: the preset's)"
    )
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sample")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward pass")
    parser.add_argument("--steps-before-change", type=int, default=10, help="optimizer steps at the first batch")
    parser.add_argument("--steps-after-change", type=int, default=10, help="optimizer steps at the doubled batch")
    parser.add_argument("--skip-steps", type=int, default=3, help="first optimizer steps left out of tokens/s")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak TFLOP/s of one device at this precision, for MFU (default: Lightning's table; "
        "989 for an H100/H200 SXM in dense bf16)",
    )
    parser.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--no-activation-checkpointing", action="store_true")
    parser.add_argument(
        "--compile", action="store_true", help="compile each transformer block (CausalLM(compile=True))"
    )
    parser.add_argument("--probe", action="store_true", help="also run a CBS probe (k = 1, 2) after the change")
    parser.add_argument("--probe-window-steps", type=int, default=4, help="probe window, in steps at the doubled batch")
    return parser.parse_args()


def main() -> dict:
    args = parse_args()
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU visible; this check needs one (or --accelerator cpu for a smoke test)")
    if args.skip_steps >= args.steps_before_change + args.steps_after_change - 1:
        raise SystemExit("error: --skip-steps must leave at least two optimizer steps to time")
    torch.set_float32_matmul_precision("high")  # before the peak lookup: fp32 matmuls then run as TF32
    if args.peak_tflops is not None:
        peak_flops = args.peak_tflops * 1e12
    elif args.accelerator == "gpu":
        peak_flops = get_available_flops(torch.device("cuda"), COMPUTE_DTYPES.get(args.precision, torch.float32))
        if peak_flops is None:
            raise SystemExit(
                f"error: Lightning knows no peak FLOP/s for {torch.cuda.get_device_name()}; pass --peak-tflops"
            )
    else:
        raise SystemExit("error: --accelerator cpu needs --peak-tflops (a CPU's peak is in no table)")
    started = time.perf_counter()
    pl.seed_everything(0)

    config = {"preset": args.preset} | ({"n_layers": args.n_layers} if args.n_layers else {})
    first_batch = args.micro_batch_size  # one micro-batch per step, then two after the change
    change_at = args.steps_before_change * first_batch * args.seq_len
    max_tokens = change_at + args.steps_after_change * 2 * first_batch * args.seq_len
    model = CausalLM(
        config,
        optimizer=functools.partial(ADAMW, lr=4e-4, fused=args.accelerator == "gpu"),
        lr_schedule=WarmupStableDecay(warmup_tokens=change_at // 2, total_tokens=max_tokens),
        activation_checkpointing=not args.no_activation_checkpointing,
        peak_flops_per_device=peak_flops,
        compile=args.compile,
    )
    data = RandomTokenData(
        model.config.vocab_size, args.seq_len, args.micro_batch_size, samples=max_tokens // args.seq_len
    )
    warmup = BatchWarmup(
        PiecewiseBatch([first_batch, 2 * first_batch], [0, change_at], unit="tokens"), max_tokens=max_tokens
    )
    timer = StepTimer()
    callbacks = [warmup, timer]
    probe = None
    if args.probe:
        window = args.probe_window_steps * 2 * first_batch * args.seq_len
        if change_at + 4 * first_batch * args.seq_len + window > max_tokens:
            raise SystemExit("error: --steps-after-change leaves no room for the probe window; raise it")
        probe = CBSProbeCallback(
            at_tokens=[change_at + 4 * first_batch * args.seq_len],  # a few steps after the change
            multipliers=(1, 2),
            window_tokens=window,
            search="grid",
            output_dir=args.output.parent,
        )
        callbacks.insert(1, probe)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
        precision=args.precision,
        max_epochs=-1,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    if args.accelerator == "gpu":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, datamodule=data)

    first, last = args.skip_steps, len(timer.steps) - 1
    tokens_per_s = (timer.tokens[last] - timer.tokens[first]) / (timer.ends["wall"][last] - timer.ends["wall"][first])
    flops_per_token = model.flops_per_token(args.seq_len)
    result = {
        "device": torch.cuda.get_device_name() if args.accelerator == "gpu" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "strategy": "ModelParallelStrategy (FSDP2 fully_shard per block and root), 1 process",
        "precision": args.precision,
        "activation_checkpointing": model.activation_checkpointing,
        "compile": args.compile,
        "compiled_graphs": counters["stats"][
            "unique_graphs"
        ],  # torch's count, over the whole run (the batch change included)
        "fused_adamw": args.accelerator == "gpu",
        "model": dataclasses.asdict(model.config),
        "parameters": model.num_parameters(),
        "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size,
        "batch_changes": [dataclasses.asdict(change) for change in warmup.history],
        "optimizer_steps": trainer.global_step,
        "tokens_trained": warmup.accounting.tokens_seen,
        "timed_steps": f"{timer.steps[first] + 1}..{timer.steps[last]}",
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "peak_flops_per_device": peak_flops,
        "mfu": flops_per_token * tokens_per_s / peak_flops,
        "last_logged_tokens_per_s": float(trainer.callback_metrics[metrics.TOKENS_PER_S]),
        "last_logged_mfu": float(trainer.callback_metrics[metrics.MFU]),
        "last_train_loss": float(trainer.callback_metrics[metrics.TRAIN_LOSS]),
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if args.accelerator == "gpu" else None,
        # What `plan=true` estimates for this run (lit_cbs.run.plan), to hold against the measured peak above.
        "planned_memory_gib": device_memory(
            ModelShape.measure(model.config),
            args.micro_batch_size,
            args.seq_len,
            args.precision,
            "fsdp",
            1,
            model.activation_checkpointing,
        ).total
        / GIB,
        "wall_s": time.perf_counter() - started,
    }
    if probe is not None:
        # Steps that contain probe branches are slow by design: leave them out of nothing, report them.
        gaps = timer.durations("wall")
        result["probe"] = {
            "history": [r.to_record() for r in probe.history],
            "k1_minus_main_loss": [r.losses["1"] - r.main_loss for r in probe.history],
            "slowest_step_s": max(gaps),
            "median_step_s": sorted(gaps)[len(gaps) // 2],
            "tokens_spent": probe.tokens_spent,
        }
    text = json.dumps(result, indent=2)
    args.output.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
