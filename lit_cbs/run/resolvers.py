"""The OmegaConf resolvers ``conf/`` uses (``${lit_cbs.world_size:...}``, ``${lit_cbs.scaled_lr:...}``,
``${lit_cbs.sweep_subdir:...}``); a script that composes ``conf/`` calls ``register_resolvers()`` first."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.rules.scaling import get_lr_rule

__all__ = ["register_resolvers"]


def devices_per_node(devices: Any, needed_for: str) -> int:
    """``trainer.devices`` (a positive number, its string, or a list of device ids) as a count."""
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


def world_size(devices: Any, num_nodes: int | str) -> int:
    """Processes in the job: devices per node (a count or a list of device ids) x nodes."""
    return devices_per_node(devices, "trainer=fsdp sets the data-parallel size from it") * int(num_nodes)


def scaled_lr(lr: float | str, batch_size: int | str, base_batch_size: int | str, rule: str = "sqrt") -> float:
    """``lr`` tuned at ``base_batch_size`` samples, scaled to ``batch_size`` by an LR rule."""
    return float(lr) * get_lr_rule(rule).factor(float(batch_size) / float(base_batch_size))


SWEPT_KEYS = "LIT_CBS_SWEPT_KEYS"  # the keys a multirun's command line sweeps, for jobs that run elsewhere


def swept_keys(arguments: list[str]) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides([a for a in arguments if not a.startswith("-")])
    return [override.key_or_group for override in overrides if override.is_sweep_override()]


def remember_swept_keys(arguments: list[str]) -> None:
    """Put this command line's swept keys in the environment, for multirun jobs that run in other processes."""
    os.environ.setdefault(SWEPT_KEYS, ",".join(swept_keys(arguments)))


def sweep_subdir(job_number: int | str, run_name: str, job_overrides: list[str]) -> str:
    """A multirun job's folder: ``<n>_<run_name>`` and its values of the swept keys."""
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
    """Register the resolvers with OmegaConf; calling it again changes nothing."""
    for name, resolver in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
