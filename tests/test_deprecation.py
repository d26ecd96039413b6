"""Names from before 0.3 keep working until 0.4, each with a LitCBSDeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import pickle
import sys

import lightning.pytorch as pl
import pytest

from lit_cbs import BatchAccounting, BatchChange
from lit_cbs._deprecation import LitCBSDeprecationWarning, renamed_argument


@pytest.mark.parametrize(
    "old, new, name",
    [
        ("lit_cbs.warmup", "lit_cbs.callbacks.warmup", "BatchWarmup"),
        ("lit_cbs.schedules", "lit_cbs.rules.batch_schedules", "PiecewiseBatch"),
        ("lit_cbs.lm", "lit_cbs.models.lm", "CausalLM"),
        ("lit_cbs.hydra_resolvers", "lit_cbs.recipes.resolvers", "register_resolvers"),
    ],
)
def test_an_old_module_path_imports_the_new_module_with_a_warning(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(LitCBSDeprecationWarning, match=f"{old} is now {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    assert importlib.import_module(new).__name__ == new  # the new module's own identity is untouched


def test_an_object_pickled_under_an_old_module_path_loads():
    change = BatchChange(
        step=3,
        epoch=0,
        samples_seen=96,
        tokens_seen=3072,
        old_global_batch=8,
        new_global_batch=16,
        old_accumulate=2,
        new_accumulate=4,
        old_micro_batch_size=4,
        new_micro_batch_size=4,
        lr_factor=2**0.5,
        requested_at_samples=96,
        requested_at_tokens=3072,
    )
    old_pickle = pickle.dumps(change, protocol=0).replace(b"lit_cbs.callbacks.warmup", b"lit_cbs.warmup")
    assert b"lit_cbs.warmup" in old_pickle
    sys.modules.pop("lit_cbs.warmup", None)
    with pytest.warns(LitCBSDeprecationWarning):
        assert pickle.loads(old_pickle) == change


def test_batch_accounting_of_is_attach_with_a_warning():
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.warns(LitCBSDeprecationWarning, match=r"BatchAccounting.attach\(trainer\)"):
        accounting = BatchAccounting.of(trainer)
    assert trainer.callbacks[0] is accounting and BatchAccounting.attach(trainer) is accounting


def test_a_renamed_keyword_moves_to_its_new_name_and_both_is_an_error():
    kwargs = {"old_name": 1}
    with pytest.warns(LitCBSDeprecationWarning, match=r"Thing\(old_name=...\) is now Thing\(new_name=...\)"):
        renamed_argument(kwargs, "old_name", "new_name", "Thing")
    assert kwargs == {"new_name": 1}
    with pytest.raises(TypeError, match="give new_name= only"):
        renamed_argument({"old_name": 1, "new_name": 2}, "old_name", "new_name", "Thing")
