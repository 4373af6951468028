"""The training loop: ``Trainer(cfg).fit()`` builds the run, trains, evaluates and saves.

    <run_dir>/config.yaml                resolved config
    <run_dir>/results.json               last and best figures, per-class AP, dataset facts, counts, history
    <run_dir>/checkpoints/last.pt        newest full training state (what resume=auto loads first)
    <run_dir>/checkpoints/iter_*.pt      the newest trainer.keep_checkpoints full states (fallbacks)
    <run_dir>/checkpoints/best.pt        the weights of the best mAP@class evaluation
    <run_dir>/tb/                        TensorBoard scalars

The run directory is ``trainer.output_dir``, else Hydra's ``hydra.run.dir`` (``hydra.sweep.dir``/subdir in
a multirun), chosen by rank 0 for every process.

SIGTERM or SIGUSR1 (what SLURM sends before preemption) or Ctrl-C finishes the current step, writes a
checkpoint with all ranks in step and stops with :class:`Preempted`; relaunching the same command with
``trainer.resume=auto`` continues exactly where it stopped.

The training step reads nothing back from the device: losses, skipped steps and the non-finite guard are
accumulated on the device and read every ``trainer.log_every`` steps; the stop flag travels on the CPU.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from mlcls.data.fast import AugmentedImage, DeviceStage
from mlcls.data.loader import DevicePrefetcher
from mlcls.engine import distributed as dist_utils
from mlcls.engine.build import (
    build_data,
    build_loss,
    build_model,
    build_optimization,
    classes_without_positives,
)
from mlcls.engine.checkpoint import (
    CheckpointError,
    load_checkpoint,
    resume_candidates,
    save_checkpoint,
    save_training_checkpoint,
    write_json,
)
from mlcls.engine.ema import ModelEma
from mlcls.engine.evaluate import autocast_context, predict
from mlcls.engine.optim import group_lrs
from mlcls.engine.preemption import StopSignals
from mlcls.engine.state import EpochProgress, TrainState, rng_state, seed_everything, set_rng_state
from mlcls.engine.validate import ConfigError, validate_config
from mlcls.inference import calibrate_thresholds, preprocess_spec
from mlcls.inference.thresholds import NEVER_PREDICTED
from mlcls.metrics import compute_metrics
from mlcls.metrics.gather import gather_shards
from mlcls.reporting.plots import write_plots
from mlcls.reporting.provenance import collect_provenance

log = logging.getLogger("mlcls")

EXIT_PREEMPTED = 75

__all__ = ["EXIT_PREEMPTED", "ConfigError", "Evaluation", "NonFiniteError", "Preempted", "Trainer"]


class Preempted(Exception):
    """Training stopped on a signal after writing a checkpoint; relaunch to resume."""

    def __init__(self, message: str, signum: int | None = None) -> None:
        super().__init__(message)
        self.signum = signum


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


@dataclass
class Evaluation:
    """Figures of one set of weights on the whole validation set, and the scores behind them."""

    figures: dict[str, Any]
    scores: torch.Tensor  # (N, C) logits, dataset order
    labels: torch.Tensor  # (N, C) in {1, 0, -1}


def gradient_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients together (0 without any), as ``clip_grad_norm_`` reports it."""
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


