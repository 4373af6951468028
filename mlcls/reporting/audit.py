"""``mlcls-data audit``: suspected label errors of a training split, ranked by cleanlab from K-fold
out-of-sample probabilities.

K runs of the training config each train on K-1 folds (:class:`FoldSplit`, cut by :func:`fold_rows`) and score
the fold held out (the sigmoid of the last epoch's raw weights' logits), so that every training image is
scored by a model that never saw it. Each fold is saved atomically to ``<out>/folds/fold_<k>.npz``; a rerun
skips the folds saved with the same settings (a stopped fold resumes from ``<out>/folds/fold_<k>/``).
cleanlab's self-confidence scores (``get_label_quality_scores_per_class``) rank every known (image, class)
label, least likely first; the first ``top`` go to ``<out>/audit.csv`` and ``<out>/audit.html``
(:func:`audit_page`). The out-of-fold mAP@class says how good the folds' models are, with a warning below
:data:`HELPFUL_MAP`. Names from the dataset's owner are kept from running as formulas in the CSV
(:func:`mlcls.reporting.render.spreadsheet_text`) and from driving the terminal (:func:`printable`).
"""

from __future__ import annotations

import json
import sys
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from mlcls.data import build_dataset
from mlcls.data.datasets.base import DatasetConfigError, MultiLabelDataset, check_choice
from mlcls.data.datasets.observed import ALL_LABELS, NO_HOLDOUT
from mlcls.data.views import DatasetView, TrainingView
from mlcls.engine.build import pin_dataset_root
from mlcls.engine.trainer import Trainer
from mlcls.errors import ConfigError, plural, printable
from mlcls.io import CAPS, atomic_write, atomic_write_bytes, open_regular
from mlcls.metrics.ap import map_class
from mlcls.reporting.render import csv_text, spreadsheet_text
from mlcls.reporting.report_data import check_npz_members
from mlcls.reporting.report_html import Thumbnails, escape, page, sortable_table

AUDIT_CSV, AUDIT_HTML = "audit.csv", "audit.html"
CSV_COLUMNS = ("rank", "image", "class", "given_label", "probability", "score")
SHOWN = 20  # suspects printed
# The out-of-fold mAP@class (percent) below which fewer than half of the audit's first suspects are wrong
# labels: measured in docs/report.md ("The label audit: how good the folds' models must be").
HELPFUL_MAP = 70.0
# What helps folds that start from weights reach it (docs/report.md, "The label audit"): the fine-tune recipe,
# which mlcls-data audit takes for them unless told otherwise (:func:`fold_overrides`), and more epochs.
HELPFUL_SETTINGS = (
    "experiment=finetune (the rate held until a late decay, the head's 10x the backbone's, a small new "
    "classifier, dataset.transform=crop), more epochs (trainer.epochs), and ImageNet weights "
    "(model.pretrained=true, model.checkpoint_path) or a trained model (model.init_from)"
)
FINETUNE = "experiment=finetune"
RECIPES = ("auto", "none")  # recipe=: auto: FINETUNE for folds that start from weights; none: as composed
# The settings a fold's probabilities depend on: a saved fold is reused only when they are unchanged.
FOLD_SETTINGS = ("dataset", "model", "loss", "optim", "sched", "data")
FOLD_TRAINER_SETTINGS = ("epochs", "batch_size", "seed", "amp", "ema_decay", "grad_clip")
# A fold file's arrays (dtype kinds, named dims), as check_npz_members checks them before loading.
FOLD_KINDS = {"rows": ("iu", ("N",)), "probabilities": ("f", ("N", "C")), "settings": ("U", ())}
# The two sides of a FoldSplit: the other folds (trained on) and the fold held out (scored).
FOLD_SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Suspect:
    """One ranked label: row ``row`` of the training split, class ``column``, its given label (1 or 0), the
    out-of-sample probability of the class and cleanlab's label quality score (low: likely wrong)."""

    rank: int
    row: int
    image: str
    column: int
    label: int
    probability: float
    score: float


