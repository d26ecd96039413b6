"""Train an OLMo-style language model with batch size warmup: the Hydra entry point (config: ../conf).

    python recipes/train.py                                  # tiny_warmup: tiny model, stdlib corpus, CPU
    python recipes/train.py +recipe=olmo7b_warmup data.path=/data/tokens trainer.num_nodes=8
    python recipes/train.py -m +recipe=tiny_small_batch,tiny_warmup,tiny_large_batch
    python recipes/train.py +recipe=olmo7b_warmup plan=true trainer.devices=8 trainer.num_nodes=8
    torchrun --nproc_per_node 8 recipes/train.py +recipe=olmo1b_warmup data.path=... hydra.run.dir=outputs/run1

``plan=true`` prints what the run will need (steps per batch phase, memory per device, the CBS
probe's host memory and tokens, wall time at an assumed MFU) and exits: no data, no accelerator,
no training (lit_cbs.recipes.plan). The configuration is checked before any model is built; a bad setting ends the run with one
line that names it (set HYDRA_FULL_ERROR=1 for the traceback). Each run folder gets the
resolved config (resolved_config.yaml), metrics.csv, batch_history.json (BatchWarmup's
changes), summary.json (what the run did, also printed at its end), loss_vs_tokens.png,
batch_lr_vs_tokens.png, report.html (all of it on one page, lit_cbs.recipes.report) and checkpoints/.
"""

from __future__ import annotations

import os

# OpenMP threads that spin while they wait stall each other when other jobs share the cores, which
# slows a small model's step by an order of magnitude; waiting passively costs some speed on idle
# cores, so set OMP_WAIT_POLICY=ACTIVE on a machine of your own (the README gives the measurements).
# Read when torch loads OpenMP: set before importing it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dataclasses
import importlib.util
import json
import logging
import re
import signal
import time
import warnings
from pathlib import Path

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from lit_cbs import BatchWarmup, CBSAdaptive, CBSProbeCallback
from lit_cbs.callbacks.logs import log_figures
from lit_cbs.data import TokenDataModule
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.models.lm import CausalLM, resolve_model_config
from lit_cbs.recipes.plan import Limits, OptimizerState, RunPlan, batch_phases, plan_run
from lit_cbs.recipes.report import write_report
from lit_cbs.recipes.resolvers import devices_per_node, register_resolvers
from lit_cbs.recipes.run_report import plot_run, write_batch_history

LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc", "registry")  # resolved by Trainer.fit itself
# What stops a run as a bad setting: lit_cbs's own LitCBSConfigError, and what torch,
# Lightning, Hydra and OmegaConf raise for settings they refuse.
CONFIG_ERRORS = (
    LitCBSConfigError,
    ValueError,
    TypeError,
    MisconfigurationException,
    InstantiationException,
    OmegaConfBaseException,
)

register_resolvers()
# The CSV logger writes into the Hydra run folder, which already holds Hydra's own files.
warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
# litdata's StreamingDataset has a length and splits its items among a loader's workers itself, which
# is what Lightning's warning about an IterableDataset with __len__ asks for.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")


log = logging.getLogger("lit_cbs.train")


# ``${batch.guard}`` or ``${oc.select:batch.guard,null}``: the key a value is taken from.
_INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?([\w.]+)(?:,[^}]*)?\}$")


def config_keys(cfg: DictConfig, key: str) -> dict[str, tuple[str, str | None]]:
    """Argument name -> (the Hydra key that sets it, the key it is interpolated from or None), for the
    node at ``key`` and the nodes it interpolates (``callbacks.batch_warmup.schedule`` is ``${batch.schedule}``)."""
    keys: dict[str, tuple[str, str | None]] = {}
    node = OmegaConf.select(cfg, key)
    raw = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_dict(node) else {}
    for name, value in raw.items():
        source = _INTERPOLATION.match(value).group(1) if isinstance(value, str) and _INTERPOLATION.match(value) else None
        if source is not None and OmegaConf.is_dict(OmegaConf.select(cfg, source)):
            keys.update({k: v for k, v in config_keys(cfg, source).items() if k not in keys})
            if not name.startswith("_"):
                keys[name] = (source, None)  # a group of settings: the user sets it there
            continue
        if isinstance(value, dict):
            keys.update({k: v for k, v in config_keys(cfg, f"{key}.{name}").items() if k not in keys})
        if not name.startswith("_"):
            keys[name] = (f"{key}.{name}", source)
    return keys


