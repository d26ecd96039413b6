"""lit_cbs.analysis.law and readings measured elsewhere: a law fitted to bracketed readings finds what made them
(the tokens or the loss), its band holds a size it never saw, its file plans a run through
recipes/schedule_from_probe.py and plan=true, and a hand-written minimal reading file feeds every consumer."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from recipe_runs import ROOT, compose_config, train

from lit_cbs.analysis import brackets_from_records, schedule_from_probe
from lit_cbs.analysis.law import CBSLaw, LawPoint, fit_law, law_points, schedule_from_law
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe import read_readings

SEQ_LEN = 128
DOUBLING = [32768 * 2**i for i in range(8)]


def loss_at(tokens: float, params: float) -> float:
    """A Chinchilla-like loss: a bigger model is lower at the same D."""
    return 1.4 + 30 * tokens**-0.25 + 20 * params**-0.3


def bracketed(cbs_tokens: float, batch: int = 4) -> tuple[float, float]:
    """The probe's bracket (tokens) on the grid batch x 2^k of a CBS read at ``cbs_tokens``."""
    samples = cbs_tokens / SEQ_LEN
    lower = batch * 2 ** max(0, math.floor(math.log2(samples / batch)))
    return lower * SEQ_LEN, 2 * lower * SEQ_LEN


def simulated(follows: str, sizes=(66_560, 233_472), seeds=(1, 2), spread=0.15, corpus="text") -> list[LawPoint]:
    """Readings of runs whose CBS is 60 D^0.5 tokens (``follows="tokens"``, no size term) or a power of the loss,
    read with log-normal noise and bracketed as the probe brackets them."""
    points = []
    for params in sizes:
        for seed in seeds:
            rng = np.random.default_rng([seed, params])
            for tokens in DOUBLING:
                loss = loss_at(tokens, params)
                cbs = 60 * tokens**0.5 if follows == "tokens" else 6.4e4 * (loss - 1.2) ** -4
                lower, upper = bracketed(cbs * math.exp(rng.normal(0, spread)))
                points.append(LawPoint(tokens, lower, upper, params, corpus, f"{params}_{seed}", loss))
    return points


@pytest.mark.parametrize("follows, other", [("tokens", "loss"), ("loss", "tokens")])
def test_the_law_in_what_made_the_readings_needs_no_size_term(follows, other):
    points = simulated(follows)
    made, not_made = fit_law(points, follows), fit_law(points, other)
    # In what made them the size adds nothing (c near 0); in the other the sizes fall on two curves.
    assert abs(made.size_slope) < 3 * math.sqrt(made.covariance[-1][-1]) + 0.05
    assert abs(not_made.size_slope) > 3 * math.sqrt(not_made.covariance[-1][-1])
    if follows == "tokens":
        assert made.slope == pytest.approx(0.5, abs=0.06)
    # One curve without c explains the readings better in what made them.
    assert fit_law(points, follows, size_term=False).log_likelihood > fit_law(points, other, False).log_likelihood


def test_the_90_percent_band_holds_a_larger_size_it_never_saw():
    law = fit_law(simulated("tokens"))
    unseen = simulated("tokens", sizes=(852_000,), seeds=range(1, 26))
    inside = [law.band([p.tokens], p.params, 0.9, p.corpus) for p in unseen]
    held = sum(low[0] <= p.upper and high[0] >= p.lower for p, (low, high) in zip(unseen, inside))
    assert 0.85 <= held / len(unseen) <= 1.0  # brackets a factor 2 wide: overlap holds at least the nominal 90%
    middle = sum(low[0] <= math.sqrt(p.lower * p.upper) <= high[0] for p, (low, high) in zip(unseen, inside))
    assert 0.75 <= middle / len(unseen) <= 0.99  # the bracket's middle, about as often as the band says


