"""The OmegaConf resolvers lit_cbs's Hydra configs (``conf/``) use, and ``register_resolvers()``, which
every script that composes them calls first (``recipes/train.py`` does at import).

- ``${lit_cbs.world_size:${trainer.devices},${trainer.num_nodes}}``: processes in the job.
- ``${lit_cbs.scaled_lr:3e-3,${batch.schedule.batch_size},16,${batch.lr_rule}}``: an LR tuned at one
  global batch, scaled to another by an LR rule.
- ``${lit_cbs.sweep_subdir:${hydra.job.num},${run_name},${hydra.overrides.task}}``: a multirun job's folder.

Imported on its own (``lit_cbs`` does not import it), so the library needs no Hydra.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.rules.scaling import get_lr_rule

__all__ = [
    "register_resolvers",
    "scaled_lr",
    "sweep_subdir",
    "world_size",
]


def devices_per_node(devices, needed_for: str) -> int:
    """``trainer.devices`` as a count: a positive number (or its string) or a list of device ids;
    else LitCBSConfigError naming the key. ``needed_for`` says what needs the count.

    Args:
        devices: the value of ``trainer.devices``: a count of devices per node, its string, or a list of
            device ids.
        needed_for: what needs the count, for the error message.

    Returns:
        Devices per node.

    Raises:
        LitCBSConfigError: ``devices`` is none of these (e.g. ``"auto"``), naming ``trainer.devices``.

    Examples:
        >>> devices_per_node("8", "the plan"), devices_per_node([0, 1, 2], "the plan")
        (8, 3)
        >>> devices_per_node("auto", "plan=true sizes the run from it")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: trainer.devices='auto' must be a number per node ...: plan=true sizes ...
    """
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        return devices
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        return len(devices)
    raise LitCBSConfigError(
        f"trainer.devices={devices!r} must be a number per node (or a list of device ids): {needed_for}; "
        "e.g. trainer.devices=8"
    )


def world_size(devices, num_nodes) -> int:
    """Processes in the job: devices per node (a count or a list of device ids) x nodes.

    The resolver ``${lit_cbs.world_size:${trainer.devices},${trainer.num_nodes}}``.

    Args:
        devices: ``trainer.devices``: devices per node, as for ``devices_per_node``.
        num_nodes: ``trainer.num_nodes``: nodes (a number or its string).

    Returns:
        Processes (devices) in the job.

    Raises:
        LitCBSConfigError: ``devices`` is not a count or a list of device ids.

    Examples:
        >>> world_size(8, 2), world_size("4", "1"), world_size([0, 1], 3)
        (16, 4, 6)
    """
    return devices_per_node(devices, "trainer=fsdp sets the data-parallel size from it") * int(num_nodes)


def scaled_lr(lr, batch_size, base_batch_size, rule: str = "sqrt") -> float:
    """``lr`` tuned at ``base_batch_size`` samples, scaled to ``batch_size`` samples by an LR rule
    (lit_cbs.rules.scaling): each run of a batch-size sweep gets the LR BatchWarmup would give that batch.

    The resolver ``${lit_cbs.scaled_lr:3e-3,${batch.schedule.batch_size},16,${batch.lr_rule}}``.

    Args:
        lr: the learning rate tuned at ``base_batch_size``.
        batch_size: the global batch to scale it to (samples).
        base_batch_size: the global batch ``lr`` was tuned at (samples).
        rule: the LR rule's name (``lit_cbs.rules.scaling.LR_RULES``: ``sqrt``, ``linear``, ...).

    Returns:
        ``lr`` x the rule's factor for the batch ratio ``batch_size / base_batch_size``.

    Raises:
        LitCBSConfigError: ``rule`` names no LR rule.

    Examples:
        >>> round(scaled_lr(3e-3, 64, 16, "sqrt"), 6), round(scaled_lr(3e-3, 64, 16, "linear"), 6)
        (0.006, 0.012)
        >>> scaled_lr(3e-3, 64, 16, "cubic")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: lr_rule='cubic' is unknown; use one of [...] or a callable ratio -> factor
    """
    return float(lr) * get_lr_rule(rule).factor(float(batch_size) / float(base_batch_size))


SWEPT_KEYS = "LIT_CBS_SWEPT_KEYS"  # the keys a multirun's command line sweeps, for jobs that run elsewhere


def swept_keys(arguments: list[str]) -> list[str]:
    """The keys (or groups) a command line's overrides sweep (``batch.schedule.batch_size=8,16``).

    Args:
        arguments: the command line's arguments after the script (options, starting with ``-``, are skipped).

    Returns:
        The swept keys and config groups, in command-line order.

    Examples:
        >>> swept_keys(["-m", "batch.schedule.batch_size=8,16", "seed=1", "model=tiny,tiny4x"])
        ['batch.schedule.batch_size', 'model']
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides([a for a in arguments if not a.startswith("-")])
    return [override.key_or_group for override in overrides if override.is_sweep_override()]


