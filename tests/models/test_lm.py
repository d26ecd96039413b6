"""CausalLM: model configs, weight-decay groups, loss, checkpointing without a Trainer; its logged
throughput in a real fit."""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from toys import trainer_kwargs

from lit_cbs._internals import should_accumulate
from lit_cbs.analysis.curves import read_metrics_csv
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.data.synthetic import RandomTokenData
from lit_cbs.models import OLMoConfig, get_config
from lit_cbs.models.lm import ADAMW, CausalLM, resolve_model_config
from lit_cbs.rules.lr_schedules import TokenLRScheduler


def built(**kwargs) -> CausalLM:
    module = CausalLM(**kwargs)
    module.configure_model()
    return module


def test_a_micro_batch_of_no_sample_gives_a_finite_loss_and_a_zero_gradient():
    # Under DDP an epoch's last micro-batch can hold no sample on one rank, which still runs its step.
    module = built(config="tiny")
    loss = module.training_step(torch.zeros(0, 9, dtype=torch.long), 0)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in module.parameters())


def test_model_config_forms():
    assert resolve_model_config("tiny") == get_config("tiny")
    assert resolve_model_config({"preset": "olmo_1b", "n_layers": 2}).n_layers == 2
    assert resolve_model_config({"preset": "olmo_1b", "n_layers": 2}).d_model == 2048
    fields = vars(get_config("tiny"))
    assert resolve_model_config(fields) == get_config("tiny")
    assert resolve_model_config(get_config("tiny")) == get_config("tiny")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("olmo_3b", "unknown model preset 'olmo_3b'"),
        ({"preset": "tiny", "layers": 2}, r"\['layers'\] are not OLMoConfig fields"),
        ({"d_model": 64}, "model config without a preset must give"),
    ],
)
def test_bad_model_config(config, message):
    with pytest.raises(ValueError, match=message):
        CausalLM(config)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"optimizer": functools.partial(ADAMW, lr=-1.0)},
            r"AdamW\(lr=-1.0, .*\) cannot be built: Invalid learning rate",
        ),
        ({"optimizer": functools.partial(ADAMW, betas=(0.9, 1.0))}, "Invalid beta parameter at index 1"),
        (
            {"optimizer": functools.partial(torch.optim.SGD, lr=0.1, betas=(0.9, 0.95))},
            "unexpected keyword argument 'betas'",
        ),
        ({"optimizer": "adamw"}, "optimizer='adamw' must be a callable"),
        ({"peak_flops_per_device": 0}, "peak_flops_per_device"),
        ({"ignore_index": 256}, r"ignore_index=256 must be a token id in \[0, 256\)"),
    ],
)
def test_bad_optimizer_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CausalLM("tiny", **kwargs)


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_weight_decay_only_on_matrices(tie_embeddings):
    config = OLMoConfig(**{**vars(get_config("tiny")), "tie_embeddings": tie_embeddings})
    module = built(config=config, optimizer=functools.partial(torch.optim.SGD, lr=0.1, weight_decay=0.1))
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD)
    decay, no_decay = optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert no_decay["params"] == [module.model.embedding.weight]
    named = dict(module.model.named_parameters())
    assert len(decay["params"]) == len(named) - 1 and all(p.ndim == 2 for p in decay["params"])
    assert (module.model.lm_head is not None) == (not tie_embeddings)


def test_loss_is_next_token_cross_entropy():
    torch.manual_seed(0)
    module = built()
    batch = torch.randint(0, 256, (3, 17))
    logits = module(batch[:, :-1])
    expected = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
    assert torch.allclose(module.probe_loss(batch), expected)


def test_activation_checkpointing_gives_the_same_gradients():
    batch = torch.randint(0, 256, (2, 33))
    gradients = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        module = built(activation_checkpointing=checkpointing)
        module.probe_loss(batch).backward()
        gradients.append([p.grad for p in module.model.parameters()])
    assert "CheckpointWrapper" in type(module.model.blocks[0]).__name__
    assert all(torch.allclose(a, b) for a, b in zip(*gradients))