def name_the_keys(cfg: DictConfig, key: str, message: str) -> str:
    """``message`` with the arguments it names written as the Hydra keys that set them, e.g.
    ``total_tokens=65536`` -> ``lr_schedule.total_tokens=65536 (max_tokens)``."""
    for name, (full_key, source) in sorted(config_keys(cfg, key).items(), key=lambda item: -len(item[0])):
        if "_" not in name and not re.search(rf"\b{re.escape(name)}(\[\d+\])?[=.]\S", message):
            continue  # a plain word such as `unit` may be prose; `unit=`, `guard.window` or `warmup_tokens` is the argument
        note = f" ({source})" if source is not None and not isinstance(OmegaConf.select(cfg, source), DictConfig) else ""
        message = re.sub(
            rf"(?<![\w.]){re.escape(name)}\b(=[^\s;,)]+)?",
            lambda m, full_key=full_key, note=note: f"{full_key}{m.group(1) or ''}{note}",
            message,
            count=1,
        )
        message = re.sub(rf"(?<![\w.]){re.escape(name)}\b", full_key, message)
    return message


def name_the_run_keys(cfg: DictConfig, message: str) -> str:
    """``message`` of an error raised inside ``trainer.fit`` (by a callback's setup, say) with the
    Trainer's and the callbacks' arguments written as their Hydra keys."""
    callbacks = [f"callbacks.{name}" for name, node in (cfg.callbacks or {}).items() if node is not None]
    for key in ["trainer", *callbacks]:
        message = name_the_keys(cfg, key, message)
    return message


def instantiate_key(cfg: DictConfig, key: str, **kwargs):
    """``instantiate(cfg.<key>)``; a configuration error names the keys it is about."""
    try:
        return instantiate(OmegaConf.select(cfg, key), **kwargs)
    except CONFIG_ERRORS as error:
        message = one_line(error)
        named = name_the_keys(cfg, key, message)
        raise LitCBSConfigError(named if named != message else f"{key}: {message}") from error


@dataclasses.dataclass
class Run:
    trainer: pl.Trainer
    model: CausalLM
    datamodule: TokenDataModule
    batch_warmup: BatchWarmup


def instantiate_named(cfg: DictConfig, what: str) -> dict:
    """Every non-null entry of a dict of named configs (``callbacks``, ``logger``), instantiated, by name."""
    objects = {}
    for name, node in (cfg.get(what) or {}).items():
        if node is None:
            continue
        if "_target_" not in node:
            raise LitCBSConfigError(f"{what}.{name} has no _target_; give one, or set {what}.{name}=null to drop it")
        objects[name] = instantiate_key(cfg, f"{what}.{name}")
    return objects


# The packages Lightning's loggers need (any one of them), for a one-line error that names the extra.
LOGGER_PACKAGES = {"TensorBoardLogger": ("tensorboard", "tensorboardX"), "MLFlowLogger": ("mlflow",), "WandbLogger": ("wandb",)}


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # in sys.modules as None: its import is blocked
        return False


def loggers_of(cfg: DictConfig) -> list:
    """The loggers of ``cfg.logger``, before any data work: one whose package is missing stops here,
    naming the extra, and a CSV logger must be among them (the summary and plots read its metrics.csv)."""
    nodes = {name: node for name, node in (cfg.get("logger") or {}).items() if node is not None}
    for name, node in nodes.items():
        target = str(node.get("_target_", "")).rsplit(".", 1)[-1]
        packages = LOGGER_PACKAGES.get(target, ())
        if packages and not any(_installed(package) for package in packages):
            raise LitCBSConfigError(
                f"logger.{name}: {target} needs the {packages[0]} package, which is not installed: "
                f'pip install -e ".[loggers]" (or pip install {packages[0]}), or drop it (logger=csv)'
            )
    loggers = instantiate_named(cfg, "logger")
    if loggers and not any(isinstance(logger, CSVLogger) for logger in loggers.values()):
        raise LitCBSConfigError(
            f"logger has {', '.join(loggers)} but no csv: the run's summary and plots read metrics.csv, which the CSV "
            f"logger writes; keep it beside them, e.g. logger=[csv,{next(iter(loggers))}]"
        )
    return list(loggers.values())


