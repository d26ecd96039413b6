"""``python -m lit_cbs.litgpt pretrain <litgpt's arguments> --lit_cbs CONFIG.yaml``; ``... probe CHECKPOINT ...``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from lit_cbs.errors import LitCBSConfigError

USAGE = (
    "usage: python -m lit_cbs.litgpt pretrain <litgpt pretrain's arguments> --lit_cbs CONFIG.yaml\n"
    "       python -m lit_cbs.litgpt probe CHECKPOINT --lit_cbs CONFIG.yaml   (its probe: settings, no side_jobs)"
)
KEYS = ("schedule", "lr_rule", "weight_decay_rule", "beta2_rule", "beta2_floor", "compile", "strategy", "probe")
# The config file, for the processes Lightning starts for the other devices: they run this command again with
# litgpt's arguments alone (sys.argv as litgpt parses it).
CONFIG_VARIABLE = "LIT_CBS_LITGPT_CONFIG"
WHERE = ("every_tokens", "at_tokens", "geometric", "side_jobs")  # a run's probe settings a checkpoint's probe drops


def read_config(path: str) -> dict[str, Any]:
    """The lit_cbs config file: its keys checked, ``_target_`` nodes built (Hydra's instantiate), side jobs built."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    file = Path(path)
    if not file.is_file():
        raise LitCBSConfigError(f"--lit_cbs {path}: no such file; give the lit_cbs config (docs/guides/litgpt.md)")
    loaded = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    if not isinstance(loaded, dict) or "schedule" not in loaded:
        raise LitCBSConfigError(f"--lit_cbs {path}: give schedule: (a lit_cbs batch schedule with its _target_)")
    config = {str(key): value for key, value in loaded.items()}
    if unknown := sorted(set(config) - set(KEYS)):
        raise LitCBSConfigError(f"--lit_cbs {path}: unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
    probe = config.get("probe")
    if probe is not None and probe.get("side_jobs") is not None:
        from lit_cbs.litgpt.probes import BUILD
        from lit_cbs.probe.side_jobs.launchers import SideJobs

        side = dict(probe["side_jobs"])
        if "build" in side:
            raise LitCBSConfigError("probe.side_jobs.build: a LitGPT run's jobs build it from its checkpoints; drop it")
        probe["side_jobs"] = SideJobs(**{**side, "launcher": instantiate(side.get("launcher")), "build": BUILD})
    config["schedule"] = instantiate(config["schedule"])
    return config


def pretrain(arguments: list[str], config: dict[str, Any]) -> None:
    from litgpt.__main__ import main as litgpt_main

    from lit_cbs.litgpt.loop import LitGPTRun
    from lit_cbs.probe.engine import ProbeConfig
    from lit_cbs.rules.warmup_core import WarmupCore

    rules = {key: config[key] for key in ("lr_rule", "weight_decay_rule", "beta2_rule", "beta2_floor") if key in config}
    core = WarmupCore(config["schedule"], **rules)
    probe = ProbeConfig(**rules, **config["probe"]) if config.get("probe") is not None else None
    run = LitGPTRun(core, probe, compile=config.get("compile", True), strategy=config.get("strategy"))
    sys.argv = [sys.argv[0], "pretrain", *arguments]  # litgpt saves its hyperparameters by parsing them again
    with run.patched():
        litgpt_main()


def probe(arguments: list[str], config: dict[str, Any]) -> None:
    from lit_cbs.litgpt.parts import probe_checkpoint

    if len(arguments) != 1:
        raise SystemExit(USAGE)
    rules = {key: config[key] for key in ("lr_rule", "weight_decay_rule", "beta2_rule", "beta2_floor") if key in config}
    settings = {key: value for key, value in (config.get("probe") or {}).items() if key not in WHERE}
    path = Path(arguments[0])
    folder = path if path.is_dir() else path.parent  # the reading goes beside the checkpoint, in its folder
    reading = probe_checkpoint(path, output_dir=folder, **rules, **settings)
    print(json.dumps(reading.to_record()))


def main(argv: list[str]) -> None:
    if "--lit_cbs" not in argv[:-1] and CONFIG_VARIABLE in os.environ:  # another device's process
        argv = [*argv, "--lit_cbs", os.environ[CONFIG_VARIABLE]]
    if not argv or argv[0] not in ("pretrain", "probe") or "--lit_cbs" not in argv[:-1]:
        raise SystemExit(USAGE)
    at = argv.index("--lit_cbs")
    command, arguments = argv[0], argv[1:at] + argv[at + 2 :]
    os.environ[CONFIG_VARIABLE] = str(Path(argv[at + 1]).resolve())
    try:
        config = read_config(argv[at + 1])
        (pretrain if command == "pretrain" else probe)(arguments, config)
    except LitCBSConfigError as error:
        raise SystemExit(f"lit_cbs: {error}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
