"""What the run report (:mod:`mlcls.reporting.report`) shows, from a run's saved validation predictions
(:class:`ValPredictions`): the per-class table, precision-recall curves, the most confident errors and the
suspected label errors.

Class ``c`` is predicted for image ``i`` when ``scores[i, c] >= thresholds[c]``; an error's *confidence* is
how far its logit lies past the threshold. Labels of -1 (unknown) are neither errors nor given. cleanlab gets
``sigmoid(score - threshold)``: 0.5 at each class's decision point whatever the loss (the two-way loss's
logits are shift-invariant, not probabilities centred on 0.5); validation images are never trained on, so
these predictions are out-of-sample, as cleanlab requires.
"""

from __future__ import annotations

import math
import os
import warnings
import zipfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlcls.data.datasets.labels import NPY_MAX_HEADER, check_npz_member, npy_header
from mlcls.io import CAPS, atomic_write, open_regular
from mlcls.metrics import average_precision
from mlcls.metrics.f1 import prediction_counts
from mlcls.reporting.paper import ReportError
from mlcls.reporting.run_files import error_text, is_float_number
from mlcls.reporting.run_table import differing_keys, flat_settings

PREDICTIONS_FILE = "val_predictions.npz"
# Columns of the score matrix handled at once when the errors are ranked (bounded memory at 9,605 classes).
COLUMN_BLOCK = 256
# Above this many (image, class) cells, or this many classes, cleanlab's filter (about 3 microseconds a cell,
# and 15 ms a class: it runs one binary filter per class) is skipped; the ranking by label quality, which is
# vectorised, still covers every image.
MAX_FILTER_CELLS = 20_000_000
MAX_FILTER_CLASSES = 1_000
# PR curves are drawn with at most this many points.
MAX_CURVE_POINTS = 200


@dataclass(frozen=True)
class ValPredictions:
    """``<run_dir>/val_predictions.npz``, the last evaluation of the run's raw weights: ``scores`` (N, C)
    logits, ``labels`` (N, C) in {1, 0, -1}, ``thresholds`` (C,) calibrated logit thresholds (those of
    ``last.pt``), ``classes`` (C,), ``ids`` (N,) each image's ``Sample.path``, ``indices`` (N,) each row's
    index in the validation split (not the row under ``trainer.limit_val_batches``), ``epoch``."""

    scores: np.ndarray
    labels: np.ndarray
    thresholds: np.ndarray
    classes: list[str]
    ids: list[str]
    indices: np.ndarray
    epoch: int


@dataclass(frozen=True)
class ErrorCase:
    """A confident error: validation row ``row`` wrong on class ``cls`` by ``margin`` logits."""

    row: int
    cls: int
    margin: float


@dataclass(frozen=True)
class LabelIssue:
    """A suspected label error: row ``row``, its cleanlab label quality ``quality`` (low = suspect), whether
    cleanlab's filter flagged it, and ``cls``, the class whose given label the model disputes most."""

    row: int
    quality: float
    flagged: bool
    cls: int


def save_val_predictions(
    run_dir: Path,
    scores: torch.Tensor,
    labels: torch.Tensor,
    thresholds: torch.Tensor,
    classes: Sequence[str],
    dataset: Any,
    epoch: int,
) -> Path:
    """Write ``run_dir/val_predictions.npz`` atomically; ``dataset``: the validation set the rows come from
    (a ``Subset`` of the split under ``trainer.limit_val_batches``). Returns the file's path."""
    indices = np.asarray(getattr(dataset, "indices", range(len(dataset))), dtype=np.int64)
    base = getattr(dataset, "dataset", dataset)
    arrays = {
        "scores": scores.detach().float().cpu().numpy(),
        "labels": labels.detach().cpu().to(torch.int8).numpy(),
        "thresholds": thresholds.detach().double().cpu().numpy(),
        "classes": np.asarray([str(name) for name in classes]),
        "ids": np.asarray([str(base.samples[int(i)].path) for i in indices]),
        "indices": indices,
        "epoch": np.asarray(epoch, dtype=np.int64),
    }
    path = Path(run_dir) / PREDICTIONS_FILE
    atomic_write(path, lambda f: np.savez(f, **arrays))
    return path