def finish_loggers(loggers: list) -> None:
    """End each logger's run once the figures are in: W&B's (else a sweep's next job would log into it, and
    its record file is written after the process exits), TensorBoard's writer (reopened by the figures)."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()
        elif isinstance(logger, TensorBoardLogger):
            logger.experiment.close()


def drop_probes_outside_the_budget(cfg: DictConfig, callbacks: dict) -> list:
    """The callbacks, less any CBS probe none of whose windows fits in max_tokens: it would stop the
    run once the model is built, so warn now, naming its keys, and train without it."""
    kept = []
    for name, callback in callbacks.items():
        if isinstance(callback, CBSProbeCallback):
            first = callback.probe_point(0)
            if first + callback.span_tokens > cfg.max_tokens:
                windows = f"{callback.replicates} x " if callback.replicates > 1 else ""
                log.warning(
                    f"warning: callbacks.{name}: the first probe ({first:,} tokens + {windows}window_tokens={callback.window_tokens:,}) ends past "
                    f"max_tokens={cfg.max_tokens:,}, so it never runs; training without it. Probe earlier "
                    f"(callbacks.{name}.geometric / at_tokens / every_tokens), raise max_tokens, or set callbacks.{name}=null"
                )
                continue
        kept.append(callback)
    return kept


def model_config_of(cfg: DictConfig):
    """model.config as an OLMoConfig or a transformers config; its errors name the key."""
    try:
        return resolve_model_config(OmegaConf.to_container(cfg.model.config, resolve=True))
    except ValueError as error:
        raise LitCBSConfigError(f"model.config: {error}") from error


def batch_warmup_of(callbacks: list) -> BatchWarmup:
    warmups = [callback for callback in callbacks if isinstance(callback, BatchWarmup)]
    if len(warmups) != 1:
        raise LitCBSConfigError(
            f"callbacks hold {len(warmups)} BatchWarmup callbacks; keep exactly one (callbacks.batch_warmup): "
            "it feeds the token-indexed LR schedule and stops the run at max_tokens"
        )
    return warmups[0]


def check_accelerator(cfg: DictConfig) -> None:
    """A GPU recipe on a machine without one stops here, before any data is prepared."""
    if str(cfg.trainer.accelerator) in ("gpu", "cuda") and not torch.cuda.is_available():
        raise LitCBSConfigError(
            f"trainer.accelerator={cfg.trainer.accelerator} but this machine has no CUDA GPU; add plan=true to see "
            "this run's plan (memory per GPU, steps, wall time) here, or train a tiny recipe on the CPU "
            "(python recipes/train.py, or +recipe=tiny_warmup)"
        )


def plan_of(cfg: DictConfig) -> RunPlan:
    """The run's plan from its configuration alone: no data, no accelerator, no model weights."""
    model_config = model_config_of(cfg)
    model = instantiate_key(cfg, "model")  # checks model.optimizer; builds no weights
    datamodule = instantiate_key(cfg, "data")
    datamodule.check_context(model.dims.context_length)
    callbacks = list(instantiate_named(cfg, "callbacks").values())
    warmup = batch_warmup_of(callbacks)
    devices = devices_per_node(cfg.trainer.devices, "plan=true sizes the run from it")
    num_nodes = int(cfg.trainer.num_nodes)
    warmup.check_sizes(warmup.schedule.sizes(0), datamodule.batch_size, devices * num_nodes, "global batch (batch.schedule)")
    strategy = cfg.trainer.get("strategy", "auto")
    target = str(strategy.get("_target_", "")) if OmegaConf.is_dict(strategy) else str(strategy)
    if target.endswith(("ModelParallelStrategy", "FSDPStrategy")) or target.startswith("fsdp"):
        kind = "fsdp"
    else:
        kind = "ddp" if devices * num_nodes > 1 else "single"
    probes = [callback for callback in callbacks if isinstance(callback, CBSProbeCallback)]
    limits = OmegaConf.to_container(cfg.plan_for, resolve=True)
    if cfg.model.get("peak_flops_per_device"):
        limits["peak_flops_per_device"] = float(cfg.model.peak_flops_per_device)
    return plan_run(
        name=cfg.run_name,
        config=model_config,
        schedule=warmup.schedule,
        lr_factor=warmup.lr_rule.lr_factor,
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
        command=f"recipes/train.py {' '.join(command_line_overrides()) or f'+recipe={cfg.run_name}'}",
        settings=moving_settings(warmup, cfg),
    )


