"""The Hydra configuration: every recipe composes, builds its model on the meta device, and
bad settings stop recipes/train.py's checks with one line that names the setting."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from hydra.utils import instantiate
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import OmegaConf

from lit_cbs import BatchWarmup
from lit_cbs.lm import CausalLM

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
RECIPES = sorted(path.stem for path in (CONF / "recipe").glob("*.yaml"))
OLMO_PARAMETERS = {"olmo_1b": 1.18e9, "olmo_7b": 6.89e9}  # the OLMo papers' sizes


def load_train_module():
    spec = importlib.util.spec_from_file_location("lit_cbs_train", ROOT / "recipes" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # registers the config's resolvers
    return module


train = load_train_module()


def compose_config(*overrides: str, output_dir: str = "/nonexistent/run"):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[f"output_dir={output_dir}", *overrides])


def test_recipes_listed():
    assert {
        "olmo1b_large_batch", "olmo1b_small_batch", "olmo1b_warmup", "olmo7b_warmup",
        "tiny_large_batch", "tiny_small_batch", "tiny_warmup",
    } <= set(RECIPES)


def test_default_config_is_tiny_warmup():
    assert compose_config() == compose_config("+recipe=tiny_warmup")


def test_tiny_warmup_is_the_reference_workload():
    cfg = compose_config()
    warmup = instantiate(cfg.callbacks.batch_warmup)
    assert isinstance(warmup, BatchWarmup) and warmup.max_tokens == 4_194_304
    assert [warmup.schedule.batch_size(t) for t in (0, 1_245_183, 1_245_184, 2_523_136)] == [16, 16, 32, 64]
    assert warmup.lr_rule.lr_factor(2) == pytest.approx(math.sqrt(2))
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.data.path, cfg.data.input_dir) == (128, 16, None, None)
    assert (cfg.optimizer.lr, list(cfg.optimizer.betas), cfg.optimizer.weight_decay) == (3e-3, [0.9, 0.95], 0.1)
    assert (cfg.trainer.gradient_clip_val, cfg.trainer.accelerator, cfg.trainer.precision) == (1.0, "cpu", "32-true")
    schedule = instantiate(cfg.lr_schedule)
    assert schedule(0) < 0.01 and schedule(262_144) == 1.0 and schedule(4_194_303) == 1.0


@pytest.mark.parametrize(("recipe", "batch", "lr"), [("tiny_small_batch", 16, 3e-3), ("tiny_large_batch", 64, 6e-3)])
def test_tiny_controls(recipe, batch, lr):
    cfg = compose_config(f"+recipe={recipe}")
    schedule = instantiate(cfg.batch.schedule)
    assert schedule.sizes(0) == [batch] and cfg.optimizer.lr == pytest.approx(lr)
    assert cfg.run_name == recipe and cfg.max_tokens == 4_194_304


@pytest.mark.parametrize("recipe, base_lr, base_batch", [
    ("tiny_small_batch", 3e-3, 16), ("tiny_large_batch", 3e-3, 16), ("tiny_es_sweep", 3e-3, 16),
    ("olmo1b_small_batch", 4e-4, 1024), ("olmo1b_large_batch", 4e-4, 1024),
])
@pytest.mark.parametrize("rule, factor", [("sqrt", math.sqrt), ("linear", float), ("none", lambda r: 1.0)])
def test_every_constant_batch_recipe_scales_the_lr_by_the_batch_rule(recipe, base_lr, base_batch, rule, factor):
    # One rule for batch overrides: the LR BatchWarmup would give that batch, whichever control is overridden.
    cfg = compose_config(f"+recipe={recipe}", f"batch.schedule.batch_size={4 * base_batch}", f"batch.lr_rule={rule}")
    assert cfg.optimizer.lr == pytest.approx(base_lr * factor(4))
    warmup = instantiate(cfg.callbacks.batch_warmup)
    assert warmup.lr_rule.lr_factor(4) == pytest.approx(factor(4))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_builds_on_meta(recipe):
    cfg = compose_config(f"+recipe={recipe}")
    model = instantiate(cfg.model, lr_schedule=instantiate(cfg.lr_schedule), **OmegaConf.to_container(cfg.optimizer))
    assert isinstance(model, CausalLM)
    with torch.device("meta"):
        model.configure_model()  # no trainer: built unsharded, here on the meta device
    assert all(p.is_meta for p in model.parameters())
    preset = cfg.model.config.preset
    if preset in OLMO_PARAMETERS:
        assert model.num_parameters() == pytest.approx(OLMO_PARAMETERS[preset], rel=0.01)
    assert cfg.data.seq_len <= model.config.context_length


@pytest.mark.parametrize(
    ("recipe", "preset", "sizes", "micro", "accumulate", "lr"),
    [
        ("olmo1b_warmup", "olmo_1b", [1024, 2048, 4096], 8, 16, 4e-4),
        ("olmo1b_small_batch", "olmo_1b", [1024], 8, 16, 4e-4),
        ("olmo1b_large_batch", "olmo_1b", [4096], 8, 64, 8e-4),
        ("olmo7b_warmup", "olmo_7b", [1024, 2048, 4096], 4, 32, 3e-4),
    ],
)
def test_olmo_recipes(recipe, preset, sizes, micro, accumulate, lr):
    cfg = compose_config(f"+recipe={recipe}", "data.path=/data/tokens")
    assert cfg.model.config.preset == preset and cfg.model.activation_checkpointing
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.optimizer.lr) == (4096, micro, lr)
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.accelerator == "gpu"
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, ModelParallelStrategy)
    processes = cfg.trainer.devices * cfg.trainer.num_nodes
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (processes, 1)
    warmup = instantiate(cfg.callbacks.batch_warmup)
    assert warmup.schedule.sizes(0) == sizes
    if len(sizes) > 1:
        assert warmup.schedule.unit == "tokens"
        assert [warmup.schedule.batch_size(t) for t in (167_999_999_999, 168e9, 503e9)] == [1024, 2048, 4096]
        assert warmup.lr_rule.lr_factor(2) == pytest.approx(math.sqrt(2))
    assert all(size % (micro * processes) == 0 for size in sizes)
    assert sizes[0] // (micro * processes) == accumulate  # at the start, on one node of 8 GPUs
    assert warmup.max_tokens == 658_000_000_000
    schedule = instantiate(cfg.lr_schedule)
    assert schedule(608_000_000_000) == 1.0 and schedule(658_000_000_000) == 0.0  # 50B-token anneal


def test_fsdp_world_size_scales_with_nodes():
    cfg = compose_config("+recipe=olmo1b_warmup", "data.path=/data/tokens", "trainer.num_nodes=4")
    assert instantiate(cfg.trainer.strategy)._data_parallel_size == 32


def test_extra_callback_option_composes():
    cfg = compose_config("callbacks=[default,lr_monitor]")
    assert set(cfg.callbacks) == {"batch_warmup", "checkpoint", "progress_bar", "lr_monitor"}


def test_unknown_recipe_lists_the_recipes():
    with pytest.raises(MissingConfigException) as error:
        compose_config("+recipe=olmo3b_warmup")
    assert "recipe/olmo3b_warmup" in str(error.value) and "tiny_warmup" in str(error.value)


def test_unknown_model_option_lists_the_models():
    with pytest.raises(MissingConfigException) as error:
        compose_config("model=olmo_3b")
    assert "model/olmo_3b" in str(error.value) and "olmo_7b" in str(error.value)


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    (folder / "a.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    return folder


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.config.preset=olmo_3b"], "model.config: unknown model preset 'olmo_3b'"),
        (["data.seq_len=256"], "data.seq_len=256 exceeds the model's context_length=128"),
        (["data.path=/nonexistent/tokens"], "data.path='/nonexistent/tokens' is not a folder"),
        (["data.batch_size=5"], "global batch (batch.schedule) 16 is not a multiple of micro-batch 5 x data-parallel size 1"),
        (["ckpt_path=/nonexistent/last.ckpt"], "ckpt_path='/nonexistent/last.ckpt' does not exist"),
        (["+recipe=olmo1b_warmup", "trainer.accelerator=cpu"], "this recipe trains on your tokens"),
        (["trainer=fsdp", "trainer.devices=auto", "trainer.accelerator=cpu"], "trainer.devices='auto' must be the number"),
        (["max_tokens=65536"], "lr_schedule.warmup_tokens + lr_schedule.decay_tokens = 262144 exceeds "
                               "lr_schedule.total_tokens=65536 (max_tokens); shorten the warmup or the decay"),
        (["batch.schedule.thresholds=[5,10,20]"], "batch.schedule.thresholds[0]=5 must be 0"),
        (["batch.schedule.unit=token"], "batch.schedule.unit='token' is not supported"),
        (["callbacks.cbs_probe.strategy=binary"], "callbacks.cbs_probe.strategy='binary'"),
    ],
)
def test_bad_settings_stop_before_the_model(overrides, message):
    cfg = compose_config(*overrides)
    with pytest.raises(train.CONFIG_ERRORS) as error:
        train.build_run(cfg)
    assert message in train.one_line(error.value)
    assert "\n" not in train.one_line(error.value)


def test_a_probe_past_the_budget_warns_and_is_left_out(caplog):
    cfg = compose_config("max_tokens=600000", "lr_schedule.warmup_tokens=16384")  # first probe: 524,288 + 131,072 tokens
    with caplog.at_level("WARNING", logger="lit_cbs.train"):
        run = train.build_run(cfg)
    from lit_cbs import CBSProbeCallback

    assert not [c for c in run.trainer.callbacks if isinstance(c, CBSProbeCallback)]
    (record,) = caplog.records
    assert record.message.startswith("warning: callbacks.cbs_probe: the first probe (524,288 tokens + window_tokens=131,072)")
    assert "\n" not in record.message


def test_data_folder_without_chunks(tmp_path):
    cfg = compose_config(f"data.path={tmp_path}")
    with pytest.raises(ValueError, match="has no litdata index"):
        train.build_run(cfg)


def test_empty_input_folder(tmp_path):
    cfg = compose_config(f"data.input_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(ValueError, match=r"data.input_dir=.* holds no files"):
        train.build_run(cfg)


def test_data_vocabulary_larger_than_the_model(text_folder, tmp_path):
    cfg = compose_config(
        f"data.input_dir={text_folder}", f"data.cache_dir={tmp_path}", "+model.config.vocab_size=100"
    )
    with pytest.raises(ValueError, match="model's vocab_size is 100"):
        train.build_run(cfg)


def test_slurm_launcher_follows_the_trainer():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra is not installed")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["output_dir=/run", "hydra/launcher=slurm", "+recipe=olmo7b_warmup", "trainer.num_nodes=4"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (4, 8, 8)


@pytest.mark.parametrize(
    "recipe, probed",
    [
        ("tiny_warmup", True), ("tiny_cbs_curve", True), ("tiny_adaptive", True), ("olmo1b_cbs_probe", True),
        ("tiny_small_batch", False), ("tiny_large_batch", False), ("tiny_es_sweep", False),
        ("olmo1b_warmup", False), ("olmo1b_small_batch", False), ("olmo7b_warmup", False),
    ],
)
def test_which_recipes_probe_the_cbs(recipe, probed):
    from lit_cbs import CBSProbeCallback
    from lit_cbs.schedules import CBSAdaptive

    cfg = compose_config(f"+recipe={recipe}")
    callbacks = list(train.instantiate_named(cfg, "callbacks").values())
    probes = [c for c in callbacks if isinstance(c, CBSProbeCallback)]
    assert len(probes) == int(probed)
    if recipe == "olmo1b_cbs_probe":  # the paper's protocol
        (probe,) = probes
        assert probe.strategy == "grid" and probe.evaluate == "train_ema" and probe.epsilon == 0.01
        assert probe.window_tokens == 2_000_000_000 and len(probe.at_tokens) == 14 and min(probe.multipliers) < 1
    if recipe == "tiny_adaptive":
        warmup = next(c for c in callbacks if isinstance(c, BatchWarmup))
        assert isinstance(warmup.schedule, CBSAdaptive) and probes[0].multipliers == [1.0, 2.0]