THUMBNAIL = 96  # the audit page's thumbnails' longer side, in pixels
AUDIT_COLUMNS = (
    ("rank", "rank", "number"),
    ("image", "image", "number"),
    ("file", "file", "text"),
    ("class", "class", "text"),
    ("given_label", "given label", "number"),
    ("probability", "probability", "number"),
    ("score", "score", "number"),
    ("positives", "given positives", "text"),
)


def audit_page(
    suspects: Sequence[Suspect],
    dataset: MultiLabelDataset,
    labels: np.ndarray,
    name: str,
    folds: int,
    quality: str,
) -> str:
    """``audit.html`` (:func:`mlcls.reporting.report_html.page`), sortable by any column: the ranking
    ``suspects`` of ``dataset``'s training split, each with its image's thumbnail and given positive classes;
    ``labels`` are the split's (N, C); ``quality`` says how good the folds' models are (out-of-fold mAP)."""
    thumbnails = Thumbnails(dataset, THUMBNAIL)  # each image once, however many of its labels are ranked
    rows = []
    for s in suspects:
        key = thumbnails.key(s.row)
        image = f'<img data-thumb="{key}" alt="{escape(s.image)}">' if key else "unreadable"
        positives = ", ".join(dataset.classes[c] for c in np.flatnonzero(labels[s.row] == 1))
        texts = (s.image, dataset.classes[s.column])
        rows.append(
            [
                (str(s.rank), s.rank, "n"),
                (image, s.row, ""),
                *((escape(text), text, "") for text in texts),
                (str(s.label), s.label, f"n given{s.label}"),
                (f"{s.probability:.3f}", s.probability, "n"),
                (f"{s.score:.3f}", s.score, "n"),
                (escape(positives), positives, ""),
            ]
        )
    intro = (
        f"{len(suspects)} labels of the training split ({len(labels)} images, {len(dataset.classes)} "
        "classes), the least likely first: cleanlab's label quality score of each given label under "
        f"out-of-sample probabilities from {folds} folds (each image scored by a model trained on the other "
        f"folds; {quality}). Click a column to sort."
    )
    table = sortable_table("audit", AUDIT_COLUMNS, rows)
    sections = [("ranking", "", table)]
    return page(f"Suspected label errors: {name}", intro, sections, thumbnails.uris, "mlcls-data audit")


def starts_from_weights(model: Mapping[str, Any]) -> bool:
    """Whether the model config ``model`` starts from trained weights: ImageNet's (``pretrained``), a local
    file's (``checkpoint_path``) or an mlcls checkpoint's (``init_from``)."""
    return any(bool(model.get(key)) for key in ("pretrained", "checkpoint_path", "init_from"))


def fold_overrides(cfg: DictConfig, overrides: Sequence[str], recipe: str) -> list[str] | None:
    """The overrides of the folds' config when it is to change: ``overrides`` with :data:`FINETUNE` first
    (what the user gave still wins) when ``recipe`` is ``auto``, the folds start from weights
    (:func:`starts_from_weights` of ``cfg``, composed from ``overrides``) and no ``experiment=`` is given;
    else None (``cfg`` as it is)."""
    check_choice("recipe", recipe, RECIPES)
    chosen = any(override.lstrip("+~").startswith("experiment=") for override in overrides)
    if recipe == "none" or chosen or not starts_from_weights(cfg.model):
        return None
    return [FINETUNE, *overrides]


def fold_rows(num_rows: int, folds: int, fold: int, seed: int) -> np.ndarray:
    """The rows (ascending) of fold ``fold`` of ``folds``: positions ``p`` of a permutation of
    ``range(num_rows)`` drawn from ``seed`` with ``p mod folds == fold`` (sizes differ by one at most)."""
    order = np.random.default_rng(seed).permutation(num_rows)
    return np.sort(order[fold::folds])


