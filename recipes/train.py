"""Train an OLMo-style language model with batch size warmup: the Hydra entry point (config: ../conf).

    python recipes/train.py                                  # tiny_warmup: tiny model, stdlib corpus, CPU
    python recipes/train.py +recipe=olmo7b_warmup data.path=/data/tokens trainer.num_nodes=8
    python recipes/train.py -m +recipe=tiny_small_batch,tiny_warmup,tiny_large_batch
    python recipes/train.py +recipe=olmo7b_warmup plan=true trainer.devices=8 trainer.num_nodes=8
    torchrun --nproc_per_node 8 recipes/train.py +recipe=olmo1b_warmup data.path=... hydra.run.dir=outputs/run1

``plan=true`` prints what the run will need (steps per batch phase, memory per device, the CBS
probe's host memory and tokens, wall time at an assumed MFU) and exits: no data, no accelerator,
no training (lit_cbs.run.plan). The configuration is checked before any model is built; a bad
setting ends the run with one line that names its Hydra key (lit_cbs.run.job; set
HYDRA_FULL_ERROR=1 for the traceback), and a run that ends before its first optimizer step takes back
its run folder. Each run folder gets the resolved config
(resolved_config.yaml), metrics.csv, checkpoints/ and what lit_cbs.run.run_report writes:
batch_history.json, summary.json (also printed at the run's end) and the plots, which report.html
(lit_cbs.run.report) embeds.
"""

from __future__ import annotations

import os

# OpenMP threads that spin while they wait stall each other when other jobs share the cores, which
# slows a small model's step by an order of magnitude; waiting passively costs some speed on idle
# cores, so set OMP_WAIT_POLICY=ACTIVE on a machine of your own (the README gives the measurements).
# Read when torch loads OpenMP: set before importing it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging
import shlex
import signal
import sys
import time
import warnings
from pathlib import Path

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from lit_cbs import CBSAdaptive, CBSProbeCallback
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.metrics import VAL_LOSS
from lit_cbs.run import job
from lit_cbs.run.plan import Limits, OptimizerState, RunPlan, plan_run
from lit_cbs.run.report import write_report
from lit_cbs.run.resolvers import devices_per_node, register_resolvers, remember_swept_keys
from lit_cbs.run.run_report import Run, run_header, write_run_summary

CONF = Path(__file__).resolve().parents[1] / "conf"  # hydra.main's config_path below

register_resolvers()
# The CSV logger writes into the Hydra run folder, which already holds Hydra's own files.
warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
# conf/config.yaml puts ./conf on Hydra's search path, for options of your own beside the package's; a folder
# without one is the usual case, not a problem to warn about.
warnings.filterwarnings("ignore", message=r"provider=hydra\.searchpath in main, path=conf is not available")
# litdata's StreamingDataset has a length and splits its items among a loader's workers itself, which
# is what Lightning's warning about an IterableDataset with __len__ asks for.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")

log = logging.getLogger("lit_cbs.train")