def load_val_predictions(run_dir: Path, expected: Mapping[str, Any] | None = None) -> ValPredictions:
    """Read ``run_dir/val_predictions.npz`` (never unpickling); :class:`ReportError` in one line when it is
    missing, is not a regular file of at most ``CAPS["predictions"]`` bytes, its members ask for more
    memory than the file allows (:func:`check_npz_members`), or its arrays are inconsistent, also with
    ``expected`` (``results.json``'s ``dataset``: ``num_classes`` classes, at most ``val_size`` rows)."""
    path = Path(run_dir) / PREDICTIONS_FILE
    try:
        file = open_regular(path, "rb", max_bytes=CAPS["predictions"], what="predictions file")
    except FileNotFoundError:
        raise ReportError(
            f"{run_dir} has no {PREDICTIONS_FILE}, the validation predictions mlcls-train saves at the end "
            "of a run with trainer.report=true (the default); a run without them has no report"
        ) from None
    except (OSError, ValueError) as exc:  # not a regular file, too large
        raise ReportError(f"{path}: not a readable predictions file ({exc})") from None
    try:
        with file:
            rows, classes = check_npz_members(file)["scores"]
            num_classes, val_size = (expected or {}).get("num_classes"), (expected or {}).get("val_size")
            if isinstance(num_classes, int) and classes != num_classes:
                raise ValueError(f"{classes} classes; the run's results.json counts {num_classes}")
            if isinstance(val_size, int) and rows > val_size:
                raise ValueError(f"{rows} rows; the run's results.json counts {val_size} validation images")
            file.seek(0)
            with np.load(file, allow_pickle=False) as npz:
                data = {key: npz[key] for key in PREDICTION_KINDS}
        return ValPredictions(
            scores=data["scores"].astype(np.float32),
            labels=data["labels"].astype(np.int8),
            thresholds=data["thresholds"].astype(np.float64),
            classes=[str(name) for name in data["classes"]],
            ids=[str(name) for name in data["ids"]],
            indices=data["indices"].astype(np.int64),
            epoch=int(data["epoch"]),
        )
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise ReportError(f"{path}: not a readable predictions file ({error_text(exc)})") from None


# The arrays of val_predictions.npz: the kinds of dtype each may have (numpy's ``dtype.kind``) and its shape,
# in N (rows) and C (classes); () is a scalar.
PREDICTION_KINDS = {
    "scores": ("fiu", ("N", "C")),
    "labels": ("iu", ("N", "C")),
    "thresholds": ("fiu", ("C",)),
    "classes": ("U", ("C",)),
    "ids": ("U", ("N",)),
    "indices": ("iu", ("N",)),
    "epoch": ("iu", ()),
}
# The members of the archive together may declare at most this many times the file's size: ``np.savez``
# (mlcls-train) stores members uncompressed (1x); ``np.savez_compressed`` of real predictions shrinks them
# about 1.1-2x, their scores being random floats.
MAX_EXPANSION = 8


