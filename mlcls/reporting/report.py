"""``<run_dir>/report.html``: where a run's model fails, on which images, and which labels look wrong.

One self-contained page (:mod:`mlcls.reporting.report_html`) from the run directory
(:mod:`mlcls.reporting.report_data`) and the validation set, whose images become the thumbnails. Over
:data:`MAX_GALLERY_IMAGES` validation images (or :data:`MAX_GALLERY_CELLS` image-class cells), the galleries
and the label-error search draw a seeded sample (the page says so); the table and curves use every image.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mlcls.config_tree import nested_get
from mlcls.errors import plural
from mlcls.io import atomic_write_bytes
from mlcls.losses.spec import loss_name
from mlcls.reporting import report_html as ui
from mlcls.reporting.paper import ReportError
from mlcls.reporting.plots import write_plots
from mlcls.reporting.report_data import (
    ErrorCase,
    ValPredictions,
    changed_settings,
    class_rows,
    confident_errors,
    default_settings,
    evaluated_epoch,
    gallery_rows,
    history_curves,
    label_issues,
    load_val_predictions,
    pr_curve,
    probabilities,
    save_val_predictions,
)
from mlcls.reporting.run_files import config_groups, read_run

if TYPE_CHECKING:
    from mlcls.engine.trainer import Trainer

log = logging.getLogger("mlcls")

REPORT_FILE = "report.html"
OVERALL_CARDS = 16
PER_CLASS_CARDS = 4
ISSUE_CARDS = 20
MAX_GALLERY_IMAGES = 10_000
# ... and at most this many image-class cells (cleanlab's probabilities are float64): 10,000 images up to
# 10,000 classes, 1,333 at 75,000.
MAX_GALLERY_CELLS = 100_000_000
MAX_CLASS_DETAILS = 100
TABLE_ROWS = 50  # rows of each per-class table over 3 x TABLE_ROWS classes, and search results shown
THUMB_SIDE = 160
# The thumbnails' share of the page (base64 JPEGs): about 250 photos; the cards after them show none, so that
# the page stays under 5 MB with 75,000 classes (whose search index takes about 1.7 MB).
MAX_THUMBNAIL_BYTES = 1_500_000
PREDICTED_SHOWN = 3
GIVEN_SHOWN = 10  # given labels named on a card (a tagger's image may hold dozens)


class Thumbnails(ui.Thumbnails):
    """The thumbnails of validation rows of ``predictions`` (at most :data:`MAX_THUMBNAIL_BYTES` of them),
    each row's image checked to be the one the run scored."""

    def __init__(self, dataset: Any, predictions: ValPredictions) -> None:
        super().__init__(dataset, THUMB_SIDE, MAX_THUMBNAIL_BYTES)
        self.predictions = predictions

    def key(self, row: int) -> str | None:
        index = int(self.predictions.indices[row])
        expected = self.predictions.ids[row]
        found = str(self.dataset.samples[index].path) if index < len(self.dataset) else None
        if found != expected:
            raise ReportError(
                f"the validation set no longer matches the run's predictions: image {index} is "
                f"{found!r}, the run scored {expected!r}"
            )
        return super().key(index)


