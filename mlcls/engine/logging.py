"""What a run tells while it trains: log lines (rank 0) and TensorBoard scalars (``<run_dir>/tb``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tqdm import tqdm

log = logging.getLogger("mlcls")


class RunLog:
    """Log lines and TensorBoard scalars of rank 0; the other ranks log warnings only and write nothing."""

    def __init__(self, run_dir: Path, is_main: bool, epochs: int, iters_per_epoch: int) -> None:
        self.epochs, self.iters_per_epoch = epochs, iters_per_epoch
        self.writer = None
        if is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tb"))
        else:
            log.setLevel(logging.WARNING)

    def step(
        self, epoch: int, step: int, iteration: int, loss: float, lrs: dict[str, float], bar: tqdm
    ) -> None:
        """A log step: the loss in the progress bar (on a terminal) or a log line, loss and lr scalars."""
        if not bar.disable:
            bar.set_postfix(loss=f"{loss:.4f}")
        else:
            log.info("epoch %d iter %d/%d loss %.4f", epoch + 1, step + 1, self.iters_per_epoch, loss)
        self.scalars("train", {"loss": loss, **{f"lr_{part}": lr for part, lr in lrs.items()}}, iteration)

    def epoch(self, epoch: int, loss: float, images_per_s: float) -> None:
        self.scalars("train", {"epoch_loss": loss, "images_per_s": images_per_s}, epoch + 1)
        log.info("epoch %d/%d  loss %.4f  %.1f images/s", epoch + 1, self.epochs, loss, images_per_s)

    def evaluation(self, epoch: int, metrics: dict[str, Any], best: dict[str, Any]) -> None:
        """The metrics of the raw weights (and of the EMA under ``metrics["ema"]``) and the best so far."""
        self.scalars("val", metrics, epoch)
        ema_note = ""
        if "ema" in metrics:
            self.scalars("val_ema", metrics["ema"], epoch)
            ema_note = f"  EMA mAP@class {metrics['ema']['mAP_class']:.2f}"
        log.info(
            "epoch %d/%d  mAP@class %.2f  mAP@sample %.2f%s  (best mAP@class %.2f at epoch %d, %s weights)",
            epoch,
            self.epochs,
            metrics["mAP_class"],
            metrics["mAP_sample"],
            ema_note,
            best["mAP_class"],
            best["epoch"],
            best["weights"],
        )

    def scalars(self, prefix: str, values: dict[str, Any], step: int) -> None:
        """``prefix/<key>`` for every number among ``values``."""
        if self.writer is None:
            return
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