def plan_of(cfg: DictConfig) -> RunPlan:
    """The run's plan from its configuration alone: no data, no accelerator, no model weights."""
    model_config = job.model_config_of(cfg)
    if cfg.get("lr_schedule") is not None:
        job.instantiate_group(cfg, "lr_schedule")  # its checks against max_tokens, as a run makes them
    model = job.instantiate_group(cfg, "model")  # checks model.optimizer; builds no weights
    datamodule = job.instantiate_group(cfg, "data")
    datamodule.check_context(model.dims.context_length)
    warmup = job.batch_warmup_of(cfg)
    probes = [
        callback
        for callback in job.instantiate_named(cfg, "callbacks").values()
        if isinstance(callback, CBSProbeCallback)
    ]
    devices = devices_per_node(cfg.trainer.devices, "plan=true sizes the run from it")
    num_nodes = int(cfg.trainer.num_nodes)
    warmup.check_sizes(
        warmup.schedule.sizes(0), datamodule.batch_size, devices * num_nodes, "global batch (batch.schedule)"
    )
    strategy = cfg.trainer.get("strategy", "auto")
    target = str(strategy.get("_target_", "")) if OmegaConf.is_dict(strategy) else str(strategy)
    if target.endswith(("ModelParallelStrategy", "FSDPStrategy")) or target.startswith("fsdp"):
        kind = "fsdp"
    else:
        kind = "ddp" if devices * num_nodes > 1 else "single"
    limits = job.dict_container(cfg.plan_for, resolve=True)
    if cfg.model.get("peak_flops_per_device"):
        limits["peak_flops_per_device"] = float(cfg.model.peak_flops_per_device)
    try:  # the job's overrides, less plan=true and what the plan's commands set
        moved = ("plan=", "plan_for.", "trainer.num_nodes=", "trainer.max_steps=", "ckpt_path=", "hydra.run.dir=")
        overrides = [override for override in HydraConfig.get().overrides.task if not override.startswith(moved)]
        slurm_arguments = [override for override in overrides if not override.startswith("trainer.devices=")]
    except ValueError:  # no Hydra job: composed by a script or a test
        overrides, slurm_arguments = [], []
    optimizer = job.dict_container(cfg.model.optimizer, resolve=True) if cfg.model.get("optimizer") else {}
    start = {"weight_decay": optimizer.get("weight_decay"), "beta2": (optimizer.get("betas") or [None, None])[1]}
    rules = [rule for rule in warmup.rules.settings if start[rule.key] is not None]  # the settings BatchWarmup moves

    def settings(changes: list[tuple[float, float]]) -> dict[str, float]:  # a phase's, change by change as BatchWarmup
        values = {rule.key: float(start[rule.key]) for rule in rules}
        for ratio, lr_factor in changes:
            values = {rule.key: rule.scaled(values[rule.key], ratio, lr_factor) for rule in rules}
        return values

    return plan_run(
        name=cfg.run_name,
        config=model_config,
        schedule=warmup.schedule,
        lr_factor=warmup.lr_rule.factor,
        max_tokens=int(cfg.max_tokens),
        seq_len=datamodule.seq_len,
        micro_batch=datamodule.batch_size,
        val_micro_batch=datamodule.val_batch_size,
        precision=str(cfg.trainer.precision),
        strategy=kind,
        accelerator=str(cfg.trainer.accelerator),
        devices_per_node=devices,
        num_nodes=num_nodes,
        activation_checkpointing=bool(cfg.model.get("activation_checkpointing", False)),
        probe=probes[0] if probes else None,
        limits=Limits(**limits),
        optimizer=OptimizerState.measure(model.optimizer_factory),
        max_micro_batch_size=warmup.max_micro_batch_size,
        command=f"recipes/train.py {' '.join(map(shlex.quote, overrides)) or f'+recipe={cfg.run_name}'}",
        slurm_arguments=" ".join(map(shlex.quote, slurm_arguments)) or f"+recipe={cfg.run_name}",
        settings=settings if rules else None,
    )