def check_npz_members(
    file: Any, kinds: Mapping[str, tuple[str, tuple[str, ...]]] = PREDICTION_KINDS
) -> dict[str, tuple[int, ...]]:
    """The shape of each array of the ``.npz`` archive ``file`` (open, seekable), checked before any array
    is read, so that what :func:`numpy.load` allocates is bounded by :data:`MAX_EXPANSION` times the file's
    size: each of ``kinds`` (name: dtype kinds, named dims; :data:`PREDICTION_KINDS`) a member as
    ``np.savez`` writes it (:func:`check_npz_member`), all together at most :data:`MAX_EXPANSION` times the
    file (a deflated member may declare 1,000 times its bytes); each ``.npy`` header
    (:func:`~mlcls.data.datasets.labels.npy_header`) naming a
    dtype of its kind, and a shape whose bytes are exactly the member's data (numpy allocates from the
    header's shape before reading); the shapes agreeing. :class:`ValueError` names the first that fails.
    """
    size = os.fstat(file.fileno()).st_size
    with zipfile.ZipFile(file) as archive:
        members = {info.filename: info for info in archive.infolist()}
        total = 0
        for info in members.values():
            check_npz_member(info, size)
            total += info.file_size
        if total > MAX_EXPANSION * size:
            raise ValueError(f"its members declare {total:,} bytes in a file of {size:,}")
        shapes, sizes = {}, {}
        for key, (dtype_kinds, dims) in kinds.items():
            info = members.get(f"{key}.npy")
            if info is None:
                raise ValueError(f"no array {key!r}")
            with archive.open(info) as stream:
                dtype, shape, _, header = npy_header(stream.read(NPY_MAX_HEADER), f"{key}.npy")
            if dtype.kind not in dtype_kinds or len(shape) != len(dims):
                raise ValueError(
                    f"{key} is a {len(shape)}-d {dtype} array; a {len(dims)}-d one of kind {dtype_kinds} "
                    "expected"
                )
            need = math.prod(shape) * dtype.itemsize
            if need != info.file_size - header:
                raise ValueError(
                    f"{key}'s header declares shape {shape} ({need:,} bytes) in a member of "
                    f"{info.file_size - header:,} bytes of data"
                )
            shapes[key] = shape
            for dim, length in zip(dims, shape, strict=True):
                if sizes.setdefault(dim, length) != length:
                    raise ValueError(f"{key} has shape {shape}; {dim} is {sizes[dim]} in the other arrays")
    return shapes


def probabilities(scores: np.ndarray, thresholds: np.ndarray | float = 0.0) -> np.ndarray:
    """``sigmoid(scores - thresholds)`` (float64): with the thresholds (C,), 0.5 at each class's decision
    point, 0 for a class never predicted (+inf), 1 for one always predicted (-inf)."""
    # imported here: scipy and scikit-learn take a second to import, which every command that imports this
    # module (mlcls-train among them) would otherwise pay.
    from scipy.special import expit

    return expit(np.asarray(scores, dtype=np.float64) - thresholds)


def evaluated_epoch(history: Sequence[Mapping[str, Any]]) -> int | None:
    """The last epoch of a run's ``history`` (``results.json``'s) with an evaluation, None before any: the
    epoch of its last ``per_class_ap`` and of the predictions saved beside it."""
    return max((h["epoch"] for h in history if h.get("mAP_class") is not None), default=None)


def class_ap(
    per_class_ap: Mapping[str, float | None] | None,
    classes: Sequence[str],
    scores: torch.Tensor,
    labels: torch.Tensor,
) -> list[float]:
    """The AP in percent of each of ``classes``, NaN for a class without a positive: read from the run's
    evaluation, ``per_class_ap`` (its metrics' or results.json's, by class name; computed once, by
    :func:`mlcls.metrics.compute_metrics`). A run that holds none for one of the classes (None, or a
    directory written otherwise) gets them from its saved ``scores`` and ``labels`` (N, C) by the same
    function, :func:`mlcls.metrics.average_precision`."""
    if per_class_ap is not None and all(name in per_class_ap for name in classes):
        return [math.nan if per_class_ap[name] is None else float(per_class_ap[name]) for name in classes]
    return (100 * average_precision(scores, labels, dim=0)).tolist()


def class_rows(
    predictions: ValPredictions, per_class_ap: Mapping[str, float | None] | None = None
) -> list[dict[str, Any]]:
    """One dict per class, worst AP first (classes without a positive, AP undefined, last): ``cls``,
    ``name``, ``ap`` (%, the run's ``per_class_ap``: :func:`class_ap`), ``positives``, ``threshold`` (as a
    probability), ``precision`` and ``recall`` (%) at the threshold (NaN when nothing is predicted, or no
    positive), ``fp`` and ``fn`` counts."""
    scores, labels = torch.from_numpy(predictions.scores), torch.from_numpy(predictions.labels)
    ap = class_ap(per_class_ap, predictions.classes, scores, labels)
    predicted = scores.double() >= torch.from_numpy(predictions.thresholds)[None, :]
    true_positives, predicted_known, positives = prediction_counts(predicted, labels).tolist()
    rows = []
    for c, name in enumerate(predictions.classes):
        tp, npred, pos = true_positives[c], predicted_known[c], positives[c]
        rows.append(
            {
                "cls": c,
                "name": name,
                "ap": ap[c],
                "positives": pos,
                "threshold": float(probabilities(predictions.thresholds[c])),
                "precision": 100 * tp / npred if npred else math.nan,
                "recall": 100 * tp / pos if pos else math.nan,
                "fp": npred - tp,
                "fn": pos - tp,
            }
        )
    return sorted(rows, key=lambda row: (math.isnan(row["ap"]), row["ap"], row["cls"]))