def test_corpora_get_their_own_intercept_and_an_unseen_corpus_a_wider_band(tmp_path):
    points = simulated("tokens", corpus="a") + [
        LawPoint(p.tokens, 4 * p.lower, 4 * p.upper, p.params, "b", p.run + "b", p.loss)
        for p in simulated("tokens", corpus="b")
    ]
    law = fit_law(points)
    assert law.corpora == ("a", "b") and law.intercepts[1] - law.intercepts[0] == pytest.approx(math.log(4), abs=0.1)
    a, b, unseen = (law.band([1e6], 233_472, 0.9, corpus) for corpus in ("a", "b", None))
    assert a[1][0] < unseen[1][0] and unseen[0][0] < b[0][0]  # pooled: between the two, and wider
    law.save(tmp_path / "law.json")
    assert CBSLaw.load(tmp_path / "law.json") == law
    one_size_each = [p for p in points if (p.corpus, p.params) in {("a", 66_560), ("b", 233_472)}]
    with pytest.raises(ValueError, match="each corpus was read at one size, so the size term and the corpora's"):
        fit_law(one_size_each)
    with pytest.raises(ValueError, match="corpus='c' is not one of the law's"):
        law.band([1e6], 233_472, 0.9, "c")
    (tmp_path / "broken.json").write_text('{"covariate": "tokens"}')
    with pytest.raises(ValueError, match=r"broken.json is not a CBS law .*fit_law\(\.\.\.\)\.save"):
        CBSLaw.load(tmp_path / "broken.json")


def test_a_schedule_follows_the_lower_edge_of_the_band_at_the_target_size():
    law = fit_law(simulated("tokens"))
    schedule, changes = schedule_from_law(law, 852_000, 16_000_000, start=4, seq_len=SEQ_LEN, final=256)
    assert schedule.batch_sizes[0] == 4 and schedule.batch_sizes[-1] == 256
    for change in changes:  # each increase where the band's lower edge reaches the new batch
        low, _ = law.band([change.tokens], 852_000, 0.8)
        assert low[0] / SEQ_LEN >= change.batch and change.band_low == pytest.approx(low[0] / SEQ_LEN)
    with pytest.raises(ValueError, match="a law in the tokens"):
        schedule_from_law(fit_law(simulated("tokens"), "loss"), 852_000, 16_000_000, 4, SEQ_LEN)


MINIMAL = [  # a paper's numbers, or an own sweep: tokens, the CBS's bracket in samples
    {"tokens": 65536, "cbs_lower": 8, "cbs_upper": 16, "seq_len": SEQ_LEN},
    {"tokens": 262144, "cbs_lower": 16, "cbs_upper": 32, "seq_len": SEQ_LEN, "determined": True},
    {"tokens": 1048576, "cbs_lower": 64, "cbs_upper": None, "seq_len": SEQ_LEN, "determined": False},
]


def write(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_readings_measured_elsewhere_feed_the_schedule_the_forecast_and_the_law(tmp_path):
    readings = read_readings(write(tmp_path / "paper.jsonl", MINIMAL))
    assert [r.bracket for r in readings] == ["[8, 16]", "[16, 32]", "[64, beyond the grid] (undetermined)"]
    schedule = schedule_from_probe(readings, start=8)  # undetermined readings skipped, as the probe's own
    assert (schedule.batch_sizes, schedule.thresholds) == ([8, 16], [0, 262144])
    brackets = brackets_from_records(readings)
    assert [(b.lower, b.upper, b.determined) for b in brackets] == [
        (8, 16, True),
        (16, 32, True),
        (64, math.inf, False),
    ]
    points = law_points(readings, 233_472)
    assert [(p.lower, p.upper, p.loss) for p in points][:2] == [(1024, 2048, None), (2048, 4096, None)]
    with pytest.raises(ValueError, match="holds no loss; a law in the loss needs each's"):
        fit_law(points, "loss", size_term=False)
    no_seq_len = read_readings(
        write(tmp_path / "bare.jsonl", [{k: v for k, v in MINIMAL[0].items() if k != "seq_len"}])
    )
    with pytest.raises(ValueError, match="holds no seq_len; a law counts the CBS in tokens"):
        law_points(no_seq_len, 233_472)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"tokens": 65536, "cbs_lower": 8}, "it lacks cbs_upper (one measured elsewhere holds tokens, cbs_lower"),
        ({"tokens": 65536, "cbs_lower": 8, "cbs_upper": 16, "batch": 4}, "it has unknown fields batch"),
        ({"tokens": 65536, "cbs_lower": 8, "cbs_upper": 4}, "cbs_upper=4 must be above cbs_lower=8"),
        ({"tokens": -1, "cbs_lower": 8, "cbs_upper": 16}, "tokens=-1 must be"),
        ({"tokens": 65536, "cbs_lower": 8, "cbs_upper": 16, "determined": "yes"}, "determined='yes' must be true"),
    ],
)
def test_a_reading_measured_elsewhere_that_lacks_or_mistakes_a_field_is_named_in_one_line(tmp_path, record, message):
    with pytest.raises(ValueError, match=rf"bad.jsonl:1: .*{re.escape(message)}") as raised:
        read_readings(write(tmp_path / "bad.jsonl", [record]))
    assert "\n" not in str(raised.value)


