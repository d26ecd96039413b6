"""A setting's errors in one line naming the Hydra key typed, the key its value comes from, and the fix."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, HydraException, InstantiationException
from hydra.types import RunMode
from hydra.utils import get_object, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

from lit_cbs._internals import hydra_command_line
from lit_cbs.errors import LitCBSConfigError, LitCBSConfigWarning
from lit_cbs.models.lm import resolve_model_config

__all__: list[str] = []  # recipes/ call these; users set the Hydra keys

log = logging.getLogger("lit_cbs.train")

# What stops a run as a bad setting: lit_cbs's own, and what torch, Lightning, Hydra and OmegaConf raise.
CONFIG_ERRORS: tuple[type[Exception], ...] = (LitCBSConfigError, ValueError, TypeError, MisconfigurationException)
CONFIG_ERRORS += (InstantiationException, OmegaConfBaseException)
# ``${max_tokens}`` or ``${oc.select:data.batch_size,null}``: the key a value is taken from.
_INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?([\w.]+)(?:,[^}]*)?\}$")


def one_line(error: BaseException) -> str:
    """A configuration error's message on one line, unwrapped from Hydra's and OmegaConf's."""
    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__
    message = getattr(error, "msg", None) or str(error)
    if isinstance(error, InterpolationResolutionError):
        message = re.sub(r"^\w+ raised while resolving interpolation: ", "", message)
    return " ".join(message.split())


def dict_container(node: DictConfig, resolve: bool) -> dict[str, Any]:
    """``OmegaConf.to_container`` of a DictConfig, typed as the dict it is."""
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=resolve))


def setting_keys(cfg: DictConfig, group: str) -> dict[str, tuple[str, str | None]]:
    """Argument name of ``group`` (and groups nested in it) -> (its Hydra key, the key it is interpolated from)."""
    keys: dict[str, tuple[str, str | None]] = {}
    node = OmegaConf.select(cfg, group, throw_on_resolution_failure=False)
    raw = dict_container(node, resolve=False) if OmegaConf.is_dict(node) else {}
    for name, value in raw.items():
        match = _INTERPOLATION.match(value) if isinstance(value, str) else None
        source = match.group(1) if match else None
        key = f"{group}.{name}"
        if source is not None and OmegaConf.is_dict(OmegaConf.select(cfg, source, throw_on_resolution_failure=False)):
            key, source = source, None
        if isinstance(value, dict) or key != f"{group}.{name}":
            keys.update({inner: named for inner, named in setting_keys(cfg, key).items() if inner not in keys})
        if not name.startswith("_"):
            keys[name] = (key, source)
    return keys


def name_the_keys(cfg: DictConfig, groups: Iterable[str], message: str) -> str:
    """``message`` with the arguments of ``groups`` written as their Hydra keys."""
    named: dict[str, tuple[str, str | None]] = {}
    for group in groups:
        named |= {name: found for name, found in setting_keys(cfg, group).items() if name not in named}
    problem = message.partition(";")[0]
    for name in sorted(named, key=len, reverse=True):
        key, source = named[name]
        mention = rf"(?<![\w.]){re.escape(name)}\b"
        with_value = re.search(rf"{mention}(\[\d+\])?[=.]\S", message) is not None
        if not with_value and ("_" not in name or not re.search(mention, problem)):
            continue
        note = f" ({source})" if source is not None else ""
        first = re.sub(rf"{mention}(=[^\s;,)]+)?", rf"{key}\g<1>{note}", message, count=1)
        head, separator, rest = first.partition(";")
        message = re.sub(mention, key, head) + separator + (re.sub(mention, key, rest) if with_value else rest)
        problem = message.partition(";")[0]
    return message


@contextlib.contextmanager
def group_key(cfg: DictConfig, group: str) -> Iterator[None]:
    """Build ``group`` inside: its config errors and LitCBSConfigWarnings name their Hydra keys."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LitCBSConfigWarning)
        try:
            yield
        except CONFIG_ERRORS as error:
            message = one_line(error)
            named = name_the_keys(cfg, [group], message)
            line = named if named != message or f"{group}." in message else f"{group}: {message}"
            raise LitCBSConfigError(line) from error
    for warning in caught:
        if issubclass(warning.category, LitCBSConfigWarning):
            # warnings.warn(text, category) records category(text): the message is the warning itself
            log.warning(f"warning: {name_the_keys(cfg, [group], one_line(cast(Warning, warning.message)))}")
        else:  # not ours: as it would have been shown
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def instantiate_group(cfg: DictConfig, group: str, **kwargs: Any) -> Any:
    """``instantiate(cfg.<group>, **kwargs)``; a configuration error names the keys it is about."""
    with group_key(cfg, group):
        return instantiate(OmegaConf.select(cfg, group), **kwargs)


def instantiate_named(cfg: DictConfig, what: str) -> dict[str, Any]:
    """Every non-null entry of a dict of named configs (``callbacks``, ``logger``), built, by name."""
    objects = {}
    for name, node in ((name, node) for name, node in (cfg.get(what) or {}).items() if node is not None):
        if "_target_" not in node:
            raise LitCBSConfigError(f"{what}.{name} has no _target_; give one, or set {what}.{name}=null to drop it")
        objects[name] = instantiate_group(cfg, f"{what}.{name}")
    return objects


def name_the_run_keys(cfg: DictConfig, message: str) -> str:
    """``message`` with the Trainer's, BatchWarmup's and the callbacks' arguments as their Hydra keys."""
    callbacks = [f"callbacks.{name}" for name, node in (cfg.callbacks or {}).items() if node is not None]
    return name_the_keys(cfg, ["trainer", "batch", *callbacks], message)


