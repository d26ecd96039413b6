"""recipes/train.py as a Hydra job: each config group built under the key that sets it, its loggers, its exit.

Every setting lives at one Hydra key (``batch.lr_rule``, ``lr_schedule.warmup_tokens``, ...), so a
constructor's error that names its argument (``lr_rule='x'``) names the key the user typed once the
group's key path is put in front of it: ``instantiate_group(cfg, "batch", ...)`` does that for any error a
group raises while it is built (``batch.lr_rule='x'``), and ``name_the_run_keys`` for one raised
inside ``trainer.fit`` (a callback's setup). An argument whose default is another key's value
(``lr_schedule.total_tokens: ${max_tokens}``) is named with that key beside it:
``lr_schedule.total_tokens=65536 (max_tokens)``. ``stop_on_config_error`` then ends the job with
that one line.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import inspect
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException, InstantiationException
from hydra.types import RunMode
from hydra.utils import get_object, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

from lit_cbs._internals import hydra_command_line
from lit_cbs.callbacks.checkpoint_files import newest_complete, settle, unreadable
from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.errors import LitCBSConfigError, LitCBSConfigWarning
from lit_cbs.models.lm import resolve_model_config
from lit_cbs.probe.callback import CBSProbeCallback
from lit_cbs.probe.from_checkpoint import RunParts

__all__: list[str] = []  # recipes/train.py's machinery; users set the Hydra keys, not these

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
# The packages Lightning's loggers need (any one of them), for a one-line error that names the extra.
LOGGER_PACKAGES = {
    "TensorBoardLogger": ("tensorboard", "tensorboardX"),
    "MLFlowLogger": ("mlflow",),
    "WandbLogger": ("wandb",),
}
LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc", "registry")  # resolved by Trainer.fit itself
AUTO_RESUME = "auto"
# ``${max_tokens}`` or ``${oc.select:data.batch_size,null}``: the key a value is taken from.
_INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?([\w.]+)(?:,[^}]*)?\}$")

log = logging.getLogger("lit_cbs.train")


def one_line(error: BaseException) -> str:
    """The message of a configuration error on one line (Hydra wraps errors raised while instantiating,
    OmegaConf prefixes those its resolvers raise).

    Args:
        error: the error raised.

    Returns:
        The message of the error Hydra's wrappers hold, its whitespace runs (newlines included) as one space.

    Examples:
        >>> from hydra.errors import InstantiationException
        >>> wrapped = InstantiationException("Error in call to target 'lit_cbs.BatchWarmup'")
        >>> wrapped.__cause__ = ValueError("lr_rule='x' is unknown;\\n  use one of sqrt, linear")
        >>> one_line(wrapped)
        "lr_rule='x' is unknown; use one of sqrt, linear"
    """
    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__
    message = getattr(error, "msg", None) or str(error)
    if isinstance(error, InterpolationResolutionError):
        message = re.sub(r"^\w+ raised while resolving interpolation: ", "", message)
    return " ".join(message.split())


def dict_container(node: DictConfig, resolve: bool) -> dict[str, Any]:
    """``OmegaConf.to_container(node, resolve=resolve)`` for a DictConfig ``node``: the plain dict it returns for
    one, typed so (OmegaConf's annotation is the union of every container it can return).

    Examples:
        >>> from omegaconf import OmegaConf
        >>> dict_container(OmegaConf.create({"max_tokens": 1024, "total": "${max_tokens}"}), resolve=True)
        {'max_tokens': 1024, 'total': 1024}
    """
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=resolve))


def setting_keys(cfg: DictConfig, group: str) -> dict[str, tuple[str, str | None]]:
    """Argument name -> (the Hydra key that sets it, the key its value defaults to or None), for the
    group at ``group`` and the groups nested in it, the outer name first: ``thresholds`` ->
    ``batch.schedule.thresholds``; ``total_tokens`` -> ``lr_schedule.total_tokens``, from ``max_tokens``. A
    group taken whole from another key (Seesaw's ``lr_schedule: ${lr_schedule}``) is named at that key.

    Args:
        cfg: the job's configuration.
        group: the dotted key of a group (``lr_schedule``, ``callbacks.cbs_probe``).

    Returns:
        Argument name -> (its Hydra key, the key its value is taken from or None).

    Examples:
        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"max_tokens": 65536, "lr_schedule": {
        ...     "_target_": "lit_cbs.rules.lr_schedules.WarmupStableDecay", "warmup_tokens": 1024,
        ...     "total_tokens": "${max_tokens}"}})
        >>> setting_keys(cfg, "lr_schedule")["total_tokens"]
        ('lr_schedule.total_tokens', 'max_tokens')
    """
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
    """``message`` with the arguments of ``groups`` it names written as the Hydra keys that set them, e.g.
    ``total_tokens=65536`` -> ``lr_schedule.total_tokens=65536 (max_tokens)``. An argument written with
    its value or a field (``name=...``, ``guard.watch_span``) is named at every mention; one written bare
    (``warmup_tokens + decay_tokens``) only in the message's first clause, which states the problem
    (what follows a ``;`` is advice or a list of valid fields); a plain word such as ``unit`` only
    where written as the argument.

    Args:
        cfg: the job's configuration.
        groups: the dotted keys of the groups whose arguments to look for.
        message: an error's or warning's message.

    Returns:
        The message, its arguments named as Hydra keys.

    Examples:
        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"max_tokens": 65536, "lr_schedule": {
        ...     "_target_": "lit_cbs.rules.lr_schedules.WarmupStableDecay", "warmup_tokens": 1024,
        ...     "total_tokens": "${max_tokens}"}})
        >>> name_the_keys(cfg, ["lr_schedule"], "warmup_tokens=1024 must be below total_tokens=65536")
        'lr_schedule.warmup_tokens=1024 must be below lr_schedule.total_tokens=65536 (max_tokens)'
    """
    named: dict[str, tuple[str, str | None]] = {}
    for group in groups:
        for name, found in setting_keys(cfg, group).items():
            named.setdefault(name, found)
    problem = message.partition(";")[0]
    for name in sorted(named, key=len, reverse=True):
        key, source = named[name]
        mention = rf"(?<![\w.]){re.escape(name)}\b"
        with_value = re.search(rf"{mention}(\[\d+\])?[=.]\S", message) is not None
        if not with_value and ("_" not in name or not re.search(mention, problem)):
            continue
        note = f" ({source})" if source is not None else ""

        def keyed(m: re.Match[str], key: str = key, note: str = note) -> str:
            return f"{key}{m.group(1) or ''}{note}"

        first = re.sub(rf"{mention}(=[^\s;,)]+)?", keyed, message, count=1)
        head, separator, rest = first.partition(";")
        message = re.sub(mention, key, head) + separator + (re.sub(mention, key, rest) if with_value else rest)
        problem = message.partition(";")[0]
    return message


@contextlib.contextmanager
def group_key(cfg: DictConfig, group: str) -> Iterator[None]:
    """Build the group at ``group`` inside: a configuration error raised there becomes a LitCBSConfigError
    naming the Hydra keys of the arguments it names, or, naming none, led by ``group: ``; a LitCBSConfigWarning
    raised there, once the group is built, one ``warning: ...`` line in the job's log naming them the same way.

    Args:
        cfg: the job's configuration.
        group: the dotted key of the group built inside.

    Raises:
        LitCBSConfigError: for a configuration error (``CONFIG_ERRORS``) raised inside, from it.

    Examples:
        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"max_tokens": 65536, "lr_schedule": {
        ...     "_target_": "lit_cbs.rules.lr_schedules.WarmupStableDecay", "warmup_tokens": 1024,
        ...     "total_tokens": "${max_tokens}"}})
        >>> with group_key(cfg, "lr_schedule"):
        ...     raise ValueError("warmup_tokens=1024 is too large")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: lr_schedule.warmup_tokens=1024 is too large
    """
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


def instantiate_group(cfg: DictConfig, group: str, **kwargs):
    """``instantiate(cfg.<group>, **kwargs)``; a configuration error names the keys it is about.

    Args:
        cfg: the job's configuration.
        group: the dotted key of the group to build.
        **kwargs: arguments passed to ``instantiate`` besides the group's.

    Returns:
        What the group's ``_target_`` built.

    Raises:
        LitCBSConfigError: a configuration error while building it, naming the keys (``group_key``).

    Examples:
        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"max_tokens": 65536, "lr_schedule": {
        ...     "_target_": "lit_cbs.rules.lr_schedules.WarmupStableDecay", "warmup_tokens": 1024,
        ...     "total_tokens": "${max_tokens}"}})
        >>> instantiate_group(cfg, "lr_schedule").total_tokens
        65536
    """
    with group_key(cfg, group):
        return instantiate(OmegaConf.select(cfg, group), **kwargs)


def instantiate_named(cfg: DictConfig, what: str) -> dict:
    """Every non-null entry of a dict of named configs (``callbacks``, ``logger``), built, by name.

    Args:
        cfg: the job's configuration.
        what: the key of the dict (``callbacks``, ``logger``).

    Returns:
        Name -> the object built.

    Raises:
        LitCBSConfigError: an entry without ``_target_``, or a configuration error while building one.

    Examples:
        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"callbacks": {"off": None, "on": {"_target_": "builtins.dict", "x": 1}}})
        >>> instantiate_named(cfg, "callbacks")
        {'on': {'x': 1}}
    """
    objects = {}
    for name, node in (cfg.get(what) or {}).items():
        if node is None:
            continue
        if "_target_" not in node:
            raise LitCBSConfigError(f"{what}.{name} has no _target_; give one, or set {what}.{name}=null to drop it")
        objects[name] = instantiate_group(cfg, f"{what}.{name}")
    return objects


def batch_warmup_of(cfg: DictConfig) -> BatchWarmup:
    """BatchWarmup with the batch group's arguments (batch.schedule, batch.lr_rule, ...) and max_tokens.

    Args:
        cfg: the job's configuration.

    Returns:
        The run's BatchWarmup.

    Raises:
        LitCBSConfigError: an argument BatchWarmup or its schedule refuses, naming its key.
    """
    return instantiate_group(cfg, "batch", _target_="lit_cbs.BatchWarmup", max_tokens=cfg.max_tokens)


def callbacks_of(cfg: DictConfig) -> list:
    """The callbacks of ``cfg.callbacks``, less any CBS probe whose first window ends past max_tokens: it
    would stop the run once the model is built, so warn now, naming its keys, and train without it.

    Args:
        cfg: the job's configuration.

    Returns:
        The callbacks, in ``cfg.callbacks`` order.

    Raises:
        LitCBSConfigError: a second BatchWarmup among them, or a configuration error while building one.
    """
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


def probe_parts(cfg: DictConfig, devices: int | None = None, num_nodes: int | None = None) -> RunParts:
    """A recipe run rebuilt from its configuration (``resolved_config.yaml``) for a CBS probe of one of its
    checkpoints: its model, data, BatchWarmup and Trainer settings, none of its loggers or other callbacks, on
    ``devices`` x ``num_nodes`` processes (default: the run's).

    Args:
        cfg: the run's configuration (``resolved_config.yaml``).
        devices: devices per node for the probe, or None for the run's.
        num_nodes: nodes for the probe, or None for the run's.

    Returns:
        The parts ``lit_cbs.probe.probe_checkpoint`` rebuilds the run from.

    Raises:
        LitCBSConfigError: the configuration is not a recipe run's, naming the key.
    """
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    for key, value in (("devices", devices), ("num_nodes", num_nodes)):
        if value is not None:
            cfg.trainer[key] = value
    strategy = cfg.trainer.get("strategy")
    if OmegaConf.is_dict(strategy) and str(strategy.get("_target_", "")).endswith("ModelParallelStrategy"):
        strategy.data_parallel_size = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    lr_schedule = instantiate_group(cfg, "lr_schedule") if cfg.get("lr_schedule") is not None else None
    model = instantiate_group(cfg, "model", lr_schedule=lr_schedule)
    datamodule = instantiate_group(cfg, "data")
    datamodule.check_context(model.dims.context_length)
    settings = dict_container(cfg.trainer, resolve=True)
    for key in ("_target_", "callbacks", "logger", "default_root_dir", "enable_checkpointing"):
        settings.pop(key, None)
    if isinstance(settings.get("strategy"), dict):
        with group_key(cfg, "trainer.strategy"):
            settings["strategy"] = instantiate(cfg.trainer.strategy)
    return RunParts(model, datamodule, settings, [batch_warmup_of(cfg)])


def probe_parts_of(config: str) -> RunParts:
    """``probe_parts`` of the recipe run whose ``resolved_config.yaml`` is ``config``: the build the recipes give
    their side jobs (``conf/side_jobs/``).

    Args:
        config: a recipe run's ``resolved_config.yaml``.

    Returns:
        The run's parts, on the run's own processes.

    Raises:
        LitCBSConfigError: the file holds no recipe run's configuration.
    """
    recipe = OmegaConf.load(config)
    if not isinstance(recipe, DictConfig):
        raise LitCBSConfigError(f"{config} holds a list, not a recipe run's configuration (a mapping)")
    return probe_parts(recipe)


def check_command_line(config_dir: Path, argv: list[str]) -> None:
    """Refuse a command line that sets a key the composed configuration lacks, before Hydra composes the job (whose
    own error advises ``+key=value``, which adds a key nothing reads when the key is a typo): LitCBSConfigError naming
    the key to set instead (``val_check_tokens`` for Lightning's ``val_check_interval``), the keys it is close to,
    or, for an argument of a group's ``_target_`` the recipes leave at its default, the ``+`` that adds it. A
    multirun is checked on its first job's values. Anything else Hydra refuses is left to Hydra's own message,
    when it composes the job.

    Args:
        config_dir: the folder of the job's configuration (``conf/``).
        argv: the command line, the script's name first (``sys.argv``).

    Raises:
        LitCBSConfigError: the command line sets a key the configuration lacks, saying what to set instead.
    """
    args = hydra_command_line(argv)
    if args.config_path or args.config_dir or args.help or args.hydra_help or args.info or args.shell_completion:
        return
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except HydraException:
        return
    first_job = [_first_value(override) for override in overrides]
    config_name = args.config_name or "config"
    try:
        _compose(config_dir, config_name, [line for line in first_job if line is not None])
        return
    except Exception as error:  # a missing key is OmegaConf's error under Hydra's; anything else is Hydra's to say
        if not isinstance(error, ConfigCompositionException) or not isinstance(
            error.__cause__, (ConfigAttributeError, ConfigKeyError)
        ):
            return
        missing = error.__cause__.full_key  # the first part of the override's key the configuration lacks
    bad = next((o for o in overrides if f"{o.key_or_group}.".startswith(f"{missing}.")), None)
    if bad is None:
        return
    rest = [line for override, line in zip(overrides, first_job) if line is not None and override is not bad]
    try:
        cfg = _compose(config_dir, config_name, rest)
    except Exception:  # another problem on the same command line: Hydra's message names it
        return
    line = bad.input_line
    assert line is not None  # parsed from a command line: it has its line
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
    """What to do about ``line``, which sets ``key``, a key ``cfg`` lacks (the rest of the command line composed)."""
    if key in REPLACED_TRAINER_KEYS:
        now = OmegaConf.select(cfg, "val_check_tokens")
        return REPLACED_TRAINER_KEYS[key].format(val_check_tokens=f"{now:,}" if isinstance(now, int) else now)
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    siblings = [str(name) for name in node if not str(name).startswith("_")] if OmegaConf.is_dict(node) else []
    target = str(node.get("_target_", "")) if OmegaConf.is_dict(node) else ""
    if target and leaf in _arguments_of(target):
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


def _first_value(override) -> str | None:
    """An override as the first job of a multirun sets it (None for a sweep that cannot be listed)."""
    if not override.is_sweep_override():
        return override.input_line
    try:
        return f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}"
    except HydraException:
        return None


def _compose(config_dir: Path, config_name: str, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name, overrides=overrides)


def _keys_of(node: dict, prefix: str = "") -> list[str]:
    """Every dotted key of a config container, nested ones included, less ``_target_`` and its kind."""
    keys = []
    for name, value in node.items():
        if str(name).startswith("_"):
            continue
        keys.append(f"{prefix}{name}")
        if isinstance(value, dict):
            keys += _keys_of(value, f"{prefix}{name}.")
    return keys


def _arguments_of(target: str) -> list[str]:
    """The named arguments of the class or function at ``target`` (none where it cannot be imported)."""
    try:
        signature = inspect.signature(get_object(target))
    except (ImportError, ValueError, TypeError, HydraException):
        return []
    return [name for name, parameter in signature.parameters.items() if parameter.kind is not parameter.VAR_KEYWORD]


def model_config_of(cfg: DictConfig):
    """model.config as an OLMoConfig or a transformers config; its errors name the key.

    Args:
        cfg: the job's configuration.

    Returns:
        The model's config (``lit_cbs.models.lm.resolve_model_config``).

    Raises:
        LitCBSConfigError: a config ``resolve_model_config`` refuses, naming ``model.config``.

    Examples:
        >>> from omegaconf import OmegaConf
        >>> model_config_of(OmegaConf.create({"model": {"config": {"preset": "tiny", "n_layers": 2}}})).n_layers
        2
    """
    with group_key(cfg, "model.config"):
        return resolve_model_config(OmegaConf.to_container(cfg.model.config, resolve=True))


def name_the_run_keys(cfg: DictConfig, message: str) -> str:
    """``message`` of an error raised inside ``trainer.fit`` (by a callback's setup, say) with the
    Trainer's, BatchWarmup's and the callbacks' arguments written as their Hydra keys.

    Args:
        cfg: the job's configuration.
        message: the error's message (``one_line``).

    Returns:
        The message, its arguments named as Hydra keys (``name_the_keys``).

    Examples:
        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"trainer": {"devices": 1}, "batch": {"max_micro_batch_size": 4},
        ...                         "callbacks": {"checkpoint": None}})
        >>> name_the_run_keys(cfg, "max_micro_batch_size=4 is below the micro-batch 8")
        'batch.max_micro_batch_size=4 is below the micro-batch 8'
    """
    callbacks = [f"callbacks.{name}" for name, node in (cfg.callbacks or {}).items() if node is not None]
    return name_the_keys(cfg, ["trainer", "batch", *callbacks], message)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # in sys.modules as None: its import is blocked
        return False


def loggers_of(cfg: DictConfig) -> list:
    """The loggers of ``cfg.logger``, before any data work (one whose package is missing stops here, naming
    the extra), and a CSV logger writing ``<output_dir>/metrics.csv``, added when none does: that file is the
    run's own record, which its summary, plots and report.html read, whatever else it logs to.

    Args:
        cfg: the job's configuration (``logger`` and ``output_dir``).

    Returns:
        The loggers, the CSV logger first where it was added.

    Raises:
        LitCBSConfigError: a logger whose package is not installed, naming the extra, or one without
            ``_target_``.
    """
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


def finish_loggers(loggers: list) -> None:
    """End each logger's run once the figures are in: W&B's (else a sweep's next job would log into it, and
    its record file is written after the process exits), TensorBoard's writer (reopened by the figures).

    Args:
        loggers: the Trainer's loggers; others than W&B's and TensorBoard's are left as they are.
    """
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()
        elif isinstance(logger, TensorBoardLogger):
            logger.experiment.close()


def checkpoint_folders(cfg: DictConfig) -> list[Path]:
    """Where a recipe run writes checkpoints: its checkpoint callback's folder, and the run folder (Lightning's
    ``hpc_ckpt_<n>.ckpt`` at SLURM's requeue signal).

    Args:
        cfg: the job's configuration (``output_dir``, ``callbacks.checkpoint.dirpath``).

    Returns:
        The folders, the checkpoint callback's first.

    Examples:
        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"output_dir": "outputs/run",
        ...                         "callbacks": {"checkpoint": {"dirpath": "outputs/run/checkpoints"}}})
        >>> [str(folder) for folder in checkpoint_folders(cfg)]
        ['outputs/run/checkpoints', 'outputs/run']
    """
    checkpoint = (cfg.get("callbacks") or {}).get("checkpoint")
    folders = [Path(cfg.output_dir)]
    if checkpoint is not None and checkpoint.get("dirpath"):
        folders.insert(0, Path(checkpoint.dirpath))
    return folders


def resume_checkpoint(cfg: DictConfig) -> str | None:
    """The checkpoint ``trainer.fit`` resumes from, by ``ckpt_path``:

    - ``auto`` (the default): the newest complete checkpoint in this run's folders (``checkpoint_folders``),
      so a job started again with the same ``hydra.run.dir`` (a requeued SLURM job) resumes by itself;
      none when the folder holds none (a new run).
    - ``null``: none, start afresh.
    - ``last``, ``hpc``, ``best``, ``registry``: Lightning resolves them.
    - a path: that checkpoint, once complete.

    A checkpoint write or replacement a kill interrupted in those folders is finished or undone first
    (``checkpoint_files.settle``).

    Args:
        cfg: the job's configuration (``ckpt_path``, and the folders of ``checkpoint_folders``).

    Returns:
        The path or Lightning's name to pass to ``trainer.fit(ckpt_path=...)``, or None.

    Examples:
        >>> from omegaconf import OmegaConf
        >>> resume_checkpoint(OmegaConf.create({"ckpt_path": "last", "output_dir": "outputs/run"}))
        'last'

    Raises:
        LitCBSConfigError: the path does not exist, or is a torn or partial checkpoint (naming the newest
            complete one beside it).
    """
    given = cfg.ckpt_path
    if given is None or given in LIGHTNING_CHECKPOINT_NAMES:
        return given
    folders = checkpoint_folders(cfg)
    for folder in folders:
        settle(folder)
    if given == AUTO_RESUME:
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
    once they are done. With HYDRA_FULL_ERROR=1 the error itself is raised, with its traceback.

    Args:
        error: the configuration error.
        line: the line to end with, or None for the error's own (``one_line``).

    Raises:
        SystemExit: in a single run (or outside Hydra), with ``error: <line>``.
        LitCBSConfigError: in a multirun, with the line.
    """
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


