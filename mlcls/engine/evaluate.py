"""Evaluation: scores of every validation sample -- streamed into an output store by a single process
(:mod:`mlcls.metrics.store`, on disk above ``metrics.in_memory_gb``), gathered once on rank 0 under DDP --
then the metrics, the thresholds and their held-out F1; and the training set's predictions for a loss that
relabels it between epochs (:func:`predict_training_set`).

Zero-shot evaluation (:class:`ZeroShot`) is read here and in two modules it calls: a text-query head
scores the evaluated classes from their text embeddings
(:func:`mlcls.models.heads.text_query.scoring_classes`), and the ZSL / GZSL figures are
:func:`mlcls.metrics.zero_shot.zero_shot_metrics`, added to the figures of every evaluation
(:func:`mlcls.metrics.compute_metrics`, per-class AP included)."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from mlcls import collectives
from mlcls.engine import distributed as dist_utils
from mlcls.metrics import RowFigures, compute_metrics, store_metrics
from mlcls.metrics.store import DEFAULT_STORAGE, MemoryStore, OutputStore, Storage
from mlcls.metrics.thresholds import (
    DEFAULT_RULE,
    NEVER_PREDICTED,
    ThresholdRule,
    calibrate_store,
    calibrate_thresholds,
    check_model_scores,
    held_out_f1,
)
from mlcls.metrics.zero_shot import check_zsl_images, zero_shot_metrics
from mlcls.models.heads.text_query import scoring_classes
from mlcls.text import TextEncoder, class_embeddings

T = TypeVar("T")
log = logging.getLogger("mlcls")


def autocast_context(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """Autocast to bfloat16 (``amp="bf16"``) or float16 (``"fp16"``) on ``device``'s type; none for
    ``"none"`` (``"auto"`` is :func:`mlcls.engine.config_checks.resolve_amp`'s)."""
    if amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def scored_batches(
    model: nn.Module, loader: Iterable, device: torch.device, amp: str = "none"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The float32 logits and int8 targets (1, 0, -1) of each batch of ``loader``, on the model's device."""
    model.eval()
    for images, target in loader:
        with autocast_context(device, amp):
            logits = model(images)
        yield logits.float(), target.to(torch.int8)


def predict(
    model: nn.Module, loader: Iterable, device: torch.device, amp: str = "none"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (float32) and targets (int8: 1, 0, -1) of this process's rank part, on the CPU in its order.
    The logits stay on the device until the split ends (one copy to the host, not a wait per batch)."""
    batches = list(scored_batches(model, loader, device, amp))
    if not batches:  # a rank without rows: the dtypes the other ranks gather
        return torch.empty(0), torch.empty(0, dtype=torch.int8)
    return torch.cat([s for s, _ in batches]).cpu(), torch.cat([t for _, t in batches]).cpu()


@dataclass
class Evaluation:
    """Metrics of one set of weights on the whole validation set (equal on every rank), and the scores
    behind them (on rank 0 only, the one rank that computes from them; None elsewhere)."""

    metrics: dict[str, Any]
    scores: torch.Tensor | None  # (N, C) float32 logits, dataset order; None: in ``store`` on disk
    labels: torch.Tensor | None  # (N, C) int8 in {1, 0, -1}
    # zero-shot: the columns of the trained (seen) classes among the C evaluated; None: all are trained
    trained_columns: torch.Tensor | None = None
    store: OutputStore | None = None  # a single process's outputs (what a DiskStore keeps on disk)

    def trained_part(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(scores, labels)`` of the trained classes' columns, what thresholds are calibrated on."""
        if self.trained_columns is None or self.scores is None or self.labels is None:
            return self.scores, self.labels
        return self.scores[:, self.trained_columns], self.labels[:, self.trained_columns]

    def trained_store(self) -> OutputStore | None:
        """The outputs of :meth:`trained_part` as a store (None on a rank without them)."""
        scores, labels = self.trained_part()
        if scores is None or labels is None:
            return self.store
        return MemoryStore.of(scores, labels)


@dataclass(frozen=True)
class ZeroShot:
    """How a model trained on some of the evaluation set's classes scores all of them: ``classes`` the
    evaluated names (the validation split's), ``embeddings`` (C, T) their text embeddings, ``unseen`` bool
    (C,) those no training target held, ``trained`` int64 the columns of the trained classes, in the
    trained order, ``images`` the images the ZSL figures score (``metrics.zsl_images``,
    :data:`mlcls.metrics.zero_shot.ZSL_IMAGES`)."""

    classes: list[str]
    embeddings: torch.Tensor | None  # None: the model's own classes are the evaluated ones
    unseen: torch.Tensor
    trained: torch.Tensor
    images: str = "all"

    @classmethod
    def of(
        cls,
        trained: Sequence[str],
        evaluated: Sequence[str],
        text_cfg: Mapping[str, Any] | TextEncoder | None,
        named_unseen: Sequence[str] = (),
        images: str = "all",
    ) -> ZeroShot | None:
        """The zero-shot evaluation of ``evaluated``'s classes beyond the ``trained`` ones, embedded by
        ``text_cfg`` (a ``text`` config or an encoder), its ZSL figures on ``images``; a trained class
        missing or an unknown ``images`` is a ``ValueError``. When ``trained`` is ``evaluated``: the ZSL /
        GZSL figures of the ``named_unseen`` columns (a model trained on every class), or None."""
        check_zsl_images(images)
        if list(trained) == list(evaluated):
            named = set(named_unseen)
            unseen = torch.tensor([name in named for name in evaluated], dtype=torch.bool)
            everything = torch.arange(len(evaluated))
            return cls(list(evaluated), None, unseen, everything, images) if bool(unseen.any()) else None
        column = {name: c for c, name in enumerate(evaluated)}
        missing = [name for name in trained if name not in column]
        if missing or text_cfg is None:
            raise ValueError(
                f"the evaluation set lacks {len(missing)} trained class(es) ({', '.join(missing[:5])}) or no "
                "text config is given; expected the trained classes among the evaluated and a text source"
            )
        unseen = torch.ones(len(evaluated), dtype=torch.bool)
        trained_columns = torch.tensor([column[name] for name in trained], dtype=torch.long)
        unseen[trained_columns] = False
        embeddings = class_embeddings(text_cfg, list(evaluated))
        return cls(list(evaluated), embeddings, unseen, trained_columns, images)

    @classmethod
    def of_run(cls, cfg: Any, trained: Sequence[str], val_set: Any) -> ZeroShot | None:
        """A training run's zero-shot evaluation: with ``dataset.unseen_classes``, the validation split's
        classes beyond the ``trained`` ones, scored by their text (``text``, ``metrics.zsl_images``); else
        None."""
        if not cfg.dataset.get("unseen_classes"):
            return None
        images = (cfg.get("metrics") or {}).get("zsl_images", "all")
        return cls.of(trained, evaluated_classes(val_set), cfg.get("text"), images=images)

    @property
    def unseen_classes(self) -> list[str]:
        """The names of the :attr:`unseen` columns, in the evaluated order."""
        return [name for name, unseen in zip(self.classes, self.unseen.tolist(), strict=True) if unseen]


def evaluated_classes(dataset: Any) -> list[str]:
    """The class names of an evaluation set (a dataset, or a ``Subset`` of one)."""
    return list(getattr(dataset, "dataset", dataset).classes)


def headline(metrics: dict[str, Any]) -> dict[str, float]:
    """The mAP@class and mAP@sample of ``metrics`` (what ``history``, ``best`` and a selection record)."""
    return {key: metrics[key] for key in ("mAP_class", "mAP_sample")}


def on_main_for_all(work: Callable[[], T]) -> T:
    """``work()`` on rank 0, its (small) result broadcast to every rank; if it raises, every rank raises."""
    return collectives.broadcast_object(dist_utils.on_main(work, collectives.rank() == 0))


@torch.no_grad()
def predict_training_set(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, ...]], steps: int, amp: str = "none"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sample indices (int64 (n,)), sigmoid probabilities (float32 (n, C)) and targets (int8 (n, C))
    of the first ``steps`` batches ``(images, targets, indices)``, every rank's in rank order on the
    device (n = steps x global batch), identical on every rank; ``model`` runs as in :func:`evaluate`."""
    collectives.broadcast_buffers(model)
    model.eval()
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    with dist_utils.all_or_none():
        for images, targets, indices in itertools.islice(batches, steps):
            with autocast_context(images.device, amp):
                logits = model(images)
            rows.append((indices.long(), torch.sigmoid(logits.float()), targets.to(torch.int8)))
    indices, probabilities, targets = (torch.cat(column) for column in zip(*rows, strict=True))
    if collectives.initialized():
        indices, probabilities, targets = map(collectives.all_gather_rows, (indices, probabilities, targets))
    return indices, probabilities, targets


def evaluate(
    model: nn.Module,
    loader: Any,
    device: torch.device,
    classes: list[str],
    amp: str = "none",
    zero_shot: ZeroShot | None = None,
    storage: Storage = DEFAULT_STORAGE,
) -> Evaluation:
    """``model`` on the whole dataset behind ``loader``, each sample scored once; with ``zero_shot`` every
    class of :attr:`ZeroShot.classes`, the metrics with ZSL and GZSL.

    A single process streams the outputs batch by batch into a store (``storage``: in memory, or on disk
    above its size) and computes every figure from it, in memory bounded by a block, not N x C
    (:mod:`mlcls.metrics.store`). Under DDP (and for zero-shot figures) only rank 0 holds the whole set and
    computes the metrics (labels in int8: 0.4 GB instead of 1.6 GB at Open Images' 41,620 x 9,605). Rank
    0's BatchNorm buffers, the checkpointed ones, are broadcast first (under DDP each rank's drift during an
    epoch): every part is scored by exactly the saved model. A rank that fails on its part ends every rank
    instead of leaving them waiting in the gather.
    """
    collectives.broadcast_buffers(model)
    embeddings = None if zero_shot is None else zero_shot.embeddings  # None: the model's own classes
    switched = contextlib.nullcontext() if embeddings is None else scoring_classes(model, embeddings)
    if zero_shot is None and not collectives.initialized():
        rows = RowFigures(len(loader.dataset))
        store = storage.open(len(loader.dataset), len(classes), rows, check_model_scores)
        with dist_utils.all_or_none():
            for scores, labels in scored_batches(model, loader, device, amp):
                store.append(scores, labels)
        return measure_store(store.finish(), rows, classes)
    with dist_utils.all_or_none(), switched:
        scores, labels = predict(model, loader, device, amp)
    if zero_shot is None:
        return measure_rank_parts(scores, labels, len(loader.dataset), classes)
    evaluation = measure_rank_parts(
        scores, labels, len(loader.dataset), zero_shot.classes, zero_shot.unseen, zero_shot.images
    )
    evaluation.trained_columns = zero_shot.trained
    return evaluation


def measure_store(store: OutputStore, rows: RowFigures, classes: list[str]) -> Evaluation:
    """The evaluation of a single process's finished ``store``, whose rows ``rows`` has seen."""
    metrics = store_metrics(store, rows, classes)
    if isinstance(store, MemoryStore):
        return Evaluation(metrics, store.scores, store.labels, store=store)
    return Evaluation(metrics, None, None, store=store)


def measure_rank_parts(
    scores: torch.Tensor,
    labels: torch.Tensor,
    total: int,
    classes: list[str],
    unseen: torch.Tensor | None = None,
    zsl_images: str = "all",
) -> Evaluation:
    """The rest of :func:`evaluate`: this rank's logits (n_r, C) and int8 labels of ``total`` samples
    gathered on rank 0, whose metrics (with ``unseen``, bool (C,): ZSL on ``zsl_images`` and GZSL too)
    every rank returns."""
    scores = collectives.gather_rank_parts(scores, total, dst=0)
    labels = collectives.gather_rank_parts(labels, total, dst=0)

    def figures() -> dict[str, Any]:
        checked = check_model_scores(scores)
        metrics = compute_metrics(checked, labels, classes)
        if unseen is not None:
            metrics.update(zero_shot_metrics(checked, labels, unseen, zsl_images))
        return metrics

    return Evaluation(on_main_for_all(figures), scores, labels)


def thresholds_split(dataset_cfg: Any, held_out: bool) -> str:
    """Where a run calibrates its thresholds: ``"holdout"`` when its held-out share shows the dataset's own
    labels (not fitted on the split the run reports), else ``"validation"`` (single-positive or partial
    labels have too few known negatives to place a threshold)."""
    if not held_out:
        return "validation"
    shows_own = (
        dataset_cfg.get("val_labels", "clean") == "clean" or dataset_cfg.get("observed", "all") == "all"
    )
    return "holdout" if shows_own else "validation"


def calibrate_on_main(
    evaluation: Evaluation,
    classes: list[str],
    split: str = "validation",
    rule: ThresholdRule = DEFAULT_RULE,
) -> torch.Tensor:
    """The per-class logit thresholds of ``rule`` (float64 (C,), :data:`NEVER_PREDICTED` without a
    positive) of ``evaluation``'s trained part, computed on rank 0 and equal on every rank."""
    scores, labels = evaluation.trained_part()
    if scores is None and evaluation.store is not None:  # a single process's outputs on disk
        return calibrate_store(evaluation.store, NEVER_PREDICTED, classes, split, rule)
    return on_main_for_all(
        lambda: calibrate_thresholds(
            scores, labels, no_positive=NEVER_PREDICTED, classes=classes, split=split, rule=rule
        )
    )


def held_out_on_main(evaluation: Evaluation, rule: ThresholdRule = DEFAULT_RULE) -> dict[str, Any] | None:
    """:func:`held_out_f1` of ``evaluation``'s trained part on rank 0, equal on every rank, and logged:
    the held-out F1 of ``rule``'s per-class thresholds beside one global threshold's; None for a set of
    fewer than 2 samples, which cannot be halved."""

    def figures() -> dict[str, Any] | None:
        store = evaluation.trained_store()
        assert store is not None  # rank 0 holds the outputs
        return held_out_f1(store, rule) if store.n_rows >= 2 else None

    result = on_main_for_all(figures)
    if result is not None:
        log.info(
            "thresholds (%s, min_positives %d): F1 on the half of the split they were not calibrated on, "
            "mean over classes %.2f per class vs %.2f one global threshold (OF1 %.2f vs %.2f)",
            "max F1" if rule.rule == "f1" else f"precision >= {rule.precision}",
            rule.min_positives,
            result["per_class"]["F1_mean"],
            result["global"]["F1_mean"],
            result["per_class"]["OF1"],
            result["global"]["OF1"],
        )
    return result
