"""A recipe run built from its configuration, group by group (``keys.instantiate_group``), and its run folder."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import shlex
import shutil
from pathlib import Path
from typing import cast

import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from lit_cbs.callbacks.checkpoint import newest_complete, settle, unreadable
from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.data import TokenDataModule
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.models.lm import CausalLM
from lit_cbs.probe.callback import CBSProbeCallback
from lit_cbs.probe.from_checkpoint import RunParts
from lit_cbs.rules.batch_schedules import BatchSchedule, CBSAdaptive
from lit_cbs.run.keys import (
    dict_container,
    group_key,
    instantiate_group,
    instantiate_named,
    model_config_of,
    name_the_keys,
)
from lit_cbs.run.memory import OptimizerState
from lit_cbs.run.plan import RunPlan, batch_phases
from lit_cbs.run.resolvers import devices_per_node

__all__: list[str] = []  # recipes/ call these; users set the Hydra keys

log = logging.getLogger("lit_cbs.train")

# The packages Lightning's loggers need (any one of them), for a one-line error that names the extra.
LOGGER_PACKAGES = {"TensorBoardLogger": ("tensorboard", "tensorboardX"), "MLFlowLogger": ("mlflow",)}
LOGGER_PACKAGES["WandbLogger"] = ("wandb",)
_SIZES = "global batch (batch.schedule)"  # what BatchWarmup.check_sizes names
LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc", "registry")  # resolved by Trainer.fit itself


def batch_warmup_of(cfg: DictConfig) -> BatchWarmup:
    """BatchWarmup with the batch group's arguments (batch.schedule, batch.lr_rule, ...) and max_tokens."""
    return cast(BatchWarmup, instantiate_group(cfg, "batch", _target_="lit_cbs.BatchWarmup", max_tokens=cfg.max_tokens))


def callbacks_of(cfg: DictConfig) -> list[pl.Callback]:
    """``cfg.callbacks``, less (with a warning) any CBS probe whose first window ends past max_tokens."""
    kept = []
    for name, callback in instantiate_named(cfg, "callbacks").items():
        if isinstance(callback, BatchWarmup):
            raise LitCBSConfigError(
                f"callbacks.{name} is a second BatchWarmup; set the run's one at batch.*, and drop it"
            )
        if isinstance(callback, CBSProbeCallback):
            try:
                callback.config.check_inside_run(cfg.max_tokens, f"max_tokens={cfg.max_tokens:,}", whole_span=True)
            except LitCBSConfigError as problem:
                message = name_the_keys(cfg, [f"callbacks.{name}"], str(problem))
                log.warning(
                    f"warning: {message}; training without it. Or raise max_tokens, or set callbacks.{name}=null"
                )
                continue
        kept.append(callback)
    return kept


def _model_and_data(cfg: DictConfig) -> tuple[CausalLM, TokenDataModule]:
    lr_schedule = instantiate_group(cfg, "lr_schedule") if cfg.get("lr_schedule") is not None else None
    model = instantiate_group(cfg, "model", lr_schedule=lr_schedule)  # builds no weights (configure_model does)
    datamodule = instantiate_group(cfg, "data")
    datamodule.check_context(model.dims.context_length)
    return model, datamodule


def probe_parts(cfg: DictConfig, devices: int | None = None, num_nodes: int | None = None) -> RunParts:
    """The run's model, data, BatchWarmup and Trainer settings for a CBS probe of its checkpoint."""
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    for key, value in (("devices", devices), ("num_nodes", num_nodes)):
        if value is not None:
            cfg.trainer[key] = value
    strategy = cfg.trainer.get("strategy")
    if OmegaConf.is_dict(strategy) and str(strategy.get("_target_", "")).endswith("ModelParallelStrategy"):
        strategy.data_parallel_size = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    model, datamodule = _model_and_data(cfg)
    dropped = ("_target_", "callbacks", "logger", "default_root_dir", "enable_checkpointing")
    settings = {key: value for key, value in dict_container(cfg.trainer, resolve=True).items() if key not in dropped}
    if isinstance(settings.get("strategy"), dict):
        with group_key(cfg, "trainer.strategy"):
            settings["strategy"] = instantiate(cfg.trainer.strategy)
    return RunParts(model, datamodule, settings, [batch_warmup_of(cfg)])


