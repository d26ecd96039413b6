"""The Hydra configuration as a user meets it: every recipe builds its model and optimizer on the
meta device and plans within its limits, the package's resolvers scale LRs and size FSDP, a swapped
optimizer trains, and bad settings stop recipes/train.py's checks with one line naming the Hydra key."""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import OmegaConf
from recipe_runs import CONF, SHORT_RUN, compose_config, short_run, train

from lit_cbs.analysis.curves import read_metrics_csv
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.models.lm import CausalLM
from lit_cbs.run import job, keys
from lit_cbs.run.job import batches_reached, run_header
from lit_cbs.run.resolvers import RESOLVERS, register_resolvers

RECIPES = sorted(path.stem for path in (CONF / "recipe").glob("*.yaml"))
OLMO_PARAMETERS = {"olmo_1b": 1.18e9, "olmo_7b": 6.89e9}  # the OLMo papers' sizes


def test_the_package_registers_the_resolvers_once_and_for_all():
    for name in RESOLVERS:
        OmegaConf.clear_resolver(name)
    register_resolvers()
    register_resolvers()  # a second call (another script, a test) changes nothing
    cfg = compose_config("+recipe=olmo1b_large_batch", "trainer.num_nodes=4")
    assert cfg.model.optimizer.lr == pytest.approx(4e-4 * 2)  # 4e-4 at 1024, sqrt rule to 4096
    assert instantiate(cfg.trainer.strategy)._data_parallel_size == 8 * 4


@pytest.mark.parametrize(
    "recipe, base_lr, base_batch",
    [
        ("tiny_small_batch", 3e-3, 16),
        ("tiny_large_batch", 3e-3, 16),
        ("tiny_es_sweep", 3e-3, 16),
        ("olmo1b_small_batch", 4e-4, 1024),
        ("olmo1b_large_batch", 4e-4, 1024),
    ],
)
@pytest.mark.parametrize("rule, factor", [("sqrt", math.sqrt), ("linear", float), ("none", lambda r: 1.0)])
def test_every_constant_batch_recipe_scales_the_lr_by_the_batch_rule(recipe, base_lr, base_batch, rule, factor):
    # One rule for batch overrides: the LR BatchWarmup would give that batch, whichever control is overridden.
    cfg = compose_config(f"+recipe={recipe}", f"batch.schedule.batch_size={4 * base_batch}", f"batch.lr_rule={rule}")
    assert cfg.model.optimizer.lr == pytest.approx(base_lr * factor(4))
    warmup = job.batch_warmup_of(cfg)
    assert warmup.lr_rule.factor(4) == pytest.approx(factor(4))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_builds_on_meta_and_plans_within_its_limits(recipe):
    cfg = compose_config(f"+recipe={recipe}")
    model = instantiate(cfg.model, lr_schedule=instantiate(cfg.lr_schedule))
    assert isinstance(model, CausalLM)
    with torch.device("meta"):
        model.configure_model()  # no trainer: built unsharded, here on the meta device
    assert all(p.is_meta for p in model.parameters())
    optimizer = model.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    assert [group["weight_decay"] for group in optimizer.param_groups] == [cfg.model.optimizer.weight_decay, 0.0]
    preset = cfg.model.config.preset
    if preset in OLMO_PARAMETERS:
        assert model.num_parameters() == pytest.approx(OLMO_PARAMETERS[preset], rel=0.01)
    # Runnable as configured: global batches divide into micro-batches on every process, the data
    # fits the context, the probe fits the budget, and memory fits plan_for's limits.
    plan = train.plan_of(cfg)
    assert "WARNING:" not in plan.report()
    assert plan.tokens >= cfg.max_tokens


def test_fsdp_world_size_scales_with_nodes():
    cfg = compose_config("+recipe=olmo1b_warmup", "data.path=/data/tokens", "trainer.num_nodes=4")
    assert instantiate(cfg.trainer.strategy)._data_parallel_size == 32