def indexed_training_split(cfg: DictConfig) -> TrainingView:
    """The training view of the dataset config ``cfg``; :class:`DatasetConfigError` for packed shards (read
    in sequence, not by index)."""
    dataset = build_dataset(cfg, train=True)
    if not isinstance(dataset.source, MultiLabelDataset):
        raise DatasetConfigError(
            f"the training split of {cfg.get('name', 'this dataset')} is read in sequence (packed shards), "
            "not by index; audit the dataset config the shards were packed from"
        )
    return dataset


class FoldSplit(DatasetView):
    """Fold ``fold`` of ``folds`` (>= 2) of the training split of the dataset config ``source``
    (``heldout``: full labels), or the other folds (``train``: as its regime shows them), read by the source
    with this dataset's ``transform``; ``seed``: the cut's (:func:`fold_rows`)."""

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        source: Mapping[str, Any] | None = None,
        folds: int = 5,
        fold: int = 0,
        seed: int = 0,
        **config_keys: Any,
    ) -> None:
        MultiLabelDataset.__init__(self, transform, **config_keys)
        self.split = check_choice("fold split", split, FOLD_SPLITS)
        if source is None:
            raise DatasetConfigError(
                "a fold split needs source, the dataset config whose training split it cuts"
            )
        if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
            raise DatasetConfigError(f"folds={folds!r}; expected an integer >= 2")
        if isinstance(fold, bool) or not isinstance(fold, int) or not 0 <= fold < folds:
            raise DatasetConfigError(f"fold={fold!r}; expected an integer from 0 to {folds - 1}")
        source_cfg = OmegaConf.create(OmegaConf.to_container(OmegaConf.create(source), resolve=True))
        training = indexed_training_split(source_cfg)
        training.transform = self.transform  # the source reads; this split's transform applies
        if len(training) < folds:
            raise DatasetConfigError(
                f"the training split has {len(training)} samples, fewer than folds={folds}"
            )
        held = fold_rows(len(training), folds, fold, seed)
        if split == "heldout":
            self.select(TrainingView(training.source, ALL_LABELS, NO_HOLDOUT), held)
        else:
            self.select(training, np.setdiff1d(np.arange(len(training)), held))


def fold_dir(out: Path, fold: int) -> Path:
    """The run directory of fold ``fold``'s training."""
    return out / "folds" / f"fold_{fold}"


def fold_config(cfg: DictConfig, folds: int, fold: int, seed: int) -> DictConfig:
    """The training config of fold ``fold``: ``cfg`` with its dataset replaced by the
    :class:`FoldSplit` of its training split (fold ``fold`` held out and
    evaluated once, after the last epoch), resumed from its run directory (:func:`fold_dir`)."""
    source = OmegaConf.to_container(cfg.dataset, resolve=True)
    fold_cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    fold_cfg.dataset = {
        "_target_": f"{FoldSplit.__module__}.{FoldSplit.__qualname__}",
        "_recursive_": False,  # source is a dataset config, instantiated by the fold split itself
        **{key: source[key] for key in ("name", "image_size", "transform", "mean", "std") if key in source},
        "train_split": "train",
        "val_split": "heldout",
        "source": source,
        "folds": folds,
        "fold": fold,
        "seed": seed,
    }
    fold_cfg.trainer.resume = "auto"
    fold_cfg.trainer.eval_every = fold_cfg.trainer.epochs
    fold_cfg.trainer.limit_val_batches = None
    return fold_cfg


