"""recipes/train.py and conf/ as the tests meet them: the script loaded as a module, a composed
config, and the short run several test folders train."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TRAIN_SCRIPT = ROOT / "recipes" / "train.py"
# recipes/train.py on two processes under torchrun (a free rendezvous port of its own).
TORCHRUN_TRAIN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node",
    "2",
    str(TRAIN_SCRIPT),
]


def load_script(name: str):
    """recipes/<name>.py loaded as a module (to call its functions in-process; a subprocess pays a
    Python start per case)."""
    spec = importlib.util.spec_from_file_location(f"lit_cbs_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


train = load_script("train")


def compose_config(*overrides: str, output_dir: str = "/nonexistent/run"):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[f"output_dir={output_dir}", *overrides])


SHORT_RUN = [
    "data.batch_size=4",
    "batch.schedule.batch_sizes=[8,16]",
    "batch.schedule.thresholds=[0,2048]",
    "max_tokens=6144",
    "lr_schedule.warmup_tokens=1024",
    "val_check_tokens=2048",
    "callbacks.cbs_probe=null",
    "callbacks.progress_bar=null",
    "trainer.enable_progress_bar=false",
    "data.val_fraction=0.1",
]


def short_run(text_folder, tmp_path, *overrides: str):
    """The config and the built run of SHORT_RUN on the small text folder with ``overrides``, its output in
    tmp_path/run."""
    cfg = compose_config(
        *overrides,
        *SHORT_RUN,
        f"data.input_dir={text_folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        output_dir=str(tmp_path / "run"),
    )
    return cfg, train.build_run(cfg)
