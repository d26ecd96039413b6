"""GNSConfig: every setting checked when built, one line naming the field; GradientNoiseScale takes it or its fields."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
from gns.regression import HALVES, fit, squared_error
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lit_cbs import GNSConfig as TopLevelGNSConfig
from lit_cbs import LitCBSConfigError
from lit_cbs.gns import GNSConfig, GradientNoiseScale

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("build", [GradientNoiseScale, GNSConfig], ids=["GradientNoiseScale", "GNSConfig"])
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"ema_decay": 1.0}, ValueError, r"ema_decay=1.0 must be a float in \[0, 1\)"),
        ({"ema_decay": -0.1}, ValueError, "ema_decay"),
        ({"per_example_loss": "mse"}, TypeError, "per_example_loss must be a callable"),
        ({"per_example_chunk_size": 4}, ValueError, "also pass per_example_loss"),
        ({"per_example_loss": squared_error, "per_example_chunk_size": 0}, ValueError, "positive int"),
        (
            {"groups": "layers"},
            ValueError,
            r"groups='layers' is not supported; use None, one of \('param_groups', 'blocks'\)",
        ),
        ({"groups": {}}, ValueError, "a non-empty dict of group name -> regex"),
        ({"groups": {"attention": "("}}, ValueError, r"groups\['attention'\]='\(' is not a valid regex"),
        ({"groups": {"attention": 3}}, TypeError, "must be a regex string over parameter names"),
        ({"groups": {"": "weight"}}, ValueError, "group names must be non-empty strings"),
    ],
)
def test_bad_arguments_fail_at_construction(build, kwargs, error, match):
    with pytest.raises(error, match=match):
        build(**kwargs)


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("ema_decay", {"ema_decay": True}),
        ("ema_decay", {"ema_decay": "0.9"}),
        ("ema_decay", {"ema_decay": 1.5}),
        ("groups", {"groups": ["first"]}),
        ("groups", {"groups": {"first": "("}}),
        ("groups", {"groups": {1: "first"}}),
        ("per_example_loss", {"per_example_loss": 3}),
        ("per_example_chunk_size", {"per_example_loss": squared_error, "per_example_chunk_size": 2.5}),
        ("per_example_chunk_size", {"per_example_chunk_size": 8}),
    ],
)
def test_a_bad_field_is_named_in_one_line(field, kwargs):
    with pytest.raises(LitCBSConfigError) as raised:
        GNSConfig(**kwargs)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(field)


def test_every_field_has_a_docstring():
    # A string right under each field (as mkdocstrings reads it), not just the class docstring.
    (node,) = ast.parse(inspect.getsource(GNSConfig)).body
    documented = {
        statement.target.id
        for statement, following in zip(node.body, node.body[1:])
        if isinstance(statement, ast.AnnAssign)
        and isinstance(following, ast.Expr)
        and isinstance(following.value, ast.Constant)
        and isinstance(following.value.value, str)
        and following.value.value.strip()
    }
    fields = [field.name for field in dataclasses.fields(GNSConfig)]
    assert fields == ["ema_decay", "groups", "per_example_loss", "per_example_chunk_size"]
    assert documented == set(fields)


def test_config_and_keyword_arguments_build_the_same_callback():
    config = GNSConfig(ema_decay=0.9, groups=HALVES)
    assert GradientNoiseScale(config).config is config
    assert GradientNoiseScale(ema_decay=0.9, groups=HALVES).config == config
    assert GradientNoiseScale().config == GNSConfig() and GNSConfig().ema_decay == 0.99
    assert TopLevelGNSConfig is GNSConfig
    assert isinstance(GNSConfig(ema_decay=0).ema_decay, float)
    # The config measures: the same run with either gives the same numbers.
    _, by_config, _, _, _ = fit(
        8 * 4 * 10, 8, gns=GradientNoiseScale(GNSConfig(groups=HALVES)), accumulate_grad_batches=4
    )
    _, by_keywords, _, _, _ = fit(8 * 4 * 10, 8, gns=GradientNoiseScale(groups=HALVES), accumulate_grad_batches=4)
    assert by_config.num_updates == 10 and by_config.metrics() == by_keywords.metrics()


def test_config_and_keyword_arguments_together_are_refused():
    with pytest.raises(
        LitCBSConfigError, match=r"config=GNSConfig\(...\) or its fields as keyword arguments, not both"
    ):
        GradientNoiseScale(GNSConfig(), ema_decay=0.9)
    with pytest.raises(LitCBSConfigError, match=r"GradientNoiseScale\(config=0.9\) must be a GNSConfig"):
        GradientNoiseScale(0.9)
    with pytest.raises(
        LitCBSConfigError, match=r"^GradientNoiseScale got ema_decy=0.9, which is not a setting: use the GNSConfig "
    ):
        GradientNoiseScale(ema_decy=0.9)


def test_hydra_flat_keys_build_the_config():
    recipe = OmegaConf.load(ROOT / "conf" / "recipe" / "tiny_es_sweep.yaml")
    assert instantiate(recipe.callbacks.gns).config == GNSConfig()
    node = OmegaConf.create({"_target_": "lit_cbs.gns.GradientNoiseScale", "ema_decay": 0.9, "groups": dict(HALVES)})
    gns = instantiate(node)
    assert gns.config.ema_decay == 0.9 and dict(gns.config.groups) == HALVES
