"""One-GPU check of the training stack: OLMo-1B shape, FSDP2, bf16, a batch change mid-run.

    python benchmarks/gpu_check.py --output gpu_check.json

Trains ``lit_cbs.lm.CausalLM`` (olmo_1b preset, all 16 layers unless --n-layers says fewer)
through Lightning's ModelParallelStrategy (FSDP2, one process), bf16-mixed, activation
checkpointing, AdamW and the token-indexed LR schedule, with ``BatchWarmup`` doubling the global
batch from 8 to 16 sequences of 4096 tokens after --steps-before-change optimizer steps. The
tokens are random (uniform over the vocabulary): this measures speed and memory, not learning.
Prints, and writes to --output, JSON with tokens/s over the optimizer steps after the first
--skip-steps (wall time between steps, CUDA-synchronized), MFU = model FLOPs per token
(``OLMo.flops_per_token``: 6N + attention, recomputation not counted) x tokens/s / peak, the
peak used (--peak-tflops, default 989: dense bf16 of an H100/H200 SXM), peak memory and the
batch change. Takes about a minute after start-up on an H200.

``--probe`` also attaches ``CBSProbeCallback`` (grid k = 1, 2 over a window of
--probe-window-steps steps, snapshots on the CPU) right after the batch change, and reports the
branch losses, the difference between the k = 1 branch and the main run over the same window
(0 where the GPU kernels are deterministic) and the probe's seconds and tokens.

Imports only torch, lightning, torchmetrics and lit_cbs modules that need nothing else, so it
runs where hydra-core, omegaconf and litdata are not installed. ``--accelerator cpu --preset tiny``
runs the same path on a CPU (tests/test_train.py does, as a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, IterableDataset

from lit_cbs.lm import CausalLM
from lit_cbs.lr_schedules import WarmupStableDecay
from lit_cbs.plan import GIB, ModelShape, device_memory
from lit_cbs.probe import CBSProbeCallback
from lit_cbs.schedules import PiecewiseBatch
from lit_cbs.warmup import BatchWarmup

H200_DENSE_BF16_TFLOPS = 989.0


class RandomTokens(IterableDataset):
    """An endless stream of samples of ``seq_len + 1`` token ids drawn uniformly from [0, vocab_size)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            yield torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)


class RandomTokenData(pl.LightningDataModule):
    """Micro-batches of ``batch_size`` random samples; ``batch_size`` and ``seq_len`` as BatchWarmup reads them."""

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, seed: int = 0):
        super().__init__()
        self.vocab_size, self.seq_len, self.batch_size, self.seed = vocab_size, seq_len, batch_size, seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(self.vocab_size, self.seq_len, self.seed), batch_size=self.batch_size)


