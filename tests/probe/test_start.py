"""Whether a due probe starts, and on what (lit_cbs/probe/plan.py), with numbers: the decision the in-process
probe, a side-job probe and a probe of a saved checkpoint all take. Tokens per sample 16 and a global batch of 8
samples throughout; every multiplier's batch makes whole micro-batches unless a test says otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lit_cbs.probe.engine import ProbeConfig
from lit_cbs.probe.plan import ProbePlan, ProbeSkip, RunEnd, plan_probe, window_at

SEQ_LEN, BATCH = 16, 8


def fits(k: float) -> int:
    return BATCH  # samples per rank in a micro-batch of branch k


def plan(config: ProbeConfig, tokens: int = 1024, data_parallel_size: int = 1, **run) -> ProbePlan | ProbeSkip:
    """plan_probe at batch BATCH in a run with these counts (``largest_batch``: the run's largest batch)."""
    micro_batch, largest = run.pop("branch_micro_batch", fits), run.pop("largest_batch", BATCH)
    if "run_end_tokens" in run:
        end = run.pop("run_end_tokens")
        run["end"] = RunEnd(end, end, f"max_tokens={end}")
    probe_run = SimpleNamespace(
        config=config,
        accounting=SimpleNamespace(tokens_seen=tokens, data_parallel_size=data_parallel_size),
        global_batch=lambda: BATCH,
        seq_len=lambda: SEQ_LEN,
        micro_batch_for=lambda batch: micro_batch,
        largest_batch=lambda: largest,
    )
    return plan_probe(probe_run, **run)


def test_the_window_is_whole_steps_of_the_largest_branch():
    # 5,000 tokens are 312 samples; k = 4 trains 32 a step, so the window is 9 of its steps: 288 samples.
    config = ProbeConfig(multipliers=(1, 2, 4), window_tokens=5000)
    assert window_at(config, BATCH, SEQ_LEN, fits) == ([1.0, 2.0, 4.0], 288)
    assert plan(config) == ProbePlan([1.0, 2.0, 4.0], 288, [])


def test_a_multiplier_is_measured_where_its_batch_makes_micro_batches_and_fits_the_window():
    # k = 2 makes no whole micro-batch here; k = 8 (64 samples) does not fit a window of 40.
    config = ProbeConfig(multipliers=(1, 2, 4, 8), window_tokens=40 * SEQ_LEN)
    assert window_at(config, BATCH, SEQ_LEN, lambda k: None if k == 2 else BATCH)[0] == [1, 4]


@pytest.mark.parametrize(
    "window_tokens, branch_micro_batch",
    [(4096, lambda k: BATCH if k == 1 else None), (64, fits)],  # only k = 1 makes micro-batches; a window of 4 samples
)
def test_a_probe_where_fewer_than_two_multipliers_fit_is_skipped_with_a_warning(window_tokens, branch_micro_batch):
    config = ProbeConfig(multipliers=(1, 2, 4), window_tokens=window_tokens)
    skip = plan(config, branch_micro_batch=branch_micro_batch)
    assert skip == ProbeSkip("fewer than two multipliers, k = 1 among them, fit batch 8", warn=True)
    assert window_at(config, BATCH, SEQ_LEN, branch_micro_batch)[1] == 0


def test_a_window_past_the_run_end_stays_due_for_a_resumed_run():
    config = ProbeConfig(multipliers=(1, 2, 4), window_tokens=4096)  # 256 samples: exactly 4,096 tokens
    assert plan(config, run_end_tokens=5119) == ProbeSkip(
        "its window of 4,096 tokens would end past the run's end (max_tokens=5119, at 5,119 tokens); a run resumed "
        "from this one's last checkpoint starts it there",
        stays_due=True,
    )
    assert isinstance(plan(config, run_end_tokens=5120), ProbePlan)  # 1,024 + 4,096: it ends where the run ends


def test_replicate_windows_count_against_the_run_end_but_a_side_jobs_main_run_records_one():
    config = ProbeConfig(multipliers=(1, 2, 4), window_tokens=4096, replicates=2, evaluate="heldout")
    skip = plan(config, run_end_tokens=9215)  # 1,024 + 2 x 4,096 = 9,216
    assert isinstance(skip, ProbeSkip) and skip.stays_due and skip.reason.startswith("its window of 8,192 tokens")
    assert isinstance(plan(config, run_end_tokens=9216), ProbePlan)
    # Side jobs read their windows from the data themselves: the main run needs only its own first window.
    assert plan(config, run_end_tokens=5120, main_span_tokens=4096) == ProbePlan([1.0, 2.0, 4.0], 256, [])


def test_max_overhead_counts_the_branches_the_search_trains_at_most():
    # grid: 3 branches of 4,096 tokens against the 1,024 tokens trained and the 4,096 of the window: 2.4.
    def config(max_overhead):
        return ProbeConfig(multipliers=(1, 2, 4), window_tokens=4096, search="grid", max_overhead=max_overhead)

    assert isinstance(plan(config(2.4)), ProbePlan)
    assert plan(config(2.3)) == ProbeSkip("it would bring probe overhead to 2.40 > max_overhead=2.3")
    # Earlier probes' branch tokens count too: (5,120 + 12,288) / (1,024 + 4,096) = 3.4.
    assert plan(config(3.3), tokens_spent=5120).reason == "it would bring probe overhead to 3.40 > max_overhead=3.3"


@pytest.mark.parametrize(
    "early_stop, data_parallel_size, samples",
    [
        ((0.25, 0.5), 2, [32, 64]),  # a rank's 128 samples; steps of k = 4 are 16 samples per rank
        ((0.3, 0.99), 1, [64, 224]),  # 76.8 and 253.4 of 256, rounded down to steps of 32
        ((0.1,), 1, []),  # 25.6 rounds down to no step at all
    ],
)
def test_early_stops_are_whole_steps_of_the_largest_branch_per_rank(early_stop, data_parallel_size, samples):
    config = ProbeConfig(multipliers=(1, 2, 4), window_tokens=4096, early_stop=early_stop)
    assert plan(config, data_parallel_size=data_parallel_size).early_stop_samples == samples


def test_a_cbs_adaptive_at_its_final_batch_is_not_probed():
    skip = plan(ProbeConfig(multipliers=(1, 2, 4), window_tokens=4096), adaptive_final=256)
    keeps_probing = "(CBSAdaptive(probe_after_final=True) keeps probing)"
    assert skip == ProbeSkip(f"CBSAdaptive is at its final batch 256, where no reading can move it {keeps_probing}")


def test_a_window_stays_clear_of_an_uneven_epoch_end():
    # The window (256 samples) and one step at the largest batch the run reaches (16 samples): 272 samples.
    config = ProbeConfig(multipliers=(1, 2, 4), window_tokens=4096)
    uneven = "leave the 2 ranks different numbers of samples"

    def at(samples: int, position: int) -> ProbePlan | ProbeSkip:
        return plan(
            config,
            data_parallel_size=2,
            uneven_loader=SimpleNamespace(num_samples=samples, position=position),
            largest_batch=16,
        )

    too_long = "its window and a step (272 samples) do not fit in an epoch of 271 samples"
    assert at(271, 0) == ProbeSkip(f"{too_long}, whose last micro-batches {uneven}: shorten window_tokens", warn=True)
    waits = f"its window would reach this epoch's last micro-batches, which {uneven}"
    assert at(300, 29) == ProbeSkip(waits, next_epoch=True)
    assert isinstance(at(300, 28), ProbePlan)