def test_extra_callback_option_composes():
    cfg = compose_config("callbacks=[default,lr_monitor]")
    callbacks = keys.instantiate_named(cfg, "callbacks")
    assert set(callbacks) == {
        "checkpoint",
        "progress_bar",
        "validation",
        "lr_monitor",
    }  # BatchWarmup is the batch group
    assert isinstance(callbacks["lr_monitor"], LearningRateMonitor)


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
        (["data.corpus=wiki"], "data.corpus='wiki' is not supported; use one of ('stdlib', 'kjv')"),
        (
            ["batch.max_micro_batch_size=null", "data.batch_size=5"],
            "global batch (batch.schedule) 16 is not a multiple of micro-batch 5 x data-parallel size 1",
        ),
        (["batch.max_micro_batch_size=0"], "batch.max_micro_batch_size=0 must be a positive int or None"),
        (["ckpt_path=/nonexistent/last.ckpt"], "ckpt_path=/nonexistent/last.ckpt is not a complete checkpoint"),
        (["+recipe=olmo1b_warmup", "trainer.accelerator=cpu"], "this recipe trains on your tokens"),
        (
            ["trainer=fsdp", "trainer.devices=auto", "trainer.accelerator=cpu"],
            "trainer.devices='auto' must be a number per node (or a list of device ids): trainer=fsdp sets",
        ),
        (["model.optimizer.lr=-1"], "optimizer AdamW(model.optimizer.lr=-1, "),
        (["model.optimizer.betas=[0.9,1.0]"], "model.optimizer.betas=[0.9, 1.0]"),
        (["model.optimizer._target_=torch.optim.SGD"], "unexpected keyword argument 'model.optimizer.betas'"),
        (
            ["max_tokens=65536"],
            "lr_schedule.warmup_tokens + lr_schedule.decay_tokens = 262144 exceeds "
            "lr_schedule.total_tokens=65536 (max_tokens); shorten the warmup or the decay",
        ),
        (
            ["lr_schedule=cosine", "max_tokens=262144"],
            "lr_schedule.warmup_tokens=262144 leaves no tokens of lr_schedule.total_tokens=262144 (max_tokens) for the "
            "cosine decay; shorten the warmup (a tenth of the run: lr_schedule.warmup_tokens=26214) or lengthen "
            "lr_schedule.total_tokens",
        ),
        (["batch.schedule.thresholds=[5,10,20]"], "batch.schedule.thresholds[0]=5 must be 0"),
        (["batch.schedule.unit=token"], "batch.schedule.unit='token' is not supported"),
        (["callbacks.cbs_probe.search=binary"], "callbacks.cbs_probe.search='binary'"),
        (
            ["callbacks.cbs_probe.replicates=2", "callbacks.cbs_probe.evaluate=train_ema"],
            "callbacks.cbs_probe.replicates=2 compares each k on the same held-out batches",
        ),
        (["+batch.guard={watch_span:0}"], "batch.guard.watch_span=0 must be a positive int"),
    ],
)
def test_bad_settings_stop_before_the_model(overrides, message):
    cfg = compose_config(*overrides)
    with pytest.raises(keys.CONFIG_ERRORS) as error:
        train.build_run(cfg)
    assert message in keys.one_line(error.value)
    assert "\n" not in keys.one_line(error.value)


@pytest.mark.parametrize("schedule", ["wsd", "step"])
def test_an_lr_warmup_as_long_as_the_run_warns_once_naming_the_keys_and_the_fix(schedule, caplog):
    cfg = compose_config(f"lr_schedule={schedule}", "max_tokens=262144", "callbacks.cbs_probe=null")
    with caplog.at_level("WARNING", logger="lit_cbs.train"):
        plan = train.plan_of(cfg)  # what a run checks before any work, without data
    (record,) = caplog.records
    assert record.message == (
        "warning: lr_schedule.warmup_tokens=262144 is the whole run (lr_schedule.total_tokens=262144 (max_tokens)): "
        "the LR rises until the last token and never trains at its base value; shorten the warmup (a tenth of the "
        "run: lr_schedule.warmup_tokens=26214) or lengthen lr_schedule.total_tokens"
    )
    assert plan.tokens >= 262144  # it trains: a warning, not an error


def test_a_probe_past_the_budget_warns_and_is_left_out(caplog):
    cfg = compose_config(
        "max_tokens=600000", "lr_schedule.warmup_tokens=16384"
    )  # first probe: 524,288 + 131,072 tokens
    with caplog.at_level("WARNING", logger="lit_cbs.train"):
        run = train.build_run(cfg)
    from lit_cbs import CBSProbeCallback

    assert not [c for c in run.trainer.callbacks if isinstance(c, CBSProbeCallback)]
    (record,) = caplog.records
    assert record.message.startswith(
        "warning: the first probe (524,288 tokens + callbacks.cbs_probe.window_tokens=131,072) "
        "ends past max_tokens=600,000"
    )
    assert "\n" not in record.message


