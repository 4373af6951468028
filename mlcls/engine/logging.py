"""What a run tells while it trains: log lines (rank 0), TensorBoard scalars (``<run_dir>/tb``) and, with
``logger=mlflow``, an MLflow run (:class:`MlflowRun`)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from mlcls.config_tree import flatten_config
from mlcls.engine.distributed import on_main
from mlcls.errors import ConfigError, is_number

log = logging.getLogger("mlcls")
# What MlflowRun uploads at the end, relative to the run directory, when it exists.
MLFLOW_ARTIFACTS = ("plots", "results.json", "config.yaml")
BEST_CHECKPOINT = "checkpoints/best.pt"


class MlflowRun:
    """The MLflow run of a training run (``logger=mlflow``, rank 0, ``configs/logger/mlflow.yaml``): the
    config as dotted params, metrics with their step, ``run_dir``'s results uploaded at :meth:`close`."""

    def __init__(self, logger_cfg: Mapping[str, Any], run_dir: Path, params: Mapping[str, Any] | DictConfig):
        try:
            import mlflow
        except ImportError:
            raise ConfigError("logger=mlflow needs the mlflow package; pip install 'mlcls[mlflow]'") from None
        self.mlflow, self.run_dir = mlflow, run_dir
        self.log_checkpoint = bool(logger_cfg.get("log_checkpoint", True))
        uri = logger_cfg.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow 3 keeps its file store behind this switch
            uri = Path("mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(logger_cfg.get("experiment") or "mlcls")
        self.run = mlflow.start_run(run_name=logger_cfg.get("run_name") or run_dir.name)
        if isinstance(params, DictConfig):
            params = OmegaConf.to_container(params, resolve=True)
        flat = flatten_config(params)
        mlflow.log_params({k: str(v)[:500] for k, v in flat.items() if not k.startswith("hydra.")})

    def metrics(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self, failed: bool) -> None:
        """Upload :data:`MLFLOW_ARTIFACTS` (and the best checkpoint); end the run FAILED or FINISHED."""
        for name in MLFLOW_ARTIFACTS:
            path = self.run_dir / name
            if path.is_dir():
                self.mlflow.log_artifacts(str(path), artifact_path=name)
            elif path.is_file():
                self.mlflow.log_artifact(str(path))
        best = self.run_dir / BEST_CHECKPOINT
        if self.log_checkpoint and best.is_file():
            self.mlflow.log_artifact(str(best), artifact_path="checkpoints")
        self.mlflow.end_run("FAILED" if failed else "FINISHED")


class RunLog:
    """Rank 0's log lines, TensorBoard scalars and MLflow run (``logger=mlflow``); the other ranks log
    warnings only (until :meth:`close`) and write nothing."""

    def __init__(
        self,
        run_dir: Path,
        is_main: bool,
        epochs: int,
        iters_per_epoch: int,
        cfg: DictConfig | Mapping[str, Any] | None = None,
    ) -> None:
        self.epochs, self.iters_per_epoch = epochs, iters_per_epoch
        self.writer = None
        self.mlflow: MlflowRun | None = None
        self.level_before: int | None = None  # the "mlcls" logger's level, put back by close()
        if is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tb"))
            logger_cfg = (cfg or {}).get("logger") or {}
            if logger_cfg.get("name") == "mlflow":
                self.mlflow = MlflowRun(logger_cfg, run_dir, cfg)
        else:
            self.level_before = log.level
            log.setLevel(logging.WARNING)

    def step(
        self, epoch: int, step: int, iteration: int, loss: float, lrs: dict[str, float], bar: tqdm
    ) -> None:
        """The loss in the progress bar (on a terminal) or a log line; loss and lr scalars."""
        if not bar.disable:
            bar.set_postfix(loss=f"{loss:.4f}")
        else:
            log.info("epoch %d iter %d/%d loss %.4f", epoch + 1, step + 1, self.iters_per_epoch, loss)
        self.scalars("train", {"loss": loss, **{f"lr_{part}": lr for part, lr in lrs.items()}}, iteration)

    def epoch(self, epoch: int, loss: float, images_per_s: float) -> None:
        self.scalars("train", {"epoch_loss": loss, "images_per_s": images_per_s}, epoch + 1)
        log.info("epoch %d/%d  loss %.4f  %.1f images/s", epoch + 1, self.epochs, loss, images_per_s)

    def evaluation(self, epoch: int, metrics: dict[str, Any], best: dict[str, Any]) -> None:
        """The raw weights' metrics (the EMA's and held-out split's within) and the best so far."""
        self.scalars("val", metrics, epoch)
        notes = ""
        if "selection" in metrics:
            self.scalars("holdout", metrics["selection"], epoch)
            notes += f"  held-out mAP@class {metrics['selection']['mAP_class']:.2f}"
        if "ema" in metrics:
            self.scalars("val_ema", metrics["ema"], epoch)
            notes += f"  EMA mAP@class {metrics['ema']['mAP_class']:.2f}"
        log.info(
            "epoch %d/%d  mAP@class %.2f  mAP@sample %.2f%s  (best mAP@class %.2f at epoch %d, %s weights%s)",
            epoch,
            self.epochs,
            metrics["mAP_class"],
            metrics["mAP_sample"],
            notes,
            best["mAP_class"],
            best["epoch"],
            best["weights"],
            ", selected on the held-out split" if best.get("selected_on") == "holdout" else "",
        )

    def scalars(self, prefix: str, values: dict[str, Any], step: int) -> None:
        """``prefix/<key>`` for every number among ``values`` (MLflow: ``prefix_<key>``, with the step)."""
        if self.writer is None:
            return
        numbers = {key: float(value) for key, value in values.items() if is_number(value)}
        for key, value in numbers.items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)
        if self.mlflow is not None and numbers:
            self.mlflow.metrics({f"{prefix}_{key}": value for key, value in numbers.items()}, step)

    def close(self) -> None:
        """Close TensorBoard and MLflow (``FAILED`` while an exception propagates); restore the log level."""
        if self.level_before is not None:
            log.setLevel(self.level_before)
            self.level_before = None
        if self.writer is not None:
            self.writer.close()
        if self.mlflow is not None:
            self.mlflow.close(failed=sys.exc_info()[0] is not None)
            self.mlflow = None


def open_run_log(run_dir: Path, is_main: bool, epochs: int, iters_per_epoch: int, cfg: DictConfig) -> RunLog:
    """The run's :class:`RunLog`, once rank 0 has opened it; if rank 0 fails (an MLflow server down), every
    rank raises (:func:`on_main`)."""
    run_log = on_main(lambda: RunLog(run_dir, True, epochs, iters_per_epoch, cfg=cfg), is_main)
    return run_log if run_log is not None else RunLog(run_dir, False, epochs, iters_per_epoch, cfg=cfg)
