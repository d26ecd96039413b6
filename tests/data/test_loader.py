"""GlobalOrderLoader on its own: one order for any ranks and micro-batch, a data position that
resumes anywhere, and the length Lightning reads."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from launch import run_forked
from toys import IndexedRegression

from lit_cbs.data.loader import GlobalOrderLoader, epoch_order
from lit_cbs.errors import LitCBSConfigError

SAMPLES = list(range(100))


def identity(batch):
    return batch


def loaders(ranks: int, micro: int, **kwargs) -> list[GlobalOrderLoader]:
    return [
        GlobalOrderLoader(SAMPLES, micro, num_replicas=ranks, rank=r, collate_fn=identity, seed=3, **kwargs)
        for r in range(ranks)
    ]


def steps_of(ranks: int, micro_per_step: list[tuple[int, int]], **kwargs) -> list[list[int]]:
    """The samples of each optimizer step over all ranks in lockstep; ``micro_per_step``: (micro-batch,
    accumulation) per step."""
    group = loaders(ranks, micro_per_step[0][0], **kwargs)
    iterators = [iter(loader) for loader in group]
    steps = []
    for micro, accumulate in micro_per_step:
        for loader in group:
            loader.batch_size = micro
        steps.append(sorted(i for _ in range(accumulate) for iterator in iterators for i in next(iterator)))
    return steps


def test_every_step_takes_the_next_samples_of_one_order_whatever_the_split():
    # Global batches 8, 8, 16, 16, 4 on one rank with micro-batches 4, 8, 8, 16, 2 ...
    one = steps_of(1, [(4, 2), (8, 1), (8, 2), (16, 1), (2, 2)])
    # ... and on four ranks with micro-batches 1, 2, 4, 2, 1.
    four = steps_of(4, [(1, 2), (2, 1), (4, 1), (2, 2), (1, 1)])
    order = epoch_order(100, 3, 0, shuffle=True).tolist()
    assert one == four
    assert [i for step in one for i in step] == sorted(order[:8]) + sorted(order[8:16]) + sorted(order[16:32]) + sorted(
        order[32:48]
    ) + sorted(order[48:52])


def test_the_order_is_a_seeded_permutation_per_epoch():
    first, again, other = epoch_order(100, 3, 0, True), epoch_order(100, 3, 0, True), epoch_order(100, 3, 1, True)
    assert sorted(first.tolist()) == SAMPLES and first.tolist() == again.tolist() and first.tolist() != other.tolist()
    assert epoch_order(100, 3, 0, False).tolist() == SAMPLES


def test_len_counts_this_ranks_micro_batches_and_follows_the_micro_batch():
    loader = GlobalOrderLoader(SAMPLES, 8, num_replicas=2, rank=1, collate_fn=identity)
    assert len(loader) == 7  # 6 rounds of 16 samples, then the last 4, 2 on each rank
    iterator = iter(loader)
    next(iterator), next(iterator)
    loader.batch_size = 3
    assert len(loader) == 2 + 12  # (100 - 32) samples: 11 rounds of 6, then the last 2, 1 on each rank
    rest = list(iterator)
    assert len(rest) == len(loader) - 2 and [len(batch) for batch in rest[-2:]] == [3, 1]
    assert loader.position == 100


def test_state_dict_resumes_at_the_position_on_other_ranks():
    group = loaders(2, 4)
    iterators = [iter(loader) for loader in group]
    for _ in range(3):
        for iterator in iterators:
            next(iterator)
    state = group[0].state_dict()
    assert state["position"] == 24 and state["micro_batches"] == 3 and state["data_parallel_size"] == 2
    rest = sorted(i for iterator in iterators for batch in iterator for i in batch)
    resumed = GlobalOrderLoader(SAMPLES, 8, collate_fn=identity, seed=3)  # one rank now, another micro-batch
    resumed.load_state_dict(state)
    assert sorted(i for batch in resumed for i in batch) == rest
    order = epoch_order(100, 3, 0, True).tolist()
    assert set(rest) == set(order[24:])


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_sample_of_every_epoch_trains_once_whatever_the_split(ranks):
    # Micro-batches 4, 8, 3, 8 for 5 rounds each, for ever; every rank reads as many micro-batches per epoch.
    group = loaders(ranks, 4)
    read = []
    for epoch in range(3):
        for loader in group:
            loader.set_epoch(epoch)
        iterators = [iter(loader) for loader in group]
        lengths = {len(loader) for loader in group}
        rounds = 0
        while True:
            micro = [4, 8, 3, 8][rounds // 5 % 4]
            for loader in group:
                loader.batch_size = micro
            batches = [next(iterator, None) for iterator in iterators]
            if batches[0] is None:
                assert batches == [None] * ranks  # every rank ends the epoch on the same micro-batch
                break
            rounds += 1
            sizes = [len(batch) for batch in batches]
            assert max(sizes) - min(sizes) <= 1 and max(sizes) <= micro  # the last round: as even as can be
            read += [i for batch in batches for i in batch]
        assert {len(loader) for loader in group} == {rounds} and len(lengths) == 1
        assert {loader.position for loader in group} == {100}
    assert sorted(read) == sorted(SAMPLES * 3)


def test_a_rank_whose_share_of_the_last_round_is_empty_gets_a_batch_of_zero_samples():
    dataset = IndexedRegression(10)
    group = [GlobalOrderLoader(dataset, 2, num_replicas=4, rank=r, seed=3) for r in range(4)]
    assert all(loader.deals_unevenly for loader in group)
    batches = [list(loader) for loader in group]  # one round of 8 samples, then the last 2: one for ranks 0 and 1
    assert [[len(batch["idx"]) for batch in rank] for rank in batches] == [[2, 1], [2, 1], [2, 0], [2, 0]]
    empty = batches[3][1]
    assert empty["x"].shape == (0, 4) and empty["x"].dtype == torch.float64 and empty["idx"].dtype == torch.int64
    assert sorted(i for rank in batches for batch in rank for i in batch["idx"].tolist()) == list(range(10))
    assert [(loader.last_samples, loader.last_round_samples) for loader in group] == [(1, 2), (1, 2), (0, 2), (0, 2)]
    assert group[0].empty_batch()["x"].shape == (0, 4)
    assert not GlobalOrderLoader(dataset, 2, num_replicas=5, rank=0).deals_unevenly


@pytest.mark.parametrize("stop_after", [3, 6])  # mid-epoch, and right before the last round
def test_a_position_inside_or_before_the_last_round_resumes_on_other_ranks(stop_after):
    # 2 ranks, micro-batch 8: rounds of 16; the 100th sample ends a last round of 4.
    group = loaders(2, 8)
    iterators = [iter(loader) for loader in group]
    for _ in range(stop_after):
        for iterator in iterators:
            next(iterator)
    state = group[0].state_dict()
    rest = sorted(i for iterator in iterators for batch in iterator for i in batch)
    resumed = loaders(3, 5)  # three ranks now: rounds of 15, the last short
    for loader in resumed:
        loader.load_state_dict(state)
    read = [[i for batch in loader for i in batch] for loader in resumed]
    assert (
        sorted(i for rank in read for i in rank)
        == rest
        == sorted(epoch_order(100, 3, 0, True).tolist()[state["position"] :])
    )


def test_set_epoch_moves_to_the_next_order_and_keeps_a_resumed_position():
    loader = GlobalOrderLoader(SAMPLES, 10, collate_fn=identity, seed=3)
    loader.load_state_dict({**loader.state_dict(), "epoch": 2, "position": 50, "micro_batches": 5})
    loader.set_epoch(2)  # what Lightning calls when the resumed epoch starts
    assert next(iter(loader)) == epoch_order(100, 3, 2, True).tolist()[50:60]
    loader.set_epoch(3)
    assert loader.position == 0 and next(iter(loader)) == epoch_order(100, 3, 3, True).tolist()[:10]
    exhausted = GlobalOrderLoader(SAMPLES, 50, collate_fn=identity, seed=3)
    assert (
        len(list(exhausted)) == 2 and next(iter(exhausted)) == epoch_order(100, 3, 1, True).tolist()[:50]
    )  # without Lightning


def test_workers_read_the_same_batches_and_draw_no_global_random_numbers():
    data = torch.arange(64).float()
    in_process = list(GlobalOrderLoader(data, 8, seed=1))
    state = torch.get_rng_state()
    with_workers = list(GlobalOrderLoader(data, 8, seed=1, num_workers=2))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(in_process, with_workers)) and len(with_workers) == 8


def test_a_checkpoint_of_other_data_is_refused():
    state = GlobalOrderLoader(SAMPLES, 4, seed=3).state_dict()
    with pytest.raises(LitCBSConfigError, match=r"train loader read num_samples=100 but this one has num_samples=99"):
        GlobalOrderLoader(SAMPLES[:99], 4, seed=3).load_state_dict(state)
    with pytest.raises(LitCBSConfigError, match=r"read seed=3 but this one has seed=4"):
        GlobalOrderLoader(SAMPLES, 4, seed=4).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), r"batch_size=0 must be a positive int"),
        (dict(batch_size=2, num_workers=-1), r"num_workers=-1 must be an int >= 0"),
        (dict(batch_size=2, num_replicas=2), r"give both num_replicas and rank"),
        (dict(batch_size=2, num_replicas=2, rank=2), r"rank=2 must lie in \[0, num_replicas=2\)"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(LitCBSConfigError, match=match):
        GlobalOrderLoader(SAMPLES, **kwargs)


KILL_RESUME = Path(__file__).resolve().parents[1] / "scripts" / "kill_resume.py"


def kill_resume_run(out: Path, *args: str) -> subprocess.CompletedProcess:
    """tests/scripts/kill_resume.py, each run a process of its own (a copy of this one: it imports nothing again)."""
    return run_forked(KILL_RESUME, str(out), *args, capture_output=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted")
    assert kill_resume_run(out).returncode == 0
    return torch.load(out / "result.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [21, 36])  # micro-batch 21: epoch 0, step 16 of 18; 36: epoch 1, mid-accumulation
def test_a_map_style_dataset_killed_mid_epoch_resumes_bit_for_bit(uninterrupted, tmp_path, kill_at):
    # BatchWarmup grows the batch 4 -> 8 -> 16 (accumulation 1 -> 2 -> 4 of micro-batches of 4), a CBS probe
    # runs at 224 tokens; SIGKILL leaves only the periodic checkpoints (every 3 steps, none inside the probe).
    full = uninterrupted
    killed = kill_resume_run(tmp_path / "killed", "--kill-at", str(kill_at))
    assert killed.returncode == -9  # SIGKILL: nothing saved on the way out
    checkpoints = sorted(
        (tmp_path / "killed" / "checkpoints").glob("step=*.ckpt"), key=lambda path: int(path.stem.split("=")[1])
    )
    latest = checkpoints[-1]
    resumed = kill_resume_run(tmp_path / "resumed", "--resume", str(latest))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = torch.load(tmp_path / "resumed" / "result.pt", weights_only=False)
    step = int(latest.stem.split("=")[1])
    assert (
        after["step"] == full["step"] == 27 and after["steps"] == full["steps"][step:]
    )  # the same samples in every step
    assert torch.equal(after["weight"], full["weight"])
    assert all(torch.equal(a[key], b[key]) for a, b in zip(after["adam"], full["adam"]) for key in a)
    assert after["readings"] == full["readings"]  # redone from its start, or carried in the checkpoint
