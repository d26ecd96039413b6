"""The CBS at saved checkpoints of a recipe run, measured after the fact (config: ../conf/probe.yaml).

    python recipes/probe.py ckpt_path=outputs/tiny_warmup/<date>/checkpoints/step0000608.ckpt
    python recipes/probe.py ckpt_path=outputs/tiny_warmup/<date>/checkpoints     # every checkpoint: the CBS curve
    python recipes/probe.py ckpt_path=... probe.multipliers=[1,2,4,8] probe.replicates=2 trainer.devices=2
    python recipes/probe.py ckpt_path=outputs/tiny_warmup/<date>/checkpoints window_fraction=0.125

The run is rebuilt from the ``resolved_config.yaml`` that recipes/train.py wrote in its run folder (beside
``checkpoints/``). From each checkpoint the probe trains the k = 1 baseline and the branches on the run's next
window of data, in the run's own order, scores them on the run's held-out batches and decides as the in-process
probe does (lit_cbs.probe.probe_checkpoint): the same seed and thread count give the reading the run's own probe
would have taken at that step. Each reading is appended to ``cbs_probe.jsonl`` in this job's folder; at the end
``cbs_curve.png`` draws them, and from three readings on the curve fitted through them is forecast
(``forecast.png``). ``window_fraction`` sizes each checkpoint's window by the tokens it holds (at least
``probe.window_tokens``), so that a curve's early and late readings look as far ahead relative to the run. A
distributed (FSDP2) checkpoint is loaded on this job's processes (``trainer.devices``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as recipes/train.py: see the note there

import logging
from pathlib import Path
from typing import Any, cast

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lit_cbs.callbacks.checkpoint import unreadable
from lit_cbs.errors import LitCBSConfigError, positive_number
from lit_cbs.probe.engine import ProbeConfig
from lit_cbs.probe.from_checkpoint import checkpoint_step, checkpoint_tokens, checkpoints_in_order, probe_checkpoint
from lit_cbs.probe.reading import ProbeReading
from lit_cbs.run import job, keys
from lit_cbs.run.resolvers import register_resolvers

CONF = Path(__file__).resolve().parents[1] / "conf"
RUN_CONFIG = "resolved_config.yaml"
# Where the probe is placed does not apply to a checkpoint (it probes at the checkpoint's step); how the run's
# probe ran its branches (side jobs, overhead cap, output folder) does not either.
NOT_FOR_A_CHECKPOINT = ("every_tokens", "at_tokens", "geometric", "side_jobs", "max_overhead", "output_dir")

register_resolvers()
log = logging.getLogger("lit_cbs.probe")


def checkpoints_and_run(ckpt_path: str) -> tuple[list[Path], Path]:
    """The checkpoints to probe (one, or every complete one of a folder, by step) and the run folder whose
    configuration rebuilds them; LitCBSConfigError before any work if either is missing."""
    path = Path(ckpt_path)
    if not path.exists():
        raise LitCBSConfigError(
            f"ckpt_path={ckpt_path} does not exist; give a run's checkpoint or its checkpoints/ folder"
        )
    folder_of_checkpoints = path.is_dir() and not (path / ".metadata").exists()
    checkpoints = checkpoints_in_order(path, checkpoint_step) if folder_of_checkpoints else [path]
    if not checkpoints:
        raise LitCBSConfigError(f"ckpt_path={ckpt_path} holds no complete checkpoint (*.ckpt)")
    problem = None if folder_of_checkpoints else unreadable(path)
    if problem is not None:
        raise LitCBSConfigError(f"ckpt_path={ckpt_path} is not a complete checkpoint: {problem}")
    run = (path if folder_of_checkpoints else path.parent).parent
    if not (run / RUN_CONFIG).is_file():
        raise LitCBSConfigError(
            f"ckpt_path={ckpt_path}: its run folder {run} has no {RUN_CONFIG} (the configuration recipes/train.py "
            "writes there), so the run cannot be rebuilt: give a checkpoint of a recipe run, or use "
            "lit_cbs.probe.probe_checkpoint with your own module"
        )
    return checkpoints, run


def probe_settings(run_cfg: DictConfig, overrides: DictConfig) -> dict[str, Any]:
    """The run's probe settings (conf/callbacks/cbs_probe.yaml's if it had no probe), with the probe.* overrides,
    checked before any work."""
    node = (run_cfg.get("callbacks") or {}).get("cbs_probe")
    if node is None:
        default = OmegaConf.load(CONF / "callbacks" / "cbs_probe.yaml")
        node = OmegaConf.merge(run_cfg, {"callbacks": default}).callbacks.cbs_probe  # its ${batch.*} from the run
    settings = keys.dict_container(node, resolve=True)
    for key in ("_target_", "_convert_", *NOT_FOR_A_CHECKPOINT):
        settings.pop(key, None)
    settings.update(
        {key: value for key, value in keys.dict_container(overrides, resolve=False).items() if value is not None}
    )
    with keys.group_key(run_cfg, "probe"):
        ProbeConfig(**settings)
    return settings


@hydra.main(version_base="1.3", config_path="../conf", config_name="probe")
def main(cfg: DictConfig) -> None:
    job.send_lightning_logs_to_the_job_log()
    earlier = job.earlier_entries()  # what a job that probes nothing leaves in its folder
    try:
        checkpoints, run = checkpoints_and_run(cfg.ckpt_path)
        run_cfg = cast(DictConfig, OmegaConf.load(run / RUN_CONFIG))  # the mapping recipes/train.py wrote
        settings = probe_settings(run_cfg, cfg.probe)
        positive_number("window_fraction", cfg.window_fraction, "of each checkpoint's tokens", optional=True)
    except keys.CONFIG_ERRORS as error:
        job.remove_hydra_run_dir(earlier)
        keys.stop_on_config_error(error)
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    log.info(f"CBS probes of {len(checkpoints)} checkpoint(s) of {run}; readings in {output_dir / 'cbs_probe.jsonl'}")
    readings = []
    for number, checkpoint in enumerate(checkpoints, 1):
        pl.seed_everything(int(run_cfg.seed), workers=True, verbose=False)
        parts = job.probe_parts(run_cfg, cfg.trainer.devices, cfg.trainer.num_nodes)
        window = settings["window_tokens"]
        if cfg.window_fraction is not None:
            if (tokens := checkpoint_tokens(checkpoint)) is None:
                raise LitCBSConfigError(
                    f"window_fraction: {checkpoint} holds no tokens_seen (not a recipe run's checkpoint?)"
                )
            window = max(window, round(cfg.window_fraction * tokens))
        reading = probe_checkpoint(checkpoint, parts, output_dir=output_dir, **{**settings, "window_tokens": window})
        readings.append(reading)
        log.info(
            f"[{number}/{len(checkpoints)}] {checkpoint.name}: step {reading.step:,}, {reading.tokens:,} tokens, batch "
            f"{reading.batch_size}: CBS in {reading.bracket} samples; {reading.tokens_spent:,} branch tokens"
        )
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        report(readings, output_dir, cfg.forecast_to)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def report(readings: list[ProbeReading], output_dir: Path, forecast_to: int | None) -> None:
    """cbs_curve.png of the readings; with three or more, the forecast through them (forecast.png)."""
    from lit_cbs.analysis import brackets_from_records, forecast_cbs, plot_forecast
    from lit_cbs.probe.plot import plot_cbs_curve

    curve = plot_cbs_curve(readings, [], output_dir / "cbs_curve.png", epsilon=readings[-1].epsilon)
    log.info(f"the CBS curve: {curve}")
    if len(readings) < 3:
        log.info("no forecast: it needs three readings or more")
        return
    try:
        forecast = forecast_cbs(brackets_from_records(readings))
    except ValueError as error:  # readings the fit cannot use (all undetermined, ...)
        log.info(f"no forecast: {error}")
        return
    tokens_to = forecast_to or 8 * max(reading.tokens for reading in readings)
    plot = plot_forecast(forecast, output_dir / "forecast.png", tokens_to=tokens_to)
    log.info(f"forecast: {forecast.describe()}; {plot}")


if __name__ == "__main__":
    main()