def test_replicate_windows_count_in_the_probes_span(caplog):
    # 524,288 + 131,072 fits in 700,000 tokens; two windows (786,432) do not.
    with caplog.at_level("WARNING", logger="lit_cbs.train"):
        train.build_run(compose_config("max_tokens=700000", "lr_schedule.warmup_tokens=16384"))
        assert not caplog.records
        run = train.build_run(
            compose_config("max_tokens=700000", "lr_schedule.warmup_tokens=16384", "callbacks.cbs_probe.replicates=2")
        )
    from lit_cbs import CBSProbeCallback

    assert not [c for c in run.trainer.callbacks if isinstance(c, CBSProbeCallback)]
    (record,) = caplog.records
    assert record.message.startswith(
        "warning: the first probe (524,288 tokens + 2 x callbacks.cbs_probe.window_tokens=131,072)"
    )


def test_data_folder_without_chunks(tmp_path):
    cfg = compose_config(f"data.path={tmp_path}")
    with pytest.raises(ValueError, match="has no litdata index"):
        train.build_run(cfg)


def test_empty_input_folder(tmp_path):
    cfg = compose_config(f"data.input_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(ValueError, match=r"data.input_dir=.* holds no files"):
        train.build_run(cfg)


def test_data_vocabulary_larger_than_the_model(text_folder, tmp_path):
    cfg = compose_config(f"data.input_dir={text_folder}", f"data.cache_dir={tmp_path}", "+model.config.vocab_size=100")
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


# A few optimizer steps on the small text folder: micro-batch 4 of 128 tokens, global batch 8 -> 16 at
# 2,048 tokens, 6,144 tokens in all, a tenth of the text held out, no probe, no progress bar.


def test_a_recipe_trains_with_the_optimizer_it_swaps_in(text_folder, tmp_path):
    _, run = short_run(text_folder, tmp_path, "optimizer=sgd", "model.optimizer.lr=0.05")
    run.trainer.fit(run.model, datamodule=run.datamodule)
    (optimizer,) = run.trainer.optimizers
    assert isinstance(optimizer, torch.optim.SGD)
    assert run.trainer.global_step == 2 + 2 and run.batch_warmup.accounting.tokens_seen == 6144  # 2 steps of 8, 2 of 16
    assert job.trained_a_step(run.batch_warmup)  # a failure now would keep the run's folder
    metrics = read_metrics_csv(tmp_path / "run" / "metrics.csv")
    # The logged LR is SGD's 0.05 after the token warmup, times sqrt(2) after the batch doubled.
    assert metrics["lr"][1][-1] == pytest.approx(0.05 * 2**0.5)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    (saved,) = checkpoint["optimizer_states"]
    assert [group["momentum"] for group in saved["param_groups"]] == [0.9, 0.9]
    assert all("momentum_buffer" in state for state in saved["state"].values())


def test_the_weight_decay_and_beta2_rules_move_adamw_at_the_doubling(text_folder, tmp_path):
    # AdamW's beta2 0.95 is the default floor: batch.beta2_floor=0.9 lets the doubling take it to 0.9025.
    rules = ("batch.weight_decay_rule=timescale", "batch.beta2_rule=half_life", "batch.beta2_floor=0.9")
    _, run = short_run(text_folder, tmp_path, *rules)
    run.trainer.fit(run.model, datamodule=run.datamodule)
    metrics = read_metrics_csv(tmp_path / "run" / "metrics.csv")
    assert metrics["batch/weight_decay"][1] == pytest.approx([0.1, 0.1, 0.1 * 2**0.5, 0.1 * 2**0.5])  # 8, 8, 16, 16
    assert metrics["batch/beta2"][1] == pytest.approx([0.95, 0.95, 0.95**2, 0.95**2])
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0][
        "param_groups"
    ]
    assert [group["weight_decay"] for group in saved] == pytest.approx([0.1 * 2**0.5, 0.0])
    assert [group["betas"][1] for group in saved] == pytest.approx([0.95**2] * 2)


def test_a_rule_the_optimizer_lacks_stops_before_the_first_step_naming_its_key(text_folder, tmp_path):
    cfg, run = short_run(text_folder, tmp_path, "optimizer=sgd", "batch.beta2_rule=half_life")
    with pytest.raises(LitCBSConfigError, match="param group 0 of SGD has no Adam betas") as raised:
        run.trainer.fit(run.model, datamodule=run.datamodule)
    named = keys.name_the_run_keys(cfg, str(raised.value))
    assert "batch.beta2_rule='half_life'" in named and "set batch.beta2_rule=None" in named
    assert run.trainer.global_step == 0 and not job.trained_a_step(run.batch_warmup)  # so train.py removes its folder


