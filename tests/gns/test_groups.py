"""lit_cbs.gns.groups: which parameters are measured together, checked on the closed-form regression
(regression.py) and a tiny OLMo."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gns.regression import (
    GROUPS,
    HALVES,
    assert_exact_measurements,
    fit,
    fit_tiny_olmo,
    logged_gns_rows,
)
from lightning.pytorch.loggers import CSVLogger

from lit_cbs.analysis.curves import read_metrics_csv
from lit_cbs.gns import GradientNoiseScale
from lit_cbs.gns.groups import block_groups
from lit_cbs.models.decoder import layer_stacks
from lit_cbs.run.report import group_noise_scale_figure, plot_run


def test_regex_groups_equal_optimizer_groups_and_add_up_to_the_whole_model(tmp_path):
    # The same two halves of the weight, once as two optimizer groups and once as regexes over the
    # parameter names of a single optimizer group: the same numbers, and they add up to the model's.
    _, by_optimizer, _, _, _ = fit(
        8 * 4 * 50, 8, gns=GradientNoiseScale(groups="param_groups"), two_groups=True, accumulate_grad_batches=4
    )
    logger = CSVLogger(tmp_path, name="run", version=0)
    _, by_name, recorder, data, module = fit(
        8 * 4 * 50,
        8,
        gns=GradientNoiseScale(groups=HALVES),
        accumulate_grad_batches=4,
        logger=logger,
        log_every_n_steps=10,
    )
    assert by_name.group_names == by_optimizer.group_names == ["first", "second"]
    metrics = by_name.metrics()
    assert metrics == by_optimizer.metrics()
    for metric in ("grad_sq", "trace_sigma"):
        assert metrics[f"gns/first/{metric}"] + metrics[f"gns/second/{metric}"] == pytest.approx(
            metrics[f"gns/{metric}"], rel=1e-6
        )
    rows = logged_gns_rows(tmp_path / "run" / "version_0" / "metrics.csv")
    assert len(rows) == 5 and rows[-1] == pytest.approx(metrics)
    assert set(rows[-1]) == {
        f"gns/{group}{metric}"
        for group in ("", "first/", "second/")
        for metric in ("b_simple", "grad_sq", "trace_sigma")
    }
    assert assert_exact_measurements(recorder.steps, data.dataset, module.weight, groups=list(GROUPS.values())) == 50


def test_one_group_of_everything_is_the_whole_model_and_unmatched_parameters_stay_in_it():
    _, everything, _, _, _ = fit(8 * 4 * 30, 8, gns=GradientNoiseScale(groups={"all": ".*"}), accumulate_grad_batches=4)
    metrics = everything.metrics()
    assert everything.group_names == ["all"]
    assert [metrics[f"gns/all/{m}"] for m in ("b_simple", "grad_sq", "trace_sigma")] == [
        metrics[f"gns/{m}"] for m in ("b_simple", "grad_sq", "trace_sigma")
    ]
    _, first_only, recorder, data, module = fit(
        8 * 4 * 30, 8, gns=GradientNoiseScale(groups={"first": r"^first\."}), accumulate_grad_batches=4
    )
    assert first_only.group_names == ["first", None]  # second.weight: in no group, still in the whole model
    partial = first_only.metrics()
    assert set(partial) == {
        f"gns/{group}{m}" for group in ("", "first/") for m in ("b_simple", "grad_sq", "trace_sigma")
    }
    assert partial["gns/b_simple"] == pytest.approx(metrics["gns/b_simple"], rel=1e-6)
    assert assert_exact_measurements(recorder.steps, data.dataset, module.weight, groups=list(GROUPS.values())) == 30


@pytest.mark.parametrize("tie_embeddings, activation_checkpointing", [(False, False), (True, True)])
def test_blocks_on_a_tiny_olmo(tmp_path, tie_embeddings, activation_checkpointing):
    gns, metrics_csv = fit_tiny_olmo(tmp_path, "blocks", tie_embeddings, activation_checkpointing)
    assert gns.group_names == ["embedding", "block0", "block1"] + ([] if tie_embeddings else ["lm_head"])
    rows = logged_gns_rows(metrics_csv)
    assert len(rows) == gns.num_updates == 8
    for row in rows:
        for metric in ("grad_sq", "trace_sigma"):
            groups_sum = sum(row[f"gns/{group}/{metric}"] for group in gns.group_names)
            assert groups_sum == pytest.approx(row[f"gns/{metric}"], rel=1e-5, abs=1e-9)
        for group in gns.group_names:
            assert row[f"gns/{group}/b_simple"] == pytest.approx(
                row[f"gns/{group}/trace_sigma"] / row[f"gns/{group}/grad_sq"], rel=1e-5
            )


@pytest.mark.slow
def test_compiled_blocks_measure_the_noise_scale_of_the_eager_model(tmp_path):
    eager, _ = fit_tiny_olmo(tmp_path / "eager", "blocks", activation_checkpointing=True)
    compiled, _ = fit_tiny_olmo(tmp_path / "compiled", "blocks", activation_checkpointing=True, compile=True)
    assert compiled.group_names == eager.group_names and compiled.num_updates == eager.num_updates == 8
    # The same gradients to rounding: inductor's kernels sum in another order than eager's.
    assert compiled.b_simple == pytest.approx(eager.b_simple, rel=1e-3)


def test_blocks_of_two_stacks_stay_apart():
    def stack(blocks: int) -> torch.nn.Module:
        module = torch.nn.Module()
        module.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2, bias=False) for _ in range(blocks))
        return module

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 2)
    model.encoder, model.decoder = stack(2), stack(1)
    model.decoder.norm = torch.nn.LayerNorm(2, bias=False)
    names = [name for name, _ in model.named_parameters()]
    assert layer_stacks(model) == ["encoder.blocks", "decoder.blocks"]
    assert block_groups(names, layer_stacks(model)) == {
        "embed": ["embed.weight"],
        "block0": ["encoder.blocks.0.weight"],
        "block1": ["encoder.blocks.1.weight"],
        "decoder.block0": ["decoder.blocks.0.weight"],
        "decoder.norm": ["decoder.norm.weight"],
    }


def test_run_report_plots_b_simple_per_group(tmp_path):
    gns, metrics_csv = fit_tiny_olmo(tmp_path, "blocks")
    written = plot_run(metrics_csv, tmp_path / "plots")
    assert [path.name for path in written] == [
        "loss_vs_tokens.png",
        "batch_lr_vs_tokens.png",
        "gns_groups_vs_tokens.png",
    ]
    figure = group_noise_scale_figure(read_metrics_csv(metrics_csv))
    (ax,) = figure.axes
    lines = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
    assert gns.group_names == ["embedding", "block0", "block1", "lm_head"]
    assert list(lines) == ["block0", "block1", "embedding", "lm_head", "whole model"]
    rows = logged_gns_rows(metrics_csv)
    np.testing.assert_allclose(lines["block1"], [row["gns/block1/b_simple"] for row in rows])
    # Without groups there is nothing to draw per group.
    _, plain_csv = fit_tiny_olmo(tmp_path / "plain", None)
    assert "gns_groups_vs_tokens.png" not in [path.name for path in plot_run(plain_csv, tmp_path / "plain_plots")]


@pytest.mark.parametrize(
    "groups, message",
    [
        (
            {"first": r"^first\.", "third": r"^third\."},
            r"groups['third']='^third\\.' matches none of the trained parameters (first.weight, second.weight)",
        ),
        (
            {"weights": "weight", "first": r"^first\."},
            "parameter 'first.weight' is matched by groups ['weights', 'first']",
        ),
        (
            "blocks",
            "groups='blocks' looks for the model's stack of transformer blocks "
            "(an nn.ModuleList of modules of one class",
        ),
    ],
)
def test_groups_that_match_nothing_or_overlap_are_refused_before_training(groups, message):
    gns = GradientNoiseScale(groups=groups)
    with pytest.raises(ValueError, match=re.escape(message)):
        fit(64, 8, gns=gns, accumulate_grad_batches=2)
    assert gns.num_updates == 0 and gns.last_measurement is None