class _Cards:
    """The gallery cards of one report: each image's given labels and predicted scores."""

    def __init__(self, predictions: ValPredictions, thumbnails: Thumbnails) -> None:
        self.p, self.thumbnails = predictions, thumbnails
        self.thresholds = probabilities(predictions.thresholds)

    def _card(self, row: int, cls: int, what: str, first: str) -> ui.Card:
        """The card of image ``row`` wrong on class ``cls``: its score, given labels and predicted classes."""
        names, probs = self.p.classes, probabilities(self.p.scores[row])  # a row at a time: (C,), not (N, C)
        given = np.flatnonzero(self.p.labels[row] == 1)
        given_more = f" +{len(given) - GIVEN_SHOWN}" if len(given) > GIVEN_SHOWN else ""
        predicted = np.flatnonzero(self.p.scores[row].astype(np.float64) >= self.p.thresholds)
        predicted = predicted[np.argsort(-probs[predicted], kind="stable")]  # ties by class
        shown = ", ".join(f"{names[c]} {probs[c]:.2f}" for c in predicted[:PREDICTED_SHOWN])
        more = f" +{len(predicted) - PREDICTED_SHOWN}" if len(predicted) > PREDICTED_SHOWN else ""
        lines = (
            f"{first}; score {probs[cls]:.2f}, threshold {self.thresholds[cls]:.2f}",
            f"given: {', '.join(names[c] for c in given[:GIVEN_SHOWN]) or 'none'}{given_more}",
            f"predicted: {shown or 'none'}{more}",
        )
        key, index = self.thumbnails.key(row), int(self.p.indices[row])
        missing = "page's image budget spent" if index in self.thumbnails.omitted else "unreadable image"
        return ui.Card(key, self.p.ids[row], f"{names[cls]} {what}", lines, missing)

    def errors(self, cases: Mapping[str, Sequence[ErrorCase]], headings: Sequence[str]) -> str:
        """The galleries of the false positives ``cases["fp"]`` and negatives ``cases["fn"]``."""
        kinds = (
            ("fp", "predicted", "not given", "No false positive."),
            ("fn", "missed", "given", "No false negative."),
        )
        return "".join(
            f"<h3>{heading}</h3>"
            + ui.gallery([self._card(case.row, case.cls, what, first) for case in cases[kind]], empty)
            for heading, (kind, what, first, empty) in zip(headings, kinds, strict=True)
        )

    def issue(self, row: int, cls: int, quality: float, flagged: bool) -> ui.Card:
        given = self.p.labels[row, cls] == 1
        first = f"label quality {quality:.3f}" + (", flagged" if flagged else "")
        return self._card(row, cls, "given: wrong?" if given else "not given: missing?", first)


def _run_summary(results: Mapping[str, Any], config: Mapping[str, Any], epoch: int) -> tuple[str, str]:
    """The page's subtitle and the headline figures block."""
    data = results.get("dataset") or {}
    metrics, best = results.get("metrics") or {}, results.get("best") or {}
    subtitle = " · ".join(
        [
            f"dataset {data.get('name', config['dataset'].get('name'))}",
            f"model {config['model'].get('name')}",
            f"loss {loss_name(config['loss'])}",
            f"{results.get('epochs_completed', '?')} epochs",
            f"{data.get('train_size', '?')} training / {data.get('val_size', '?')} validation images",
        ]
    )
    figures = [(ui.number(metrics.get("mAP_class")), f"mAP@class, epoch {epoch}")]
    if best:
        where = f"epoch {best.get('epoch', '?')} ({best.get('weights', '?')})"
        figures.append((ui.number(best.get("mAP_class")), f"best mAP@class, {where}"))
    for key in ("mAP_sample", "CF1", "OF1"):
        if metrics.get(key) is not None:
            figures.append((ui.number(metrics[key]), key.replace("_", "@")))
    wall = nested_get(results, "provenance", "wall_time_s")
    if wall is not None:
        figures.append((f"{wall:.0f} s", "training time"))
    cells = "".join(
        f'<div class="figure"><b>{ui.escape(v)}</b><span>{ui.escape(k)}</span></div>' for v, k in figures
    )
    return subtitle, f'<div class="figures">{cells}</div>'


def _curves(history: Sequence[Mapping[str, Any]]) -> str:
    """The training loss and validation mAP per epoch (:func:`mlcls.reporting.report_data.history_curves`)."""
    epochs = [h["epoch"] for h in history if "epoch" in h] or [1]
    charts = []
    for title, y_label, margin, series in history_curves(history):
        values = [value for _, _, ys in series for value in ys] or [0.0]
        y_range = (min(values) - margin, max(values) + margin)
        charts.append(
            ui.line_chart(series, title, "epoch", y_label, (min(epochs), max(epochs)), y_range, whole_x=True)
        )
    return f'<div class="charts">{"".join(charts)}</div>'