def test_optimizer_and_token_schedule():
    module = built(optimizer=functools.partial(ADAMW, lr=1e-3), lr_schedule=lambda tokens: 0.5)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)
    assert isinstance(scheduler, TokenLRScheduler) and scheduler.optimizer is optimizer
    assert config["lr_scheduler"]["interval"] == "step"
    assert [group["lr"] for group in optimizer.param_groups] == [5e-4, 5e-4]
    assert isinstance(built().configure_optimizers(), torch.optim.AdamW)  # no schedule: the base LR


@pytest.mark.parametrize("peak_flops_per_device", [None, 1e12])
def test_throughput_is_logged_every_optimizer_step(tmp_path, peak_flops_per_device):
    # 4 optimizer steps of 2 micro-batches of 4 x 16 tokens; a validation after step 2.
    module = CausalLM("tiny", lr_schedule=None, peak_flops_per_device=peak_flops_per_device)
    data = RandomTokenData(vocab_size=256, seq_len=16, batch_size=4, samples=32)
    data.val_dataloader = lambda: torch.utils.data.DataLoader(data.tokens[:8], batch_size=4)
    trainer = pl.Trainer(
        **trainer_kwargs(
            max_steps=4,
            accumulate_grad_batches=2,
            val_check_interval=4,
            num_sanity_val_steps=0,
            logger=CSVLogger(tmp_path, name="run"),
            log_every_n_steps=1,
        )
    )
    trainer.fit(module, datamodule=data)
    metrics = read_metrics_csv(next(tmp_path.rglob("metrics.csv")))
    steps, tokens_per_s = metrics["perf/tokens_per_s"]
    assert steps.tolist() == [0, 1, 2, 3] and (tokens_per_s > 0).all()
    if peak_flops_per_device is None:  # a CPU: Lightning's table knows no peak, so no MFU
        assert "perf/mfu" not in metrics
    else:
        _, mfu = metrics["perf/mfu"]
        flops_per_token = module.flops_per_token(16)
        assert mfu == pytest.approx(flops_per_token * tokens_per_s / peak_flops_per_device)


class SleepsAtStep(Callback):
    """Stands in for a CBS probe: 0.5 s of work at the end of optimizer step 3, inside the accounting's
    ``branching()`` (as the probe's branches run) or, to show what it guards against, outside it."""

    def __init__(self, as_branch: bool):
        self.as_branch = as_branch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3 and not should_accumulate(trainer):
            with BatchAccounting.attach(trainer).branching() if self.as_branch else nullcontext():
                time.sleep(0.5)


@pytest.fixture
def one_thread():
    """Steps of a steady few milliseconds: torch's threads on a loaded machine's cores stall for far longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("as_branch", [True, False])
def test_throughput_leaves_out_the_probes_branches(tmp_path, one_thread, as_branch):
    # 5 optimizer steps of 2 micro-batches; the "probe" sleeps after step 3 (logged at step index 2).
    data = RandomTokenData(vocab_size=256, seq_len=16, batch_size=4, samples=40)
    trainer = pl.Trainer(
        callbacks=[SleepsAtStep(as_branch)],
        **trainer_kwargs(
            max_steps=5,
            accumulate_grad_batches=2,
            logger=CSVLogger(tmp_path, name="run"),
            log_every_n_steps=1,
        ),
    )
    trainer.fit(CausalLM("tiny", lr_schedule=None), datamodule=data)
    steps, tokens_per_s = read_metrics_csv(next(tmp_path.rglob("metrics.csv")))["perf/tokens_per_s"]
    assert steps.tolist() == [0, 1, 2, 3, 4]
    others = float(np.median(tokens_per_s[[1, 3, 4]]))
    if as_branch:
        assert tokens_per_s[2] > 0.25 * others
    else:  # 0.5 s is tens of steps of this model: the rate falls far below
        assert tokens_per_s[2] < 0.25 * others