def moving_settings(warmup: BatchWarmup, cfg: DictConfig):
    """For the plan: the optimizer settings BatchWarmup's rules move, per phase, from the optimizer's
    configured values (``model.optimizer``); None if no rule moves one."""
    optimizer = OmegaConf.to_container(cfg.model.optimizer, resolve=True) if cfg.model.get("optimizer") else {}
    start = {"weight_decay": optimizer.get("weight_decay"), "beta2": (optimizer.get("betas") or [None, None])[1]}
    rules = [rule for rule in warmup.rules.settings if start[rule.key] is not None]
    if not rules:
        return None
    return lambda ratio, lr_factor: {rule.key: rule.scaled(float(start[rule.key]), ratio, lr_factor) for rule in rules}


def command_line_overrides() -> list[str]:
    """The overrides this job was started with, less plan=true and what the plan's commands set (empty outside a Hydra job)."""
    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # no Hydra job: composed by a script or a test
        return []
    moved = ("plan=", "plan_for.", "trainer.num_nodes=", "trainer.max_steps=", "ckpt_path=", "hydra.run.dir=")
    return [override for override in overrides if not override.startswith(moved)]


def build_run(cfg: DictConfig) -> Run:
    """Check the configuration and build the run; nothing here builds the model's weights.

    Order: model and optimizer settings (CausalLM builds model.optimizer on a stand-in parameter),
    data settings, trainer (it knows the process count), the global batch against micro-batch x
    processes, then the data source (prepared here once per node if needed) and its vocabulary
    against the model's.
    """
    check_accelerator(cfg)
    if cfg.ckpt_path is not None and cfg.ckpt_path not in LIGHTNING_CHECKPOINT_NAMES and not Path(cfg.ckpt_path).exists():
        raise LitCBSConfigError(
            f"ckpt_path={cfg.ckpt_path!r} does not exist; give a checkpoint from a run's checkpoints/ folder "
            "(a .ckpt file, or a .ckpt folder under trainer=fsdp), or ckpt_path=null to start afresh"
        )
    model_config_of(cfg)  # a bad model.config fails here, naming its key, before the data settings
    if not cfg.allow_default_corpus and cfg.data.path is None and cfg.data.input_dir is None:
        raise LitCBSConfigError(
            "this recipe trains on your tokens, not the embedded corpus (allow_default_corpus=false): set "
            "data.path=<folder prepared by lit_cbs.data.prepare>, or data.input_dir=<folder of text files> "
            "data.tokenizer=<tokenizer.json>"
        )
    lr_schedule = instantiate_key(cfg, "lr_schedule") if cfg.get("lr_schedule") is not None else None
    model = instantiate_key(cfg, "model", lr_schedule=lr_schedule)  # the decoder is built in configure_model, during fit
    datamodule = instantiate_key(cfg, "data")
    datamodule.check_context(model.dims.context_length)

    callbacks = drop_probes_outside_the_budget(cfg, instantiate_named(cfg, "callbacks"))
    warmup = batch_warmup_of(callbacks)
    if warmup.lacks_a_feeder(callbacks, resumed=cfg.ckpt_path is not None):
        raise LitCBSConfigError(
            f"batch.schedule is CBSAdaptive, which grows the batch only on CBS readings, but the run has no probe "
            f"(callbacks.cbs_probe is null, or its first window ends past max_tokens), so the batch would stay "
            f"{warmup.schedule.start}: set callbacks.cbs_probe (as the tiny_adaptive recipe does), or a fixed schedule (batch=warmup)"
        )
    if not cfg.trainer.get("enable_progress_bar", True):  # the switch a user reaches for turns lit_cbs's bar off too
        callbacks = [callback for callback in callbacks if not isinstance(callback, ProgressBar)]
    trainer = instantiate_key(cfg, "trainer", callbacks=callbacks, logger=loggers_of(cfg) or False)
    warmup.check_sizes(warmup.schedule.sizes(0), datamodule.batch_size, trainer.world_size, "global batch (batch.schedule)")

    # One process per node tokenizes a new source; Lightning's prepare_data in fit is then a cache hit.
    if trainer.local_rank == 0:
        datamodule.prepare_data()
    if datamodule.vocab_size > model.dims.vocab_size:
        raise LitCBSConfigError(
            f"the data's token ids go up to {datamodule.vocab_size - 1} but the model's vocab_size is "
            f"{model.dims.vocab_size}; use a larger model.config.vocab_size or the model's tokenizer (data.tokenizer)"
        )
    return Run(trainer, model, datamodule, warmup)


