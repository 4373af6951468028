"""The training loop: ``Trainer(cfg).fit()`` trains the run :func:`build_run` builds, evaluates and saves.

A run's calls, top-down in this file::

    fit -> train_one_epoch -> train_step          (each step of each epoch)
        -> relabel_training_set                   (after an epoch, for a loss that asks: EM's APL)
        -> select_best -> measure -> evaluate      (every trainer.eval_every epochs, and after the last)
        -> Checkpointer.save                      (after each epoch; mid-epoch on a stop signal)

Where training stands is ``state.epoch`` (complete epochs) and ``state.step`` (steps of the next one); a
stop signal writes a checkpoint there and raises :class:`Preempted`, and ``trainer.resume=auto`` continues.
The training step reads nothing back from the device: the loss and the non-finite guard are copied to the
host every ``trainer.log_every`` steps and read one log period later (:class:`LaggedRead`), so that no
read waits for the steps queued since; the stop flag travels on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from tqdm import tqdm

from mlcls.collectives import all_reduce_sum
from mlcls.data.loader import DevicePrefetcher
from mlcls.engine import distributed as dist_utils
from mlcls.engine.build import Run, build_run
from mlcls.engine.evaluate import (
    Evaluation,
    ZeroShot,
    autocast_context,
    calibrate_on_main,
    evaluate,
    headline,
    held_out_on_main,
    predict_training_set,
    thresholds_split,
)
from mlcls.engine.guards import NonFiniteCounter, NonFiniteError, gradient_norm, step_if_finite
from mlcls.engine.optim import group_lrs
from mlcls.engine.results import record_skipped_images, run_results
from mlcls.engine.rundir import close_run_dir
from mlcls.engine.state import EpochProgress
from mlcls.errors import plural
from mlcls.io import write_json
from mlcls.metrics.store import Storage
from mlcls.metrics.thresholds import ThresholdRule
from mlcls.models.factory import backbone_in_eval

log = logging.getLogger("mlcls")
RUN_LINE = "run dir %s | %d train / %d val samples, %d classes | %s on %s x%d | batch %d (%d per process)"

EXIT_PREEMPTED = 75

__all__ = ["EXIT_PREEMPTED", "Evaluation", "NonFiniteError", "Preempted", "Trainer"]


def selection_score(record: dict[str, Any]) -> float:
    """The mAP@class that selects the best epoch: the held-out split's when there is one, else its own."""
    return record.get("selection", record)["mAP_class"]


class Preempted(Exception):
    """Training stopped on a signal after writing a checkpoint; relaunch to resume."""

    def __init__(self, message: str, signum: int | None = None) -> None:
        super().__init__(message)
        self.signum = signum


class LaggedRead:
    """Device values read one call later: :meth:`swap` starts copying a tensor to the host (into pinned
    memory, an event after it, on CUDA; nothing waits) and returns the values of the previous call, whose
    copy has long finished; :meth:`flush` returns the last ones (waiting for their copy)."""

    def __init__(self) -> None:
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None, Any] | None = None

    def swap(self, values: torch.Tensor, context: Any) -> tuple[list[float], Any] | None:
        """Start copying ``values`` (kept with ``context``); the previous ``(values as floats, context)``."""
        previous = self.flush()
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.current_stream(values.device).record_event() if values.is_cuda else None
        self._pending = (host, event, context)
        return previous

    def flush(self) -> tuple[list[float], Any] | None:
        """The pending ``(values, context)``, None when there is none."""
        if self._pending is None:
            return None
        host, event, context = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        return host.tolist(), context