def probe_parts_of(config: str) -> RunParts:
    """``probe_parts`` of the run whose ``resolved_config.yaml`` is ``config`` (``conf/side_jobs/``'s build)."""
    recipe = OmegaConf.load(config)
    if not isinstance(recipe, DictConfig):
        raise LitCBSConfigError(f"{config} holds a list, not a recipe run's configuration (a mapping)")
    return probe_parts(recipe)


def _installed(package: str) -> bool:
    with contextlib.suppress(ValueError):  # ValueError: in sys.modules as None, its import blocked
        return importlib.util.find_spec(package) is not None
    return False


def loggers_of(cfg: DictConfig) -> list[Logger]:
    """``cfg.logger``'s loggers, with a CSV logger writing ``<output_dir>/metrics.csv`` if none does."""
    for name, node in (cfg.get("logger") or {}).items():
        target = str((node or {}).get("_target_", "")).rsplit(".", 1)[-1]
        packages = LOGGER_PACKAGES.get(target, ())
        if packages and not any(_installed(package) for package in packages):
            raise LitCBSConfigError(
                f"logger.{name}: {target} needs the {packages[0]} package, which is not installed: "
                f'pip install -e ".[loggers]" (or pip install {packages[0]}), or drop it (logger=csv)'
            )
    loggers = list(instantiate_named(cfg, "logger").values())
    output_dir = Path(cfg.output_dir)
    if not any(isinstance(logger, CSVLogger) and Path(logger.log_dir) == output_dir for logger in loggers):
        # First, where logger=csv puts it: the Trainer's log_dir (cbs_probe.jsonl's folder) is the first logger's.
        loggers.insert(0, CSVLogger(output_dir, name="", version=""))
    return loggers


def finish_loggers(loggers: list[Logger]) -> None:
    """End W&B's run (else a sweep's next job logs into it) and close TensorBoard's writer, once the figures are in."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()
        elif isinstance(logger, TensorBoardLogger):
            logger.experiment.close()


def resume_checkpoint(cfg: DictConfig) -> str | None:
    """The checkpoint ``trainer.fit`` resumes from (``ckpt_path=auto``: the newest complete one)."""
    given: str | None = cfg.ckpt_path
    if given is None or given in LIGHTNING_CHECKPOINT_NAMES:
        return given
    # The checkpoint callback's folder, and the run folder (Lightning's hpc_ckpt_<n>.ckpt at SLURM's requeue).
    dirpath = ((cfg.get("callbacks") or {}).get("checkpoint") or {}).get("dirpath")
    folders = [Path(dirpath), Path(cfg.output_dir)] if dirpath else [Path(cfg.output_dir)]
    for folder in folders:
        settle(folder)
    if given == "auto":
        found = newest_complete(folders)
        if found is not None:
            log.info(f"resuming from {found} (ckpt_path=auto: the newest complete checkpoint of this run folder)")
        return str(found) if found is not None else None
    path = Path(given)
    settle(path.parent)
    problem = unreadable(path)
    if problem is None:
        return given
    newest = newest_complete([path.parent, *folders])
    fix = f"resume from the newest complete one, ckpt_path={newest}" if newest else "ckpt_path=null starts afresh"
    kind = "a .ckpt file, or a .ckpt folder under trainer=fsdp"
    raise LitCBSConfigError(f"ckpt_path={given} is not a complete checkpoint ({kind}): {problem}; {fix}")


def send_lightning_logs_to_the_job_log() -> None:
    """Lightning's messages go to Hydra's handlers, so ``train.log`` holds them too."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        lightning_logger = logging.getLogger(name)
        lightning_logger.handlers.clear()
        lightning_logger.propagate = True


def _hydra_run() -> tuple[Path, Path, list[logging.FileHandler]] | None:
    """(run folder, start folder, the job's log handlers) on rank 0 of a single Hydra run, else None."""
    if not HydraConfig.initialized() or rank_zero_only.rank != 0:  # type: ignore[attr-defined]  # set at import
        return None
    config = HydraConfig.get()
    run_dir = Path(config.runtime.output_dir)
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    logs = [handler for handler in handlers if Path(handler.baseFilename).parent == run_dir]
    return (run_dir, Path(config.runtime.cwd), logs) if config.mode == RunMode.RUN else None


def earlier_entries() -> frozenset[str]:
    """What a job that trains nothing keeps of its run folder: all of an earlier run's, else nothing."""
    if (run := _hydra_run()) is None or not run[0].is_dir():
        return frozenset()
    entries = frozenset(entry.name for entry in run[0].iterdir())
    hydra_own = {Path(handler.baseFilename).name for handler in run[2]} | {HydraConfig.get().output_subdir}
    return frozenset() if entries <= hydra_own else entries