def out_of_sample_probabilities(
    cfg: DictConfig, num_rows: int, folds: int, seed: int, out: Path, say: Callable[[str], None]
) -> np.ndarray:
    """(N, C) float32: each training row's probabilities from the fold run that held it out; the folds
    saved under ``out/folds`` with the same settings (:data:`FOLD_SETTINGS`, :data:`FOLD_TRAINER_SETTINGS`,
    the cut, the split's size) are read, the others trained and saved."""
    chosen = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in FOLD_SETTINGS if key in cfg}
    chosen["trainer"] = {key: cfg.trainer.get(key) for key in FOLD_TRAINER_SETTINGS}
    chosen["cut"] = {"folds": folds, "seed": seed, "rows": num_rows}
    settings = json.dumps(chosen, sort_keys=True, default=str)
    probabilities: np.ndarray | None = None
    for fold in range(folds):
        path = out / "folds" / f"fold_{fold}.npz"
        saved = path.exists()  # by an earlier audit: with these settings, or refused in one line
        if saved:
            saved_settings, rows, probs = read_fold(path)
            if saved_settings != settings:
                raise ConfigError(
                    f"{path} holds the probabilities of an audit with other settings; pass another "
                    "out= or delete the folder"
                )
        else:
            start = time.perf_counter()
            trainer = Trainer(fold_config(cfg, folds, fold, seed), fold_dir(out, fold))
            trainer.fit()
            scores = trainer.val_outputs[0] if trainer.val_outputs else None
            if scores is None:  # resumed after its last epoch: the weights are trained, not yet scored
                scores = trainer.measure().scores
            rows, probs = trainer.data.val_set.rows, torch.sigmoid(scores).numpy()
        if not np.array_equal(rows, fold_rows(num_rows, folds, fold, seed)):
            raise ConfigError(f"fold {fold}: the training split changed while the audit ran ({path})")
        if probabilities is None:
            probabilities = np.full((num_rows, probs.shape[1]), np.nan, dtype=np.float32)
        if probs.shape[1] != probabilities.shape[1]:
            raise ConfigError(
                f"{path} scores {probs.shape[1]} classes, the other folds {probabilities.shape[1]}"
            )
        if saved:
            say(f"fold {fold + 1}/{folds}: read from {path}")
        else:
            atomic_write(path, partial(np.savez, rows=rows, probabilities=probs, settings=np.array(settings)))
            say(f"fold {fold + 1}/{folds}: trained and scored in {time.perf_counter() - start:.0f} s, {path}")
        probabilities[rows] = probs
    return probabilities


