"""The training loop: one class that reads top to bottom.

``Trainer(cfg).fit()`` validates the config, builds everything from it, trains with DDP when launched by
torchrun, evaluates every ``trainer.eval_every`` epochs and writes the run directory:

    <run_dir>/config.yaml                resolved config
    <run_dir>/results.json               last and best figures, per-class AP, dataset facts, counts, history
    <run_dir>/checkpoints/last.pt        newest full training state (what resume=auto loads first)
    <run_dir>/checkpoints/iter_*.pt      the newest trainer.keep_checkpoints full states (fallbacks)
    <run_dir>/checkpoints/best.pt        the weights of the best mAP@class evaluation
    <run_dir>/tb/                        TensorBoard scalars

SIGTERM or SIGUSR1 (what SLURM sends before preemption) finishes the current step, writes a checkpoint with
all ranks in step and exits with :data:`EXIT_PREEMPTED` (75, EX_TEMPFAIL: "try again"); relaunching the same
command with ``trainer.resume=auto`` continues exactly where it stopped.
"""

from __future__ import annotations

import logging
import random
import signal
import sys
import time
import warnings
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Subset
from tqdm import tqdm

from mlcls.data import build_dataset
from mlcls.data.fast import AugmentedImage, DeviceStage
from mlcls.data.loader import eval_loader, train_loader
from mlcls.engine import distributed as dist_utils
from mlcls.engine.checkpoint import (
    CheckpointError,
    load_checkpoint,
    resume_candidates,
    save_checkpoint,
    save_training_checkpoint,
    write_json,
)
from mlcls.engine.evaluate import autocast_context, predict_dataset
from mlcls.engine.optim import build_optimizer, build_scheduler
from mlcls.engine.validate import ConfigError, validate_config
from mlcls.inference import calibrate_thresholds, preprocess_spec
from mlcls.metrics import compute_metrics
from mlcls.reporting.plots import write_plots
from mlcls.reporting.provenance import collect_provenance

log = logging.getLogger("mlcls")

EXIT_PREEMPTED = 75
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

__all__ = ["EXIT_PREEMPTED", "ConfigError", "NonFiniteError", "Preempted", "Trainer"]


class Preempted(Exception):
    """Training stopped on a preemption signal after writing a checkpoint; relaunch to resume."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


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


def gradient_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients together (0 without any), as ``clip_grad_norm_`` reports it."""
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