def test_batch_seesaw_doubles_the_batch_where_the_cosine_halves_the_lr(text_folder, tmp_path):
    cfg = compose_config(
        "batch=seesaw",
        "lr_schedule=cosine",
        "lr_schedule.min_lr_ratio=0.0",
        "batch.schedule.start=8",
        "batch.schedule.max_batch_size=16",
        *[o for o in SHORT_RUN if not o.startswith("batch.")],
        f"data.input_dir={text_folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        output_dir=str(tmp_path / "run"),
    )
    run = train.build_run(cfg)
    run.trainer.fit(run.model, datamodule=run.datamodule)
    # 1,024 warmup tokens, cosine to 0 at 6,144: half the peak LR at 3,584 tokens, reached by steps of 8 x 128.
    (change,) = run.batch_warmup.history
    assert (change.old_global_batch, change.new_global_batch, change.requested_at_tokens) == (8, 16, 4096)
    metrics = read_metrics_csv(tmp_path / "run" / "metrics.csv")
    assert list(metrics["batch/global_size"][1]) == [8, 8, 8, 8, 16]


def test_batch_seesaw_without_a_decaying_lr_schedule_stops_before_any_data_work(tmp_path):
    cfg = compose_config("batch=seesaw", f"data.cache_dir={tmp_path / 'cache'}")  # the default wsd has no decay
    with pytest.raises(
        LitCBSConfigError, match=r"never falls to 1/2 of its peak before 4,194,304 tokens.*lr_schedule=cosine"
    ):
        train.build_run(cfg)
    assert not (tmp_path / "cache").exists()


def test_adam_sde_refuses_an_optimizer_without_betas_before_the_first_step(text_folder, tmp_path):
    _, run = short_run(text_folder, tmp_path, "optimizer=sgd", "batch.lr_rule=adam_sde")
    with pytest.raises(TypeError, match="lr_rule='adam_sde' needs an Adam-type optimizer"):
        run.trainer.fit(run.model, datamodule=run.datamodule)
    assert run.trainer.global_step == 0


def test_an_error_inside_fit_names_the_hydra_keys(text_folder, tmp_path):
    cfg, run = short_run(text_folder, tmp_path, "batch.clip_rule=sqrt", "trainer.gradient_clip_val=null")
    with pytest.raises(LitCBSConfigError) as raised:
        run.trainer.fit(run.model, datamodule=run.datamodule)
    named = keys.name_the_run_keys(cfg, str(raised.value))
    assert "batch.clip_rule='sqrt'" in named and "set trainer.gradient_clip_val" in named
    assert run.trainer.global_step == 0


def test_an_adaptive_recipe_without_its_probe_stops_before_any_data_work(tmp_path):
    cfg = compose_config("+recipe=tiny_adaptive", "callbacks.cbs_probe=null", f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(
        LitCBSConfigError,
        match=r"batch.schedule is CBSAdaptive.*no probe \(callbacks.cbs_probe is null.*set callbacks.cbs_probe",
    ):
        train.build_run(cfg)
    assert not (tmp_path / "cache").exists()  # nothing tokenized


def test_the_run_header_names_the_batches_a_short_budget_never_reaches():
    from hydra.utils import instantiate

    schedule = instantiate(compose_config("max_tokens=262144").batch.schedule)
    assert (
        batches_reached(schedule, 262_144, 128)
        == "16 samples (not 32, 64: batch.schedule asks for them after max_tokens=262,144)"
    )
    assert batches_reached(schedule, 4_194_304, 128) == "16 -> 32 -> 64 samples"


def test_the_run_header_says_what_the_run_will_do(text_folder, tmp_path):
    _, run = short_run(text_folder, tmp_path)
    header = run_header(run, "short", "cpu", tmp_path / "run")
    assert header.startswith(
        f"lit_cbs: short: model 4 layers x d_model 64 ({run.model.num_parameters():,} parameters), "
    )
    assert header.endswith(
        "1 process(es) on cpu, precision 32-true, micro-batch 4 x 128 tokens, global batch 8 -> 16 samples, "
        f"budget 6,144 tokens; output {tmp_path / 'run'}"
    )


def test_plan_needs_a_device_count():
    with pytest.raises(
        LitCBSConfigError,
        match=r"trainer.devices='auto' must be a number per node \(or a list of device ids\): plan=true",
    ):
        train.plan_of(compose_config("+recipe=olmo1b_warmup", "trainer.devices=auto"))


def test_trainer_enable_progress_bar_false_alone_turns_the_bar_off(prepared):
    from lightning.pytorch.callbacks import ProgressBar

    run = train.build_run(compose_config("trainer.enable_progress_bar=false", f"data.path={prepared}"))
    assert not any(isinstance(callback, ProgressBar) for callback in run.trainer.callbacks)
    assert run.trainer.progress_bar_callback is None