def remember_swept_keys(arguments: list[str]) -> None:
    """Put the swept keys of this command line where a multirun's jobs find them: a job that runs in another process
    (a SLURM job of Hydra's submitit launcher) has another command line, but this environment.

    Args:
        arguments: the command line's arguments after the script; the keys go into the environment variable
            ``SWEPT_KEYS`` (``LIT_CBS_SWEPT_KEYS``), unless it is set already.

    Examples:
        >>> import os
        >>> before = os.environ.pop(SWEPT_KEYS, None)
        >>> remember_swept_keys(["-m", "seed=1,2"])
        >>> os.environ[SWEPT_KEYS]
        'seed'
        >>> _ = os.environ.pop(SWEPT_KEYS) if before is None else os.environ.update({SWEPT_KEYS: before})
    """
    os.environ.setdefault(SWEPT_KEYS, ",".join(swept_keys(arguments)))


def sweep_subdir(job_number, run_name, job_overrides) -> str:
    """A multirun job's folder: ``<n>_<run_name>``, then the job's values of the keys the command line
    sweeps (``batch.schedule.batch_size=8,16`` -> ``..._batch.schedule.batch_size=16``). The recipe is
    in ``run_name``; keys set to one value for every job would only lengthen every name.

    The resolver ``${lit_cbs.sweep_subdir:${hydra.job.num},${run_name},${hydra.overrides.task}}``; the swept
    keys are those ``remember_swept_keys`` put in the environment, else those of this process's command line.

    Args:
        job_number: the job's number in the multirun (``hydra.job.num``).
        run_name: the run's name (``run_name``, the recipe's).
        job_overrides: the job's overrides (``hydra.overrides.task``), e.g. ``["batch.schedule.batch_size=16"]``.

    Returns:
        The job's folder name.

    Examples:
        >>> import os
        >>> before = os.environ.get(SWEPT_KEYS)
        >>> os.environ[SWEPT_KEYS] = "batch.schedule.batch_size"
        >>> sweep_subdir(3, "tiny_warmup", ["batch.schedule.batch_size=16", "seed=1"])
        '3_tiny_warmup_batch.schedule.batch_size=16'
        >>> _ = os.environ.pop(SWEPT_KEYS) if before is None else os.environ.update({SWEPT_KEYS: before})
    """
    remembered = os.environ.get(SWEPT_KEYS)
    swept = set(remembered.split(",") if remembered else swept_keys(sys.argv[1:]))
    own = [item for item in job_overrides if item.split("=", 1)[0].lstrip("+~") in swept - {"recipe"}]
    return "_".join([f"{job_number}_{run_name}", *own])


RESOLVERS: dict[str, Callable[..., Any]] = {
    "lit_cbs.world_size": world_size,
    "lit_cbs.scaled_lr": scaled_lr,
    "lit_cbs.sweep_subdir": sweep_subdir,
}


def register_resolvers() -> None:
    """Register the resolvers with OmegaConf; calling it again changes nothing.

    Examples:
        >>> from omegaconf import OmegaConf
        >>> register_resolvers()
        >>> OmegaConf.create({"processes": "${lit_cbs.world_size:8,2}"}).processes
        16
    """
    for name, resolver in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
