"""``FinalStateCheckpoint``: Lightning's ModelCheckpoint that also saves the state a run ends with.

Lightning's ModelCheckpoint saves every ``every_n_train_steps`` optimizer steps. A run that stops
in between (BatchWarmup's ``max_tokens``, ``max_steps``, SIGTERM) would leave ``last.ckpt`` at
the last multiple, and the steps after it lost to anyone who resumes, evaluates or exports from it.
This callback writes ``last.ckpt`` again when training ends, so it always holds the final step.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_cbs._internals import last_saved_step, set_last_saved_step, should_accumulate


class FinalStateCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (same arguments) whose ``last.ckpt`` holds the final optimizer step.

    When training ends (``max_tokens``, ``max_steps``, ``max_epochs``) and when Lightning stops on
    SIGTERM, ``last.ckpt`` is written unless this step was already saved. Needs ``save_last=True``.
    A SIGTERM that arrives inside an accumulation window (between optimizer steps) saves nothing:
    a checkpoint there would resume without the window's accumulated gradients, so ``last.ckpt``
    keeps the last step it holds, and a warning says which.
    """

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save_final_state(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        if not isinstance(exception, SIGTERMException) or not trainer.training:
            return
        if should_accumulate(trainer):
            rank_zero_warn(
                f"SIGTERM inside an accumulation window after step {trainer.global_step}: not checkpointed (resuming "
                f"there would lose the window's gradients); last.ckpt holds step {last_saved_step(self)}"
            )
            return
        self._save_final_state(trainer)

    def _save_final_state(self, trainer: pl.Trainer) -> None:
        if not self.save_last or trainer.global_step == 0 or last_saved_step(self) == trainer.global_step:
            return
        path = str(Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}")
        trainer.save_checkpoint(path, weights_only=self.save_weights_only)
        set_last_saved_step(self, trainer.global_step)
        self.last_model_path = path