def remove_hydra_run_dir(kept: frozenset[str]) -> None:
    """Remove what a job that trained nothing wrote (all but ``kept``), and the folders left empty."""
    if (run := _hydra_run()) is None:
        return
    run_dir, start, logs = run
    for handler in logs:
        if Path(handler.baseFilename).name not in kept:
            handler.close()
            logging.getLogger().removeHandler(handler)
    for entry in run_dir.iterdir() if run_dir.is_dir() else []:
        if entry.name not in kept:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)
    start, folder = start.resolve(), run_dir.resolve()
    while folder != start and start in folder.parents and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def trained_a_step(warmup: BatchWarmup) -> bool:
    """Whether this ``trainer.fit`` read a global batch of samples since ``on_fit_start``."""
    a = warmup.accounting  # None: the fit failed before setup, read nothing, and its own error is the one to see
    return a is not None and a.global_batch is not None and a.samples_seen - a.samples_at_fit_start >= a.global_batch


@dataclasses.dataclass
class Run:
    """A recipe run's objects, built and checked."""

    trainer: pl.Trainer
    model: CausalLM
    datamodule: TokenDataModule
    batch_warmup: BatchWarmup
    ckpt_path: str | None = None  # the checkpoint trainer.fit resumes from (job.resume_checkpoint)


def batches_reached(schedule: BatchSchedule, max_tokens: int, seq_len: int) -> str:
    """The global batches (samples) the run trains at within max_tokens, and any it ends before."""
    if isinstance(schedule, CBSAdaptive):  # its batches come from the probe's readings
        return f"{schedule.start} -> up to {schedule.final} samples (batch.schedule, by CBS readings)"
    phases = batch_phases(schedule, max_tokens, seq_len, 1, 1, lambda ratio: 1.0)
    reached = list(dict.fromkeys(phase.global_batch for phase in phases))
    text = f"{' -> '.join(map(str, reached))} samples"
    never = [size for size in schedule.sizes(0) if size not in reached]
    if never:
        them = "it" if len(never) == 1 else "them"
        text += f" (not {', '.join(map(str, never))}: batch.schedule asks for {them} after max_tokens={max_tokens:,})"
    return text


def run_header(run: Run, run_name: str, accelerator: str, output_dir: str | os.PathLike[str]) -> str:
    """The line a run starts with: its model, processes, precision, batches and token budget."""
    dims, datamodule, warmup = run.model.dims, run.datamodule, run.batch_warmup
    max_tokens = warmup.max_tokens
    assert max_tokens is not None  # job.batch_warmup_of gives the run's BatchWarmup its max_tokens
    return (
        f"lit_cbs: {run_name}: model {dims.n_layers} layers x d_model {dims.d_model} "
        f"({run.model.num_parameters():,} parameters), {run.trainer.world_size} process(es) on {accelerator}, "
        f"precision {run.trainer.precision}, micro-batch {datamodule.batch_size} x {datamodule.seq_len} tokens, "
        f"global batch {batches_reached(warmup.schedule, max_tokens, datamodule.seq_len)}, "
        f"budget {max_tokens:,} tokens; output {output_dir}"
    )


