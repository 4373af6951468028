"""``results.json``: the figures of a run, its dataset, counts, history and provenance."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from omegaconf import DictConfig

from mlcls import collectives
from mlcls.data.datasets.labels import label_counts
from mlcls.engine.build import RunData
from mlcls.engine.state import TrainState
from mlcls.errors import plural
from mlcls.provenance import collect_provenance

log = logging.getLogger("mlcls")


def run_results(
    cfg: DictConfig,
    state: TrainState,
    data: RunData,
    world_size: int,
    device: torch.device,
    epochs_completed: int,
    unseen: Sequence[str] = (),
) -> dict[str, Any]:
    """The content of results.json: the last evaluation's ``metrics`` on the validation split (per-class AP
    apart), with a held-out split its ``selection`` figures and ``dataset["holdout_size"]``, with ``unseen``
    classes (the trainer's zero-shot evaluation's) ``dataset["unseen_classes"]`` (``num_classes`` counts the
    trained)."""
    metrics = state.last_metrics or {}
    counts, history = state.counts, state.history
    return {
        "metrics": {k: v for k, v in metrics.items() if k != "per_class_ap"},
        "best": state.best,
        "per_class_ap": metrics.get("per_class_ap", {}),
        "dataset": {
            "name": cfg.dataset.name,
            "num_classes": len(data.classes),
            "train_size": len(data.train_set),
            "val_size": len(data.val_set),
            **({} if data.holdout_set is None else {"holdout_size": len(data.holdout_set)}),
            **({"unseen_classes": list(unseen)} if unseen else {}),
        },
        "epochs_completed": epochs_completed,
        "counts": {
            "skipped_steps": counts["skipped_steps"],
            "skipped_images": len(counts["skipped_images"]),
            "skipped_image_files": counts["skipped_images"][:100],
            "ignored_train_labels": label_counts(data.train_set).unknown,
        },
        "history": history,
        "resumes": state.resumes,
        "world_size": world_size,
        "provenance": collect_provenance(
            cfg,
            world_size,
            device,
            len(data.train_set),
            len(data.val_set),
            state.wall_time_s,
            history[-1]["images_per_s"] if history else float("nan"),
        ),
    }


def record_skipped_images(counts: dict[str, Any], datasets: Iterable[Any]) -> None:
    """Add the files any rank's ``datasets`` skipped since the last call to ``counts["skipped_images"]``."""
    mine: list[str] = []
    for dataset in datasets:
        dataset = getattr(dataset, "dataset", dataset)  # a Subset (trainer.limit_val_batches)
        if hasattr(dataset, "pop_bad_images"):
            mine.extend(dataset.pop_bad_images())
    skipped = counts["skipped_images"]
    new = sorted({p for part in collectives.all_gather_object(mine) for p in part} - set(skipped))
    if new:
        log.warning("skipped %s, e.g. %s", plural(len(new), "unreadable image"), new[0])
        skipped.extend(new)