# The panels of a run's training curves, drawn by the report (SVG) and by mlcls.reporting.plots (PNG): title,
# y label, the report chart's margin around the values, and each series' label and results.json history key.
CURVE_PANELS = (
    ("Training loss", "mean loss of the epoch", 0.0, (("loss", "loss"),)),
    ("Validation mAP", "mAP (%)", 1.0, (("mAP@class", "mAP_class"), ("mAP@sample", "mAP_sample"))),
)


def history_curves(
    history: Sequence[Mapping[str, Any]],
) -> list[tuple[str, str, float, list[tuple[str, list[Any], list[float]]]]]:
    """The :data:`CURVE_PANELS` of a run's ``history`` (``results.json``'s): each series as ``(label,
    epochs, values)``, the epochs that have a finite value (the mean training loss; mAP, %, of the
    evaluated epochs)."""
    panels = []
    for title, y_label, margin, keys in CURVE_PANELS:
        series = []
        for label, key in keys:
            shown = [
                h for h in history if "epoch" in h and is_float_number(h.get(key)) and math.isfinite(h[key])
            ]
            series.append((label, [h["epoch"] for h in shown], [h[key] for h in shown]))
        panels.append((title, y_label, margin, series))
    return panels


def pr_curve(
    scores: np.ndarray, labels: np.ndarray, max_points: int | None = MAX_CURVE_POINTS
) -> tuple[np.ndarray, np.ndarray]:
    """(recall, precision) of one class's precision-recall curve, ``scores`` (N,) against ``labels`` (N,)
    in {1, 0, -1}, the unknown (-1) left out, as they are of its AP; at most ``max_points`` points (None:
    all), empty for a class without a positive."""
    known = labels >= 0
    truth = labels[known] == 1
    if not truth.any():
        return np.empty(0), np.empty(0)
    from sklearn.metrics import precision_recall_curve  # imported when used, as in probabilities

    precision, recall, _ = precision_recall_curve(truth, scores[known].astype(np.float64))
    if max_points is not None and len(recall) > max_points:
        keep = np.unique(np.linspace(0, len(recall) - 1, max_points).round().astype(int))
        recall, precision = recall[keep], precision[keep]
    return recall, precision