def one_line(error: BaseException) -> str:
    """The message of a configuration error on one line (Hydra wraps errors raised while instantiating,
    OmegaConf prefixes those its resolvers raise)."""
    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__
    message = getattr(error, "msg", None) or str(error)
    if isinstance(error, InterpolationResolutionError):
        message = re.sub(r"^\w+ raised while resolving interpolation: ", "", message)
    return " ".join(message.split())


def batches_reached(schedule, max_tokens: int, seq_len: int) -> str:
    """The global batches the run trains at within max_tokens, and any of the schedule's it ends before."""
    sizes = schedule.sizes(0)
    if isinstance(schedule, CBSAdaptive):  # its batches come from the probe's readings
        return f"{schedule.start} -> up to {schedule.final} samples (batch.schedule, by CBS readings)"
    reached = list(
        dict.fromkeys(phase.global_batch for phase in batch_phases(schedule, max_tokens, seq_len, 1, 1, lambda ratio: 1.0))
    )
    text = f"{' -> '.join(map(str, reached))} samples"
    never = [size for size in sizes if size not in reached]
    if never:
        them = "it" if len(never) == 1 else "them"
        text += f" (not {', '.join(map(str, never))}: batch.schedule asks for {them} after max_tokens={max_tokens:,})"
    return text


def describe(run: Run, cfg: DictConfig) -> str:
    model = run.model
    return (
        f"lit_cbs: {cfg.run_name}: model {model.dims.n_layers} layers x d_model {model.dims.d_model} "
        f"({model.num_parameters():,} parameters), {run.trainer.world_size} process(es) on {cfg.trainer.accelerator}, "
        f"precision {run.trainer.precision}, micro-batch {run.datamodule.batch_size} x {run.datamodule.seq_len} tokens, "
        f"global batch {batches_reached(run.batch_warmup.schedule, cfg.max_tokens, run.datamodule.seq_len)}, "
        f"budget {cfg.max_tokens:,} tokens; output {cfg.output_dir}"
    )