def _hydra_run() -> tuple[Path, Path] | None:
    """(this job's run folder, the folder the job was started in) for a single Hydra run; None in a multirun
    (a failed job's folder holds its error) or outside a Hydra job (composed by a script or a test)."""
    try:
        config = HydraConfig.get()
    except ValueError:
        return None
    if config.mode != RunMode.RUN:
        return None
    return Path(config.runtime.output_dir), Path(config.runtime.cwd)


def earlier_entries() -> frozenset[str]:
    """The names in this job's run folder that it must leave in place if it trains nothing: none when the
    folder holds only what Hydra wrote for this job (its config folder and the job log), else all of them,
    Hydra's included (the folder of an earlier run, or of something else, given as ``hydra.run.dir``).
    Called first thing in the job, before it writes anything.

    Returns:
        The names to keep (none outside a single Hydra run, and on ranks other than 0).

    Examples:
        >>> earlier_entries()  # outside a Hydra job
        frozenset()
    """
    run = _hydra_run()
    if run is None or rank_zero_only.rank != 0:  # type: ignore[attr-defined]  # Lightning sets .rank at import
        return frozenset()
    run_dir, _ = run
    entries = frozenset(entry.name for entry in run_dir.iterdir()) if run_dir.is_dir() else frozenset()
    hydra_own = {Path(handler.baseFilename).name for handler in _job_logs(run_dir)} | {HydraConfig.get().output_subdir}
    return frozenset() if entries <= hydra_own else entries


