"""The training loop: one class that reads top to bottom.

``Trainer(cfg).fit()`` builds everything from the resolved config, trains with DDP when launched by
torchrun, evaluates on every ``trainer.eval_every`` epochs and writes the run directory:

    <run_dir>/config.yaml            resolved config
    <run_dir>/results.json           last and best figures, per-class AP, dataset facts, history
    <run_dir>/checkpoints/last.pt    full training state (resume)
    <run_dir>/checkpoints/best.pt    the weights of the best mAP@class evaluation
    <run_dir>/tb/                    TensorBoard scalars
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Subset
from tqdm import tqdm

from mlcls.data import build_dataset
from mlcls.data.loader import eval_loader, set_loader_epoch, train_loader
from mlcls.engine import distributed as dist_utils
from mlcls.engine.checkpoint import load_checkpoint, save_checkpoint, write_json
from mlcls.engine.evaluate import autocast_context, predict_dataset
from mlcls.engine.optim import build_optimizer, build_scheduler
from mlcls.metrics import map_class, map_sample

log = logging.getLogger("mlcls")

AMP_MODES = ("none", "bf16", "fp16")


class ConfigError(ValueError):
    """The resolved configuration is invalid; the message says which key and what is expected."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def compute_figures(scores: torch.Tensor, labels: torch.Tensor, class_names: list[str]) -> dict[str, Any]:
    """mAP@class, mAP@sample (percent) and the per-class AP table."""
    from mlcls.metrics import average_precision

    mac, classes_counted = map_class(scores, labels)
    mas, samples_counted = map_sample(scores, labels)
    per_class = average_precision(scores, labels, dim=0)
    return {
        "mAP_class": mac,
        "mAP_sample": mas,
        "classes_counted": classes_counted,
        "samples_counted": samples_counted,
        "per_class_ap": {
            name: (None if math.isnan(ap) else 100.0 * ap) for name, ap in zip(class_names, per_class.tolist())
        },
    }