def run_summary(run: Run, run_name: str, fit_seconds: float) -> dict:
    """What the run did, as written to summary.json: tokens, optimizer steps, batch changes, final
    val/loss, wall time (this fit's, and the run's over every fit it resumed from) and, with a CBS
    probe, its readings and what the probe branches cost (their tokens and optimizer steps, which
    the main run's step count does not include)."""
    warmup, trainer = run.batch_warmup, run.trainer
    seq_len = warmup.seq_len or run.datamodule.seq_len
    val_loss = trainer.callback_metrics.get("val/loss")
    summary = {
        "run_name": run_name,
        "tokens": warmup.tokens_seen,
        "tokens_this_fit": warmup.tokens_seen - warmup.accounting.tokens_at_fit_start,
        "optimizer_steps": trainer.global_step,
        "first_batch": warmup.history[0].old_global_batch if warmup.history else warmup.global_batch,
        "final_batch": warmup.global_batch,
        "seq_len": seq_len,
        "batch_changes": [
            {
                "step": c.step,
                "tokens": c.tokens_seen,
                "old": c.old_global_batch,
                "new": c.new_global_batch,
                "lr_factor": c.lr_factor,
                "micro_batch_size": c.new_micro_batch_size,
                "accumulate": c.new_accumulate,
            }
            for c in warmup.history
        ],
        "final_val_loss": float(val_loss) if val_loss is not None else None,
        "fit_seconds": fit_seconds,
        "run_seconds": warmup.accounting.fit_seconds,
        "stopped_by": signal.Signals(warmup.accounting.stop_signal).name if warmup.accounting.stop_signal else None,
        "probe": None,
    }
    probes = [callback for callback in trainer.callbacks if isinstance(callback, CBSProbeCallback)]
    if probes:
        history = probes[0].history
        summary["probe"] = {
            "tokens": probes[0].tokens_spent,
            "optimizer_steps": sum(reading.branch_steps for reading in history),
            "readings": [
                {
                    "tokens": r.tokens,
                    "batch_size": r.batch_size,
                    "k_star": r.k_star,
                    "cbs_lower": r.cbs_lower,
                    "cbs_upper": r.cbs_upper,
                    "determined": r.determined,
                    "window_tokens": r.window_tokens,
                }
                for r in history
            ],
        }
    return summary


def summarize(summary: dict) -> str:
    """summary.json as the lines printed at the end of a run."""
    steps, tokens = summary["optimizer_steps"], summary["tokens"]
    steps_at_first_batch = tokens / (summary["first_batch"] * summary["seq_len"])
    changes = (
        ", ".join(
            f"{c['old']} -> {c['new']} after step {c['step']} ({c['tokens']:,} tokens, micro {c['micro_batch_size']} x "
            f"accumulate {c['accumulate']}, LR x{c['lr_factor']:.3g})"
            for c in summary["batch_changes"]
        )
        or "none"
    )
    val_loss = summary["final_val_loss"]
    seconds, this_fit = summary["fit_seconds"], summary["tokens_this_fit"]
    resumed = this_fit != tokens
    wall = f"wall time        {seconds:.1f} s (trainer.fit)"
    if resumed:
        wall += f"; {summary['run_seconds']:.1f} s of training since the run began, over the fits it resumed from"
    lines = [
        f"tokens           {tokens:,} ({this_fit / seconds:,.0f} tokens/s over this fit"
        + (f", which trained {this_fit:,} of them)" if resumed else ")"),
        f"optimizer steps  {steps:,} ({1 - steps / steps_at_first_batch:.0%} fewer than at the starting batch "
        f"{summary['first_batch']})",
        f"batch changes    {changes}",
        f"final val/loss   {val_loss:.4f}" if val_loss is not None else "final val/loss   (not evaluated)",
        wall,
    ]
    if summary.get("stopped_by"):
        lines.append(
            f"stopped by       {summary['stopped_by']} after step {steps:,}: resume from checkpoints/last.ckpt (ckpt_path=...)"
        )
    probe = summary["probe"]
    if probe and probe["readings"]:
        readings = ", ".join(
            (f"[{r['cbs_lower']:g}, {r['cbs_upper']:g}]" if r["cbs_upper"] is not None else f">= {r['cbs_lower']:g}")
            + ("" if r.get("determined", True) else " (undetermined)")
            for r in probe["readings"]
        )
        at = ", ".join(f"{r['tokens']:,}" for r in probe["readings"])
        lines.insert(
            3,
            f"CBS (samples)    {readings} at {at} tokens; probes trained {probe['tokens']:,} tokens "
            f"({probe['tokens'] / tokens:.0%} of training) in {probe['optimizer_steps']:,} optimizer steps",
        )
    return "\n".join(lines)


def send_lightning_logs_to_the_job_log() -> None:
    """Lightning's messages (and BatchWarmup's) go to Hydra's handlers, so ``train.log`` holds them too.

    Imported before Hydra configured logging, Lightning found no root handler, added its own console
    handler and stopped propagating; undo that now that Hydra's console and file handlers exist.
    """
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        lightning_logger = logging.getLogger(name)
        for handler in list(lightning_logger.handlers):
            lightning_logger.removeHandler(handler)
        lightning_logger.propagate = True