def confident_errors(
    predictions: ValPredictions, rows: np.ndarray, per_class: int, overall: int, classes: Collection[int]
) -> tuple[dict[str, list[ErrorCase]], dict[str, dict[int, list[ErrorCase]]]]:
    """The most confident false positives (``"fp"``) and false negatives (``"fn"``) among the validation
    rows ``rows`` (ascending): the ``overall`` largest margins of all classes, and the ``per_class`` largest
    of each of ``classes`` (``{kind: {cls: cases}}``). Ties are broken by row, then class. The candidates
    stay arrays until they are chosen, so a column costs numpy's work only (75,000 classes)."""
    scores, labels, thresholds = predictions.scores, predictions.labels, predictions.thresholds
    wanted = np.asarray(sorted(classes), dtype=np.int64)
    keep = max(per_class, overall)
    empty = (np.empty(0), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
    best = {"fp": empty, "fn": empty}  # the overall candidates so far: (margin, row, class)
    per_class_cases: dict[str, dict[int, list[ErrorCase]]] = {"fp": {}, "fn": {}}
    for start in range(0, scores.shape[1], COLUMN_BLOCK):
        block = slice(start, start + COLUMN_BLOCK)
        margin = scores[rows, block].astype(np.float64) - thresholds[None, block]
        block_labels = labels[rows, block]
        columns = np.arange(start, start + margin.shape[1])
        for kind, wrong, key in (
            ("fp", (block_labels == 0) & (margin >= 0), margin),
            ("fn", (block_labels == 1) & (margin < 0), -margin),
        ):
            key = np.where(wrong, key, -1.0)  # every error's key is >= 0
            order = np.argsort(-key, axis=0, kind="stable")[:keep]  # (keep, width), ties by row
            top = np.take_along_axis(key, order, axis=0)
            error = top >= 0
            found = (top[error], rows[order[error]], np.broadcast_to(columns, top.shape)[error])
            merged = [np.concatenate(pair) for pair in zip(best[kind], found, strict=True)]
            chosen = np.lexsort((merged[2], merged[1], -merged[0]))[:overall]
            best[kind] = tuple(values[chosen] for values in merged)
            for c in wanted[(wanted >= start) & (wanted < columns[-1] + 1)].tolist():
                j = c - start
                per_class_cases[kind][c] = [
                    ErrorCase(int(rows[r]), c, float(k))
                    for r, k in zip(order[:per_class, j], top[:per_class, j], strict=True)
                    if k >= 0
                ]
    overall_cases = {
        kind: [ErrorCase(int(r), int(c), float(k)) for k, r, c in zip(*best[kind], strict=True)]
        for kind in best
    }
    return overall_cases, per_class_cases


def label_issues(
    predictions: ValPredictions, rows: np.ndarray, count: int
) -> tuple[list[LabelIssue], int | str]:
    """The ``count`` validation rows (of ``rows``) whose given labels cleanlab finds least likely, lowest
    label quality first (``get_label_quality_scores``), the rows its filter flags (``find_label_issues``)
    before the others; and how many it flags (-1 when the filter was skipped: over
    :data:`MAX_FILTER_CELLS` cells or :data:`MAX_FILTER_CLASSES` classes). Where cleanlab cannot rank these
    labels at all (it needs at least two classes among the given labels: a tiny validation set), no issue
    and cleanlab's reason."""
    from cleanlab.multilabel_classification import filter as cleanlab_filter
    from cleanlab.multilabel_classification import rank

    probs = probabilities(predictions.scores[rows], predictions.thresholds)
    given = predictions.labels[rows] == 1
    labels = [np.flatnonzero(row).tolist() for row in given]
    flagged = np.zeros(len(rows), dtype=bool)
    filtered = probs.size <= MAX_FILTER_CELLS and probs.shape[1] <= MAX_FILTER_CLASSES
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "too few examples in class ..." for each rare class
        try:
            quality = rank.get_label_quality_scores(labels, probs)
            if filtered:
                flagged[cleanlab_filter.find_label_issues(labels, probs, n_jobs=1)] = True
        except ValueError as exc:  # cleanlab's checks of its input, e.g. "at least 2 classes"
            return [], str(exc)
    order = np.lexsort((np.arange(len(rows)), quality, ~flagged))[:count]
    disputed = np.where(given, probs, 1.0 - probs).argmin(axis=1)
    issues = [LabelIssue(int(rows[k]), float(quality[k]), bool(flagged[k]), int(disputed[k])) for k in order]
    return issues, int(flagged.sum()) if filtered else -1


def gallery_rows(num_rows: int, limit: int, seed: int = 0) -> np.ndarray:
    """All ``num_rows`` validation rows, or a seeded random ``limit`` of them in row order."""
    if num_rows <= limit:
        return np.arange(num_rows)
    return np.sort(np.random.default_rng(seed).choice(num_rows, size=limit, replace=False))


def default_settings() -> dict[str, Any]:
    """The resolved config ``mlcls-train`` runs without arguments (``configs/train.yaml``'s defaults)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from mlcls import config_dir

    if GlobalHydra.instance().is_initialized():  # inside mlcls-train: Hydra holds the same configs
        cfg = compose(config_name="train")
    else:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose(config_name="train")
    return OmegaConf.to_container(cfg, resolve=True)


def changed_settings(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, run's value, default)`` of every setting of ``config`` that differs from ``defaults``
    (:func:`mlcls.reporting.run_table.differing_keys`); absent = None."""
    ours, theirs = flat_settings(config), flat_settings(defaults)
    return [(key, ours.get(key), theirs.get(key)) for key in differing_keys([ours, theirs])]
