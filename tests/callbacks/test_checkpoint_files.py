"""Checkpoints a kill cannot tear (lit_cbs/callbacks/checkpoint.py): runs SIGKILLed inside their checkpoint
writes resume from a complete checkpoint and end bitwise where the uninterrupted run ends; a torn checkpoint given
to resume from is refused in one line naming the newest complete one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from launch import run_forked
from recipe_runs import compose_config

from lit_cbs.callbacks.checkpoint import newest_complete, partial_path, replaced_path, settle, unreadable
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.run.job import resume_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kill_in_write.py"


def run(out: Path, *args: str) -> subprocess.CompletedProcess:
    """tests/scripts/kill_in_write.py as a forked copy of this process (tests/launch.py) in a session of its own (a
    kill takes every process of the run: with --fsdp, rank 1 is a fresh process it starts)."""
    return run_forked(SCRIPT, str(out), *args, capture_output=True, start_new_session=True, timeout=300)


def killed_at(out: Path, write: str, occurrence: int, *args: str) -> None:
    result = run(out, *args, "--kill-at", write, str(occurrence))
    assert result.returncode == -9, result.stderr[-3000:]  # SIGKILL, inside the write
    assert (out / "writes.txt").read_text().splitlines()[-1] == write


def assert_same_end(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][name], b["weights"][name]) for name in a["weights"])
    for state, other in zip(a["optimizer"], b["optimizer"], strict=True):
        assert all(
            torch.equal(state[key], other[key]) if torch.is_tensor(state[key]) else state[key] == other[key]
            for key in state
        )
    assert a["readings"] == b["readings"]


@pytest.mark.slow
def test_a_run_killed_inside_its_checkpoint_writes_resumes_bitwise(tmp_path):
    # A checkpoint every step and last.ckpt after it; a CBS probe whose window opens at step 3 (last.ckpt is
    # written there and held); the batch grows at step 10; the run ends at step 14.
    assert run(tmp_path / "full").returncode == 0
    full = torch.load(tmp_path / "full" / "result.pt", weights_only=False)
    out = tmp_path / "killed"
    killed_at(out, "os.rename step=2.ckpt", 1)  # a periodic checkpoint written, not yet moved into place
    killed_at(out, "os.rename last.ckpt", 2, "--resume-newest")  # last.ckpt replaced at the probe window's start
    killed_at(out, "shutil.copyfile .last.ckpt.partial", 1, "--resume-newest")  # the resumed start copied to last.ckpt
    killed_at(out, "os.rename step=14.ckpt", 1, "--resume-newest")  # the final step's checkpoint
    resumed = run(out, "--resume-newest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = torch.load(out / "result.pt", weights_only=False)
    assert Path(after["resumed_from"]).name == "last.ckpt" and unreadable(Path(after["resumed_from"])) is None
    assert_same_end(after, full)
    assert not list((out / "checkpoints").glob(".*"))  # nothing half-written is left behind


@pytest.mark.slow
def test_a_distributed_checkpoint_killed_mid_write_or_mid_replacement_resumes_bitwise(tmp_path):
    # FSDP2 on 2 processes: every checkpoint is a folder of shards; last.ckpt's folder is replaced at every step.
    assert run(tmp_path / "full", "--fsdp").returncode == 0
    full = torch.load(tmp_path / "full" / "result.pt", weights_only=False)
    out = tmp_path / "killed"
    # Rank 0's shard of last.ckpt written, the metadata not: the folder at its temporary name is torn.
    killed_at(out, "open .last.ckpt.partial/.metadata.tmp", 3, "--fsdp")
    assert unreadable(partial_path(out / "checkpoints" / "last.ckpt")) is not None
    # The old last.ckpt moved aside, the new one not yet in: no last.ckpt for a moment.
    killed_at(out, "os.rename last.ckpt", 4, "--fsdp", "--resume-newest")
    assert (
        not (out / "checkpoints" / "last.ckpt").exists() and replaced_path(out / "checkpoints" / "last.ckpt").exists()
    )
    resumed = run(out, "--fsdp", "--resume-newest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = torch.load(out / "result.pt", weights_only=False)
    assert Path(after["resumed_from"]).name == "last.ckpt"  # settled: the replacement completed
    assert_same_end(after, full)


def test_settle_finishes_or_undoes_an_interrupted_replacement(tmp_path):
    target = tmp_path / "last.ckpt"
    # Killed after the old one moved aside, before the new one moved in: the new one (complete) goes in.
    replaced_path(target).write_text("old")
    partial_path(target).write_text("new")
    settle(tmp_path)
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # Killed while writing, with the old one in place: the unfinished write is dropped.
    partial_path(target).write_text("half")
    settle(tmp_path)
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # Moved aside and nothing to move in: the old one comes back.
    target.rename(replaced_path(target))
    settle(tmp_path)
    assert target.read_text() == "new"


def test_a_torn_checkpoint_is_refused_naming_the_newest_complete_one(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"global_step": 3}, folder / "step=3.ckpt")
    complete = folder / "step=4.ckpt"
    torch.save({"global_step": 4}, complete)
    torn = folder / "last.ckpt"
    torn.write_bytes(complete.read_bytes()[:-100])  # cut short, as by a copy killed halfway
    assert "not a whole torch.save archive" in unreadable(torn)
    assert newest_complete([folder]) == complete
    cfg = compose_config(f"ckpt_path={torn}", output_dir=str(tmp_path / "run"))
    with pytest.raises(LitCBSConfigError) as error:
        resume_checkpoint(cfg)
    assert str(error.value) == (
        f"ckpt_path={torn} is not a complete checkpoint (a .ckpt file, or a .ckpt folder under trainer=fsdp): it is "
        f"not a whole torch.save archive (cut short while written?); resume from the newest complete one, "
        f"ckpt_path={complete}"
    )
    # ckpt_path=auto (the default) takes the newest complete checkpoint of the run folder; a new run folder has none.
    assert resume_checkpoint(compose_config(output_dir=str(tmp_path / "run"))) == str(complete)
    assert resume_checkpoint(compose_config(output_dir=str(tmp_path / "new"))) is None


def test_a_distributed_checkpoint_folder_missing_a_shard_is_incomplete(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter, save

    folder = tmp_path / "step=1.ckpt"
    save({"w": torch.arange(4.0)}, storage_writer=FileSystemWriter(str(folder)), no_dist=True)
    torch.save({"global_step": 1}, folder / "meta.pt")
    assert unreadable(folder) is None
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:5])
    assert unreadable(folder) == f"its shard {shard.name} is missing or short"
    shutil.rmtree(folder)
    folder.mkdir()
    assert unreadable(folder) == "its folder has no .metadata (the distributed checkpoint was not finished)"