class Trainer:
    """Trains a :class:`Run` with :meth:`fit`; ``Trainer(cfg)`` builds it first (:func:`build_run`), in
    ``run_dir`` when given, else in Hydra's job directory (``hydra.run.dir``)."""

    def __init__(self, run: Run | DictConfig, run_dir: str | Path | None = None) -> None:
        if isinstance(run, DictConfig):
            run = build_run(run, run_dir)
        self.cfg, self.dist, self.device, self.run_dir = run.cfg, run.dist, run.dist.device, run.run_dir
        self.amp, self.eval_amp, self.channels_last = run.amp, run.eval_amp, run.channels_last
        self.data, self.classes, self.iters_per_epoch = run.data, run.data.classes, run.data.iters_per_epoch
        self.model, self.ddp_model, self.ema, self.criterion = (
            run.model,
            run.ddp_model,
            run.ema,
            run.criterion,
        )
        self.optimizer, self.scheduler, self.scaler = run.optimizer, run.scheduler, run.scaler
        self.device_stage, self.state, self.run_log = run.device_stage, run.state, run.run_log
        self.checkpointer = run.checkpointer
        self._nonfinite = NonFiniteCounter(self.device, self.cfg.trainer.max_nonfinite)
        self._log_reads = LaggedRead()
        self.signals = dist_utils.StopSignals(self.dist.distributed)
        self.val_outputs: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
        self.best_thresholds: torch.Tensor | None = None
        self.thresholds_split = thresholds_split(self.cfg.dataset, self.data.holdout_loader is not None)
        self.storage = Storage.of(self.cfg.get("metrics"))  # metrics.in_memory_gb, metrics.scratch_dir
        self.threshold_rule = ThresholdRule.of(self.cfg.get("thresholds"))  # the config group thresholds
        self.zero_shot = ZeroShot.of_run(self.cfg, self.classes, run.data.val_set)  # dataset.unseen_classes
        # Called with the trainer on rank 0 once the last epoch is recorded (the CLI adds the plots): the
        # engine knows nothing of what reports a run.
        self.on_finish: list[Callable[[Trainer], None]] = []

    @property
    def train_loader(self):
        return self.data.train_loader

    # ------------------------------------------------------------------ training
    def fit(self) -> dict[str, Any]:
        """Train from ``state.epoch`` (and ``state.step``) to ``trainer.epochs``; return results.json's."""
        tcfg = self.cfg.trainer
        sizes = (len(self.data.train_set), len(self.data.val_set), len(self.classes))
        model = (self.cfg.model.name, self.device.type, self.dist.world_size)
        log.info(RUN_LINE, self.run_dir, *sizes, *model, tcfg.batch_size, self.data.local_batch)
        try:
            with self.signals:
                for epoch in range(self.state.epoch, tcfg.epochs):
                    record: dict[str, Any] = {"epoch": epoch + 1, **self.train_one_epoch(epoch)}
                    self.state.epoch, self.state.step = epoch + 1, 0  # epoch + 1 epochs complete
                    self.relabel_training_set(epoch)
                    is_best = False
                    if (epoch + 1) % tcfg.eval_every == 0 or epoch + 1 == tcfg.epochs:
                        is_best = self.select_best(epoch + 1)
                        metrics = self.state.last_metrics
                        record.update(headline(metrics))
                        if "selection" in metrics:
                            record["selection"] = metrics["selection"]
                    datasets = (self.data.train_set, self.data.val_set, self.data.holdout_set)
                    record_skipped_images(self.state.counts, [d for d in datasets if d is not None])
                    self.state.history.append(record)
                    self.save(is_best)
                    if self.state.last_metrics is not None:
                        self.write_results(epoch + 1)
                    if epoch + 1 < tcfg.epochs and self.signals.agree_now():
                        self._stop()
                for finish in self.on_finish:
                    dist_utils.on_main(partial(finish, self), self.dist.is_main)
        except Preempted:
            # A handler installed before ours (submitit's on SLURM) gets the signal too, once the checkpoint
            # exists: it requeues the job. Without one, the CLI exits with EXIT_PREEMPTED.
            self.signals.hand_over()
            raise
        finally:
            self.run_log.close()
            close_run_dir(self.run_dir, self.dist.is_main)
        return self.results(tcfg.epochs)

    def _stop(self) -> None:
        """Raise :class:`Preempted` naming where training stands, as the checkpoint just written holds it."""
        epoch, step = self.state.epoch, self.state.step
        where = f"epoch {epoch + 1}, step {step}" if step else f"the end of epoch {epoch}"
        raise Preempted(
            f"stopped by a signal at {where}; checkpoint in {self.run_dir / 'checkpoints'}; relaunch with "
            "trainer.resume=auto to continue",
            self.signals.received,
        )

    def train_one_epoch(self, epoch: int) -> dict[str, float]:
        """Train epoch ``epoch`` (0-based) from ``state.step`` when resumed within it; return its mean loss,
        images/s and seconds."""
        tcfg = self.cfg.trainer
        self.ddp_model.train()
        if self.cfg.model.get("freeze_backbone"):
            backbone_in_eval(self.model)
        sampler = self.train_loader.sampler
        sampler.set_epoch(epoch)
        # a loss whose terms change with the epoch (ll, splc), wrapped or not
        for module in self.loss_modules():
            if hasattr(module, "set_epoch"):
                module.set_epoch(epoch)
        first_step = self.state.step if epoch == self.state.epoch else 0
        if first_step:
            sampler.set_start(first_step * self.data.local_batch)
        progress = self.state.progress_of(self.dist.rank) if first_step else EpochProgress()
        loss_sum = torch.tensor(progress.loss_sum, device=self.device)
        skipped_steps = torch.tensor(progress.skipped_steps, device=self.device)
        seen, elapsed = progress.seen, progress.time_s
        bar = tqdm(
            total=self.iters_per_epoch,
            initial=first_step,
            desc=f"epoch {epoch + 1}/{tcfg.epochs}",
            disable=not (self.dist.is_main and sys.stdout.isatty()),
        )
        start = time.perf_counter()
        # Batches arrive on the device, finished by a thread beside this loop (closed with it: no thread
        # is left behind at the epoch's end, on a stop signal or an error).
        batches = DevicePrefetcher(self.train_loader, self.device_stage)
        with contextlib.closing(iter(batches)) as finished:
            for step, (images, targets, *indices) in enumerate(finished, start=first_step):
                if step >= self.iters_per_epoch:
                    break
                loss, applied = self.train_step(images, targets, *indices)
                loss_sum += torch.where(applied, loss, 0.0)
                skipped_steps += ~applied
                seen += targets.shape[0]
                iteration = epoch * self.iters_per_epoch + step + 1
                bar.update()
                if iteration % tcfg.log_every == 0:  # copied now, read one log period later
                    values = torch.stack([loss.float(), self._nonfinite.take_longest().float()])
                    context = (epoch, step, iteration, group_lrs(self.optimizer))
                    self._log(self._log_reads.swap(values, context), bar)
                if self.signals.poll(step + 1):
                    self.state.epoch, self.state.step = epoch, step + 1  # step + 1 steps of this epoch done
                    elapsed += time.perf_counter() - start
                    self._log(self._log_reads.flush(), bar)
                    progress = EpochProgress(loss_sum.item(), seen, elapsed, int(skipped_steps.item()))
                    self.state.counts["skipped_steps"] += self._nonfinite.take_skipped()
                    self.save(False, progress)
                    self._stop()
        self._log(self._log_reads.flush(), bar)
        bar.close()
        self._nonfinite.check(epoch)
        elapsed += time.perf_counter() - start
        self.state.wall_time_s += time.perf_counter() - start
        skipped = self._nonfinite.take_skipped()
        if skipped:
            log.warning(
                "epoch %d: %s with a non-finite loss or gradient skipped", epoch + 1, plural(skipped, "step")
            )
        self.state.counts["skipped_steps"] += skipped
        # the mean over the applied steps of every rank (a skipped step's loss is not finite)
        totals = all_reduce_sum(torch.stack([loss_sum, skipped_steps.to(loss_sum.dtype)])).tolist()
        applied_steps = self.iters_per_epoch * self.dist.world_size - totals[1]
        mean_loss = totals[0] / applied_steps if applied_steps else float("nan")
        images_per_s = seen * self.dist.world_size / max(elapsed, 1e-9)
        self.run_log.epoch(epoch, mean_loss, images_per_s)
        return {"loss": mean_loss, "images_per_s": images_per_s, "time_s": elapsed}

    def _log(self, read: tuple[list[float], Any] | None, bar: tqdm) -> None:
        """Log a :class:`LaggedRead`'s ``([loss, longest run of skipped steps], (epoch, step, iteration,
        learning rates))``; :class:`NonFiniteError` when that run reached ``trainer.max_nonfinite``."""
        if read is None:
            return
        (loss, longest), (epoch, step, iteration, lrs) = read
        self._nonfinite.raise_if(int(longest), epoch)
        self.run_log.step(epoch, step, iteration, loss, lrs, bar)

    def train_step(
        self, images: torch.Tensor, targets: torch.Tensor, *indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimisation step (``indices``: for a loss with a row per training sample); return the
        detached loss and whether the update was applied, as device tensors.

        A non-finite gradient norm (the same on every rank after DDP's all-reduce) skips the step on the
        device (:func:`step_if_finite`): parameters, optimizer state and EMA stay; the schedule advances.
        """
        with autocast_context(self.device, self.amp):
            logits = self.ddp_model(images)
        loss = self.criterion(logits.float(), targets, *indices)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        if self.cfg.trainer.grad_clip:
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        else:  # the norm alone (clip_grad_norm_ would also rescale every gradient by 1)
            grad_norm = gradient_norm(self.model.parameters())
        applied = torch.isfinite(grad_norm)
        step_if_finite(self.optimizer, applied)
        self.scaler.update()  # fp16: backs off after an inf/NaN gradient, grows after a run of finite ones
        if self.ema is not None:
            self.ema.update(self.model, applied)
        self._nonfinite.record(applied)
        self.scheduler.step()  # optimizer.step() ran (skipped on the device or not): torch does not warn
        return loss.detach(), applied

    def loss_modules(self) -> list[Any]:
        """The criterion and its submodules (a wrapped loss included); a plain callable alone."""
        return list(self.criterion.modules()) if isinstance(self.criterion, nn.Module) else [self.criterion]

    def relabel_training_set(self, epoch: int) -> None:
        """After epoch ``epoch`` (0-based), for a loss that asks (``wants_train_predictions``, EM's APL):
        score the whole training set with the raw weights and hand the predictions to its ``pseudo_label``."""
        relabelling = [
            module
            for module in self.loss_modules()
            if hasattr(module, "wants_train_predictions") and module.wants_train_predictions(epoch + 1)
        ]
        if not relabelling:
            return
        self.train_loader.sampler.set_epoch(epoch)
        batches = DevicePrefetcher(self.train_loader, self.device_stage)
        start = time.perf_counter()
        predictions = predict_training_set(self.model, batches, self.iters_per_epoch, self.amp)
        added = sum(int(module.pseudo_label(*predictions).item()) for module in relabelling)
        log.info(
            "epoch %d: %s after scoring %d training images in %.1f s",
            epoch + 1,
            plural(added, "new pseudo-label"),
            len(predictions[0]),
            time.perf_counter() - start,
        )

    # ------------------------------------------------------------------ evaluation
    def measure(self, model: nn.Module | None = None, loader: Any = None) -> Evaluation:
        """``model`` (default: the raw weights) on ``loader``'s set (default: the validation set, every
        class of it under ``dataset.unseen_classes``)."""
        model = self.model if model is None else model
        zero_shot = self.zero_shot if loader is None else None  # the held-out split has the seen classes
        loader = self.data.val_loader if loader is None else loader
        args = (self.device, self.classes, self.eval_amp, zero_shot, self.storage)
        return evaluate(model, loader, *args)

    def select_best(self, epoch: int) -> bool:
        """Evaluate the raw (and EMA) weights on the validation split and the held-out one; log them, update
        ``best`` (the highest :func:`selection_score`); True for a new best epoch. Thresholds are calibrated
        for the raw weights (last.pt) and for new best ones, on the split :func:`thresholds_split` names."""
        weights = {"raw": self.model} | ({} if self.ema is None else {"ema": self.ema.module})
        evaluations = {name: self.measure(model) for name, model in weights.items()}
        held_out = self.data.holdout_loader is not None
        selections = {}
        if held_out:
            selections = {name: self.measure(m, self.data.holdout_loader) for name, m in weights.items()}
            for name, selection in selections.items():
                evaluations[name].metrics["selection"] = headline(selection.metrics)
        split = self.thresholds_split
        calibration = selections if split == "holdout" else evaluations
        metrics = evaluations["raw"].metrics
        if "ema" in evaluations:
            metrics["ema"] = evaluations["ema"].metrics
        top_weights = max(evaluations, key=lambda name: selection_score(evaluations[name].metrics))
        best = self.state.best
        is_best = best is None or selection_score(evaluations[top_weights].metrics) > selection_score(best)
        raw, top = evaluations["raw"], evaluations[top_weights]
        self.val_outputs = raw.trained_part()  # for on_finish: on rank 0, (None, None) elsewhere
        # last.pt's raw weights, then best.pt's; the rule's F1 on data it was not calibrated on
        rule = self.threshold_rule
        self.state.thresholds = calibrate_on_main(calibration["raw"], self.classes, split, rule)
        if (threshold_figures := held_out_on_main(calibration["raw"], rule)) is not None:
            metrics["thresholds"] = threshold_figures
        if is_best:
            self.best_thresholds = (
                self.state.thresholds
                if top_weights == "raw"
                else calibrate_on_main(calibration[top_weights], self.classes, split, rule)
            )
            self.state.best = {
                "epoch": epoch,
                **headline(top.metrics),
                "weights": top_weights,  # "raw" or "ema": which weights best.pt holds
            }
            if held_out:
                self.state.best.update(selected_on="holdout", selection=top.metrics["selection"])
        self.state.last_metrics = metrics
        self.run_log.evaluation(epoch, metrics, self.state.best)
        return is_best

    # ------------------------------------------------------------------ outputs
    def save(self, is_best: bool, progress: EpochProgress | None = None) -> None:
        """Checkpoint where training stands (see :meth:`Checkpointer.save`), ``best.pt`` when ``is_best``."""
        self.checkpointer.save(is_best, progress, self.best_thresholds, self.thresholds_split)

    def results(self, epochs_completed: int) -> dict[str, Any]:
        """What results.json holds after ``epochs_completed`` epochs (see :func:`run_results`)."""
        unseen = [] if self.zero_shot is None else self.zero_shot.unseen_classes
        return run_results(
            self.cfg, self.state, self.data, self.dist.world_size, self.device, epochs_completed, unseen
        )

    def write_results(self, epochs_completed: int) -> None:
        results = self.results(epochs_completed)
        dist_utils.on_main(lambda: write_json(results, self.run_dir / "results.json"), self.dist.is_main)
