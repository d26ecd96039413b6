"""lit_cbs.run.keys: each config group built under the key that sets it, so a constructor's error
names the Hydra key the user typed, whatever group, nesting or default the argument comes through."""

from __future__ import annotations

import pytest
from recipe_runs import CONF, compose_config

from lit_cbs import BatchWarmup, ConstantBatch
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.run import job, keys

RECIPES = sorted(path.stem for path in (CONF / "recipe").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_batch_warmup_is_built_from_the_batch_group_alone(recipe):
    cfg = compose_config(f"+recipe={recipe}", "batch.lr_rule=linear", "max_tokens=8388608")
    warmup = job.batch_warmup_of(cfg)
    assert isinstance(warmup, BatchWarmup) and warmup.max_tokens == 8388608
    assert warmup.lr_rule.factor(4) == 4.0  # batch.lr_rule, set once, reaches the callback
    assert not any("BatchWarmup" in str(node.get("_target_")) for node in cfg.callbacks.values() if node is not None)


def test_the_keys_of_a_group_follow_nesting_defaults_and_groups_taken_whole():
    cfg = compose_config("batch=seesaw", "lr_schedule=cosine", "+recipe=olmo1b_warmup")
    named = keys.setting_keys(cfg, "batch")
    assert named["lr_rule"] == ("batch.lr_rule", None)
    assert named["start"] == ("batch.schedule.start", None)  # nested: Seesaw's argument
    assert named["max_micro_batch_size"] == (
        "batch.max_micro_batch_size",
        "data.batch_size",
    )  # a default from another key
    assert named["lr_schedule"] == ("lr_schedule", None) and named["min_lr_ratio"] == ("lr_schedule.min_lr_ratio", None)
    assert "_target_" not in named


@pytest.mark.parametrize(
    ("overrides", "build", "line"),
    [
        # a nested group taken whole from its own key (Seesaw's lr_schedule: ${lr_schedule}) is named there
        (
            ["batch=seesaw", "lr_schedule=cosine", "lr_schedule.min_lr_ratio=2"],
            job.batch_warmup_of,
            "lr_schedule.min_lr_ratio=2 must lie in [0, 1] (a fraction of the base LR)",
        ),
        # a default taken from a top-level key names both: the one set and the one the user typed
        (
            ["val_check_tokens=0"],
            job.callbacks_of,
            "callbacks.validation.every_tokens=0 (val_check_tokens) must be a positive int "
            "(tokens between validations)",
        ),
        (["batch.lr_rule=bogus"], job.batch_warmup_of, "batch.lr_rule='bogus' is unknown; use one of"),
        # a message that names no argument of the group is led by the group's key
        (["model.config.preset=olmo_3b"], keys.model_config_of, "model.config: unknown model preset 'olmo_3b'"),
    ],
)
def test_a_group_error_names_the_key_the_user_typed(overrides, build, line):
    cfg = compose_config(*overrides)
    with pytest.raises(LitCBSConfigError) as raised:
        build(cfg)
    assert str(raised.value).startswith(line)


def test_an_error_already_naming_its_key_is_left_as_it_is():
    cfg = compose_config("data.path=/nonexistent/tokens")
    with pytest.raises(LitCBSConfigError) as raised, keys.group_key(cfg, "data"):
        raise ValueError("data.path='/nonexistent/tokens' is not a folder")
    assert str(raised.value) == "data.path='/nonexistent/tokens' is not a folder"


def test_run_errors_name_the_trainers_batch_and_callback_keys():
    cfg = compose_config()
    message = (
        "clip_rule='sqrt' scales Trainer(gradient_clip_val=None), which sets none; "
        "set gradient_clip_val or clip_rule=None"
    )
    assert keys.name_the_run_keys(cfg, message) == (
        "batch.clip_rule='sqrt' scales Trainer(trainer.gradient_clip_val=None), which sets none; "
        "set trainer.gradient_clip_val or batch.clip_rule=None"
    )
    # a plain word that is also an argument's name stays prose unless written as the argument
    assert keys.name_the_run_keys(cfg, "the unit of the schedule") == "the unit of the schedule"


def test_a_second_batch_warmup_among_the_callbacks_is_refused():
    cfg = compose_config(
        "+callbacks.extra={_target_:lit_cbs.BatchWarmup,schedule:{_target_:lit_cbs.ConstantBatch,batch_size:16}}"
    )
    with pytest.raises(
        LitCBSConfigError, match=r"^callbacks.extra is a second BatchWarmup; set the run's one at batch\.\*"
    ):
        job.callbacks_of(cfg)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        # a Lightning key the recipes replace: the key to set instead
        (
            ["trainer.val_check_interval=64"],
            "trainer.val_check_interval=64: the recipes validate by tokens, whatever the batch (Lightning's "
            "val_check_interval counts micro-batches, which grow); set val_check_tokens=<tokens between validations> "
            "(now 524,288)",
        ),
        (["trainer.accumulate_grad_batches=4"], "trainer.accumulate_grad_batches=4: BatchWarmup sets the accumulation"),
        # a typo: the keys it is close to, not Hydra's "use +" (which would add a key nothing reads)
        (["max_token=65536"], "max_token=65536: this configuration has no key max_token; did you mean max_tokens?"),
        (
            ["trainr.devices=2"],
            "trainr.devices=2: this configuration has no key trainr.devices; did you mean trainer.devices?",
        ),
        (["model.lr=0.01"], "model.lr=0.01: this configuration has no key model.lr; did you mean model.optimizer.lr?"),
        (
            ["+recipe=tiny_small_batch", "batch.schedule.batch_sizes=[32]"],
            "batch.schedule.batch_sizes=[32]: this configuration has no key batch.schedule.batch_sizes; "
            "did you mean batch.schedule.batch_size?",
        ),
        (
            ["-m", "callbacks.cbs_probe.windw_tokens=65536,131072"],
            "callbacks.cbs_probe.windw_tokens=65536,131072: this configuration has no key "
            "callbacks.cbs_probe.windw_tokens; did you mean callbacks.cbs_probe.window_tokens?",
        ),
        # nothing close: where to see the keys, and the + that adds one (a model.config field the preset leaves alone)
        (
            ["model.config.n_layers=2"],
            "model.config.n_layers=2: this configuration has no key model.config.n_layers (python recipes/train.py "
            "--cfg job prints them); +model.config.n_layers=2 adds it",
        ),
        # an argument of lightning's Trainer the recipes leave at its default: adding it is the fix
        (
            ["trainer.profiler=simple"],
            "trainer.profiler=simple: the recipes leave Trainer(profiler) at its default; add +trainer.profiler=simple",
        ),
    ],
)
def test_a_key_the_configuration_lacks_is_named_with_its_fix_before_hydra_composes(argv, line):
    with pytest.raises(LitCBSConfigError) as raised:
        keys.check_command_line(CONF, argv)
    assert str(raised.value).startswith(line) and "\n" not in str(raised.value)


def test_a_command_line_of_known_keys_passes_the_check():
    keys.check_command_line(CONF, ["-m", "+recipe=tiny_small_batch,tiny_warmup", "max_tokens=65536", "seed=range(1,3)"])
    keys.check_command_line(CONF, ["+trainer.profiler=simple", "~callbacks.progress_bar", "hydra.run.dir=/tmp/x"])


def test_a_fit_that_failed_before_its_callbacks_were_set_up_trained_no_step():
    # recipes/train.py asks this when trainer.fit raised, to take back the run's folder and raise the fit's error.
    assert not job.trained_a_step(BatchWarmup(ConstantBatch(8)))