def _class_detail(row: Mapping[str, Any], predictions: ValPredictions, cards: _Cards, errors: Mapping) -> str:
    c = row["cls"]
    recall, precision = pr_curve(predictions.scores[:, c], predictions.labels[:, c])
    point = (row["recall"] / 100, row["precision"] / 100)
    marks = [] if np.isnan(point).any() else [point]
    chart = '<p class="note">No positive in the validation set: no curve.</p>'
    if len(recall):
        title, unit = f"{row['name']}: precision-recall", (0.0, 1.0)
        chart = ui.line_chart(
            [("PR", recall, precision)], title, "recall", "precision", unit, unit, steps=True, marks=marks,
            width=360, height=250,
        )  # fmt: skip
    own = cards.errors(
        {kind: errors[kind][c] for kind in ("fp", "fn")},
        ("Most confident false positives", "Most confident false negatives"),
    )
    summary = f"{ui.escape(row['name'])} — AP {ui.number(row['ap'])}, {row['positives']} positives"
    return (
        f'<details id="class-{c}"><summary>{summary}</summary>'
        f'<div class="detail">{chart}<div>{own}</div></div></details>'
    )


def _class_tables(table: Sequence[Mapping[str, Any]], linked: set[int], epoch: int) -> str:
    """The per-class results: every class in one table (worst AP first) up to 3 x :data:`TABLE_ROWS`
    classes, else the ``TABLE_ROWS`` worst, best and most frequent in three; a search box over them all."""
    note = (
        "Click a header to sort. Threshold: the calibrated one (best F1 per class) as a probability; "
        f"precision and recall at it; scores of epoch {epoch}."
    )
    search = ui.class_search(table, TABLE_ROWS)
    if len(table) <= 3 * TABLE_ROWS:
        return f'<p class="note">Worst AP first. {note}</p>{search}' + ui.class_table(table, linked)
    scored = [row for row in table if not math.isnan(row["ap"])]  # worst first; AP undefined: none
    frequent = sorted(table, key=lambda row: (-row["positives"], row["cls"]))
    parts = [
        ("classes-worst", f"The {TABLE_ROWS} worst by AP", table[:TABLE_ROWS], "ap"),
        ("classes-best", f"The {TABLE_ROWS} best by AP", scored[::-1][:TABLE_ROWS], None),
        (
            "classes-frequent",
            f"The {TABLE_ROWS} most frequent in the validation set",
            frequent[:TABLE_ROWS],
            None,
        ),
    ]
    tables = "".join(
        f"<h3>{heading}</h3>" + ui.class_table(rows, linked, table_id, by)
        for table_id, heading, rows, by in parts
    )
    return (
        f'<p class="note">{len(table):,} classes: the search box finds any of them; the tables show '
        f"{TABLE_ROWS} each. {note}</p>{search}{tables}"
    )


RunFiles = tuple[dict[str, Any], dict[str, Any], ValPredictions]


def read_report_files(run_dir: Path) -> RunFiles:
    """``(results, config, predictions)`` of the run in ``run_dir``, each file read once;
    :class:`ReportError` for a run directory without results, config (its dataset, model and loss groups)
    or predictions."""
    results, config = read_run(run_dir)
    if results is None or config is None:
        raise ReportError(f"{run_dir}: no results.json and config.yaml; is it an mlcls run directory?")
    config_groups(config, run_dir, ("dataset", "model", "loss"))
    return results, config, load_val_predictions(run_dir, results.get("dataset"))