def stop_on_config_error(error: BaseException, line: str | None = None) -> None:
    """End the job with one line naming the setting (``line``, default the error's own). A single run
    exits; in a multirun the job fails and Hydra goes on with the other jobs, then reports the failure
    once they are done. With HYDRA_FULL_ERROR=1 the error itself is raised, with its traceback."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    line = line or one_line(error)
    message = f"error: {line}"
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        log.error(message)
        raise LitCBSConfigError(line) from None
    for handler in logging.getLogger().handlers:  # train.log; the terminal gets it once, on stderr
        if isinstance(handler, logging.FileHandler):
            handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None))
    raise SystemExit(message) from None


def remove_hydra_run_dir() -> None:
    """Take back what Hydra wrote for a job that trains nothing (plan=true): its .hydra/ files and the
    job log, then the folders left empty, up to the folder the job was started in."""
    try:
        config = HydraConfig.get()
    except ValueError:  # composed by a script or a test: Hydra wrote nothing
        return
    if config.mode != RunMode.RUN:
        return
    run_dir = Path(config.runtime.output_dir)
    for handler in logging.getLogger().handlers[:]:
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir:
            handler.close()
            logging.getLogger().removeHandler(handler)
            Path(handler.baseFilename).unlink(missing_ok=True)
    if config.output_subdir is not None:
        hydra_dir = run_dir / config.output_subdir
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            (hydra_dir / name).unlink(missing_ok=True)
        if hydra_dir.is_dir() and not any(hydra_dir.iterdir()):
            hydra_dir.rmdir()
    start = Path(config.runtime.cwd).resolve()
    folder = run_dir.resolve()
    while folder != start and start in folder.parents and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Train; return the final val/loss (for Hydra sweepers)."""
    send_lightning_logs_to_the_job_log()
    torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    try:
        if cfg.plan:
            log.info(plan_of(cfg).report())
            remove_hydra_run_dir()
            return None
        pl.seed_everything(cfg.seed, workers=True)
        run = build_run(cfg)
    except CONFIG_ERRORS as error:
        stop_on_config_error(error)
    output_dir = Path(cfg.output_dir)
    if run.trainer.is_global_zero:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        log.info(describe(run, cfg))

    started = time.perf_counter()
    terminated = False
    try:
        run.trainer.fit(run.model, datamodule=run.datamodule, ckpt_path=cfg.ckpt_path)
    except LitCBSConfigError as error:  # a check that needs the Trainer (setup, first batch): before any step
        stop_on_config_error(error, name_the_run_keys(cfg, one_line(error)))
    except SIGTERMException:  # stopped at a step boundary, last.ckpt saved (lit_cbs.callbacks.checkpoint): say so, exit non-zero
        terminated = True
    fit_seconds = time.perf_counter() - started

    val_loss = run.trainer.callback_metrics.get("val/loss")
    if run.trainer.is_global_zero:
        write_batch_history(output_dir / "batch_history.json", run.batch_warmup)
        summary = run_summary(run, cfg.run_name, fit_seconds)
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        metrics_csv = output_dir / "metrics.csv"
        if cfg.plots and metrics_csv.is_file():
            log_figures(run.trainer.loggers, plot_run(metrics_csv, output_dir, title=cfg.run_name), run.trainer.global_step)
            write_report(output_dir)  # report.html: the run on one page, readable offline
        finish_loggers(run.trainer.loggers)
        log.info(
            f"lit_cbs: {cfg.run_name} {'stopped' if summary['stopped_by'] else 'done'}\n{summarize(summary)}\noutputs          {output_dir}"
        )
    if torch.distributed.is_initialized():  # before the interpreter exits: a process group torn down at exit can abort the rank
        torch.distributed.destroy_process_group()
    if terminated:
        raise SystemExit(128 + signal.SIGTERM)  # the shell's code for a run ended by SIGTERM, so schedulers do not read "done"
    return float(val_loss) if val_loss is not None else None


if __name__ == "__main__":
    main()