def _job_logs(run_dir: Path) -> list[logging.FileHandler]:
    return [
        handler
        for handler in logging.getLogger().handlers
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir
    ]


def remove_hydra_run_dir(kept: frozenset[str]) -> None:
    """Take back what a job that trained nothing (plan=true, a refused run) wrote into its run folder: every
    entry but ``kept`` (``earlier_entries()``), Hydra's files and the job log included, then the folders left
    empty, up to the folder the job was started in. Only on the process of global rank 0: the others share
    the folder. Outside a single Hydra run it does nothing.

    Args:
        kept: the names to leave in place (``earlier_entries()``, called when the job started).
    """
    run = _hydra_run()
    if run is None or rank_zero_only.rank != 0:  # type: ignore[attr-defined]  # Lightning sets .rank at import
        return
    run_dir, start = run
    for handler in _job_logs(run_dir):
        if Path(handler.baseFilename).name not in kept:
            handler.close()
            logging.getLogger().removeHandler(handler)
    for entry in run_dir.iterdir() if run_dir.is_dir() else []:
        if entry.name in kept:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)
    start = start.resolve()
    folder = run_dir.resolve()
    while folder != start and start in folder.parents and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def trained_a_step(warmup: BatchWarmup) -> bool:
    """Whether this ``trainer.fit`` may have taken an optimizer step: it read a global batch of samples or more
    since its ``on_fit_start`` (a fit that read less moved no parameter). A strategy that loads the checkpoint
    after that hook (FSDP2's) counts a resumed run's earlier samples too: such a fit is taken to have trained.

    Args:
        warmup: the run's BatchWarmup, after ``trainer.fit`` returned or raised.

    Returns:
        Whether a step may have been taken: False for a fit that failed before its callbacks were set up.
    """
    accounting = warmup.accounting
    if accounting is None:
        return False  # the fit failed before setup: it read nothing, and its own error is the one to see
    batch = accounting.global_batch
    return batch is not None and accounting.samples_seen - accounting.samples_at_fit_start >= batch
