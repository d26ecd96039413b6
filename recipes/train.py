"""Train an OLMo-style language model with batch size warmup: the Hydra entry point (config: ../conf).

    python recipes/train.py                                  # tiny_warmup: tiny model, stdlib corpus, CPU
    python recipes/train.py +recipe=olmo7b_warmup data.path=/data/tokens trainer.num_nodes=8
    python recipes/train.py -m +recipe=tiny_small_batch,tiny_warmup,tiny_large_batch
    python recipes/train.py +recipe=olmo7b_warmup plan=true trainer.devices=8 trainer.num_nodes=8
    torchrun --nproc_per_node 8 recipes/train.py +recipe=olmo1b_warmup data.path=... hydra.run.dir=outputs/run1

``plan=true`` prints what the run will need (steps per batch phase, memory per device, the CBS probe's cost, wall
time) and exits: no data, no accelerator, no training (lit_cbs.run.plan). A bad setting ends the run before any
data work with one line that names its Hydra key (lit_cbs.run.keys; HYDRA_FULL_ERROR=1 for the traceback), and a
run that ends before its first optimizer step takes back its run folder. Each run folder gets resolved_config.yaml,
metrics.csv, checkpoints/, batch_history.json, summary.json (also printed at the end), the plots and report.html
(lit_cbs.run.report).
"""

from __future__ import annotations

import os

# OpenMP threads that spin while they wait stall each other when other jobs share the cores, which
# slows a small model's step by an order of magnitude; waiting passively costs some speed on idle
# cores, so set OMP_WAIT_POLICY=ACTIVE on a machine of your own (the README gives the measurements).
# Read when torch loads OpenMP: set before importing it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging
import signal
import sys
import time
import warnings
from pathlib import Path

import hydra
import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.metrics import VAL_LOSS
from lit_cbs.run import job, keys
from lit_cbs.run.job import build_run, plan_of
from lit_cbs.run.report import write_report, write_run_summary
from lit_cbs.run.resolvers import register_resolvers, remember_swept_keys

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
    except keys.CONFIG_ERRORS as error:
        job.remove_hydra_run_dir(earlier)
        keys.stop_on_config_error(error)
    output_dir = Path(cfg.output_dir)
    if run.trainer.is_global_zero:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        log.info(job.run_header(run, cfg.run_name, cfg.trainer.accelerator, cfg.output_dir))

    started = time.perf_counter()
    terminated = False
    try:
        run.trainer.fit(run.model, datamodule=run.datamodule, ckpt_path=run.ckpt_path)
    except SIGTERMException:  # stopped at a step boundary, last.ckpt saved: say so, exit non-zero
        terminated = True
    except Exception as error:
        if not job.trained_a_step(run.batch_warmup):  # refused (or failed) before its first step: nothing to keep
            job.remove_hydra_run_dir(earlier)
        if not isinstance(error, LitCBSConfigError):
            raise
        # A check that needs the Trainer (setup, first batch): one line, as for those made while building the run.
        keys.stop_on_config_error(error, keys.name_the_run_keys(cfg, keys.one_line(error)))
    fit_seconds = time.perf_counter() - started

    val_loss = run.trainer.callback_metrics.get(VAL_LOSS)
    if run.trainer.is_global_zero:
        _, ending = write_run_summary(output_dir, cfg.run_name, run.trainer, run.batch_warmup, fit_seconds, cfg.plots)
        if cfg.plots and (output_dir / "metrics.csv").is_file():
            write_report(output_dir)  # report.html: the run on one page, readable offline, with the plots just drawn
        job.finish_loggers(run.trainer.loggers)
        log.info(ending)
    if torch.distributed.is_initialized():  # before exit: a process group torn down at exit can abort the rank
        torch.distributed.destroy_process_group()
    if terminated:  # the shell's code for a run ended by SIGTERM, so schedulers do not read "done"
        raise SystemExit(128 + signal.SIGTERM)
    return float(val_loss) if val_loss is not None else None


if __name__ == "__main__":
    remember_swept_keys(sys.argv[1:])  # for the multirun jobs that run in other processes (submitit's SLURM jobs)
    try:  # a key the configuration lacks, in one line with its fix, before Hydra composes the job and makes its folder
        keys.check_command_line(CONF, sys.argv[1:])
    except LitCBSConfigError as error:
        keys.stop_on_config_error(error)
    main()