class Trainer:
    """Builds the run from ``cfg`` (the composed ``configs/train.yaml``) and trains it with :meth:`fit`."""

    def __init__(self, cfg: DictConfig) -> None:
        validate_config(cfg)
        self.cfg = cfg
        tcfg = cfg.trainer
        self.dist = dist_utils.init_distributed(tcfg.device)
        self.device = self.dist.device
        self.cuda = self.device.type == "cuda"
        self.amp = tcfg.amp if self.cuda else "none"
        self.channels_last = bool(tcfg.channels_last) and self.cuda
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
        backend = cfg.data.backend
        self.train_set = build_dataset(cfg.dataset, train=True, backend=backend)
        self.val_set = build_dataset(cfg.dataset, train=False, backend=backend)
        self.classes = list(self.train_set.classes)
        self.preprocess = preprocess_spec(cfg.dataset)  # in checkpoints: predict needs no dataset
        if tcfg.limit_val_batches:
            keep = min(len(self.val_set), tcfg.limit_val_batches * self.local_batch * self.dist.world_size)
            self.val_set = Subset(self.val_set, range(keep))
        if backend == "dali":
            from mlcls.data.dali import DaliTrainLoader

            self.train_loader = DaliTrainLoader(
                self.train_set,
                self.local_batch,
                tcfg.workers,
                self.dist.rank,
                self.dist.world_size,
                tcfg.seed,
                int(cfg.dataset.image_size),
                self.device.index or 0,
            )
        else:
            self.train_loader = train_loader(
                self.train_set,
                self.local_batch,
                tcfg.workers,
                self.dist.rank,
                self.dist.world_size,
                tcfg.seed,
                self.cuda,
            )
        # Copies each batch to the device and finishes the fast pipeline there (colour, lighting, normalise).
        self.device_stage = DeviceStage(self.device, self.channels_last)
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
        self.ema = (
            AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(tcfg.ema_decay), use_buffers=True)
            if tcfg.ema_decay
            else None
        )
        self.criterion = instantiate(cfg.loss)
        if hasattr(self.criterion, "setup"):
            self.criterion.setup(self.train_set.labels)
        self.optimizer = build_optimizer(cfg.optim, self.model)
        self.scheduler = build_scheduler(cfg.sched, self.optimizer, tcfg.epochs * self.iters_per_epoch)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp == "fp16")

        # progress, restored by resume
        self.start_epoch, self.start_step = 0, 0
        self.epoch_partial: dict[str, float] = {}
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.last_figures: dict[str, Any] | None = None
        # validation logits/labels of the last evaluation, and per-class thresholds calibrated on them
        self.val_outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scored: tuple[torch.Tensor, torch.Tensor] | None = None
        self.thresholds: torch.Tensor | None = None
        self.best_thresholds: torch.Tensor | None = None
        self.counts: dict[str, Any] = {"skipped_steps": 0, "skipped_images": []}
        self.wall_time_s = 0.0
        if not self._maybe_resume():
            seed_everything(tcfg.seed + self.dist.rank)
        self.ddp_model = (
            DistributedDataParallel(self.model, device_ids=[self.device.index] if self.cuda else None)
            if self.dist.distributed
            else self.model
        )
        if tcfg.compile:  # training forward only; self.model (checkpoints, EMA, evaluation) stays plain
            self.ddp_model = torch.compile(self.ddp_model)
        self._signal_received, self._signum = False, None
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
        """Load ``trainer.resume`` (a path, or ``auto``: the newest readable checkpoint of this run).

        With ``auto`` an unreadable checkpoint (e.g. truncated by a crash) is reported and the previous one
        tried. Returns True if a state was loaded.
        """
        resume = self.cfg.trainer.resume
        if not resume:
            return False
        if resume != "auto":
            return self._load_state(load_checkpoint(resume), Path(resume))
        for path in resume_candidates(self.run_dir / "checkpoints"):
            try:
                state = load_checkpoint(path)
            except CheckpointError as exc:
                log.warning("%s; trying the previous checkpoint", exc)
                continue
            return self._load_state(state, path)
        log.info("trainer.resume=auto: no readable checkpoint in %s, starting from scratch", self.run_dir)
        return False

    def _load_state(self, state: dict[str, Any], path: Path) -> bool:
        if "optimizer" not in state:
            raise CheckpointError(f"{path} holds weights only (best.pt?); resume needs last.pt or iter_*.pt")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema.load_state_dict(state["ema"])
        self.start_epoch, self.start_step = state["epoch"], state.get("step", 0)
        self.epoch_partial = state.get("epoch_partial", {})
        self.history = state.get("history", [])
        self.best = state.get("best")
        self.last_figures = state.get("last_figures")
        self.thresholds = state.get("thresholds")
        self.counts = state.get("counts", self.counts)
        self.wall_time_s = state.get("wall_time_s", 0.0)
        set_rng_state(state["rng"][min(self.dist.rank, len(state["rng"]) - 1)])
        log.info("resumed from %s at epoch %d, step %d", path, self.start_epoch, self.start_step)
        return True

    def _on_signal(self, signum: int, frame: Any) -> None:
        log.warning("received %s: stopping after this step", signal.Signals(signum).name)
        self._signal_received, self._signum = True, signum

    def _stop_requested(self) -> bool:
        """True on every rank as soon as any rank received a preemption signal."""
        if not self.dist.distributed:
            return self._signal_received
        flag = torch.tensor([float(self._signal_received)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

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
        previous = {s: signal.signal(s, self._on_signal) for s in PREEMPTION_SIGNALS}
        try:
            for epoch in range(self.start_epoch, tcfg.epochs):
                record: dict[str, Any] = {"epoch": epoch + 1, **self.train_one_epoch(epoch)}
                is_best = False
                if (epoch + 1) % tcfg.eval_every == 0 or epoch + 1 == tcfg.epochs:
                    is_best = self.evaluate_and_select(epoch + 1)
                    record.update({k: self.last_figures[k] for k in ("mAP_class", "mAP_sample")})
                self._collect_bad_images()
                self.history.append(record)
                self.save(epoch + 1, 0, is_best)
                if self.last_figures is not None:
                    self.write_results(epoch + 1)
            if self.dist.is_main and self.val_outputs is not None:
                write_plots(self.run_dir, self.history, *self.val_outputs, self.classes, writer=self.writer)
        except Preempted:
            # A handler installed before ours (submitit's on SLURM) gets the signal too, once the checkpoint
            # exists: it requeues the job. Without one, the CLI exits with EXIT_PREEMPTED.
            handler = previous.get(self._signum)
            if callable(handler):
                handler(self._signum, None)
            raise
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.writer is not None:
                self.writer.close()
        dist_utils.barrier()
        return self.results(tcfg.epochs)

    def train_one_epoch(self, epoch: int) -> dict[str, float]:
        tcfg = self.cfg.trainer
        self.ddp_model.train()
        sampler = self.train_loader.sampler
        sampler.set_epoch(epoch)
        first_step = 0
        if epoch == self.start_epoch and self.start_step:
            first_step = self.start_step
            sampler.set_start(first_step * self.local_batch)
        partial = self.epoch_partial if first_step else {}
        loss_sum = torch.tensor(partial.get("loss_sum", 0.0), device=self.device)
        seen, elapsed = int(partial.get("seen", 0)), partial.get("time_s", 0.0)
        show_bar = self.dist.is_main and sys.stdout.isatty()
        bar = tqdm(
            total=self.iters_per_epoch,
            initial=first_step,
            desc=f"epoch {epoch + 1}/{tcfg.epochs}",
            disable=not show_bar,
        )
        start, nonfinite_run = time.perf_counter(), 0
        for step, (images, targets) in enumerate(self.train_loader, start=first_step):
            if step >= self.iters_per_epoch:
                break
            loss, finite = self.train_step(images, targets)
            if finite:
                nonfinite_run = 0
                loss_sum += loss
            else:
                nonfinite_run += 1
                self.counts["skipped_steps"] += 1
                log.warning(
                    "epoch %d step %d: non-finite loss or gradient, step skipped", epoch + 1, step + 1
                )
                if nonfinite_run >= tcfg.max_nonfinite:
                    raise NonFiniteError(
                        f"{nonfinite_run} consecutive steps with a non-finite loss or gradient at epoch "
                        f"{epoch + 1}: lower the learning rate (optim.lr_head/lr_backbone), try "
                        "trainer.amp=bf16 or none instead of fp16, set trainer.grad_clip, and check the "
                        "labels (values 1/0/-1)"
                    )
            seen += targets.shape[0]
            iteration = epoch * self.iters_per_epoch + step + 1
            if show_bar:
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.4f}")
            elif self.dist.is_main and iteration % tcfg.log_every == 0:
                log.info(
                    "epoch %d iter %d/%d loss %.4f", epoch + 1, step + 1, self.iters_per_epoch, loss.item()
                )
            if self.writer is not None and iteration % 10 == 0:
                self.writer.add_scalar("train/loss", loss.item(), iteration)
                self.writer.add_scalar("train/lr_head", self.optimizer.param_groups[0]["lr"], iteration)
                self.writer.add_scalar("train/lr_backbone", self.optimizer.param_groups[1]["lr"], iteration)
            if self._stop_requested():
                self.epoch_partial = {
                    "loss_sum": loss_sum.item(),
                    "seen": seen,
                    "time_s": elapsed + time.perf_counter() - start,
                }
                self.save(epoch, step + 1, is_best=False)
                raise Preempted(
                    f"stopped by a signal at epoch {epoch + 1}, step {step + 1}; checkpoint in "
                    f"{self.run_dir / 'checkpoints'}; relaunch with trainer.resume=auto to continue"
                )
        bar.close()
        elapsed += time.perf_counter() - start
        self.wall_time_s += time.perf_counter() - start
        steps_done = self.iters_per_epoch * self.dist.world_size
        mean_loss = (dist_utils.all_reduce_sum(loss_sum) / steps_done).item()
        images_per_s = seen * self.dist.world_size / max(elapsed, 1e-9)
        if self.writer is not None:
            self.writer.add_scalar("train/epoch_loss", mean_loss, epoch + 1)
            self.writer.add_scalar("train/images_per_s", images_per_s, epoch + 1)
        log.info("epoch %d/%d  loss %.4f  %.1f images/s", epoch + 1, tcfg.epochs, mean_loss, images_per_s)
        return {"loss": mean_loss, "images_per_s": images_per_s, "time_s": elapsed}

    def train_step(
        self, images: torch.Tensor | AugmentedImage, targets: torch.Tensor
    ) -> tuple[torch.Tensor, bool]:
        """One optimisation step; returns the detached loss and whether the step was applied.

        ``images``: a float batch, or the fast pipeline's uint8 batch with its colour parameters.

        A non-finite gradient norm (identical on every rank after DDP's all-reduce, so all ranks agree)
        skips the update. With fp16 the GradScaler owns that decision, as overflow is routine there.
        """
        images = self.device_stage(images)
        targets = targets.to(self.device, non_blocking=True)
        with autocast_context(self.device, self.amp):
            logits = self.ddp_model(images)
        loss = self.criterion(logits.float(), targets)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        if self.cfg.trainer.grad_clip:
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        else:  # the norm alone, for the finite check (clip_grad_norm_ would also rescale every gradient by 1)
            grad_norm = gradient_norm(self.model.parameters())
        finite = self.amp == "fp16" or bool(torch.isfinite(grad_norm))
        if finite:
            self.scaler.step(self.optimizer)
            if self.ema is not None:
                self.ema.update_parameters(self.model)
        self.scaler.update()
        with warnings.catch_warnings():
            # a skipped step (here or by the GradScaler) still advances the schedule, one value per
            # iteration; torch warns when that happens before the first applied optimizer step
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`", UserWarning)
            self.scheduler.step()
        return loss.detach(), finite

    def _collect_bad_images(self) -> None:
        """Files the datasets skipped since the last call (``dataset.on_bad_image=skip``), from every rank."""
        mine: list[str] = []
        for dataset in (self.train_set, getattr(self.val_set, "dataset", self.val_set)):
            if hasattr(dataset, "pop_bad_images"):
                mine.extend(dataset.pop_bad_images())
        parts = [mine]
        if self.dist.distributed:
            parts = [None] * self.dist.world_size
            torch.distributed.all_gather_object(parts, mine)
        new = sorted({p for part in parts for p in part} - set(self.counts["skipped_images"]))
        if new:
            log.warning("skipped %d unreadable images, e.g. %s", len(new), new[0])
            self.counts["skipped_images"].extend(new)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, model: nn.Module | None = None) -> dict[str, Any]:
        """Figures of ``model`` (default: the raw weights) on the whole validation set, equal on every rank.

        The logits and labels behind them are kept in ``self.scored`` (thresholds, plots).

        Under DDP each process's BatchNorm running statistics drift from rank 0's during the epoch (DDP
        broadcasts them only at the next forward), so rank 0's buffers, the ones checkpointed, are
        broadcast first: every shard is scored by exactly the saved model.
        """
        model = self.model if model is None else model
        if self.dist.distributed:
            for buffer in model.buffers():
                torch.distributed.broadcast(buffer, src=0)
        scores, labels = predict_dataset(model, self.val_loader, self.device, self.amp, self.channels_last)
        self.scored = (scores, labels)
        return compute_metrics(scores, labels, self.classes)

    def evaluate_and_select(self, epoch: int) -> bool:
        """Evaluate the raw (and EMA) weights, log them, update ``best``; True for a new best epoch."""
        figures = self.evaluate()
        candidates, outputs = {"raw": figures}, {"raw": self.scored}
        if self.ema is not None:
            candidates["ema"] = figures["ema"] = self.evaluate(self.ema.module)
            outputs["ema"] = self.scored
        weights, chosen = max(candidates.items(), key=lambda kv: kv[1]["mAP_class"])
        is_best = self.best is None or chosen["mAP_class"] > self.best["mAP_class"]
        self.val_outputs = outputs["raw"]
        self.thresholds = calibrate_thresholds(*outputs["raw"])  # for last.pt's raw weights
        if is_best:
            self.best_thresholds = calibrate_thresholds(*outputs[weights])
            self.best = {
                "epoch": epoch,
                "mAP_class": chosen["mAP_class"],
                "mAP_sample": chosen["mAP_sample"],
                "weights": weights,
            }
        self.last_figures = figures
        for name, figs in candidates.items():
            self._log_scalars("val" if name == "raw" else "val_ema", figs, epoch)
        ema_note = f"  EMA mAP@class {candidates['ema']['mAP_class']:.2f}" if "ema" in candidates else ""
        log.info(
            "epoch %d/%d  mAP@class %.2f  mAP@sample %.2f%s  (best mAP@class %.2f at epoch %d, %s weights)",
            epoch,
            self.cfg.trainer.epochs,
            figures["mAP_class"],
            figures["mAP_sample"],
            ema_note,
            self.best["mAP_class"],
            self.best["epoch"],
            self.best["weights"],
        )
        return is_best

    # ------------------------------------------------------------------ outputs
    def _log_scalars(self, prefix: str, figures: dict[str, Any], step: int) -> None:
        if self.writer is None:
            return
        for key, value in figures.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def save(self, epoch: int, step: int, is_best: bool) -> None:
        """Checkpoint after ``step`` steps of epoch ``epoch`` (step 0: the epoch is complete), on rank 0.

        RNG states of every rank are gathered first, so each rank resumes its own random streams.
        """
        rng_states = [rng_state()]
        if self.dist.distributed:
            rng_states = [None] * self.dist.world_size
            torch.distributed.all_gather_object(rng_states, rng_state())
        if self.dist.is_main:
            state = {
                "model": self.model.state_dict(),
                "ema": None if self.ema is None else self.ema.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "epoch": epoch,
                "step": step,
                "epoch_partial": self.epoch_partial if step else {},
                "history": self.history,
                "best": self.best,
                "last_figures": self.last_figures,
                "counts": self.counts,
                "wall_time_s": self.wall_time_s,
                "rng": rng_states,
                "classes": self.classes,
                "preprocess": self.preprocess,
                "thresholds": self.thresholds,
                "config": OmegaConf.to_container(self.cfg, resolve=True),
            }
            iteration = epoch * self.iters_per_epoch + step
            save_training_checkpoint(
                state, self.run_dir / "checkpoints", iteration, self.cfg.trainer.keep_checkpoints
            )
            if is_best:
                source = self.model if self.best["weights"] == "raw" else self.ema.module
                weights = {
                    "model": source.state_dict(),
                    "weights": self.best["weights"],
                    "thresholds": self.best_thresholds,
                    **{k: state[k] for k in ("epoch", "classes", "preprocess", "config", "best")},
                }
                save_checkpoint(weights, self.run_dir / "checkpoints" / "best.pt")
        dist_utils.barrier()

    def results(self, epochs_completed: int) -> dict[str, Any]:
        figures = self.last_figures or {}
        train_labels = self.train_set.labels
        return {
            "metrics": {k: v for k, v in figures.items() if k != "per_class_ap"},
            "best": self.best,
            "per_class_ap": figures.get("per_class_ap", {}),
            "dataset": {
                "name": self.cfg.dataset.name,
                "num_classes": len(self.classes),
                "train_size": len(self.train_set),
                "val_size": len(self.val_set),
            },
            "epochs_completed": epochs_completed,
            "counts": {
                "skipped_steps": self.counts["skipped_steps"],
                "skipped_images": len(self.counts["skipped_images"]),
                "skipped_image_files": self.counts["skipped_images"][:100],
                "ignored_train_labels": int((train_labels < 0).sum()),
            },
            "history": self.history,
            "world_size": self.dist.world_size,
            "provenance": collect_provenance(
                self.cfg,
                self.dist.world_size,
                self.device,
                len(self.train_set),
                len(self.val_set),
                self.wall_time_s,
                self.history[-1]["images_per_s"] if self.history else float("nan"),
            ),
        }

    def write_results(self, epochs_completed: int) -> None:
        if self.dist.is_main:
            write_json(self.results(epochs_completed), self.run_dir / "results.json")
