"""A user's own Lightning script with ``FinalStateCheckpoint``, nothing of the recipes, that sends itself a
real SIGTERM after optimizer step 3 (tests/callbacks/test_checkpoint.py reads what it leaves on stderr).

    python user_sigterm.py OUT    # checkpoints in OUT/checkpoints
"""

from __future__ import annotations

import argparse
import signal
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from signals import SignalAt  # noqa: E402
from toys import GlobalOrderRegressionData, RegressionModule, trainer_kwargs  # noqa: E402

from lit_cbs import FinalStateCheckpoint  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
args = parser.parse_args()

pl.seed_everything(0, verbose=False)
checkpoint = FinalStateCheckpoint(dirpath=args.out / "checkpoints", save_last=True, every_n_train_steps=10)
stop = SignalAt(step=3, signum=signal.SIGTERM)
trainer = pl.Trainer(callbacks=[stop, checkpoint], **trainer_kwargs(max_epochs=2, enable_checkpointing=True))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    trainer.fit(RegressionModule(), GlobalOrderRegressionData(n=96, batch_size=4))