class Trainer:
    """Builds the run from ``cfg`` (the composed ``configs/train.yaml``) and trains it with :meth:`fit`."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        tcfg = cfg.trainer
        if tcfg.amp not in AMP_MODES:
            raise ConfigError(f"trainer.amp={tcfg.amp!r}; expected one of {', '.join(AMP_MODES)}")
        self.dist = dist_utils.init_distributed(tcfg.device)
        self.device = self.dist.device
        if self.device.type != "cuda" and tcfg.amp == "fp16":
            raise ConfigError("trainer.amp=fp16 needs CUDA; on the CPU use trainer.amp=none (or bf16, run in fp32)")
        self.cuda = self.device.type == "cuda"
        self.amp = tcfg.amp if self.cuda else "none"
        self.channels_last = bool(tcfg.channels_last) and self.cuda
        if tcfg.batch_size % self.dist.world_size:
            raise ConfigError(
                f"trainer.batch_size={tcfg.batch_size} does not divide evenly over {self.dist.world_size} "
                "processes; use a multiple of the world size"
            )
        self.local_batch = tcfg.batch_size // self.dist.world_size
        if not self.dist.is_main:
            log.setLevel(logging.WARNING)
        if self.cuda:
            torch.backends.cudnn.benchmark = not tcfg.deterministic
        if tcfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)

        self.run_dir = self._resolve_run_dir()
        seed_everything(tcfg.seed)

        # data
        self.train_set = build_dataset(cfg.dataset, train=True)
        self.val_set = build_dataset(cfg.dataset, train=False)
        self.classes = list(self.train_set.classes)
        if tcfg.limit_val_batches:
            keep = min(len(self.val_set), tcfg.limit_val_batches * self.local_batch * self.dist.world_size)
            self.val_set = Subset(self.val_set, range(keep))
        self.train_loader = train_loader(
            self.train_set, self.local_batch, tcfg.workers, self.dist.rank, self.dist.world_size, tcfg.seed, self.cuda
        )
        self.val_loader = eval_loader(
            self.val_set, self.local_batch, tcfg.workers, self.dist.rank, self.dist.world_size, self.cuda
        )
        self.iters_per_epoch = len(self.train_loader)
        if tcfg.limit_train_batches:
            self.iters_per_epoch = min(self.iters_per_epoch, tcfg.limit_train_batches)
        if self.iters_per_epoch == 0:
            raise ConfigError(
                f"the training set has {len(self.train_set)} samples, fewer than one batch of "
                f"{self.local_batch} per process; lower trainer.batch_size"
            )

        # model, loss, optimisation
        self.model: nn.Module = instantiate(cfg.model, num_classes=len(self.classes)).to(self.device)
        if self.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.criterion = instantiate(cfg.loss)
        if hasattr(self.criterion, "setup"):
            self.criterion.setup(self.train_set.labels)
        self.optimizer = build_optimizer(cfg.optim, self.model)
        self.scheduler = build_scheduler(cfg.sched, self.optimizer, tcfg.epochs * self.iters_per_epoch)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp == "fp16")
        self.start_epoch = 0
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.last_figures: dict[str, Any] | None = None
        if not self._maybe_resume():
            seed_everything(tcfg.seed + self.dist.rank)  # per-rank augmentation; the model is already built
        self.ddp_model = (
            DistributedDataParallel(self.model, device_ids=[self.device.index] if self.cuda else None)
            if self.dist.distributed
            else self.model
        )
        self.writer = None
        if self.dist.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tb"))
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    # ------------------------------------------------------------------ set-up helpers
    def _resolve_run_dir(self) -> Path:
        """``trainer.output_dir``, else Hydra's job directory in a multirun, else ``outputs/<date>/<time>``.

        Rank 0 decides and broadcasts, so all torchrun processes write into one directory.
        """
        chosen = self.cfg.trainer.output_dir
        if not chosen:
            from hydra.core.hydra_config import HydraConfig

            if HydraConfig.initialized() and HydraConfig.get().mode.name == "MULTIRUN":
                chosen = HydraConfig.get().runtime.output_dir
            else:
                chosen = f"outputs/{datetime.now():%Y-%m-%d/%H-%M-%S}"
        run_dir = Path(dist_utils.broadcast_object(str(chosen))).absolute()
        if self.dist.is_main:
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        dist_utils.barrier()
        return run_dir

    def _maybe_resume(self) -> bool:
        """Load ``trainer.resume`` (a path, or ``auto``: this run's ``last.pt``); True if a state was loaded."""
        resume = self.cfg.trainer.resume
        if not resume:
            return False
        path = self.run_dir / "checkpoints" / "last.pt" if resume == "auto" else Path(resume)
        if resume == "auto" and not path.is_file():
            log.info("trainer.resume=auto: no checkpoint in %s, starting from scratch", path.parent)
            return False
        state = load_checkpoint(path, map_location="cpu")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.start_epoch = state["epoch"]
        self.history = state.get("history", [])
        self.best = state.get("best")
        self.last_figures = state.get("last_figures")
        set_rng_state(state["rng"][min(self.dist.rank, len(state["rng"]) - 1)])
        log.info("resumed from %s at epoch %d", path, self.start_epoch)
        return True

    # ------------------------------------------------------------------ training
    def fit(self) -> dict[str, Any]:
        tcfg = self.cfg.trainer
        log.info(
            "run dir %s | %d train / %d val samples, %d classes | %s on %s x%d | batch %d (%d per process)",
            self.run_dir,
            len(self.train_set),
            len(self.val_set),
            len(self.classes),
            self.cfg.model.name,
            self.device.type,
            self.dist.world_size,
            tcfg.batch_size,
            self.local_batch,
        )
        results: dict[str, Any] = {}
        for epoch in range(self.start_epoch, tcfg.epochs):
            train_stats = self.train_one_epoch(epoch)
            record: dict[str, Any] = {"epoch": epoch + 1, **train_stats}
            last_epoch = epoch + 1 == tcfg.epochs
            if (epoch + 1) % tcfg.eval_every == 0 or last_epoch:
                figures = self.evaluate()
                record.update({k: figures[k] for k in ("mAP_class", "mAP_sample")})
                is_best = self.best is None or figures["mAP_class"] > self.best["mAP_class"]
                if is_best:
                    self.best = {"epoch": epoch + 1, "mAP_class": figures["mAP_class"], "mAP_sample": figures["mAP_sample"]}
                self._log_scalars("val", figures, epoch + 1)
                log.info(
                    "epoch %d/%d  mAP@class %.2f  mAP@sample %.2f  (best mAP@class %.2f at epoch %d)",
                    epoch + 1,
                    tcfg.epochs,
                    figures["mAP_class"],
                    figures["mAP_sample"],
                    self.best["mAP_class"],
                    self.best["epoch"],
                )
                self.last_figures = figures
            else:
                is_best = False
            self.history.append(record)
            self.save(epoch + 1, is_best)
            if self.last_figures is not None:
                results = self.write_results(epoch + 1)
        if self.writer is not None:
            self.writer.close()
        dist_utils.barrier()
        return results

    def train_one_epoch(self, epoch: int) -> dict[str, float]:
        tcfg = self.cfg.trainer
        self.ddp_model.train()
        set_loader_epoch(self.train_loader, epoch, tcfg.seed)
        show_bar = self.dist.is_main and sys.stdout.isatty()
        bar = tqdm(total=self.iters_per_epoch, desc=f"epoch {epoch + 1}/{tcfg.epochs}", disable=not show_bar)
        loss_sum, seen, start = torch.zeros((), device=self.device), 0, time.perf_counter()
        for step, (images, targets) in enumerate(self.train_loader):
            if step >= self.iters_per_epoch:
                break
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with autocast_context(self.device, self.amp):
                logits = self.ddp_model(images)
            loss = self.criterion(logits.float(), targets)
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            if tcfg.grad_clip:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), tcfg.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            loss_sum += loss.detach()
            seen += images.shape[0]
            iteration = epoch * self.iters_per_epoch + step + 1
            if show_bar:
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.4f}")
            elif self.dist.is_main and (iteration % tcfg.log_every == 0):
                log.info("epoch %d iter %d/%d loss %.4f", epoch + 1, step + 1, self.iters_per_epoch, loss.item())
            if self.writer is not None and iteration % 10 == 0:
                self.writer.add_scalar("train/loss", loss.item(), iteration)
                self.writer.add_scalar("train/lr_head", self.optimizer.param_groups[0]["lr"], iteration)
                self.writer.add_scalar("train/lr_backbone", self.optimizer.param_groups[1]["lr"], iteration)
        bar.close()
        elapsed = time.perf_counter() - start
        mean_loss = (dist_utils.all_reduce_sum(loss_sum) / (self.iters_per_epoch * self.dist.world_size)).item()
        images_per_s = seen * self.dist.world_size / elapsed
        if self.writer is not None:
            self.writer.add_scalar("train/epoch_loss", mean_loss, epoch + 1)
            self.writer.add_scalar("train/images_per_s", images_per_s, epoch + 1)
        log.info("epoch %d/%d  loss %.4f  %.1f images/s", epoch + 1, tcfg.epochs, mean_loss, images_per_s)
        return {"loss": mean_loss, "images_per_s": images_per_s, "time_s": elapsed}

    def evaluate(self) -> dict[str, Any]:
        """Figures on the whole validation set; every process returns the same.

        Under DDP each process's BatchNorm running statistics drift from rank 0's during the epoch (DDP
        broadcasts them only at the next forward), so rank 0's buffers, the ones checkpointed, are
        broadcast first: every shard is scored by exactly the saved model.
        """
        if self.dist.distributed:
            for buffer in self.model.buffers():
                torch.distributed.broadcast(buffer, src=0)
        scores, labels = predict_dataset(self.model, self.val_loader, self.device, self.amp, self.channels_last)
        return compute_figures(scores, labels, self.classes)

    # ------------------------------------------------------------------ outputs
    def _log_scalars(self, prefix: str, figures: dict[str, Any], step: int) -> None:
        if self.writer is None:
            return
        for key, value in figures.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def save(self, epoch: int, is_best: bool) -> None:
        """Write ``last.pt`` (and ``best.pt``) on rank 0; RNG states of every rank are collected first."""
        rng_states = [rng_state()]
        if self.dist.distributed:
            rng_states = [None] * self.dist.world_size
            torch.distributed.all_gather_object(rng_states, rng_state())
        if self.dist.is_main:
            state = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "epoch": epoch,
                "history": self.history,
                "best": self.best,
                "last_figures": self.last_figures,
                "rng": rng_states,
                "classes": self.classes,
                "config": OmegaConf.to_container(self.cfg, resolve=True),
            }
            save_checkpoint(state, self.run_dir / "checkpoints" / "last.pt")
            if is_best:
                weights = {k: state[k] for k in ("model", "epoch", "classes", "config", "best")}
                save_checkpoint(weights, self.run_dir / "checkpoints" / "best.pt")
        dist_utils.barrier()

    def write_results(self, epochs_completed: int) -> dict[str, Any]:
        figures = self.last_figures
        results = {
            "metrics": {k: v for k, v in figures.items() if k != "per_class_ap"},
            "best": self.best,
            "per_class_ap": figures["per_class_ap"],
            "dataset": {
                "name": self.cfg.dataset.name,
                "num_classes": len(self.classes),
                "train_size": len(self.train_set),
                "val_size": len(self.val_set),
            },
            "epochs_completed": epochs_completed,
            "history": self.history,
            "world_size": self.dist.world_size,
        }
        if self.dist.is_main:
            write_json(results, self.run_dir / "results.json")
        return results
