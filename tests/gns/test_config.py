"""GradientNoiseScale's keyword arguments: every one checked when built, in one line naming it; Hydra builds it."""

from __future__ import annotations

from pathlib import Path

import pytest
from gns.regression import HALVES, squared_error
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lit_cbs import LitCBSConfigError
from lit_cbs.gns import GradientNoiseScale

ROOT = Path(__file__).resolve().parents[2]


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
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientNoiseScale(**kwargs)


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
        GradientNoiseScale(**kwargs)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(field)


def test_defaults():
    gns = GradientNoiseScale(ema_decay=0)
    assert isinstance(gns.ema_decay, float) and GradientNoiseScale().ema_decay == 0.99


def test_hydra_flat_keys_build_the_callback():
    recipe = OmegaConf.load(ROOT / "conf" / "recipe" / "tiny_es_sweep.yaml")
    default = instantiate(recipe.callbacks.gns)
    assert (default.ema_decay, default.groups, default.per_example_loss) == (0.99, None, None)
    node = OmegaConf.create({"_target_": "lit_cbs.gns.GradientNoiseScale", "ema_decay": 0.9, "groups": dict(HALVES)})
    gns = instantiate(node)
    assert gns.ema_decay == 0.9 and dict(gns.groups) == HALVES