def test_a_hand_written_file_gives_a_schedule_and_through_a_fitted_law_a_plan(tmp_path, recipe_script, capsys):
    command = recipe_script("schedule_from_probe")
    paper = write(tmp_path / "paper.jsonl", MINIMAL)
    assert command.main([str(paper), "--start", "8", "--out", str(tmp_path / "measured.yaml")]) == 0
    assert "batch_sizes: [8, 16]" in (tmp_path / "measured.yaml").read_text()
    # Two sizes read elsewhere: a law with a size term, then a target size no reading saw.
    small = write(
        tmp_path / "small.jsonl",
        [
            {
                **r,
                "cbs_lower": r["cbs_lower"] // 2,
                "cbs_upper": None if r["cbs_upper"] is None else r["cbs_upper"] // 2,
            }
            for r in MINIMAL
        ],
    )
    law_path = tmp_path / "law.json"
    argv = [str(small), str(paper), "--params", "66560", "233472", "--fit-law", str(law_path)]
    assert command.main(argv) == 0
    law = CBSLaw.load(law_path)
    assert law.size_term and law.size_slope > 0  # the larger size read the larger CBS
    capsys.readouterr()
    target = ["--law", str(law_path), "--target-params", "852000", "--target-tokens", "4194304", "--seq-len", "128"]
    assert command.main([*target, "--start", "8", "--out", str(tmp_path / "from_law.yaml")]) == 0
    schedule, changes = schedule_from_law(law, 852_000, 4_194_304, 8, SEQ_LEN)
    written = (tmp_path / "from_law.yaml").read_text()
    assert f"batch_sizes: {schedule.batch_sizes}" in written and f"thresholds: {schedule.thresholds}" in written
    assert (
        f"probe points worth checking it at (tokens): {', '.join(f'{c.tokens:,}' for c in changes)}"
        in capsys.readouterr().out
    )
    assert command.main([*target, "--corpus", "web", "--start", "8", "--out", str(tmp_path / "x.yaml")]) == 2
    assert "corpus='web' is not one of the law's ['corpus']" in capsys.readouterr().err
    assert command.main([*target, str(paper), "--start", "8", "--out", str(tmp_path / "x.yaml")]) == 2
    assert capsys.readouterr().err.strip() == (
        "schedule_from_probe.py: --law schedules from the law alone: leave out the probe files (or fit with --fit-law)"
    )
    # plan=true: the recipe's own size and budget are the target.
    report = train.plan_of(compose_config("plan=true", f"plan_for.law={law_path}")).report()
    plan = train.plan_of(compose_config("plan=true"))
    schedule, changes = schedule_from_law(law, plan.shape.parameters, plan.max_tokens, 16, SEQ_LEN, final=64)
    assert (
        f"batch.schedule.batch_sizes={schedule.batch_sizes} batch.schedule.thresholds={schedule.thresholds}" in report
    )
    assert (
        "probe points worth checking it at (tokens, before each increase): "
        + ", ".join(f"{c.tokens:,}" for c in changes)
        in report
    )


def test_the_law_fitted_on_the_tiny_workload_plans_the_default_job(tmp_path):
    # docs/cbs_law.json: benchmarks.cbs_law's law in the tokens (docs/RESULTS.md), for plan_for.law.
    shipped = ROOT / "docs" / "cbs_law.json"
    law = CBSLaw.load(shipped)
    assert (law.covariate, law.corpora, law.size_term) == ("tokens", ("kjv", "stdlib"), True)
    report = train.plan_of(compose_config("plan=true", f"plan_for.law={shipped}")).report()
    schedule, _ = schedule_from_law(law, 233_472, 4_194_304, 16, SEQ_LEN, final=64, corpus="stdlib")
    assert "for 233,472 parameters on stdlib" in report and f"batch_sizes={schedule.batch_sizes}" in report
    fit_law(simulated("loss"), "loss").save(tmp_path / "in_loss.json")  # a law in the loss plans no schedule
    with pytest.raises(LitCBSConfigError, match=r"^plan_for.law=.*in_loss.json is a law in the loss; a plan needs"):
        train.plan_of(compose_config("plan=true", f"plan_for.law={tmp_path / 'in_loss.json'}"))