def build_run(cfg: DictConfig) -> Run:
    """Check the configuration and build the run; nothing here builds the model's weights.

    Order: model and optimizer settings (CausalLM builds model.optimizer on a stand-in parameter),
    data settings, callbacks, trainer (it knows the process count), the global batch against
    micro-batch x processes, then the data source (prepared here once per node if needed) and its
    vocabulary against the model's.
    """
    if str(cfg.trainer.accelerator) in ("gpu", "cuda") and not torch.cuda.is_available():
        raise LitCBSConfigError(
            f"trainer.accelerator={cfg.trainer.accelerator} but this machine has no CUDA GPU; add plan=true to see "
            "this run's plan (memory per GPU, steps, wall time) here, or train a tiny recipe on the CPU "
            "(python recipes/train.py, or +recipe=tiny_warmup)"
        )
    ckpt_path = job.resume_checkpoint(cfg)
    job.model_config_of(cfg)  # a bad model.config fails here, naming its key, before the data settings
    if not cfg.allow_default_corpus and cfg.data.path is None and cfg.data.input_dir is None:
        raise LitCBSConfigError(
            "this recipe trains on your tokens, not the embedded corpus (allow_default_corpus=false): set "
            "data.path=<folder prepared by lit_cbs.data.prepare>, or data.input_dir=<folder of text files> "
            "data.tokenizer=<tokenizer.json>"
        )
    lr_schedule = job.instantiate_group(cfg, "lr_schedule") if cfg.get("lr_schedule") is not None else None
    model = job.instantiate_group(
        cfg, "model", lr_schedule=lr_schedule
    )  # the decoder is built in configure_model, during fit
    datamodule = job.instantiate_group(cfg, "data")
    datamodule.check_context(model.dims.context_length)

    warmup = job.batch_warmup_of(cfg)
    callbacks = [warmup, *job.callbacks_of(cfg)]
    schedule = warmup.schedule
    if isinstance(schedule, CBSAdaptive) and warmup.lacks_a_feeder(callbacks, resumed=ckpt_path is not None):
        raise LitCBSConfigError(
            f"batch.schedule is CBSAdaptive, which grows the batch only on CBS readings, but the run has no probe "
            f"(callbacks.cbs_probe is null, or its first window ends past max_tokens), so the batch would stay "
            f"{schedule.start}: set callbacks.cbs_probe (as the tiny_adaptive recipe does), "
            "or a fixed schedule (batch=warmup)"
        )
    if not cfg.trainer.get("enable_progress_bar", True):  # the switch a user reaches for turns lit_cbs's bar off too
        callbacks = [callback for callback in callbacks if not isinstance(callback, ProgressBar)]
    trainer = job.instantiate_group(cfg, "trainer", callbacks=callbacks, logger=job.loggers_of(cfg))
    warmup.check_sizes(
        warmup.schedule.sizes(0), datamodule.batch_size, trainer.world_size, "global batch (batch.schedule)"
    )

    # One process per node tokenizes a new source; Lightning's prepare_data in fit is then a cache hit.
    if trainer.local_rank == 0:
        datamodule.prepare_data()
    if datamodule.vocab_size > model.dims.vocab_size:
        raise LitCBSConfigError(
            f"the data's token ids go up to {datamodule.vocab_size - 1} but the model's vocab_size is "
            f"{model.dims.vocab_size}; use a larger model.config.vocab_size or the model's tokenizer (data.tokenizer)"
        )
    return Run(trainer, model, datamodule, warmup, ckpt_path)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Train; return the final val/loss (for Hydra sweepers)."""
    earlier = job.earlier_entries()  # what a job that trains nothing leaves in its run folder
    job.send_lightning_logs_to_the_job_log()
    torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    try:
        if cfg.plan:
            log.info(plan_of(cfg).report())
            job.remove_hydra_run_dir(earlier)
            return None
        pl.seed_everything(cfg.seed, workers=True)
        run = build_run(cfg)
    except job.CONFIG_ERRORS as error:
        job.remove_hydra_run_dir(earlier)
        job.stop_on_config_error(error)
    output_dir = Path(cfg.output_dir)
    if run.trainer.is_global_zero:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        log.info(run_header(run, cfg.run_name, cfg.trainer.accelerator, cfg.output_dir))

    started = time.perf_counter()
    terminated = False
    try:
        run.trainer.fit(run.model, datamodule=run.datamodule, ckpt_path=run.ckpt_path)
    except (
        SIGTERMException
    ):  # stopped at a step boundary, last.ckpt saved (lit_cbs.callbacks.checkpoint): say so, exit non-zero
        terminated = True
    except Exception as error:
        if not job.trained_a_step(run.batch_warmup):  # refused (or failed) before its first step: nothing to keep
            job.remove_hydra_run_dir(earlier)
        if not isinstance(error, LitCBSConfigError):
            raise
        # A check that needs the Trainer (setup, first batch): one line, as for those made while building the run.
        job.stop_on_config_error(error, job.name_the_run_keys(cfg, job.one_line(error)))
    fit_seconds = time.perf_counter() - started

    val_loss = run.trainer.callback_metrics.get(VAL_LOSS)
    if run.trainer.is_global_zero:
        _, ending = write_run_summary(output_dir, cfg.run_name, run.trainer, run.batch_warmup, fit_seconds, cfg.plots)
        if cfg.plots and (output_dir / "metrics.csv").is_file():
            write_report(output_dir)  # report.html: the run on one page, readable offline, with the plots just drawn
        job.finish_loggers(run.trainer.loggers)
        log.info(ending)
    if (
        torch.distributed.is_initialized()
    ):  # before the interpreter exits: a process group torn down at exit can abort the rank
        torch.distributed.destroy_process_group()
    if terminated:
        raise SystemExit(
            128 + signal.SIGTERM
        )  # the shell's code for a run ended by SIGTERM, so schedulers do not read "done"
    return float(val_loss) if val_loss is not None else None


if __name__ == "__main__":
    remember_swept_keys(sys.argv[1:])  # for the multirun jobs that run in other processes (submitit's SLURM jobs)
    try:  # a key the configuration lacks, in one line with its fix, before Hydra composes the job and makes its folder
        job.check_command_line(CONF, sys.argv[1:])
    except LitCBSConfigError as error:
        job.stop_on_config_error(error)
    main()
