"""CBSProbeCallback under DDP with 2 CPU processes (forked from the test process, gloo).

Every rank runs every branch together; branch losses are averaged over ranks, so both ranks
must read the same k* and CBS, and the main run must end where a run without the probe ends.
"""

from __future__ import annotations

import pickle
import subprocess
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import in_process_ddp, run_forked
from lightning.pytorch.callbacks import Callback
from toys import RegressionDataWithVal, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch


class SaveRankResult(Callback):
    """The ranks run in child processes, which return no callback state: each saves its probe history and final
    weights."""

    def __init__(self, outdir: Path):
        self.outdir = outdir

    def on_train_end(self, trainer, pl_module):
        probes = [cb for cb in trainer.callbacks if isinstance(cb, CBSProbeCallback)]
        torch.save(
            {
                "history": probes[0].history if probes else None,
                "weight": pl_module.layer.weight.detach().clone(),
                "micro_batches": pl_module.micro_batches,
            },
            self.outdir / f"rank{trainer.global_rank}.pt",
        )


def fit_ddp(outdir: Path, probe: CBSProbeCallback | None) -> list[dict]:
    outdir.mkdir()
    callbacks = [BatchWarmup(ConstantBatch(8), seq_len=4), SaveRankResult(outdir)]
    if probe is not None:
        callbacks.insert(1, probe)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=callbacks,
        **trainer_kwargs(
            strategy=in_process_ddp(),
            devices=2,
            max_epochs=2,
            default_root_dir=outdir,
            limit_val_batches=0,
        ),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            RegressionModule(lr=0.05, optimizer="adam"), RegressionDataWithVal(n=96, batch_size=2, val_batch_size=4)
        )
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.slow
def test_ddp_ranks_agree_on_the_cbs_and_main_run_is_untouched(tmp_path):
    probed = fit_ddp(tmp_path / "probed", CBSProbeCallback(every_tokens=256, multipliers=(1, 2, 4), window_tokens=128))
    replicated = fit_ddp(
        tmp_path / "replicated",
        CBSProbeCallback(
            every_tokens=256,
            multipliers=(1, 2),
            window_tokens=64,
            search="bisect",
            evaluate="heldout",
            heldout_batches=2,
            replicates=2,
        ),
    )
    plain = fit_ddp(tmp_path / "plain", None)
    history0, history1 = probed[0]["history"], probed[1]["history"]
    assert len(history0) >= 2
    assert history0 == history1  # same losses, k*, interval on both ranks
    for record in history0:
        assert record.batch_size == 8 and record.branches_trained == [1.0, 2.0, 4.0]
        assert record.losses["1"] == pytest.approx(record.main_loss, rel=1e-12)
    # Replicate windows: both ranks train and score every window together and read the same SEs.
    assert len(replicated[0]["history"]) >= 2 and replicated[0]["history"] == replicated[1]["history"]
    for record in replicated[0]["history"]:
        assert (
            record.replicates == 2
            and record.branches_trained == [1.0, 2.0, 2.0]
            and record.replicate_se.keys() == {"2"}
        )
    for rank in range(2):
        for run in (probed, replicated):
            assert torch.equal(run[rank]["weight"], plain[rank]["weight"])
            assert run[rank]["micro_batches"] == plain[rank]["micro_batches"]


def test_the_probe_pickles_for_ddp_spawn():
    """ddp_spawn pickles the Trainer and its callbacks into every child process (the fits above fork instead)."""
    probe = CBSProbeCallback(
        every_tokens=256, multipliers=(1, 2), window_tokens=64, search="bisect", evaluate="heldout", heldout_batches=2
    )
    assert pickle.loads(pickle.dumps(probe)).config == probe.config


def run_faults(outdir: Path, mode: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """tests/scripts/probe_faults.py with a fault forced on rank 1 in the k = 4 branch; a hang fails at the timeout."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "probe_faults.py"
    done = run_forked(script, str(outdir), mode, capture_output=True, timeout=150)  # rank 0 a forked copy of this one
    ranks = [torch.load(path, weights_only=False) for path in sorted(outdir.glob("rank*.pt"))]
    return done, ranks


@pytest.mark.slow
def test_a_fault_on_one_rank_is_agreed_by_every_rank(tmp_path):
    plain, plain_ranks = run_faults(tmp_path / "plain", "none")
    assert plain.returncode == 0, plain.stderr[-3000:]
    # Out of memory on rank 1 only: the k = 4 branch fails on both ranks, the probe and the run go on.
    oom, oom_ranks = run_faults(tmp_path / "oom", "oom")
    assert oom.returncode == 0, oom.stderr[-3000:]
    assert len(oom_ranks) == 2 and oom_ranks[0]["history"] == oom_ranks[1]["history"]
    assert all(r.failed == [4.0] and r.losses["4"] is None for r in oom_ranks[0]["history"])
    for plain_rank, oom_rank in zip(plain_ranks, oom_ranks):
        assert torch.equal(plain_rank["weight"], oom_rank["weight"])  # the main run is untouched
    assert [r.losses["2"] for r in oom_ranks[0]["history"]] == [r.losses["2"] for r in plain_ranks[0]["history"]]
    # Any other exception on rank 1 only: every rank stops (none waits in the branch's collectives).
    error, error_ranks = run_faults(tmp_path / "error", "error")
    assert error.returncode != 0
    assert "another rank raised inside a CBS probe branch" in error_ranks[0]["error"]
