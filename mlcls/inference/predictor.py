"""Labels for new images: load a checkpoint once (it carries weights, classes, model config, preprocessing,
thresholds and a text-query head's text source: no dataset config is read), then score files, folders or
globs in batches, decoded as the datasets decode them; an unreadable file is reported and skipped.
"""

from __future__ import annotations

import glob
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from mlcls.config_tree import nested_get
from mlcls.data.datasets.base import BAD_IMAGE_ERRORS
from mlcls.data.images import IMAGE_EXTENSIONS, check_aspect_ratio, read_image, to_rgb
from mlcls.data.loader import beside_the_step
from mlcls.data.pipeline.preprocess import build_eval_transform, spec_from_checkpoint
from mlcls.engine.checkpoint import load_checkpoint
from mlcls.engine.distributed import resolve_device
from mlcls.errors import ConfigError, InferenceError, first_line, plural, printable, shown
from mlcls.inference.fields import (
    check_model_fields,
    check_weights_fit,
    stored_class_embeddings,
    stored_classes,
    stored_config,
    stored_thresholds,
    stored_thresholds_split,
    stored_weights,
)
from mlcls.metrics.thresholds import select_labels
from mlcls.models import create_model
from mlcls.models.factory import TRAINING_KEYS
from mlcls.models.heads import TEXT_HEADS
from mlcls.models.heads.text_query import text_query_head
from mlcls.text import class_embeddings, encoder_from_stored

# The only function that builds a checkpoint's model (the ``_target_`` of configs/model/*.yaml).
MODEL_FACTORY = "mlcls.models.create_model"


