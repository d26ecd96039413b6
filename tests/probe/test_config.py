"""CBSProbeCallback's keywords (checked by lit_cbs.probe.engine.ProbeConfig): every bad setting refused in one line
naming the field; every keyword described in the callback's docstring."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from hydra.utils import instantiate
from toys import toy_probe

from lit_cbs import CBSProbeCallback
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.engine import ProbeConfig


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(multipliers=()), "non-empty"),
        (dict(multipliers=(1, -2)), "positive"),
        (dict(epsilon=-0.01), "epsilon=-0.01"),
        (dict(epsilon=2.0), r"epsilon=2.0 must lie in \[0, 0.5\) nats.*every batch recovers"),
        (dict(multipliers=(2, 4)), "has no k = 1.*include 1"),
        (dict(ema_alpha=0.0), "ema_alpha=0.0"),
        (dict(ema_alpha=1.5), "ema_alpha=1.5"),
        (dict(window_tokens=0), "window_tokens=0"),
        (dict(search="random"), "search='random'"),
        (dict(search="bisect", multipliers=(2, 4)), "include 1"),
        (dict(every_tokens=None), "needs where to probe: give every_tokens, at_tokens or geometric"),
        (dict(at_tokens=[100]), "give one of every_tokens, at_tokens or geometric=.*not several"),
        (dict(every_tokens=0), "every_tokens=0"),
        (dict(evaluate="val"), "evaluate='val'"),
        (dict(heldout_batches=0), "heldout_batches=0"),
        (dict(max_overhead=0), "max_overhead=0"),
    ],
)
def test_bad_probe_arguments(kwargs, match):
    with pytest.raises(LitCBSConfigError, match=match):
        toy_probe(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(multipliers=(1,)), "has one batch size"),
        (dict(confidence=1.0), "confidence=1.0"),
        (dict(confidence=0.3), "confidence=0.3"),
        (dict(cooldown_fraction=1.0), "cooldown_fraction=1.0"),
        (dict(early_stop=(0.0, 0.5)), "early_stop="),
        (dict(early_stop=(0.5,), cooldown_fraction=0.2), "cannot be combined"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(LitCBSConfigError, match=match):
        toy_probe(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(replicates=0), "replicates=0 must be"),
        (dict(replicates=2, evaluate="train_ema"), "replicates=2 compares each k on the same held-out batches"),
        (dict(replicates=2, early_stop=(0.5,)), r"early_stop=\[0.5\] and replicates=2 cannot be combined"),
    ],
)
def test_bad_replicate_settings_are_refused(kwargs, match):
    settings = dict(every_tokens=160, multipliers=(1, 2), window_tokens=64, evaluate="heldout")
    settings.update(kwargs)
    with pytest.raises(LitCBSConfigError, match=match):
        CBSProbeCallback(**settings)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(every_tokens=0), "every_tokens"),
        (dict(every_tokens=None, at_tokens=[0]), "at_tokens"),
        (dict(every_tokens=None, geometric=(100, 1.0)), "geometric"),
        (dict(multipliers=(1, 1)), "multipliers"),
        (dict(window_tokens=-1), "window_tokens"),
        (dict(epsilon=0.5), "epsilon"),
        (dict(confidence=0.4), "confidence"),
        (dict(ema_alpha=0), "ema_alpha"),
        (dict(lr_rule="cubic"), "lr_rule"),
        (dict(search="binary"), "search"),
        (dict(evaluate="val"), "evaluate"),
        (dict(heldout_batches=0), "heldout_batches"),
        (dict(cooldown_fraction=-0.1), "cooldown_fraction"),
        (dict(early_stop=(1.5,)), "early_stop"),
        (dict(replicates=2), "replicates"),
        (dict(max_overhead=-1), "max_overhead"),
    ],
)
def test_a_bad_field_is_named_in_one_line_before_any_work(kwargs, field):
    settings = dict(every_tokens=160, multipliers=(1, 2))
    settings.update(kwargs)
    with pytest.raises(LitCBSConfigError) as raised:
        CBSProbeCallback(**settings)
    message = str(raised.value)
    assert "\n" not in message and f"{field}=" in message, message


def test_every_keyword_is_described_in_the_callbacks_docstring():
    doc = inspect.getdoc(CBSProbeCallback)
    assert doc is not None
    keywords = {field.name for field in dataclasses.fields(ProbeConfig) if field.init}
    assert {name for name in keywords if name not in doc} == set()


def test_the_keywords_are_kept_in_a_normal_form_and_checked_again_on_a_copy():
    settings = dict(at_tokens=[640, 160], multipliers=(4, 1, 2), window_tokens=128, search="bisect", output_dir="out")
    config = CBSProbeCallback(**settings).config
    assert config.at_tokens == [160, 640] and config.multipliers == [1.0, 2.0, 4.0] and config.output_dir == Path("out")
    assert config.probe_point(1) == 640
    with pytest.raises(TypeError):
        CBSProbeCallback(config)  # type: ignore[misc]  # the keywords are the one way to configure it
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.epsilon = 0.02  # type: ignore[misc]
    with pytest.raises(LitCBSConfigError, match="epsilon=0.7"):
        dataclasses.replace(config, epsilon=0.7)  # a changed copy is checked again


def test_hydra_builds_the_probe_from_flat_keys():
    probe = instantiate(
        {
            "_target_": "lit_cbs.CBSProbeCallback",
            "_convert_": "all",
            "every_tokens": 160,
            "multipliers": [1, 2],
            "search": "bisect",
        }
    )
    assert (
        isinstance(probe, CBSProbeCallback)
        and probe.config.search == "bisect"
        and probe.config.multipliers == [1.0, 2.0]
    )