def read_fold(path: Path) -> tuple[str, np.ndarray, np.ndarray]:
    """``(settings, rows, probabilities)`` of a fold file an earlier audit saved, its members checked before
    any is loaded (:func:`~mlcls.reporting.report_data.check_npz_members`); one :class:`ConfigError` line
    for a file that is not one."""
    try:
        with open_regular(path, max_bytes=CAPS["predictions"], what="fold") as file:
            check_npz_members(file, FOLD_KINDS)
            file.seek(0)
            with np.load(file, allow_pickle=False) as saved:
                return str(saved["settings"]), saved["rows"], saved["probabilities"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise ConfigError(
            f"{path} is not a fold of mlcls-data audit ({exc}); delete it or pass another out="
        ) from None


def rank_labels(labels: np.ndarray, probabilities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cleanlab's per-class label quality scores (N, C) of ``labels`` (N, C: 1 / 0 / -1, unknown taken as
    negative) under ``probabilities``, and the known entries as ``(row, column)`` pairs (K, 2), the lowest
    score first (ties: row, then column)."""
    # imported here: cleanlab pulls in scikit-learn, SciPy and pandas (seconds of every mlcls-data start)
    from cleanlab.multilabel_classification.rank import get_label_quality_scores_per_class

    given = [np.flatnonzero(row == 1).tolist() for row in labels]
    scores = np.asarray(get_label_quality_scores_per_class(given, probabilities)).reshape(labels.shape)
    known = np.argwhere(labels >= 0)
    order = np.argsort(scores[known[:, 0], known[:, 1]], kind="stable")
    return scores, known[order]


def audit(cfg: DictConfig, folds: int, seed: int, out: str | Path, top: int) -> list[Suspect]:
    """Audit the training split of ``cfg`` (the composed ``configs/train.yaml``) with ``folds`` folds cut
    by ``seed``: prints the cost first, then each fold, the first :data:`SHOWN` suspects and the files;
    writes the first ``top`` of the ranking to ``out/audit.csv`` and ``out/audit.html``; returns them."""
    if folds < 2:
        raise ConfigError(f"folds={folds}; expected an integer >= 2 (each fold is scored by the others)")
    out = Path(out)
    pin_dataset_root(cfg.dataset)
    dataset = indexed_training_split(cfg.dataset)
    num_rows = len(dataset)
    if num_rows < folds:
        raise ConfigError(f"the training split has {plural(num_rows, 'sample')}, fewer than folds={folds}")
    held = num_rows // folds
    name = str(cfg.dataset.get("name", "?"))
    print(
        f"audit of {printable(name)}: {folds} trainings of {cfg.model.name} for "
        f"{plural(cfg.trainer.epochs, 'epoch')} each, on about {num_rows - held} of the {num_rows} training "
        f"images, each scoring the other {held} or so; saved folds in {out / 'folds'} are reused",
        flush=True,
    )
    probabilities = out_of_sample_probabilities(cfg, num_rows, folds, seed, out, print)
    labels = dataset.labels.numpy()
    mean_ap, counted = map_class(torch.from_numpy(probabilities), dataset.labels)
    scores, ranked = rank_labels(labels, probabilities)

    def image_name(row: int) -> str:  # the sample's file, with its box when the sample is a crop
        sample = dataset.samples[row]
        box = sample.box
        return sample.path if box is None else f"{sample.path} (box {', '.join(f'{v:g}' for v in box)})"

    suspects = [
        Suspect(
            rank + 1,
            int(row),
            image_name(int(row)),
            int(column),
            int(labels[row, column]),
            float(probabilities[row, column]),
            float(scores[row, column]),
        )
        for rank, (row, column) in enumerate(ranked[:top])
    ]
    csv_rows = [
        [s.rank, spreadsheet_text(s.image), spreadsheet_text(dataset.classes[s.column]), s.label]
        + [f"{s.probability:.6f}", f"{s.score:.6f}"]
        for s in suspects
    ]
    atomic_write_bytes(out / AUDIT_CSV, csv_text([CSV_COLUMNS, *csv_rows]).encode())
    quality = (
        f"out-of-fold mAP@class {mean_ap:.1f}% (classes with a positive: {counted} of {labels.shape[1]})"
    )
    page = audit_page(suspects, dataset, labels, name, folds, quality)
    atomic_write_bytes(out / AUDIT_HTML, page.encode())
    print(f"\n{quality}")
    if not mean_ap >= HELPFUL_MAP:  # NaN (no positive at all) warns too
        print(
            f"mlcls-data: warning: the folds' models reach an out-of-fold mAP@class of {mean_ap:.1f}%, below "
            f"{HELPFUL_MAP:g}%: fewer than half of the first suspects are likely wrong labels "
            f"(docs/report.md); what helps: {HELPFUL_SETTINGS}",
            file=sys.stderr,
        )
    # The class and image names through printable: the dataset's names cannot drive the terminal.
    shown = f"first {min(SHOWN, len(suspects))} of {plural(len(ranked), 'ranked label')}"
    print(f"\n{shown} (lowest score first):")
    print(f"{'rank':>5}  {'given':>5}  {'prob':>6}  {'score':>6}  class  image")
    for s in suspects[:SHOWN]:
        print(
            f"{s.rank:>5}  {s.label:>5}  {s.probability:6.3f}  {s.score:6.3f}  "
            f"{printable(dataset.classes[s.column])}  {printable(s.image)}"
        )
    print(f"\nwrote {out / AUDIT_CSV}\nwrote {out / AUDIT_HTML}")
    return suspects
