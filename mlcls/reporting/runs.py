"""Finished runs as the paper tables see them: where a run is, what it was, what it scored, and how it
departs from the paper's protocol. A run is placed by its resolved config only, never by its directory name.
Buckets are counted per batch, ``k = trainer.batch_size / M`` (M: rows of the logit matrix,
:func:`mlcls.losses.spec.effective_bucket_size`): the paper's M = 128 at batch 512 is k = 4, on 4 GPUs or one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlcls import errors
from mlcls.config_tree import nested_get
from mlcls.losses.spec import effective_bucket_size, loss_name
from mlcls.reporting.paper import ReportError, load_paper
from mlcls.reporting.run_files import (
    config_groups,
    error_text,
    find_run_dirs,
    is_float_number,
    read_run,
    yaml_text,
)

METRICS = {"mAP_class": "mAP@class", "mAP_sample": "mAP@sample"}
# The ImageNet weights of each Table 7 backbone (timm names): the torchvision weights where timm has them;
# timm has no torchvision V1 RegNetY-32GF, so its pycls (original RegNet) weights stand for them.
PAPER_WEIGHTS = {
    "resnet50": "resnet50.tv_in1k",
    "resnext50_32x4d": "resnext50_32x4d.tv_in1k",
    "densenet169": "densenet169.tv_in1k",
    "regnety_320": "regnety_320.pycls_in1k",
}
# Config groups checked by the name of what they build (the paper's SGD, cosine schedule).
NAMED_GROUPS = ("optim", "sched")


@dataclass(frozen=True)
class RunRecord:
    """One finished (or partly finished) run: where it is, what it was, what it scored."""

    path: Path
    attributes: dict[str, Any]
    metrics: dict[str, float]
    deviations: tuple[str, ...]


def run_attributes(config: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """The facts that place a run in a table, from its resolved config: ``dataset``, ``backbone``
    (:func:`architecture`), ``loss`` (:func:`mlcls.losses.spec.loss_name`), ``loss.<key>`` for every scalar
    loss setting, and ``buckets`` (per batch, ``trainer.batch_size / M``) for the losses that have them."""
    loss = config["loss"]
    batch_size = int(config["trainer"]["batch_size"])
    attributes: dict[str, Any] = {
        "dataset": config["dataset"]["name"],
        "backbone": architecture(config),
        "loss": loss_name(loss),
    }
    for key, value in loss.items():
        if key not in ("_target_", "name", "bucket_size", "gather") and not isinstance(value, (dict, list)):
            attributes[f"loss.{key}"] = value
    rows = effective_bucket_size(loss, batch_size, world_size)
    if rows is not None:
        attributes["buckets"] = batch_size / rows
    return attributes


def architecture(config: Mapping[str, Any]) -> str:
    """The timm architecture of a run: ``model.name`` without its weights tag (``resnet50.tv_in1k``)."""
    return str(config["model"]["name"]).split(".")[0]


def built_name(group: Mapping[str, Any]) -> str | None:
    """Short name of what a config group builds: ``torch.optim.SGD`` -> ``sgd`` (the last part of its
    ``_target_``, lower case); configs of older runs name it with a ``name`` key, used when present."""
    if group.get("name"):
        return str(group["name"])
    target = group.get("_target_")
    return None if not target else str(target).rsplit(".", 1)[-1].lower()


def same_setting(ours: Any, wanted: Any) -> bool:
    """Equality with a float tolerance (0.01 and 1e-2, 4 and 4.0 are the same setting)."""
    if errors.is_number(wanted):
        return errors.is_number(ours) and math.isclose(ours, wanted, rel_tol=1e-6, abs_tol=1e-12)
    return ours == wanted


def matches(attributes: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """True when the run attributes hold every wanted value."""
    return all(key in attributes and same_setting(attributes[key], value) for key, value in wanted.items())


def protocol_checks() -> dict[str, Any]:
    """Config keys and the values the paper's protocol (Sec. 4.1) gives them; ``optim`` and ``sched`` are
    checked by the name of what they build (:func:`built_name`)."""
    protocol = load_paper()["protocol"]
    optimizer = protocol["optimizer"]
    return {
        "trainer.epochs": protocol["epochs"],
        "trainer.batch_size": protocol["batch_size"],
        "optim": optimizer["name"],
        "optim.lr_head": protocol["lr"]["head"],
        "optim.lr_backbone": protocol["lr"]["backbone"],
        "optim.weight_decay": optimizer["weight_decay"],
        "optim.momentum": optimizer["momentum"],
        "optim.nesterov": optimizer["nesterov"],
        "optim.norm_weight_decay": None,  # null: the same weight decay on every parameter
        "optim.bias_weight_decay": None,
        "sched": "cosine",
        "sched.warmup_epochs": 0,
        "sched.min_lr_ratio": 0.0,
        "dataset.image_size": protocol["image_size"]["train"],
        "dataset.transform": "paper",
        "trainer.limit_train_batches": None,
        "trainer.limit_val_batches": None,
        "trainer.grad_clip": None,
        "trainer.ema_decay": None,
        "trainer.eval_amp": "none",  # the authors evaluate in float32
    }


def _follows(config: Mapping[str, Any], key: str, wanted: Any) -> tuple[bool, Any]:
    """Whether ``config`` holds the protocol's value at ``key``, and the value it holds; a group of
    :data:`NAMED_GROUPS` follows when one ``_``-separated part of its built name begins with the paper's
    (``sgd``; ``cosine`` for ``cosine``, ``warmup_cosine`` or ``CosineAnnealingLR``)."""
    if key in NAMED_GROUPS:
        name = built_name(config.get(key) or {})
        return name is not None and any(part.startswith(wanted) for part in name.split("_")), name
    ours = nested_get(config, *key.split("."))
    if key == "sched.warmup_epochs" and ours is None:  # null: the head's own default
        epochs = nested_get(config, "model", "head", "warmup_epochs")
        return same_setting(epochs or 0, wanted), f"null (model.head.warmup_epochs={epochs})"
    return same_setting(ours, wanted), ours


def protocol_deviations(
    config: Mapping[str, Any],
    results: Mapping[str, Any],
    checks: Mapping[str, Any],
    reference: str = "paper",
) -> list[str]:
    """How a run departs from a protocol, one short phrase each (empty: it follows it): every key of
    ``checks`` whose value ``config`` does not hold (:func:`_follows`), named beside the ``reference``'s
    value, and the epochs it left unfinished."""
    deviations = []
    for key, wanted in checks.items():
        follows, ours = _follows(config, key, wanted)
        if not follows:
            deviations.append(f"{key}={yaml_text(ours)} ({reference} {yaml_text(wanted)})")
    left = epochs_left(config, results)
    if left:
        deviations.append(f"unfinished: {left[0]} of {left[1]} epochs")
    return deviations


def epochs_left(config: Mapping[str, Any], results: Mapping[str, Any]) -> tuple[Any, Any] | None:
    """``(epochs completed, trainer.epochs)`` of a run that stopped before its last epoch, else None."""
    completed, planned = results.get("epochs_completed"), nested_get(config, "trainer", "epochs")
    return (
        (completed, planned)
        if is_float_number(completed) and is_float_number(planned) and completed < planned
        else None
    )


def paper_deviations(
    config: Mapping[str, Any], results: Mapping[str, Any], attributes: Mapping[str, Any] | None = None
) -> list[str]:
    """How a run departs from the paper's protocol, one short phrase each (empty: it follows it):
    :func:`protocol_checks`, mixed precision, and the ImageNet weights and Table 6 sizes of the backbone
    and dataset the run counts as: those of ``attributes`` (renamed by stand-ins), else the config's."""
    dataset = (attributes or {}).get("dataset", config["dataset"]["name"])
    backbone = (attributes or {}).get("backbone", architecture(config))
    deviations = protocol_deviations(config, results, protocol_checks())
    amp = nested_get(config, "trainer", "amp")
    device = nested_get(results, "provenance", "device", "type")
    if amp == "none" or (amp == "auto" and device not in (None, "cuda")):  # auto: float32 off CUDA
        deviations.append("no mixed precision (paper AMP)")
    model = config["model"]
    weights = PAPER_WEIGHTS.get(backbone)
    if model.get("checkpoint_path"):
        deviations.append(f"weights from {model['checkpoint_path']} (unverified)")
    elif not model.get("pretrained"):
        deviations.append(f"not pretrained (paper {weights or 'ImageNet weights'})")
    elif weights is not None and model["name"] != weights:
        deviations.append(f"weights {model['name']} (paper {weights})")
    sizes = load_paper()["table6_datasets"].get(dataset)
    ours_sizes = results.get("dataset") or {}
    if sizes is not None:
        for ours_key, paper_key in (("train_size", "train"), ("val_size", "test")):
            if ours_key in ours_sizes and ours_sizes[ours_key] != sizes[paper_key]:
                ours_count, paper_count = ours_sizes[ours_key], sizes[paper_key]
                deviations.append(f"{paper_key} split {ours_count} samples (paper {paper_count})")
    return deviations