def model_config_of(cfg: DictConfig) -> Any:
    """model.config as an OLMoConfig or a transformers config; its errors name the key."""
    with group_key(cfg, "model.config"):
        return resolve_model_config(OmegaConf.to_container(cfg.model.config, resolve=True))


def stop_on_config_error(error: BaseException, line: str | None = None) -> None:
    """End the job with one ``error:`` line (HYDRA_FULL_ERROR=1 raises the error itself)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    line = line or one_line(error)
    message = f"error: {line}"
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        log.error(message)
        raise LitCBSConfigError(line) from None
    for handler in logging.getLogger().handlers:  # train.log; the terminal gets it once, on stderr
        if isinstance(handler, logging.FileHandler):
            handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (), None))
    raise SystemExit(message) from None


def check_command_line(config_dir: Path, argv: list[str]) -> None:
    """Refuse, before Hydra composes the job, a command-line key the configuration lacks, naming the fix."""
    args = hydra_command_line(argv)
    if any((args.config_path, args.config_dir, args.help, args.hydra_help, args.info, args.shell_completion)):
        return
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except HydraException:
        return
    first_job = [_first_value(override) for override in overrides]

    def composed(less: Override | None = None) -> DictConfig:
        lines = [line for override, line in zip(overrides, first_job) if line is not None and override is not less]
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return compose(args.config_name or "config", overrides=lines)

    try:
        composed()
        return
    except Exception as error:  # a missing key is OmegaConf's error under Hydra's; anything else is Hydra's to say
        missing = error.__cause__ if isinstance(error, ConfigCompositionException) else None
        if not isinstance(missing, (ConfigAttributeError, ConfigKeyError)):
            return
    # missing.full_key: the first part of the override's key the configuration lacks
    bad = next((o for o in overrides if f"{o.key_or_group}.".startswith(f"{missing.full_key}.")), None)
    if bad is None:
        return
    try:  # without it: another problem on the same command line is Hydra's to name
        cfg = composed(bad)
    except Exception:
        return
    line = str(bad.input_line)
    raise LitCBSConfigError(f"{line}: {_fix_for_missing_key(cfg, bad.key_or_group, line)}")


# Lightning Trainer arguments the recipes set another way: what to set instead (formatted with the config).
REPLACED_TRAINER_KEYS = {
    "trainer.val_check_interval": (
        "the recipes validate by tokens, whatever the batch (Lightning's val_check_interval counts micro-batches, "
        "which grow); set val_check_tokens=<tokens between validations> (now {val_check_tokens})"
    ),
    "trainer.accumulate_grad_batches": (
        "BatchWarmup sets the accumulation from the global batch and the micro-batch; set the global batch "
        "(batch.schedule, samples) and the micro-batch (data.batch_size; batch.max_micro_batch_size grows it)"
    ),
}


def _fix_for_missing_key(cfg: DictConfig, key: str, line: str) -> str:
    if key in REPLACED_TRAINER_KEYS:
        now = OmegaConf.select(cfg, "val_check_tokens")
        return REPLACED_TRAINER_KEYS[key].format(val_check_tokens=f"{now:,}" if isinstance(now, int) else now)
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    siblings = [str(name) for name in node if not str(name).startswith("_")] if OmegaConf.is_dict(node) else []
    target = str(node.get("_target_", "")) if OmegaConf.is_dict(node) else ""
    with contextlib.suppress(ImportError, ValueError, TypeError, HydraException):  # not a class or function: no
        argument = inspect.signature(get_object(target)).parameters.get(leaf) if target else None
        if argument is not None and argument.kind is not argument.VAR_KEYWORD:
            return f"the recipes leave {target.rsplit('.', 1)[-1]}({leaf}) at its default; add +{line}"
    keys = _keys_of(dict_container(cfg, resolve=False))
    matches = [f"{parent}.{name}" if parent else name for name in difflib.get_close_matches(leaf, siblings, cutoff=0.8)]
    matches += [other for other in keys if other.rpartition(".")[2] == leaf]  # the same name in another group
    if not OmegaConf.is_dict(node):  # a typo in the path
        matches += difflib.get_close_matches(key, keys, cutoff=0.85)
    matches = list(dict.fromkeys(matches))[:3]
    if not matches:
        return (
            f"this configuration has no key {key} (python recipes/train.py --cfg job prints them); +{line} adds it, "
            "where the class it configures takes it"
        )
    listed = matches[0] if len(matches) == 1 else f"{', '.join(matches[:-1])} or {matches[-1]}"
    return f"this configuration has no key {key}; did you mean {listed}?"


def _first_value(override: Override) -> str | None:
    if not override.is_sweep_override():
        return override.input_line
    try:
        return f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}"
    except HydraException:
        return None


def _keys_of(node: dict[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key of a config container, less ``_target_`` and its kind."""
    keys = []
    for name, value in ((str(name), value) for name, value in node.items() if not str(name).startswith("_")):
        keys += [f"{prefix}{name}", *(_keys_of(value, f"{prefix}{name}.") if isinstance(value, dict) else [])]
    return keys
