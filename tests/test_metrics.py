"""lit_cbs.metrics names every column a run logs: a real run with every writer (CausalLM, BatchWarmup with its
guard and rules, CBSProbeCallback, GradientNoiseScale per block) writes only those names into metrics.csv, and
the names users know are the ones they always were."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from toys import fit_quietly, trainer_kwargs

from lit_cbs import BatchWarmup, CBSProbeCallback, GradientNoiseScale, PiecewiseBatch, metrics
from lit_cbs.data.synthetic import RandomTokenData
from lit_cbs.models.lm import CausalLM

TINY = {
    "vocab_size": 64,
    "d_model": 16,
    "n_layers": 2,
    "n_heads": 2,
    "mlp_hidden": 32,
    "context_length": 16,
    "tie_embeddings": False,
}
# What users read in their metrics.csv, spelled out: renaming one breaks their plots and scripts.
KNOWN = {
    "step", "epoch", "train/loss", "val/loss", "perf/tokens_per_s", "lr", "tokens_seen", "samples_seen", "fit_seconds",
    "batch/global_size", "batch/micro_batch_size", "batch/accumulate", "batch/lr_factor", "batch/gradient_clip_val",
    "batch/weight_decay", "batch/guard_reverts", "batch/guard_rise", "batch/guard_threshold", "cbs/lower",
    "cbs/estimate", "cbs/k_star", "cbs/determined", "cbs/gap_k2", "probe/overhead", "probe/tokens_spent",
    "gns/b_simple", "gns/trace_sigma", "gns/grad_sq", "gns/block0/b_simple", "gns/block1/grad_sq",
}  # fmt: skip


def test_a_run_logs_the_names_lit_cbs_metrics_defines(tmp_path):
    # 12 steps of 8 x 16 tokens, 16 from 768 tokens (after step 6): a probe, a guard verdict, the noise scale.
    pl.seed_everything(0, verbose=False)
    schedule = PiecewiseBatch([8, 16], [0, 768], unit="tokens")
    rules = dict(lr_rule="sqrt", weight_decay_rule="timescale")
    warmup = BatchWarmup(schedule, clip_rule="sqrt", guard={"min_steps": 3}, **rules)
    probe = CBSProbeCallback(at_tokens=[256], multipliers=(1, 2), window_tokens=256, **rules)
    noise = GradientNoiseScale(groups="blocks")
    trainer = pl.Trainer(
        callbacks=[warmup, probe, noise],
        **trainer_kwargs(
            max_steps=12,
            gradient_clip_val=1.0,
            logger=CSVLogger(tmp_path, name="run"),
            log_every_n_steps=1,
            val_check_interval=8,
            num_sanity_val_steps=0,
        ),
    )
    data = RandomTokenData(vocab_size=64, seq_len=16, batch_size=4, samples=512)
    data.val_dataloader = lambda: torch.utils.data.DataLoader(data.tokens[:8], batch_size=4)
    fit_quietly(trainer, CausalLM(TINY, lr_schedule=None), datamodule=data)

    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        logged = set(csv.DictReader(f).fieldnames)
    assert warmup.guard.verdicts and probe.history and {"block0", "block1"}.issubset(noise.group_names)
    assert KNOWN.issubset(logged), sorted(KNOWN - logged)
    named = {value for name, value in vars(metrics).items() if name.isupper() and isinstance(value, str)}
    named |= {metrics.batch_setting("weight_decay"), "epoch"}  # epoch: Lightning's own column
    named |= {f(k) for reading in probe.history for k in reading.losses for f in (metrics.cbs_gap, metrics.cbs_gap_se)}
    named |= {metrics.gns(q, group) for group in [None, *noise.group_names] for q in metrics.GNS_QUANTITIES}
    assert logged <= named, sorted(logged - named)