def metric_figures(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The :data:`METRICS` of ``metrics`` that a run has, as floats."""
    return {key: float(metrics[key]) for key in METRICS if metrics.get(key) is not None}


def collect_runs(
    paths: Iterable[Path | str],
    stand_ins: Mapping[str, str] | None = None,
    place: Callable[..., tuple[list[str], Mapping[str, Any]] | None] | None = None,
    renamed: tuple[str, ...] = ("dataset", "backbone"),
) -> list[RunRecord]:
    """Every run under ``paths`` (a run directory holding results.json, or a sweep directory above runs),
    its attributes ``renamed`` by ``stand_ins`` (``X stands in for Y``, its first deviation), as
    ``place(config, results, attributes)`` places it: its deviations and metrics (None: not a row); by
    default as the paper tables see it. :class:`ReportError` in one line for a run whose config lacks the
    groups that place it or holds values of other types, and (by default) for a path without runs."""
    stand_ins = stand_ins or {}
    runs = []
    for path in map(Path, paths):
        found = find_run_dirs(path)
        if not found and place is None:
            raise ReportError(f"{path}: no results.json in it or below")
        for run_dir in found:
            results, config = read_run(run_dir)
            if results is None:
                raise ReportError(f"{run_dir}: no results.json")
            if config is None:
                raise ReportError(
                    f"{run_dir}: results.json has no provenance.config and there is no config.yaml"
                )
            config_groups(config, run_dir, ("dataset", "model", "loss", "trainer"))
            try:  # a config of mapped groups holding a value of another type, or missing one
                processes = nested_get(results, "provenance", "world_size") or results.get("world_size")
                attributes = run_attributes(config, processes or 1)
                ours = [attributes[key] for key in renamed]
                stand_in = [
                    f"{name} stands in for {paper}" for name, paper in stand_ins.items() if name in ours
                ]
                for key in renamed:
                    attributes[key] = stand_ins.get(attributes[key], attributes[key])
                placed = (place or _paper_place)(config, results, attributes)
            except ReportError:
                raise
            except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
                raise ReportError(
                    f"{run_dir}: the run's config does not place it "
                    f"({type(exc).__name__}: {error_text(exc, run_dir)})"
                ) from None
            if placed is not None:
                deviations, metrics = placed
                runs.append(RunRecord(run_dir, attributes, metric_figures(metrics), (*stand_in, *deviations)))
    return runs


def _paper_place(
    config: Mapping[str, Any], results: Mapping[str, Any], attributes: Mapping[str, Any]
) -> tuple[list[str], Mapping[str, Any]]:
    """The run as the paper tables see it: its deviations from the paper's protocol, its last evaluation."""
    return paper_deviations(config, results, attributes), results.get("metrics") or {}
