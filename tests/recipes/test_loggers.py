"""What lit_cbs logs reaches TensorBoard, MLflow and W&B, read back from what the real libraries wrote:
TensorBoard's event files (EventAccumulator), MLflow's store (MlflowClient), W&B's offline run file."""

from __future__ import annotations

import glob
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
from launch import subprocess_env
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from mlflow import MlflowClient
from recipe_runs import SHORT_RUN, compose_config, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from toys import RegressionData, RegressionModule, trainer_kwargs
from wandb.proto import wandb_internal_pb2

from lit_cbs import BatchWarmup, CBSProbeCallback, GradientNoiseScale, LitCBSConfigError, PiecewiseBatch
from lit_cbs.analysis.curves import read_metrics_csv

ROOT = Path(__file__).resolve().parents[2]


def tensorboard_of(log_dir: Path) -> tuple[set[str], set[str]]:
    """The scalar and image tags of the TensorBoard event files in ``log_dir``."""
    events = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    return set(events.Tags()["scalars"]), set(events.Tags()["images"])


def mlflow_of(tracking_uri: str) -> tuple[set[str], set[str], int]:
    """The metric keys, the artifact paths under figures/ and the batch/global_size points of the one run."""
    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("lit_cbs").experiment_id])
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id, "figures")}
    return set(run.data.metrics), artifacts, len(client.get_metric_history(run.info.run_id, "batch/global_size"))


def wandb_of(save_dir: Path) -> tuple[set[str], set[str]]:
    """The history keys of the offline run (from its run-*.wandb record log: LevelDB's log format, 32 KiB
    blocks of records with a 7-byte header, after W&B's own 7-byte header) and its image files."""
    (path,) = glob.glob(str(save_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, position, record, keys = Path(path).read_bytes(), 7, b"", set()
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        record += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            if parsed.WhichOneof("record_type") == "history":
                keys |= {item.key or "/".join(item.nested_key) for item in parsed.history.item}
            record = b""
    images = {
        Path(image).name.split("_")[0]
        for image in glob.glob(str(save_dir / "wandb" / "offline-run-*" / "files" / "media" / "images" / "*.png"))
    }
    return keys, images


@pytest.mark.slow
def test_batch_cbs_and_noise_scale_metrics_and_the_cbs_curve_reach_every_logger(tmp_path):
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    loggers = [
        CSVLogger(tmp_path, name="", version=""),
        TensorBoardLogger(tmp_path, name="tensorboard", version=""),
        MLFlowLogger(
            experiment_name="lit_cbs", tracking_uri=tracking_uri, artifact_location=str(tmp_path / "mlartifacts")
        ),
        WandbLogger(project="lit_cbs", save_dir=str(tmp_path), offline=True),
    ]
    pl.seed_everything(0, verbose=False)
    probe = CBSProbeCallback(every_tokens=80, multipliers=(1, 2), window_tokens=64, output_dir=tmp_path)
    callbacks = [BatchWarmup(PiecewiseBatch([2, 4], [0, 160], unit="tokens"), seq_len=4), probe, GradientNoiseScale()]
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=2, logger=loggers, log_every_n_steps=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(RegressionModule(optimizer="adam"), RegressionData(n=48, batch_size=2))
    assert probe.history
    loggers[3].experiment.finish()  # W&B writes its record file from a process of its own: wait for it
    wanted = {
        "batch/global_size",
        "batch/accumulate",
        "lr",
        "tokens_seen",
        "cbs/lower",
        "cbs/k_star",
        "cbs/determined",
        "cbs/gap_k2",
        "cbs/gap_se_k2",
        "gns/b_simple",
    }
    scalars, images = tensorboard_of(tmp_path / "tensorboard")
    assert wanted <= scalars and images == {"cbs_curve"}
    metrics, artifacts, points = mlflow_of(tracking_uri)
    assert wanted <= metrics and artifacts == {"figures/cbs_curve.png"} and points == trainer.global_step
    keys, images = wandb_of(tmp_path)
    assert wanted <= keys and images == {"cbs"}  # cbs_curve_<step>_<hash>.png


@pytest.mark.slow
def test_a_recipe_with_every_logger_sends_its_loss_throughput_and_figures_to_each(prepared, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        *SHORT_RUN,
        "logger=[csv,tensorboard,mlflow,wandb]",
        f"data.path={prepared}",
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), *overrides],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wanted = {"train/loss", "val/loss", "perf/tokens_per_s", "batch/global_size", "lr"}
    scalars, images = tensorboard_of(run_dir / "tensorboard")
    assert wanted <= scalars and images == {"loss_vs_tokens", "batch_lr_vs_tokens"}
    metrics, artifacts, _ = mlflow_of(f"sqlite:///{tmp_path}/mlflow.db")  # in the folder the run started from
    assert wanted <= metrics and artifacts == {"figures/loss_vs_tokens.png", "figures/batch_lr_vs_tokens.png"}
    keys, images = wandb_of(run_dir)
    assert wanted <= keys and images == {"loss", "batch"}
    assert (run_dir / "metrics.csv").is_file() and 'data-figures="3"' in (run_dir / "report.html").read_text()


def test_a_logger_whose_package_is_missing_stops_before_any_data_work(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as an environment without it: its import fails
    cfg = compose_config("logger=[csv,wandb]", f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(
        LitCBSConfigError,
        match=r"^logger.wandb: WandbLogger needs the wandb package, which is not installed: "
        r'pip install -e "\.\[loggers\]"',
    ):
        train.build_run(cfg)
    assert not (tmp_path / "cache").exists()


def test_a_logger_named_alone_trains_and_the_run_still_writes_its_metrics_csv(prepared, tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose_config(*SHORT_RUN, "logger=tensorboard", f"data.path={prepared}", output_dir=str(run_dir))
    run = train.build_run(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.trainer.fit(run.model, datamodule=run.datamodule)
    assert [type(logger).__name__ for logger in run.trainer.loggers] == ["CSVLogger", "TensorBoardLogger"]
    scalars, _ = tensorboard_of(run_dir / "tensorboard")
    assert {"train/loss", "val/loss", "batch/global_size"} <= scalars
    assert read_metrics_csv(run_dir / "metrics.csv")["tokens_seen"][1][-1] == 6144  # the run's own record, as always
