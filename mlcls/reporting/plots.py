"""Figures of a finished run (:func:`write_plots`): ``<run_dir>/plots/per_class_ap.png``,
``pr_curves.png`` and ``training_curves.png``, and the same images in TensorBoard under ``plots/<name>``.

matplotlib is optional (``pip install mlcls[plots]``); without it one log line says nothing is drawn. The
figures use matplotlib's object API on the Agg canvas (no ``pyplot`` state, no display), each file is
written atomically, and class names are drawn as they are (a ``$`` in one starts no math text).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlcls.errors import plural
from mlcls.io import atomic_write_bytes
from mlcls.reporting.report_data import class_ap, history_curves, pr_curve

log = logging.getLogger("mlcls")

MAX_BARS = 60
PR_CLASSES = 5
DPI = 110


def _literal(text: str) -> str:
    """``text`` as matplotlib draws it literally: a ``$`` escaped, which would otherwise start math text (a
    class named ``price_$5_to_$10``)."""
    return text.replace("$", r"\$")


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def ranked_classes(ap: torch.Tensor) -> list[int]:
    """The classes with an AP (``ap`` (C,), NaN = no positive), best first, ties by class: one sort, not a
    Python step per class (75,000 classes)."""
    counted = torch.nonzero(~torch.isnan(ap)).flatten()
    return counted[torch.argsort(ap[counted], descending=True, stable=True)].tolist()


def per_class_ap_figure(ap: torch.Tensor, positives: torch.Tensor, class_names: Sequence[str]) -> Any:
    """Horizontal bars of the per-class AP (fractions ``ap`` (C,), NaN = no positive: left out), best class on
    top, with the mAP@class line; over :data:`MAX_BARS` classes, the best and worst ``MAX_BARS / 2``."""
    import matplotlib

    order = counted = ranked_classes(ap)
    title = f"Average precision per class (mAP@class {100 * ap[counted].mean().item():.1f})"
    hidden = max(0, len(order) - MAX_BARS)
    if hidden:
        half = MAX_BARS // 2
        title += f"\nthe {half} best and the {half} worst of {len(order)} classes"
        order = order[:half] + order[-half:]
    missing = len(class_names) - len(counted)
    figure = _figure(8.0, 1.4 + 0.26 * len(order))
    axes = figure.add_subplot()
    values = [100 * ap[c].item() for c in order]
    names = [f"{_literal(class_names[c])} (n={int(positives[c])})" for c in order]
    rows = np.arange(len(order))
    colours = matplotlib.colormaps["RdYlGn"](np.asarray(values) / 100 * 0.8 + 0.1)
    axes.barh(rows, values, color=colours, edgecolor="none")
    for row, value in zip(rows, values, strict=True):
        axes.text(value + 0.8, row, f"{value:.1f}", va="center", fontsize=8)
    axes.axvline(100 * ap[counted].mean().item(), color="0.3", linestyle="--", linewidth=1, label="mAP@class")
    axes.set_yticks(rows, names, fontsize=9)
    if hidden:
        between = f"{hidden} classes in between not shown"
        axes.axhline(half - 0.5, color="0.2", linewidth=1.2)
        axes.text(56, half - 0.5, between, ha="center", va="center", fontsize=8, backgroundcolor="white")
    axes.set(
        xlim=(0, 112), ylim=(len(order) - 0.5, -0.5), xlabel="AP (%)  --  n = positives in the validation set"
    )
    axes.set_title(title, fontsize=11)
    axes.legend(loc="lower right", fontsize=8)
    axes.grid(axis="x", alpha=0.3)
    if missing:
        figure.text(0.01, 0.002, f"{plural(missing, 'class')} without a positive label not shown", fontsize=8)
    return figure


def pr_curves_figure(
    scores: torch.Tensor, labels: torch.Tensor, ap: torch.Tensor, class_names: Sequence[str]
) -> Any:
    """Precision-recall curves (:func:`mlcls.reporting.report_data.pr_curve`) of the :data:`PR_CLASSES` best
    and worst classes (by ``ap``), side by side."""
    counted = ranked_classes(ap)
    k = max(1, min(PR_CLASSES, len(counted) // 2))
    panels = [("best", counted[:k])] + ([("worst", counted[-k:][::-1])] if len(counted) > 1 else [])
    figure = _figure(5.2 * len(panels), 4.6)
    for index, (which, classes) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), index + 1)
        for c in classes:
            recall, precision = pr_curve(scores[:, c].numpy(), labels[:, c].numpy(), None)
            label = f"{_literal(class_names[c])}  AP {100 * ap[c].item():.1f}"
            axes.plot(recall, precision, drawstyle="steps-post", linewidth=1.6, label=label)
        axes.set(xlim=(0, 1.01), ylim=(0, 1.03), xlabel="recall", ylabel="precision")
        axes.set_title(f"{which.capitalize()} {len(classes)} classes by AP", fontsize=11)
        axes.grid(alpha=0.3)
        # The curves and labels passed explicitly: matplotlib leaves a label starting with "_" out of a
        # legend it collects itself, and a class may be named "_background".
        curves = axes.get_lines()
        axes.legend(
            curves,
            [curve.get_label() for curve in curves],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.14),
            ncol=2,
            fontsize=8,
            frameon=False,
        )
    figure.suptitle("Precision-recall curves on the validation set", fontsize=12)
    return figure


def training_curves_figure(history: Sequence[dict[str, Any]]) -> Any:
    """Mean training loss per epoch (left) and mAP@class / mAP@sample of the evaluated epochs (right):
    :func:`mlcls.reporting.report_data.history_curves`."""
    from matplotlib.ticker import MaxNLocator

    figure = _figure(10.0, 4.0)
    for index, (title, y_label, _, series) in enumerate(history_curves(history)):
        axes = figure.add_subplot(1, 2, index + 1)
        for label, epochs, values in series:
            axes.plot(epochs, values, marker="o", label=label)
        axes.set_title(title, fontsize=11)
        axes.set(xlabel="epoch", ylabel=y_label)
        if len(series) > 1:
            axes.legend(loc="best", fontsize=9)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
    return figure


def write_plots(
    run_dir: str | Path,
    history: Sequence[dict[str, Any]],
    scores: torch.Tensor,
    labels: torch.Tensor,
    class_names: Sequence[str],
    per_class_ap: Mapping[str, float | None] | None,
    writer: Any = None,
) -> list[Path]:
    """Draw the run's figures into ``<run_dir>/plots/`` (and the TensorBoard ``writer``, at the last epoch);
    return the files written. ``history``: ``results.json``'s; ``scores`` (N, C) validation logits,
    ``labels`` (N, C) in {1, 0, -1}, ``class_names`` the C names, ``per_class_ap`` the same evaluation's
    per-class AP (percent by name, ``None`` without a positive: its metrics' ``per_class_ap``), read, not
    computed again (:func:`mlcls.reporting.report_data.class_ap`)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.info("plots skipped: matplotlib is not installed (pip install mlcls[plots])")
        return []
    scores, labels = scores.detach().float().cpu(), labels.detach().cpu()
    if len(class_names) != scores.shape[1]:
        raise ValueError(f"{len(class_names)} class names for {scores.shape[1]} score columns")
    ap = torch.tensor(class_ap(per_class_ap, class_names, scores, labels), dtype=torch.float64) / 100
    figures: dict[str, Any] = {}
    if not torch.isnan(ap).all():
        figures["per_class_ap"] = per_class_ap_figure(ap, (labels == 1).sum(0), class_names)
        figures["pr_curves"] = pr_curves_figure(scores, labels, ap, class_names)
    else:
        log.info("plots: no class has a positive validation label; per-class figures skipped")
    if history:
        figures["training_curves"] = training_curves_figure(history)
    step = int(history[-1]["epoch"]) if history else 0
    written = []
    for name, figure in figures.items():
        path = Path(run_dir) / "plots" / f"{name}.png"
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        atomic_write_bytes(path, buffer.getvalue())
        written.append(path)
        if writer is not None:
            figure.canvas.draw()
            pixels = np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()  # (H, W, 3) uint8
            writer.add_image(f"plots/{name}", pixels, step, dataformats="HWC")
    log.info("plots written to %s", Path(run_dir) / "plots")
    return written