def find_images(sources: str | Path | Sequence[str | Path]) -> list[Path]:
    """The image files named by ``sources``, each once, in the order given: a file as is, a directory's
    :data:`IMAGE_EXTENSIONS` files (recursively, sorted), a glob's matching files (sorted; ``**`` matches
    nested folders). A source that matches nothing contributes nothing."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    found: dict[Path, None] = {}
    for source in sources:
        path = Path(source).expanduser()
        if path.is_file():
            found[path] = None
        elif path.is_dir():
            for file in sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS):
                if file.is_file():
                    found[file] = None
        else:
            for match in sorted(glob.glob(str(path), recursive=True)):
                if Path(match).is_file():
                    found[Path(match)] = None
    return list(found)


@dataclass
class InferenceModel:
    """A trained model ready to score images, with what it needs to interpret them: ``thresholds`` the
    (C,) float64 calibrated per-class logit thresholds (None: none), calibrated on ``thresholds_split``
    (``"validation"`` or ``"holdout"``); ``text`` a text-query head's text record
    (:func:`mlcls.engine.checkpoint.text_record`), None for another head."""

    model: nn.Module
    classes: list[str]
    preprocess: dict[str, Any]
    thresholds: torch.Tensor | None
    config: dict[str, Any]
    checkpoint: Path
    device: torch.device
    thresholds_split: str = "validation"
    text: dict[str, Any] | None = None


def build_model(
    config: dict[str, Any], num_classes: int, class_embeddings: torch.Tensor | None = None
) -> nn.Module:
    """The network of a run's resolved ``config`` with ``num_classes`` outputs, randomly initialised (nothing
    is downloaded), built by :data:`MODEL_FACTORY` from the plain fields of ``config["model"]``: a field it
    does not take, or another ``_target_`` (a callable read from a file is never called), is refused."""
    if not isinstance(config.get("model"), dict):
        raise InferenceError("the checkpoint's config has no model section; is it an mlcls checkpoint?")
    fields = dict(config["model"])
    for key in TRAINING_KEYS:  # how training started and what it updated: the network is the same
        fields.pop(key, None)
    target = fields.pop("_target_", MODEL_FACTORY)
    if target != MODEL_FACTORY:
        raise InferenceError(
            f"the checkpoint's model._target_ is {target!r}; a checkpoint's model is built by "
            f"{MODEL_FACTORY} only (a _target_ read from a file is never called)"
        )
    built_here = {"num_classes", "head_options", "class_embeddings"}
    accepted = sorted(set(inspect.signature(create_model).parameters) - built_here)
    unknown = sorted(str(key) for key in fields if key not in accepted)
    if unknown:
        raise InferenceError(
            f"the checkpoint's model config has {', '.join(unknown)}, which {MODEL_FACTORY} does not take "
            f"(it takes {', '.join(accepted)})"
        )
    head = fields.get("head")
    if not isinstance(head, dict) or not isinstance(head.get("name"), str):
        raise InferenceError(f"the checkpoint's model.head is {shown(head)}; expected a head's config")
    # the model's fields and the head's options apart: both have a "name"
    check_model_fields({key: value for key, value in fields.items() if key != "head"})
    check_model_fields({key: value for key, value in head.items() if key != "name"})
    try:
        fixed = {"num_classes": num_classes, "pretrained": False, "checkpoint_path": None}
        return create_model(**{**fields, **fixed}, class_embeddings=class_embeddings)
    except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: sizes beyond torch's int64
        # ValueError includes ConfigError: an option the head does not take
        raise InferenceError(f"cannot build the checkpoint's model: {first_line(exc)}") from exc


def load_inference_model(
    path: str | Path, device: str | torch.device = "auto", trust: bool = False
) -> InferenceModel:
    """Load ``path`` (``last.pt`` or ``best.pt``; plain data unless ``trust``) in eval mode on ``device``
    (auto: CUDA when available), every field checked (:mod:`mlcls.inference.fields`) before any memory the
    size of the model is allocated."""
    state = load_checkpoint(path, map_location="cpu", trust=trust)
    classes = stored_classes(state, path)
    config = stored_config(state, path)
    weights = stored_weights(state, path)
    preprocess = spec_from_checkpoint(state)
    thresholds = stored_thresholds(state, len(classes), path)
    split = stored_thresholds_split(state, path)
    head_name = nested_get(config, "model", "head", "name")
    queries = stored_class_embeddings(weights, classes, head_name, path) if head_name in TEXT_HEADS else None
    with torch.device("meta"):  # shapes only: checked against the weights before any memory is taken
        skeleton = build_model(config, len(classes), queries)
    check_weights_fit(skeleton, weights, len(classes), path)
    model = build_model(config, len(classes), queries)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise InferenceError(f"{path}: weights do not fit the config's model ({first_line(exc)})") from exc
    if not isinstance(device, torch.device):
        device = resolve_device(device, "device")
    return InferenceModel(
        model=model.eval().to(device),
        classes=list(classes),
        preprocess=preprocess,
        thresholds=thresholds,
        config=config,
        checkpoint=Path(path),
        device=device,
        thresholds_split=split,
        text=state.get("text") if queries is not None else None,
    )


def use_classes(inference: InferenceModel, names: Sequence[str]) -> None:
    """Score the class ``names`` from now on instead of the checkpoint's own (``mlcls-predict classes=``):
    embedded by the checkpoint's stored text source (:func:`mlcls.text.encoder_from_stored`) as the
    text-query head's class embeddings; the calibrated thresholds, the checkpoint's classes', are dropped.
    A head with weights per class, or a checkpoint without a text source, is an :class:`InferenceError`."""
    head = text_query_head(inference.model)
    if head is None:
        name = inference.config["model"]["head"]["name"]  # checked by build_model
        raise InferenceError(
            f"{inference.checkpoint} has a {name} head without text queries: it scores its own "
            f"{plural(len(inference.classes), 'class')} only; classes= needs a checkpoint of a text-query "
            "head (model/head=mldecoder_zsl or cosine)"
        )
    if inference.text is None:
        raise InferenceError(
            f"{inference.checkpoint} holds no text source ('text'); it scores its own "
            f"{plural(len(inference.classes), 'class')} only"
        )
    try:
        embeddings = class_embeddings(encoder_from_stored(inference.text), names)
    except ConfigError as exc:
        raise InferenceError(f"{inference.checkpoint}: {exc}") from None
    try:
        head.set_class_embeddings(embeddings)
    except ValueError as exc:
        raise InferenceError(f"{inference.checkpoint}: {exc}") from None
    inference.classes, inference.thresholds = list(names), None


class ImageFiles(Dataset):
    """``(index, tensor, None)`` for a readable image, ``(index, None, reason)`` for one PIL cannot decode,
    the transform fails on, or of a shape the datasets refuse (checked from its header, before decoding)."""

    def __init__(self, paths: Sequence[Path], transform: Any) -> None:
        self.paths = list(paths)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, str | None]:
        try:
            with read_image(self.paths[index]) as img:
                check_aspect_ratio(*img.size)
                image = to_rgb(img)  # 16-bit greyscale scaled to 8 bits as in training
            return index, self.transform(image), None
        except BAD_IMAGE_ERRORS as exc:
            return index, None, f"{type(exc).__name__}: {exc}"


def _collate(
    batch: list[tuple[int, torch.Tensor | None, str | None]],
) -> tuple[torch.Tensor | None, list[int], list[tuple[int, str]]]:
    readable = [(index, image) for index, image, _ in batch if image is not None]
    images = torch.stack([image for _, image in readable]) if readable else None
    return images, [index for index, _ in readable], [(i, why) for i, image, why in batch if image is None]


@torch.no_grad()
def predict_logits(
    inference: InferenceModel, paths: Sequence[Path], batch_size: int = 32, workers: int = 0
) -> tuple[torch.Tensor, list[Path], list[tuple[Path, str]]]:
    """Logits (M, C) float32 on the CPU of the M readable images among ``paths``, those paths in order,
    and the unreadable ``(path, reason)`` pairs. The batches are made beside the forward passes
    (:func:`~mlcls.data.loader.beside_the_step`, as in evaluation); the logits stay on the device until the
    last batch, then are copied once."""
    if batch_size < 1:
        raise InferenceError(f"batch_size must be at least 1, got {batch_size}")
    device = inference.device
    loader = DataLoader(
        ImageFiles(paths, build_eval_transform(inference.preprocess)),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=_collate,
        pin_memory=device.type == "cuda",
    )

    def to_device(batch: tuple[torch.Tensor | None, list[int], list[tuple[int, str]]]) -> tuple:
        images, indices, failures = batch
        return (None if images is None else images.to(device, non_blocking=True)), indices, failures

    logits, kept, unreadable = [], [], []
    for images, indices, failures in beside_the_step(loader, to_device, device):
        unreadable += [(paths[i], reason) for i, reason in failures]
        if images is None:
            continue
        logits.append(inference.model(images).float())
        kept += [paths[i] for i in indices]
    if not logits:
        return torch.empty(0, len(inference.classes)), kept, unreadable
    return torch.cat(logits).cpu(), kept, unreadable


@dataclass(frozen=True)
class Prediction:
    """The labels of one image: ``(class name, probability)`` pairs by decreasing probability."""

    image: str
    labels: list[tuple[str, float]]

    def to_json(self) -> dict[str, Any]:
        """``{"image": path, "labels": [{"label": name, "score": probability}, ...]}``."""
        return {"image": self.image, "labels": [{"label": n, "score": round(s, 6)} for n, s in self.labels]}


def predict_images(
    inference: InferenceModel,
    paths: Sequence[Path],
    batch_size: int = 32,
    workers: int = 0,
    threshold: float | None = None,
    top_k: int | None = None,
) -> tuple[list[Prediction], list[tuple[Path, str]]]:
    """The :class:`Prediction` of every readable image of ``paths``, and the unreadable ``(path, reason)``;
    labels chosen by :func:`mlcls.metrics.thresholds.select_labels` (``top_k`` / ``threshold`` if given,
    else the calibrated thresholds, else probability 0.5), scored ``sigmoid(logit)``."""
    logits, kept, unreadable = predict_logits(inference, paths, batch_size, workers)
    chosen = select_labels(logits, inference.thresholds, threshold, top_k)
    probabilities = torch.sigmoid(logits.double())
    predictions = []
    for path, row, probs in zip(kept, chosen, probabilities, strict=True):
        columns = sorted(torch.nonzero(row).flatten().tolist(), key=lambda c: -probs[c].item())
        labels = [(inference.classes[c], probs[c].item()) for c in columns]
        predictions.append(Prediction(str(path), labels))
    return predictions, unreadable


def format_table(predictions: Sequence[Prediction], max_path_width: int = 60) -> str:
    """A plain-text table: one row per image, its labels with probabilities (``-`` when none); image paths
    and class names go through :func:`printable` (the JSON lines keep them exact)."""
    images = [printable(p.image) for p in predictions]
    width = min(max([len("image"), *(len(image) for image in images)]), max_path_width)
    rows = [f"{'image':<{width}}  labels (probability)"]
    for image, prediction in zip(images, predictions, strict=True):
        labels = "  ".join(f"{printable(name)} {score:.3f}" for name, score in prediction.labels) or "-"
        rows.append(f"{image:<{width}}  {labels}")
    return "\n".join(rows)