def write_report(run_dir: str | Path, dataset: Any, files: RunFiles | None = None) -> Path:
    """Write ``run_dir/report.html`` (atomically) for the run in ``run_dir`` (its ``files``, else
    :func:`read_report_files`) whose validation split is ``dataset`` (the thumbnails' source); return its
    path. :class:`ReportError` as :func:`read_report_files`, or for a dataset that no longer matches the
    predictions."""
    run_dir = Path(run_dir)
    results, config, predictions = files or read_report_files(run_dir)
    thumbnails = Thumbnails(dataset, predictions)
    cards = _Cards(predictions, thumbnails)
    num_rows = len(predictions.ids)
    classes = max(1, len(predictions.classes))
    rows = gallery_rows(num_rows, max(1, min(MAX_GALLERY_IMAGES, MAX_GALLERY_CELLS // classes)))
    # the per-class AP of the evaluation that scored the predictions (results.json's), not computed again
    stored = evaluated_epoch(results.get("history") or []) == predictions.epoch
    table = class_rows(predictions, results.get("per_class_ap") if stored else None)
    detailed = table[:MAX_CLASS_DETAILS]
    linked = {row["cls"] for row in detailed}
    overall, per_class = confident_errors(predictions, rows, PER_CLASS_CARDS, OVERALL_CARDS, linked)
    issues, flagged = label_issues(predictions, rows, ISSUE_CARDS)
    sampled = (
        f"The galleries and the label-error search draw from a random sample of {len(rows):,} of the "
        f"{num_rows:,} validation images (seed 0); the table and the curves use them all."
        if len(rows) < num_rows
        else f"From all {num_rows:,} validation images."
    )
    subtitle, figures = _run_summary(results, config, predictions.epoch)
    error_html = (
        f'<p class="note">{ui.escape(sampled)} Decisions follow the calibrated thresholds; the most '
        "confident errors lie furthest past them.</p>"
    ) + cards.errors(overall, ("False positives: predicted, not given", "False negatives: given, missed"))
    if isinstance(flagged, str):
        flag_note = f"cleanlab cannot rank these labels ({flagged})"
    elif flagged >= 0:
        flag_note = f"cleanlab's filter flags {plural(flagged, 'image')}, shown first"
    else:
        flag_note = (
            "cleanlab's filter was skipped (too many image-class cells or classes); ranked by label quality"
        )
    issue_html = (
        '<p class="note">Ranked by cleanlab (multi-label, label quality lowest first) from the '
        f"out-of-sample validation predictions of epoch {predictions.epoch}; {ui.escape(flag_note)}. "
        f"{ui.escape(sampled)}</p>"
        + ui.gallery([cards.issue(i.row, i.cls, i.quality, i.flagged) for i in issues], "No image to show.")
    )
    hidden = len(table) - len(detailed)
    details = "".join(_class_detail(row, predictions, cards, per_class) for row in detailed)
    if hidden:
        details += (
            f'<p class="note">The other {plural(hidden, "class")} (better AP) have their figures in the '
            "per-class results only.</p>"
        )
    settings = changed_settings(config, default_settings())
    sections = [
        ("overview", "", figures + _curves(results.get("history") or [])),
        ("settings", "Settings that differ from the defaults", ui.settings_table(settings)),
        ("per-class", "Per-class results", _class_tables(table, linked, predictions.epoch)),
        ("errors", "Most confident errors", error_html),
        ("label-issues", "Suspected label errors", issue_html),
        ("classes-detail", "Each class", details),
    ]
    written = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    footer = f"mlcls-report · {run_dir.resolve()} · written {written}"
    text = ui.page(f"Run report: {run_dir.resolve().name}", subtitle, sections, thumbnails.uris, footer)
    atomic_write_bytes(run_dir / REPORT_FILE, text.encode("utf-8"))
    return run_dir / REPORT_FILE


def report_run(trainer: Trainer) -> Path | None:
    """Draw the figures of a finished run (:func:`mlcls.reporting.plots.write_plots`: into its run directory
    and TensorBoard), save its last validation predictions and write its report (a
    :attr:`Trainer.on_finish` hook, on rank 0); nothing without predictions."""
    if trainer.val_outputs is None or trainer.val_outputs[0] is None:
        return None
    scores, labels = trainer.val_outputs
    per_class_ap = trainer.state.last_metrics["per_class_ap"]  # the evaluation's of val_outputs
    history, writer = trainer.state.history, trainer.run_log.writer
    write_plots(trainer.run_dir, history, scores, labels, trainer.classes, per_class_ap, writer=writer)
    epoch = evaluated_epoch(history)
    val_set = trainer.data.val_set
    save_val_predictions(
        trainer.run_dir, scores, labels, trainer.state.thresholds, trainer.classes, val_set, epoch
    )
    start = time.perf_counter()
    path = write_report(trainer.run_dir, getattr(val_set, "dataset", val_set))
    log.info("report written to %s (%.1f s)", path, time.perf_counter() - start)
    return path
