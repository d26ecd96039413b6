"""plot_cbs_curve and its figure (lit_cbs.analysis.plots)."""

from __future__ import annotations

import re

import matplotlib
import pytest
from toys import heldout_score

from lit_cbs.probe.plot import _gap_to_smaller, cbs_curve_figure, plot_cbs_curve
from lit_cbs.probe.reading import BranchScore, ProbeReading, difference


def decided(scores: dict[float, BranchScore], epsilon: float, confidence: float, tokens: int, **fields) -> ProbeReading:
    """``ProbeReading.decide`` on a grid of every k in ``scores`` (k = 1 the main window) at batch 8 of 4-token
    samples; ``fields`` set the record's other fields, which the plot does not read."""
    grid = sorted(scores)
    fields = {"window_tokens": 128, "evaluate": "train_ema", "tokens_spent": 384, **fields}
    return ProbeReading.decide(
        scores,
        epsilon,
        confidence,
        grid,
        8,
        tokens=tokens,
        step=0,
        seq_len=4,
        search="grid",
        main_loss=scores[1.0].loss,
        branches_trained=grid,
        failed=[],
        overhead=0.1,
        **fields,
    )


def test_cbs_plot_leaves_the_matplotlib_backend_alone(tmp_path):
    readings = [
        decided({1.0: BranchScore(3.0), 2.0: BranchScore(3.0), 4.0: BranchScore(loss4)}, 0.01, 0.5, tokens)
        for tokens, loss4 in ((1000, 3.5), (2000, 3.0))  # a closed interval, then the top of the grid
    ]
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a notebook's or script's own choice
    try:
        path = plot_cbs_curve(readings, [], tmp_path / "plots" / "cbs_curve.png", end_tokens=3000)
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_loss_gap_panel_labels_its_ticks_as_plain_numbers():
    readings = [
        decided({1.0: BranchScore(3.0), 2.0: BranchScore(3.0 + gap), 4.0: BranchScore(3.2)}, 0.0241374, 0.5, tokens)
        for tokens, gap in ((1000, 0.01), (2000, 0.5))
    ]
    figure = cbs_curve_figure(readings, [], end_tokens=3000, epsilon=0.0241374)  # symlog threshold 0.0482748
    figure.canvas.draw()
    bottom = figure.axes[1]
    labels = [label.get_text() for label in bottom.get_yticklabels() + bottom.get_yticklabels(minor=True)]
    assert labels and all(re.fullmatch(r"−?-?[0-9.]+(e[+-]?[0-9]+)?", text) for text in labels if text), labels


def test_the_plot_draws_what_the_rule_holds_against_epsilon():
    from lit_cbs.probe.reading import one_sided_quantile

    scores = {
        1.0: heldout_score(3.0, 0.01),
        2.0: heldout_score(2.95, 0.01, seed=2),
        4.0: heldout_score(2.99, 0.01, seed=4),
    }
    reading = decided(scores, 0.02, 0.9, 100, window_tokens=64, evaluate="heldout", tokens_spent=192)
    tokens, gap, bar = _gap_to_smaller(reading, 4.0)  # against k = 2, the lowest smaller loss
    pair = difference(scores[4.0], scores[2.0])
    assert (tokens, gap) == (100, pytest.approx(0.04)) and bar == pytest.approx(pair.se * one_sided_quantile(0.9, 15))
    assert reading.k_star == 2.0  # 4 is 0.04 above k = 2: beyond epsilon, though only 0.01 below k = 1


def test_every_reading_and_gap_is_drawn_inside_the_axes_between_labelled_ticks():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    def reading(tokens, means):  # held-out losses per k, as the default job's probe measures them
        scores = {k: heldout_score(mean, 0.01, seed=int(k)) for k, mean in means.items()}
        return decided(scores, 0.02, 0.9, tokens, window_tokens=131072, evaluate="heldout", tokens_spent=262144)

    # The default job's first reading (k = 8 is 0.083 nats above k = 4), and an early one far above epsilon.
    readings = [reading(524288, {1.0: 1.8407, 4.0: 1.8356, 8.0: 1.9188}), reading(65536, {1.0: 2.9, 2.0: 3.4})]
    figure = cbs_curve_figure(readings, [], end_tokens=1048576, epsilon=0.02)
    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.canvas.draw()
    top, bottom = figure.axes
    gaps = [point[1:] for r in readings for k in (2.0, 4.0, 8.0) if (point := _gap_to_smaller(r, k)) is not None]
    assert len(gaps) == 3
    low, high = bottom.get_ylim()
    height = bottom.transData.transform([[0, high]])[0, 1] - bottom.transData.transform([[0, low]])[0, 1]
    for gap, bar in gaps:  # each error bar whole, at least 3% of the panel's height from either edge (display units)
        lower, upper = bottom.transData.transform([[0, gap - bar], [0, gap + bar]])[:, 1]
        edge_low, edge_high = bottom.transData.transform([[0, low], [0, high]])[:, 1]
        assert lower - edge_low > 0.03 * height and edge_high - upper > 0.03 * height, (gap, bar, (low, high))
    # Each gap's value can be read: a labelled tick at or beyond it on either side.
    ticks = bottom.yaxis.get_major_ticks()
    labelled = [tick.get_loc() for tick in ticks if tick.label1.get_text() and low <= tick.get_loc() <= high]
    assert all(min(labelled) <= gap <= max(labelled) for gap, _ in gaps), (labelled, gaps)
    low, high = top.get_ylim()
    assert all(low < r.cbs_lower and r.cbs_upper < high for r in readings)