class Trainer:
    """Builds the run from ``cfg`` (the composed ``configs/train.yaml``) and trains it with :meth:`fit`."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        tcfg = cfg.trainer
        # The process group first: under SLURM the world size exists only once it is set up.
        self.dist = dist_utils.init_distributed(tcfg.device)
        validate_config(cfg, world_size=self.dist.world_size)
        self.device = self.dist.device
        self.cuda = self.device.type == "cuda"
        self.amp = tcfg.amp if self.cuda else "none"
        eval_amp = tcfg.get("eval_amp")
        self.eval_amp = (self.amp if eval_amp is None else eval_amp) if self.cuda else "none"
        self.channels_last = bool(tcfg.channels_last) and self.cuda
        self.local_batch = tcfg.batch_size // self.dist.world_size
        if not self.dist.is_main:
            log.setLevel(logging.WARNING)
        if self.cuda:
            torch.backends.cudnn.benchmark = not tcfg.deterministic
        if tcfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self._warn_protocol()
        seed_everything(tcfg.seed)

        hydra_dir = _hydra_run_dir()
        try:
            self.data = build_data(cfg, self.dist)
            self.classes = self.data.classes
            self.preprocess = preprocess_spec(cfg.dataset)  # in checkpoints: predict needs no dataset
            self.model = build_model(cfg.model, len(self.classes), self.device, self.channels_last)
            self.criterion = build_loss(cfg.loss, self.data.train_set.labels, self.device)
        except BaseException:
            _discard_if_empty(hydra_dir)  # Hydra made it at start-up; a failed check leaves nothing behind
            raise
        self.run_dir = self._resolve_run_dir(hydra_dir)
        self.iters_per_epoch = self.data.iters_per_epoch
        self.ema = ModelEma(self.model, tcfg.ema_decay, warmup=tcfg.ema_warmup) if tcfg.ema_decay else None
        self.optimizer, self.scheduler = build_optimization(cfg, self.model, self.iters_per_epoch)
        # Always enabled: with a fused optimizer the scaler skips a non-finite step on the device. Its scale
        # is dynamic for fp16 and fixed at 1 otherwise.
        self.scaler = torch.amp.GradScaler(
            self.device.type, init_scale=2.0**16 if self.amp == "fp16" else 1.0
        )
        # Copies each batch to the device and finishes the fast pipeline there (colour, lighting, normalise).
        self.device_stage = DeviceStage(self.device, self.channels_last)
        self._nonfinite = _NonFiniteCounter(self.device)
        self.signals = StopSignals(self.dist.distributed)

        self.state = TrainState()
        if not self._maybe_resume():
            seed_everything(tcfg.seed + self.dist.rank)
        self.ddp_model = (
            DistributedDataParallel(self.model, device_ids=[self.device.index] if self.cuda else None)
            if self.dist.distributed
            else self.model
        )
        if tcfg.compile:  # training forward only; self.model (checkpoints, EMA, evaluation) stays plain
            self.ddp_model = torch.compile(self.ddp_model)
        self.val_outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.best_thresholds: torch.Tensor | None = None
        self.writer = None
        if self.dist.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tb"))
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        missing = classes_without_positives(self.data.val_set, self.classes)
        if missing:
            log.warning(
                "%d of %d classes have no positive in the validation split (%s): their AP is undefined and "
                "they get no calibrated threshold",
                len(missing),
                len(self.classes),
                ", ".join(missing[:10]) + (", ..." if len(missing) > 10 else ""),
            )

    # ------------------------------------------------------------------ convenience views
    @property
    def train_set(self):
        return self.data.train_set

    @property
    def val_set(self):
        return self.data.val_set

    @property
    def train_loader(self):
        return self.data.train_loader

    @property
    def start_epoch(self) -> int:
        return self.state.epoch

    @property
    def start_step(self) -> int:
        return self.state.step

    # ------------------------------------------------------------------ set-up helpers
    def _warn_protocol(self) -> None:
        if "protocol" in self.cfg and self.dist.world_size == 1 and self.cfg.trainer.batch_size > 128:
            log.warning(
                "experiment=paper* on one process: BatchNorm normalises over all %d samples of a batch where "
                "the paper's 4 GPUs saw 128 each; for comparable figures launch "
                "torchrun --nproc_per_node=4 (docs/reproduce.md)",
                self.cfg.trainer.batch_size,
            )

    def _resolve_run_dir(self, hydra_dir: Path | None) -> Path:
        """``trainer.output_dir``, else Hydra's run (or sweep job) directory, else ``outputs/<date>/<time>``.

        Rank 0 decides for every process (each rank's Hydra resolves ``${now:...}`` on its own clock).
        """
        chosen = self.cfg.trainer.output_dir or hydra_dir or f"outputs/{datetime.now():%Y-%m-%d/%H-%M-%S}"
        run_dir = Path(dist_utils.broadcast_object(str(chosen))).absolute()
        if hydra_dir is not None and hydra_dir.absolute() != run_dir:
            _discard_if_empty(hydra_dir)
        dist_utils.on_main(
            lambda: (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True), self.dist.is_main
        )
        return run_dir

    def _maybe_resume(self) -> bool:
        """Load ``trainer.resume`` (a path, or ``auto``: the newest readable checkpoint of this run).

        Rank 0 chooses the file and every rank loads that one. With ``auto`` an unreadable checkpoint (e.g.
        truncated by a crash) is reported and the previous one tried. Returns True if a state was loaded.
        """
        resume = self.cfg.trainer.resume
        if not resume:
            return False
        path = dist_utils.on_main(lambda: self._choose_checkpoint(resume), self.dist.is_main)
        path = dist_utils.broadcast_object(path)
        if path is None:
            log.info("trainer.resume=auto: no readable checkpoint in %s, starting from scratch", self.run_dir)
            return False
        with dist_utils.all_or_none():
            state = load_checkpoint(path)
            self._load_state(state, Path(path))
        return True

    def _choose_checkpoint(self, resume: str) -> str | None:
        if resume != "auto":
            return str(resume)
        for path in resume_candidates(self.run_dir / "checkpoints"):
            try:
                load_checkpoint(path)
            except CheckpointError as exc:
                log.warning("%s; trying the previous checkpoint", exc)
                continue
            return str(path)
        return None

    def _load_state(self, state: dict[str, Any], path: Path) -> None:
        if "optimizer" not in state:
            raise CheckpointError(f"{path} holds weights only (best.pt?); resume needs last.pt or iter_*.pt")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        saved_amp = state.get("config", {}).get("trainer", {}).get("amp", self.cfg.trainer.amp)
        if saved_amp != self.cfg.trainer.amp:
            log.warning(
                "%s was trained with trainer.amp=%s; continuing with trainer.amp=%s, the loss scale starts "
                "afresh",
                path,
                saved_amp,
                self.cfg.trainer.amp,
            )
        elif state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema.load_state_dict(state["ema"])
        self.state.load_state_dict(state)
        rngs = self.state.rng
        set_rng_state(rngs[min(self.dist.rank, len(rngs) - 1)])
        where = f"epoch {self.state.epoch + 1}" + (f", step {self.state.step + 1}" if self.state.step else "")
        log.info("resumed from %s: continuing at %s", path, where)

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
        try:
            with self.signals:
                for epoch in range(self.state.epoch, tcfg.epochs):
                    record: dict[str, Any] = {"epoch": epoch + 1, **self.train_one_epoch(epoch)}
                    is_best = False
                    if (epoch + 1) % tcfg.eval_every == 0 or epoch + 1 == tcfg.epochs:
                        is_best = self.evaluate_and_select(epoch + 1)
                        record.update({k: self.state.last_figures[k] for k in ("mAP_class", "mAP_sample")})
                    self._collect_bad_images()
                    self.state.history.append(record)
                    self.save(epoch + 1, is_best=is_best)
                    if self.state.last_figures is not None:
                        self.write_results(epoch + 1)
                    if epoch + 1 < tcfg.epochs and self.signals.agree_now():
                        self._stop(epoch + 1, 0)
                if self.val_outputs is not None:
                    dist_utils.on_main(
                        lambda: write_plots(
                            self.run_dir,
                            self.state.history,
                            *self.val_outputs,
                            self.classes,
                            writer=self.writer,
                        ),
                        self.dist.is_main,
                    )
        except Preempted:
            # A handler installed before ours (submitit's on SLURM) gets the signal too, once the checkpoint
            # exists: it requeues the job. Without one, the CLI exits with EXIT_PREEMPTED.
            self.signals.hand_over()
            raise
        finally:
            if self.writer is not None:
                self.writer.close()
        return self.results(tcfg.epochs)

    def _stop(self, epoch: int, step: int) -> None:
        where = f"epoch {epoch + 1}, step {step}" if step else f"the end of epoch {epoch}"
        raise Preempted(
            f"stopped by a signal at {where}; checkpoint in {self.run_dir / 'checkpoints'}; relaunch with "
            "trainer.resume=auto to continue",
            self.signals.received,
        )

    def train_one_epoch(self, epoch: int) -> dict[str, float]:
        tcfg = self.cfg.trainer
        self.ddp_model.train()
        sampler = self.train_loader.sampler
        sampler.set_epoch(epoch)
        first_step = self.state.step if epoch == self.state.epoch else 0
        if first_step:
            sampler.set_start(first_step * self.local_batch)
        mine = self.state.progress_of(self.dist.rank) if first_step else EpochProgress()
        loss_sum = torch.tensor(mine.loss_sum, device=self.device)
        seen, elapsed = mine.seen, mine.time_s
        show_bar = self.dist.is_main and sys.stdout.isatty()
        bar = tqdm(
            total=self.iters_per_epoch,
            initial=first_step,
            desc=f"epoch {epoch + 1}/{tcfg.epochs}",
            disable=not show_bar,
        )
        start = time.perf_counter()
        # Batches arrive on the device, finished; on CUDA the next one is prepared during this step.
        batches = DevicePrefetcher(self.train_loader, self.device_stage, self.device)
        for step, (images, targets) in enumerate(batches, start=first_step):
            if step >= self.iters_per_epoch:
                break
            loss, applied = self.train_step(images, targets)
            loss_sum += torch.where(applied, loss, 0.0)
            seen += targets.shape[0]
            iteration = epoch * self.iters_per_epoch + step + 1
            bar.update()
            if iteration % tcfg.log_every == 0:  # the only reads from the device within an epoch
                self._check_nonfinite(epoch)
                self._log_step(epoch, step, iteration, loss.item(), bar if show_bar else None)
            if self.signals.poll(step + 1):
                elapsed += time.perf_counter() - start
                self._checkpoint_mid_epoch(epoch, step + 1, EpochProgress(loss_sum.item(), seen, elapsed))
                self._stop(epoch, step + 1)
        bar.close()
        self._check_nonfinite(epoch)
        elapsed += time.perf_counter() - start
        self.state.wall_time_s += time.perf_counter() - start
        skipped = self._nonfinite.take_skipped()
        if skipped:
            log.warning(
                "epoch %d: %s with a non-finite loss or gradient skipped", epoch + 1, _plural(skipped, "step")
            )
        self.state.counts["skipped_steps"] += skipped
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimisation step; returns the detached loss and whether the update was applied, both as
        device tensors (reading them would wait for the device).

        ``images``, ``targets``: a batch from :class:`DevicePrefetcher` (already on the device, finished),
        or as the loader gives it (moved and finished here).

        A step with a non-finite gradient norm (identical on every rank after DDP's all-reduce, so all
        ranks agree) is skipped by the GradScaler: parameters, optimizer state and EMA stay as they were.
        The schedule advances all the same, one value per iteration.
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
        else:  # the norm alone (clip_grad_norm_ would also rescale every gradient by 1)
            grad_norm = gradient_norm(self.model.parameters())
        applied = torch.isfinite(grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update(None if self.amp == "fp16" else 1.0)
        if self.ema is not None:
            self.ema.update(self.model, applied)
        self._nonfinite.record(applied)
        with warnings.catch_warnings():
            # a skipped first step still advances the schedule (one value per iteration); torch warns when
            # the scheduler steps before the first applied optimizer step
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`", UserWarning)
            self.scheduler.step()
        return loss.detach(), applied

    def _check_nonfinite(self, epoch: int) -> None:
        run = self._nonfinite.longest_run()
        if run >= self.cfg.trainer.max_nonfinite:
            raise NonFiniteError(
                f"{run} consecutive steps with a non-finite loss or gradient at epoch {epoch + 1}: lower the "
                "learning rate (optim.lr_head/lr_backbone), try trainer.amp=bf16 or none instead of fp16, "
                "set trainer.grad_clip, and check the labels (values 1/0/-1)"
            )

    def _log_step(self, epoch: int, step: int, iteration: int, loss: float, bar: tqdm | None) -> None:
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}")
        elif self.dist.is_main:
            log.info("epoch %d iter %d/%d loss %.4f", epoch + 1, step + 1, self.iters_per_epoch, loss)
        if self.writer is not None:
            self.writer.add_scalar("train/loss", loss, iteration)
            for part, lr in group_lrs(self.optimizer).items():
                self.writer.add_scalar(f"train/lr_{part}", lr, iteration)

    def _collect_bad_images(self) -> None:
        """Files the datasets skipped since the last call (``dataset.on_bad_image=skip``), from every rank."""
        mine: list[str] = []
        for dataset in (self.train_set, getattr(self.val_set, "dataset", self.val_set)):
            if hasattr(dataset, "pop_bad_images"):
                mine.extend(dataset.pop_bad_images())
        skipped = self.state.counts["skipped_images"]
        new = sorted({p for part in dist_utils.all_gather_object(mine) for p in part} - set(skipped))
        if new:
            log.warning("skipped %s, e.g. %s", _plural(len(new), "unreadable image"), new[0])
            skipped.extend(new)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, model: nn.Module | None = None) -> Evaluation:
        """``model`` (default: the raw weights) on the whole validation set; the figures are equal on
        every rank, each sample scored once.

        Under DDP each process's BatchNorm running statistics drift from rank 0's during the epoch (DDP
        broadcasts them only at the next forward), so rank 0's buffers, the ones checkpointed, are
        broadcast first: every shard is scored by exactly the saved model. A rank that fails on its shard
        (an unreadable image) ends every rank with its error instead of leaving them in the gather.
        """
        model = self.model if model is None else model
        if self.dist.distributed:
            for buffer in model.buffers():
                torch.distributed.broadcast(buffer, src=0)
        with dist_utils.all_or_none():
            scores, labels = predict(
                model, self.data.val_loader, self.device, self.eval_amp, self.channels_last
            )
        total = len(self.data.val_loader.dataset)
        scores, labels = gather_shards(scores, total), gather_shards(labels, total)
        return Evaluation(compute_metrics(scores, labels, self.classes), scores, labels)

    def evaluate_and_select(self, epoch: int) -> bool:
        """Evaluate the raw (and EMA) weights, log them, update ``best``; True for a new best epoch."""
        evaluations = {"raw": self.evaluate()}
        if self.ema is not None:
            evaluations["ema"] = self.evaluate(self.ema.module)
        figures = evaluations["raw"].figures
        if "ema" in evaluations:
            figures["ema"] = evaluations["ema"].figures
        weights, chosen = max(evaluations.items(), key=lambda kv: kv[1].figures["mAP_class"])
        best = self.state.best
        is_best = best is None or chosen.figures["mAP_class"] > best["mAP_class"]
        raw = evaluations["raw"]
        self.val_outputs = (raw.scores, raw.labels)
        # a class without a validation positive gets a threshold that never fires (NEVER_PREDICTED)
        calibrate = partial(calibrate_thresholds, no_positive=NEVER_PREDICTED, classes=self.classes)
        self.state.thresholds = calibrate(raw.scores, raw.labels)  # for last.pt's raw weights
        if is_best:
            self.best_thresholds = calibrate(chosen.scores, chosen.labels)
            self.state.best = best = {
                "epoch": epoch,
                "mAP_class": chosen.figures["mAP_class"],
                "mAP_sample": chosen.figures["mAP_sample"],
                "weights": weights,
            }
        self.state.last_figures = figures
        for name, evaluation in evaluations.items():
            self._log_scalars("val" if name == "raw" else "val_ema", evaluation.figures, epoch)
        ema_note = f"  EMA mAP@class {figures['ema']['mAP_class']:.2f}" if "ema" in figures else ""
        log.info(
            "epoch %d/%d  mAP@class %.2f  mAP@sample %.2f%s  (best mAP@class %.2f at epoch %d, %s weights)",
            epoch,
            self.cfg.trainer.epochs,
            figures["mAP_class"],
            figures["mAP_sample"],
            ema_note,
            best["mAP_class"],
            best["epoch"],
            best["weights"],
        )
        return is_best

    # ------------------------------------------------------------------ outputs
    def _log_scalars(self, prefix: str, figures: dict[str, Any], step: int) -> None:
        if self.writer is None:
            return
        for key, value in figures.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def _checkpoint_mid_epoch(self, epoch: int, step: int, mine: EpochProgress) -> None:
        """Checkpoint after ``step`` steps of the incomplete epoch ``epoch`` (0-based), with every rank's
        partial sums."""
        self.state.counts["skipped_steps"] += self._nonfinite.take_skipped()
        self.state.partial = dist_utils.all_gather_object(mine)
        self._write_checkpoint(epoch, step, is_best=False)

    def save(self, epochs_done: int, is_best: bool) -> None:
        """Checkpoint after ``epochs_done`` complete epochs (and ``best.pt`` when ``is_best``)."""
        self.state.partial = []
        self._write_checkpoint(epochs_done, 0, is_best)

    def _write_checkpoint(self, epoch: int, step: int, is_best: bool) -> None:
        """Write the training state on rank 0 with every rank's RNG states; every rank returns together,
        and if rank 0 fails to write, every rank raises its error."""
        self.state.epoch, self.state.step = epoch, step
        self.state.rng = dist_utils.all_gather_object(rng_state())
        dist_utils.on_main(lambda: self._write_files(is_best), self.dist.is_main)

    def _write_files(self, is_best: bool) -> None:
        state = {
            **self.state.state_dict(),
            "model": self.model.state_dict(),
            "ema": None if self.ema is None else self.ema.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "classes": self.classes,
            "preprocess": self.preprocess,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }
        iteration = self.state.epoch * self.iters_per_epoch + self.state.step
        checkpoints = self.run_dir / "checkpoints"
        save_training_checkpoint(state, checkpoints, iteration, self.cfg.trainer.keep_checkpoints)
        if is_best:
            best = self.state.best
            source = self.model if best["weights"] == "raw" else self.ema.module
            weights = {
                "model": source.state_dict(),
                "weights": best["weights"],
                "thresholds": self.best_thresholds,
                **{k: state[k] for k in ("epoch", "classes", "preprocess", "config", "best")},
            }
            save_checkpoint(weights, checkpoints / "best.pt")

    def results(self, epochs_completed: int) -> dict[str, Any]:
        figures = self.state.last_figures or {}
        counts = self.state.counts
        history = self.state.history
        return {
            "metrics": {k: v for k, v in figures.items() if k != "per_class_ap"},
            "best": self.state.best,
            "per_class_ap": figures.get("per_class_ap", {}),
            "dataset": {
                "name": self.cfg.dataset.name,
                "num_classes": len(self.classes),
                "train_size": len(self.train_set),
                "val_size": len(self.val_set),
            },
            "epochs_completed": epochs_completed,
            "counts": {
                "skipped_steps": counts["skipped_steps"],
                "skipped_images": len(counts["skipped_images"]),
                "skipped_image_files": counts["skipped_images"][:100],
                "ignored_train_labels": int((self.train_set.labels < 0).sum()),
            },
            "history": history,
            "world_size": self.dist.world_size,
            "provenance": collect_provenance(
                self.cfg,
                self.dist.world_size,
                self.device,
                len(self.train_set),
                len(self.val_set),
                self.state.wall_time_s,
                history[-1]["images_per_s"] if history else float("nan"),
            ),
        }

    def write_results(self, epochs_completed: int) -> None:
        results = self.results(epochs_completed)
        dist_utils.on_main(lambda: write_json(results, self.run_dir / "results.json"), self.dist.is_main)


class _NonFiniteCounter:
    """Skipped steps counted on the device: the current run of consecutive skips, its longest length since
    the last read, and the total since the last :meth:`take_skipped`."""

    def __init__(self, device: torch.device) -> None:
        self.run = torch.zeros((), dtype=torch.long, device=device)
        self.longest = torch.zeros_like(self.run)
        self.skipped = torch.zeros_like(self.run)

    def record(self, applied: torch.Tensor) -> None:
        skipped = (~applied).long()
        self.run.add_(skipped).mul_(skipped)
        torch.maximum(self.longest, self.run, out=self.longest)
        self.skipped.add_(skipped)

    def longest_run(self) -> int:
        """The longest run of consecutive skips since the last call (the current run included)."""
        longest = int(self.longest.item())
        self.longest.copy_(self.run)
        return longest

    def take_skipped(self) -> int:
        skipped = int(self.skipped.item())
        self.skipped.zero_()
        return skipped


def _hydra_run_dir() -> Path | None:
    """The directory Hydra made for this job (``hydra.run.dir``, or the sweep job's), if Hydra runs it."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return Path(HydraConfig.get().runtime.output_dir)


def _discard_if_empty(directory: Path | None) -> None:
    """Remove ``directory`` if nothing was written into it (a run that stopped before it began, or Hydra's
    default directory of a run that writes elsewhere), and its parents below the working directory that
    are left empty (``outputs/<date>``)."""
    if directory is None or not directory.is_dir() or any(directory.rglob("*")):
        return
    shutil.rmtree(directory, ignore_errors=True)
    cwd, parent = Path.cwd().absolute(), directory.absolute().parent
    while parent != cwd and cwd in parent.parents and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