def plan_of(cfg: DictConfig) -> RunPlan:
    """The run's plan from its configuration alone: no data, no accelerator, no model weights."""
    law = None
    if cfg.plan_for.get("law") is not None:
        from lit_cbs.analysis.law import CBSLaw  # scipy: only for a plan that asks

        try:
            law = CBSLaw.load(cfg.plan_for.law)
        except ValueError as error:
            raise LitCBSConfigError(f"plan_for.law: {error}") from None
        if law.covariate != "tokens":
            raise LitCBSConfigError(
                f"plan_for.law={cfg.plan_for.law} is a law in the {law.covariate}; a plan needs one in the tokens"
            )
    model_config = model_config_of(cfg)
    model, datamodule = _model_and_data(cfg)
    warmup = batch_warmup_of(cfg)
    probes = [probe for probe in instantiate_named(cfg, "callbacks").values() if isinstance(probe, CBSProbeCallback)]
    devices = devices_per_node(cfg.trainer.devices, "plan=true sizes the run from it")
    num_nodes = int(cfg.trainer.num_nodes)
    warmup.check_sizes(warmup.schedule.sizes(0), datamodule.batch_size, devices * num_nodes, _SIZES)
    strategy = cfg.trainer.get("strategy", "auto")
    target = str(strategy.get("_target_", "")) if OmegaConf.is_dict(strategy) else str(strategy)
    fsdp = target.endswith(("ModelParallelStrategy", "FSDPStrategy")) or target.startswith("fsdp")
    limits = dict_container(cfg.plan_for, resolve=True)
    if cfg.model.get("peak_flops_per_device"):
        limits["peak_flops_per_device"] = float(cfg.model.peak_flops_per_device)
    try:  # the job's overrides, less plan=true and what the plan's commands set
        moved = ("plan=", "plan_for.", "trainer.num_nodes=", "trainer.max_steps=", "ckpt_path=", "hydra.run.dir=")
        overrides = [override for override in HydraConfig.get().overrides.task if not override.startswith(moved)]
        slurm_arguments = [override for override in overrides if not override.startswith("trainer.devices=")]
    except ValueError:  # no Hydra job: composed by a script or a test
        overrides, slurm_arguments = [], []
    return RunPlan(
        name=cfg.run_name,
        model_config=model_config,
        schedule=warmup.schedule,
        lr_factor=warmup.lr_rule.factor,
        max_tokens=int(cfg.max_tokens),
        seq_len=datamodule.seq_len,
        micro_batch=datamodule.batch_size,
        val_micro_batch=datamodule.val_batch_size,
        precision=str(cfg.trainer.precision),
        strategy="fsdp" if fsdp else "ddp" if devices * num_nodes > 1 else "single",
        accelerator=str(cfg.trainer.accelerator),
        devices_per_node=devices,
        num_nodes=num_nodes,
        activation_checkpointing=bool(cfg.model.get("activation_checkpointing", False)),
        probe_callback=probes[0] if probes else None,
        optimizer=OptimizerState.measure(model.optimizer_factory),
        max_micro_batch_size=warmup.max_micro_batch_size,
        command=f"recipes/train.py {' '.join(map(shlex.quote, overrides)) or f'+recipe={cfg.run_name}'}",
        slurm_arguments=" ".join(map(shlex.quote, slurm_arguments)) or f"+recipe={cfg.run_name}",
        corpus=cfg.data.get("corpus"),
        **{**limits, "law": law},
    )


def build_run(cfg: DictConfig) -> Run:
    """Check the configuration and build the run, each setting before the data work it would waste."""
    if str(cfg.trainer.accelerator) in ("gpu", "cuda") and not torch.cuda.is_available():
        raise LitCBSConfigError(
            f"trainer.accelerator={cfg.trainer.accelerator} but this machine has no CUDA GPU; add plan=true to see "
            "this run's plan (memory per GPU, steps, wall time) here, or train a tiny recipe on the CPU "
            "(python recipes/train.py, or +recipe=tiny_warmup)"
        )
    ckpt_path = resume_checkpoint(cfg)
    model_config_of(cfg)  # a bad model.config fails here, naming its key, before the data settings
    if not cfg.allow_default_corpus and cfg.data.path is None and cfg.data.input_dir is None:
        raise LitCBSConfigError(
            "this recipe trains on your tokens, not the embedded corpus (allow_default_corpus=false): set "
            "data.path=<folder prepared by lit_cbs.data.prepare>, or data.input_dir=<folder of text files> "
            "data.tokenizer=<tokenizer.json>"
        )
    model, datamodule = _model_and_data(cfg)
    warmup = batch_warmup_of(cfg)
    callbacks = [warmup, *callbacks_of(cfg)]
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
    trainer = instantiate_group(cfg, "trainer", callbacks=callbacks, logger=loggers_of(cfg))
    warmup.check_sizes(warmup.schedule.sizes(0), datamodule.batch_size, trainer.world_size, _SIZES)

    # One process per node tokenizes a new source; Lightning's prepare_data in fit is then a cache hit.
    if trainer.local_rank == 0:
        datamodule.prepare_data()
    if datamodule.vocab_size > model.dims.vocab_size:
        raise LitCBSConfigError(
            f"the data's token ids go up to {datamodule.vocab_size - 1} but the model's vocab_size is "
            f"{model.dims.vocab_size}; use a larger model.config.vocab_size or the model's tokenizer (data.tokenizer)"
        )
    return Run(trainer, model, datamodule, warmup, ckpt_path)
