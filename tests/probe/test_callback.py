"""CBSProbeCallback on a real Trainer: probe points, bisection, held-out scores, early stop, resume,
CBSAdaptive, what it logs and writes, and what it refuses before training."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset
from toys import (
    SEQ,
    RegressionData,
    RegressionDataWithVal,
    RegressionModule,
    fit_regression,
    fit_regression_with_val,
    read_csv,
    toy_probe,
    trainer_kwargs,
)

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch
from lit_cbs.analysis.probe_schedule import schedule_from_probe
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe import ProbeReading
from lit_cbs.rules.batch_schedules import CBSAdaptive


def test_bisect_finds_the_grid_answer_for_fewer_tokens():
    grid = toy_probe(multipliers=(1, 2, 4, 8, 16), window_tokens=256, every_tokens=256)
    bisect = toy_probe(multipliers=(1, 2, 4, 8, 16), window_tokens=256, every_tokens=256, search="bisect")
    fit_regression(probe=grid, n=128, epochs=3)
    fit_regression(probe=bisect, n=128, epochs=3)
    assert len(grid.history) == len(bisect.history) >= 3
    for g, b in zip(grid.history, bisect.history):
        ks = [1, 2, 4, 8, 16]
        # Same tokens, same k*, within one grid step (exactly, where recovery is monotone).
        assert abs(ks.index(g.k_star) - ks.index(b.k_star)) <= 1
        assert 1.0 not in b.branches_trained and len(b.branches_trained) <= 3
        for k, loss in b.losses.items():  # every branch bisect trained matches the grid's
            assert loss == g.losses[k]
    assert bisect.tokens_spent * 5 <= grid.tokens_spent * 3


def test_resume_mid_run_continues_probe_schedule_and_main_run(tmp_path):
    # 80 samples x 4 tokens = 320 tokens per epoch; probe windows [288, 352], [576, 640], [864, 928].
    def fresh_probe():
        return toy_probe(every_tokens=288, window_tokens=64)

    full_probe = fresh_probe()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    full = fit_regression(probe=full_probe, callbacks=[checkpoint], n=80, epochs=3, enable_checkpointing=True)
    assert [r.tokens for r in full_probe.history] == [288, 576, 864]

    # Between windows (640 tokens): the resumed run continues exactly, probes included.
    resumed_probe = fresh_probe()
    resumed = fit_regression(probe=resumed_probe, n=80, epochs=3, ckpt=tmp_path / "epoch=1.ckpt")
    assert torch.equal(full[1].layer.weight, resumed[1].layer.weight)
    assert resumed_probe.history == full_probe.history
    assert all(isinstance(r, ProbeReading) for r in resumed_probe.history)  # rebuilt from the checkpoint's dicts
    assert resumed_probe.tokens_spent == full_probe.tokens_spent

    # Inside the first window (320 tokens): that probe is taken again where the resumed run starts, and says
    # where the interrupted one began; the later ones are the uninterrupted run's.
    inside_probe = fresh_probe()
    inside = fit_regression(probe=inside_probe, n=80, epochs=3, ckpt=tmp_path / "epoch=0.ckpt")
    assert torch.equal(full[1].layer.weight, inside[1].layer.weight)
    assert [r.tokens for r in inside_probe.history] == [320, 576, 864]
    assert [r.interrupted_at_tokens for r in inside_probe.history] == [288, None, None]
    assert inside_probe.history[1:] == full_probe.history[1:]


def test_heldout_evaluation_and_overhead_budget():
    probe = toy_probe(evaluate="heldout", heldout_batches=2)

    class RegressionDataWithVal(RegressionData):
        def val_dataloader(self):
            return torch.utils.data.DataLoader(self.dataset, batch_size=8)

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[BatchWarmup(ConstantBatch(4), seq_len=SEQ), probe],
        **trainer_kwargs(max_epochs=2, limit_val_batches=0),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(RegressionModule(lr=0.05, optimizer="adam"), RegressionDataWithVal(n=96, batch_size=2))
    assert probe.history and all(r.evaluate == "heldout" for r in probe.history)
    assert all(r.losses["1"] == pytest.approx(r.main_loss, rel=1e-12) for r in probe.history)

    budget = toy_probe(max_overhead=0.5)
    fit_regression(probe=budget)
    assert budget.history and budget.tokens_spent / (2 * 96 * SEQ) <= 0.5 + 1e-9
    assert all(r.overhead <= 0.5 for r in budget.history)


def test_cbs_adaptive_doubles_when_probe_says_so():
    schedule = CBSAdaptive(start=2, final=16, factor=2, unit="tokens")
    probe = toy_probe(multipliers=(1, 2, 4), window_tokens=64, every_tokens=96, confidence=0.5)
    trainer, module, warmup = fit_regression(probe=probe, schedule=schedule, epochs=3, micro=2)
    moves = [r.adaptive_batch for r in probe.history if r.adaptive_batch is not None]
    assert moves and moves == [size for _, size in schedule.decisions]
    for record in probe.history:  # doubled exactly when the measured CBS reached twice the batch
        if record.adaptive_batch is not None:
            assert record.cbs_lower >= record.adaptive_batch
    assert [c.new_global_batch for c in warmup.history] == moves
    assert all(c.lr_factor == pytest.approx(math.sqrt(2)) for c in warmup.history)


def test_cbs_adaptive_rule_unit():
    schedule = CBSAdaptive(start=16, final=64)
    assert not schedule.observe(100, 31.9) and schedule.batch_size(100) == 16
    assert schedule.observe(200, 32) and schedule.batch_size(199) == 16 and schedule.batch_size(200) == 32
    assert schedule.observe(300, 1000) and schedule.batch_size(300) == 64
    assert not schedule.observe(400, 10_000)  # never past final
    restored = CBSAdaptive(start=16, final=64)
    restored.load_state_dict(schedule.state_dict())
    assert restored.batch_size(250) == 32 and restored.sizes(0) == [16, 32, 64]
    with pytest.raises(ValueError, match="power of 2"):
        CBSAdaptive(start=16, final=48)


def test_window_smaller_than_one_large_branch_step_is_refused_before_a_step():
    module = RegressionModule(lr=0.05, optimizer="adam")
    with pytest.raises(
        LitCBSConfigError, match=r"window_tokens=64 is smaller than one step of the largest branch \(k=8 x batch 4"
    ):
        fit_regression(probe=toy_probe(multipliers=(1, 8), window_tokens=64), module=module)
    assert module.steps == []


class TokenData(pl.LightningDataModule):
    """Token ids (2-D int64) from a fixed random bigram chain: a plain DataLoader of batch_size samples."""

    def __init__(self, n: int = 64, tokens_per_sample: int = 8, vocab: int = 16, batch_size: int = 4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        successor = torch.randint(0, vocab, (vocab, 2), generator=g)
        ids = torch.empty(n, tokens_per_sample, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for t in range(1, tokens_per_sample):
            ids[:, t] = successor[ids[:, t - 1], torch.randint(0, 2, (n,), generator=g)]
        self.dataset = TensorDataset(ids)
        self.vocab = vocab
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(
            self.dataset, batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(1)
        )


class Bigram(pl.LightningModule):
    def __init__(self, vocab: int = 16):
        super().__init__()
        torch.manual_seed(2)
        self.logits = torch.nn.Embedding(vocab, vocab)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return torch.nn.functional.cross_entropy(self.logits(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def fit_tokens(callbacks, **trainer_overrides):
    pl.seed_everything(0, verbose=False)
    module = Bigram()
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=2, **trainer_overrides))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, TokenData())
    return trainer, module


def test_probe_alone_measures_a_fixed_batch_token_run(tmp_path):
    # 64 samples x 8 tokens per epoch, batch 4 x accumulate 2 = 8 samples (64 tokens) per step.
    plain_trainer, plain = fit_tokens([], accumulate_grad_batches=2)
    probe = CBSProbeCallback(at_tokens=(128, 512), multipliers=(0.5, 1, 2), window_tokens=256, output_dir=tmp_path)
    trainer, probed = fit_tokens([probe], accumulate_grad_batches=2)
    assert torch.equal(plain.logits.weight, probed.logits.weight) and trainer.global_step == plain_trainer.global_step
    assert [r.tokens for r in probe.history] == [128, 512]
    for record in probe.history:
        assert (record.batch_size, record.seq_len, record.window_tokens) == (8, 8, 256)
        assert record.branches_trained == [0.5, 1.0, 2.0]
        assert record.losses["1"] == pytest.approx(record.main_loss, rel=1e-12)
    assert len((tmp_path / "cbs_probe.jsonl").read_text().splitlines()) == 2 and (tmp_path / "cbs_curve.png").exists()


def test_probe_refuses_batches_without_token_ids():
    module = RegressionModule(lr=0.05, optimizer="adam")
    trainer = pl.Trainer(callbacks=[toy_probe()], **trainer_kwargs())
    with pytest.raises(LitCBSConfigError, match="no token ids.*give seq_len=... to BatchAccounting or BatchWarmup"):
        trainer.fit(module, RegressionData(n=16))
    assert module.steps == []


def test_undetermined_readings_do_not_move_the_batch():
    schedule = CBSAdaptive(start=2, final=16, factor=2, unit="tokens")
    unsure = toy_probe(
        multipliers=(1, 2, 4),
        window_tokens=64,
        every_tokens=96,
        evaluate="heldout",
        heldout_batches=2,
        confidence=0.999,
    )
    fit_regression_with_val(probe=unsure, warmup=BatchWarmup(schedule, seq_len=SEQ), epochs=3)
    assert unsure.history and not any(r.determined for r in unsure.history)
    assert schedule.decisions == [] and all(r.adaptive_batch is None for r in unsure.history)
    # Nor does a schedule read off those records for another run.
    with pytest.warns(UserWarning, match="every reading in probe readings is undetermined"):
        carried = schedule_from_probe(unsure.history, start=2)
    assert carried.batch_sizes == [2]


def test_cbs_adaptive_stops_probing_at_its_final_batch():
    def fit_adaptive(probe_after_final):
        schedule = CBSAdaptive(start=2, final=4, factor=2, unit="tokens", probe_after_final=probe_after_final)
        callback = toy_probe(multipliers=(1, 2, 4), window_tokens=64, every_tokens=96, confidence=0.5)
        fit_regression_with_val(probe=callback, warmup=BatchWarmup(schedule, seq_len=SEQ), epochs=3)
        return schedule, callback

    schedule, stopping = fit_adaptive(probe_after_final=False)
    ((at, size),) = schedule.decisions
    assert size == 4
    assert [r.tokens for r in stopping.history if r.tokens >= at] == []  # no probe once the batch is final
    _, going_on = fit_adaptive(probe_after_final=True)
    assert len(going_on.history) > len(stopping.history)
    assert going_on.history[: len(stopping.history)] == stopping.history


def test_early_stop_ends_decided_windows_and_resumes_branches_exactly():
    straight = toy_probe(search="grid", evaluate="heldout", heldout_batches=3, window_tokens=256, every_tokens=320)
    fit_regression_with_val(probe=straight, epochs=3)
    # Undecidable at the checkpoints: the branches go on from where they stopped, and the readings
    # at the window's end are those of branches trained straight through.
    resumed = toy_probe(
        search="grid",
        evaluate="heldout",
        heldout_batches=3,
        window_tokens=256,
        every_tokens=320,
        early_stop=(0.25, 0.5),
        confidence=0.99999,
    )
    fit_regression_with_val(probe=resumed, epochs=3)
    assert [r.losses for r in resumed.history] == [r.losses for r in straight.history]
    assert all(r.window_tokens == r.planned_window_tokens == 256 for r in resumed.history)
    assert resumed.tokens_spent == straight.tokens_spent
    # Decidable at once: each window ends at its first checkpoint, for a quarter of the tokens.
    quick = toy_probe(
        search="grid",
        evaluate="heldout",
        heldout_batches=3,
        window_tokens=256,
        every_tokens=320,
        early_stop=(0.25, 0.5),
        confidence=0.5,
    )
    fit_regression_with_val(probe=quick, epochs=3)
    assert quick.history and all(r.window_tokens == 64 and r.determined for r in quick.history)
    assert quick.tokens_spent < straight.tokens_spent


def test_cbs_metrics_are_logged_on_the_row_of_the_step_that_ended_the_window(tmp_path):
    callback = toy_probe()
    logger = CSVLogger(tmp_path, name="rows")
    fit_regression_with_val(probe=callback, logger=logger, log_every_n_steps=1)
    rows = [row for row in read_csv(f"{logger.log_dir}/metrics.csv") if row.get("cbs/k_star")]
    # Rows count steps from 0: the window's last step is reading.step + its steps - 1.
    expected = [r.step + r.window_tokens // (r.batch_size * SEQ) - 1 for r in callback.history]
    assert [int(row["step"]) for row in rows] == expected
    assert [float(row["cbs/determined"]) for row in rows] == [float(r.determined) for r in callback.history]


def test_files_mirror_the_readings_after_a_resume_and_need_a_place(tmp_path):
    logger = CSVLogger(tmp_path, name="resume", version=0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    first = toy_probe()
    fit_regression_with_val(probe=first, callbacks=[checkpoint], logger=logger, enable_checkpointing=True, epochs=2)
    jsonl = tmp_path / "resume" / "version_0" / "cbs_probe.jsonl"
    assert len(jsonl.read_text().splitlines()) == len(first.history)
    # Resume from the end of epoch 1 into the same folder: the file holds each reading once.
    resumed = toy_probe()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[BatchWarmup(ConstantBatch(4), seq_len=SEQ), resumed],
        **trainer_kwargs(max_epochs=3, limit_val_batches=0, logger=CSVLogger(tmp_path, name="resume", version=0)),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            RegressionModule(lr=0.05, optimizer="adam"),
            RegressionDataWithVal(n=96, batch_size=2),
            ckpt_path=tmp_path / "ckpt" / "epoch=0-step=24.ckpt",
        )
    tokens = [line.split('"tokens": ')[1].split(",")[0] for line in jsonl.read_text().splitlines()]
    assert len(tokens) == len(set(tokens)) == len(resumed.history) > len(first.history) // 2
    # Without a logger and without output_dir nothing is written to the working directory.
    lonely = toy_probe()
    fit_regression_with_val(probe=lonely)
    assert lonely.history and not list(tmp_path.glob("*.jsonl")) and not list(tmp_path.glob("*.png"))


def test_manual_optimization_is_refused_before_training():
    class Manual(RegressionModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(callbacks=[BatchAccounting(seq_len=SEQ), toy_probe()], **trainer_kwargs())
    with pytest.raises(LitCBSConfigError, match="CBSProbeCallback needs automatic optimization"):
        trainer.fit(Manual(), RegressionDataWithVal(n=96, batch_size=2))


def test_lr_rule_is_checked_for_every_multiplier_before_training():
    class AdamW(RegressionModule):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95))

    with pytest.raises(
        LitCBSConfigError,
        match=r"lr_rule='adam_sde', multipliers=\[1, 2, 4, 8, 16\]\): batch ratio 16 is above 10, the largest safe",
    ):
        fit_regression_with_val(AdamW(), toy_probe(multipliers=(1, 2, 4, 8, 16), lr_rule="adam_sde"))

    class OneCycle(RegressionModule):
        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
            schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=1000)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    with pytest.raises(LitCBSConfigError, match="CBSProbeCallback.*OneCycleLR"):
        fit_regression_with_val(OneCycle(), toy_probe(), warmup=BatchAccounting(seq_len=SEQ))


def test_train_ema_readings_say_their_se_is_unpaired():
    callback = toy_probe(search="grid", window_tokens=256, every_tokens=320)
    fit_regression_with_val(probe=callback, epochs=3)
    for reading in callback.history:
        assert reading.se_method == "step-loss scatter (unpaired, approximate)" and reading.batch_losses == {}
        assert reading.loss_se["1"] is None and all(reading.loss_se[k] > 0 for k in ("2", "4"))