class StepClock(pl.Callback):
    """Records (optimizer step, seconds, tokens seen) after every optimizer step."""

    def __init__(self, warmup: BatchWarmup):
        self.warmup = warmup
        self.records: list[tuple[int, float, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.records and self.records[-1][0] == trainer.global_step:
            return  # accumulating
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self.records.append((trainer.global_step, time.perf_counter(), self.warmup.tokens_seen))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="where to write the JSON result")
    parser.add_argument("--preset", default="olmo_1b", help="model preset (lit_cbs.models.PRESETS)")
    parser.add_argument("--n-layers", type=int, default=None, help="fewer layers than the preset (default: the preset's)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sample")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward pass")
    parser.add_argument("--steps-before-change", type=int, default=10, help="optimizer steps at the first batch")
    parser.add_argument("--steps-after-change", type=int, default=10, help="optimizer steps at the doubled batch")
    parser.add_argument("--skip-steps", type=int, default=3, help="first optimizer steps left out of tokens/s")
    parser.add_argument("--peak-tflops", type=float, default=H200_DENSE_BF16_TFLOPS,
                        help="peak TFLOP/s of the device at this precision, for MFU (default: H100/H200 SXM dense bf16)")
    parser.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--no-activation-checkpointing", action="store_true")
    parser.add_argument("--probe", action="store_true", help="also run a CBS probe (k = 1, 2) after the change")
    parser.add_argument("--probe-window-steps", type=int, default=4, help="probe window, in steps at the doubled batch")
    return parser.parse_args()


def main() -> dict:
    args = parse_args()
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU visible; this check needs one (or --accelerator cpu for a smoke test)")
    if args.skip_steps >= args.steps_before_change + args.steps_after_change - 1:
        raise SystemExit("error: --skip-steps must leave at least two optimizer steps to time")
    started = time.perf_counter()
    pl.seed_everything(0)
    torch.set_float32_matmul_precision("high")

    config = {"preset": args.preset} | ({"n_layers": args.n_layers} if args.n_layers else {})
    first_batch = args.micro_batch_size  # one micro-batch per step, then two after the change
    change_at = args.steps_before_change * first_batch * args.seq_len
    max_tokens = change_at + args.steps_after_change * 2 * first_batch * args.seq_len
    model = CausalLM(
        config,
        lr=4e-4,
        lr_schedule=WarmupStableDecay(warmup_tokens=change_at // 2, total_tokens=max_tokens),
        activation_checkpointing=not args.no_activation_checkpointing,
        peak_flops_per_device=args.peak_tflops * 1e12,
    )
    data = RandomTokenData(model.config.vocab_size, args.seq_len, args.micro_batch_size)
    warmup = BatchWarmup(PiecewiseBatch([first_batch, 2 * first_batch], [0, change_at], unit="tokens"), max_tokens=max_tokens)
    clock = StepClock(warmup)
    callbacks = [warmup, clock]
    probe = None
    if args.probe:
        window = args.probe_window_steps * 2 * first_batch * args.seq_len
        if change_at + 4 * first_batch * args.seq_len + window > max_tokens:
            raise SystemExit("error: --steps-after-change leaves no room for the probe window; raise it")
        probe = CBSProbeCallback(
            at_tokens=[change_at + 4 * first_batch * args.seq_len],  # a few steps after the change
            multipliers=(1, 2),
            window_tokens=window,
            strategy="grid",
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

    timed = clock.records[args.skip_steps :]
    (first_step, first_time, first_tokens), (last_step, last_time, last_tokens) = timed[0], timed[-1]
    tokens_per_s = (last_tokens - first_tokens) / (last_time - first_time)
    flops_per_token = model.flops_per_token(args.seq_len)
    result = {
        "device": torch.cuda.get_device_name() if args.accelerator == "gpu" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "strategy": "ModelParallelStrategy (FSDP2 fully_shard per block and root), 1 process",
        "precision": args.precision,
        "activation_checkpointing": model.activation_checkpointing,
        "model": dataclasses.asdict(model.config),
        "parameters": model.num_parameters(),
        "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size,
        "batch_changes": [dataclasses.asdict(change) for change in warmup.history],
        "optimizer_steps": trainer.global_step,
        "tokens_trained": warmup.tokens_seen,
        "timed_steps": f"{first_step + 1}..{last_step}",
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "peak_flops_per_device": args.peak_tflops * 1e12,
        "mfu": flops_per_token * tokens_per_s / (args.peak_tflops * 1e12),
        "last_logged_tokens_per_s": float(trainer.callback_metrics["perf/tokens_per_s"]),
        "last_logged_mfu": float(trainer.callback_metrics["perf/mfu"]),
        "last_train_loss": float(trainer.callback_metrics["train/loss"]),
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if args.accelerator == "gpu" else None,
        # What `plan=true` estimates for this run (lit_cbs.plan), to hold against the measured peak above.
        "planned_memory_gib": device_memory(
            ModelShape.of(model.config), args.micro_batch_size, args.seq_len, args.precision, "fsdp", 1,
            model.activation_checkpointing,
        ).total / GIB,
        "wall_s": time.perf_counter() - started,
    }
    if probe is not None:
        # Steps that contain probe branches are slow by design: leave them out of nothing, report them.
        gaps = [b[1] - a[1] for a, b in zip(clock.records, clock.records[1:])]
        result["probe"] = {
            "history": probe.history,
            "k1_minus_main_loss": [r["losses"]["1"] - r["main_loss"] for r in probe.history],
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
