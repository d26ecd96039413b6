"""lit_cbs/_internals.py against the installed Lightning, torch, torchmetrics and Hydra: every private
attribute it reaches still exists, and the loop internals still mean what lit_cbs relies on."""

from __future__ import annotations

import importlib

import lightning
import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.optim.lr_scheduler import ConstantLR, LinearLR, SequentialLR
from toys import RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import _internals

VERSIONS = f"lightning {lightning.__version__}, torch {torch.__version__}, torchmetrics {torchmetrics.__version__}"


class RecordLoop(pl.Callback):
    """Per micro-batch: whether Lightning will step after it; after each step: the logger's step."""

    def __init__(self):
        self.accumulating: list[bool] = []
        self.logging_steps: list[tuple[int, int]] = []  # (logging_step, global_step) after each optimizer step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.accumulating.append(_internals.should_accumulate(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not _internals.should_accumulate(trainer):
            self.logging_steps.append((_internals.logging_step(trainer), trainer.global_step))


@pytest.fixture(scope="module")
def live_objects():
    """A Trainer after 4 optimizer steps of 3 micro-batches, a used metric and two used LR schedulers."""
    record = RecordLoop()
    trainer = pl.Trainer(**trainer_kwargs(accumulate_grad_batches=3, max_steps=4, callbacks=[record]))
    trainer.fit(RegressionModule(), datamodule=RegressionData(n=96, batch_size=2))
    metric = torchmetrics.MeanMetric()
    metric.update(torch.tensor(1.0))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sequential = SequentialLR(
        optimizer, [ConstantLR(optimizer, 0.5, total_iters=2), LinearLR(optimizer)], milestones=[2]
    )
    optimizer.step()
    sequential.step()
    roots = {
        "trainer": trainer,
        "metric": metric,
        "sequential_lr": sequential,
        "lr_scheduler": sequential,
        "model_checkpoint": ModelCheckpoint(),
    }
    return roots, record


def resolve(path: str, roots: dict):
    """The object at a dotted path from a live object (``trainer.fit_loop...``) or a module (``torch.x.y``)."""
    head, *names = path.split(".")
    if head in roots:
        target = roots[head]
    else:
        for split in range(len(names), -1, -1):
            try:
                target = importlib.import_module(".".join([head, *names[:split]]))
            except ModuleNotFoundError:
                continue
            names = names[split:]
            break
    for name in names:
        target = getattr(target, name)
    return target


@pytest.mark.parametrize("function", sorted(_internals.PRIVATE_ATTRIBUTES))
def test_private_attribute_still_exists(function, live_objects):
    roots, _ = live_objects
    where = function if "." in function else f"lit_cbs._internals.{function}"
    for path in _internals.PRIVATE_ATTRIBUTES[function]:
        try:
            resolve(path, roots)
        except (AttributeError, ModuleNotFoundError) as error:
            pytest.fail(
                f"{where} reaches {path}, which is gone in {VERSIONS} ({error}); find where it moved and change {where}"
            )


def test_every_function_is_listed_and_callable():
    for function in _internals.__all__[:-1]:
        assert callable(getattr(_internals, function)), function


def test_loop_internals_mean_what_lit_cbs_assumes(live_objects):
    _, record = live_objects
    # Accumulation 3: Lightning steps after every third micro-batch; in that batch's hooks its loggers
    # write the row of the step just taken, numbered from 0.
    assert record.accumulating == [True, True, False] * 4, f"should_accumulate changed meaning in {VERSIONS}"
    assert record.logging_steps == [(0, 1), (1, 2), (2, 3), (3, 4)], f"logging_step changed meaning in {VERSIONS}"


def test_metric_update_count_round_trips(live_objects):
    roots, _ = live_objects
    metric = roots["metric"]
    assert metric._update_count == 1
    metric.update(torch.tensor(3.0))
    assert float(metric.compute()) == 2.0
    metric.mean_value, metric.weight = torch.tensor(1.0, dtype=metric.dtype), torch.tensor(1.0, dtype=metric.dtype)
    metric._update_count, metric._computed = 1, None  # as lit_cbs.callbacks.module_state restores a metric
    assert float(metric.compute()) == 1.0  # cache dropped


def test_rng_states_round_trip():
    states = _internals.collect_rng_states(include_cuda=False)
    first = torch.rand(3)
    _internals.set_rng_states(states)
    assert torch.equal(torch.rand(3), first)
