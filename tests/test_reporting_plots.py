"""Run figures: PNG files, bars and curves against scikit-learn, TensorBoard, and no matplotlib."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.metrics import average_precision_score

pytest.importorskip("matplotlib")

from mlcls.metrics import compute_metrics  # noqa: E402
from mlcls.reporting import plots  # noqa: E402

HISTORY = [
    {"epoch": 1, "loss": 0.61, "images_per_s": 90.0, "time_s": 3.0},
    {"epoch": 2, "loss": 0.45, "images_per_s": 95.0, "time_s": 3.1, "mAP_class": 41.0, "mAP_sample": 60.5},
    {"epoch": 3, "loss": 0.38, "images_per_s": 96.0, "time_s": 3.0},
    {"epoch": 4, "loss": 0.33, "images_per_s": 97.0, "time_s": 3.0, "mAP_class": 48.2, "mAP_sample": 66.0},
]


def problem(num_classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Scores of growing quality per class, some -1 labels, and class 1 without any positive."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(300, num_classes, generator=g) < 0.3).float()
    labels[:, 1] = 0
    scores = torch.randn(300, num_classes, generator=g) + torch.linspace(0, 3, num_classes) * labels
    labels[torch.rand(300, num_classes, generator=g) < 0.05] = -1
    return scores, labels, [f"class_{c:03d}" for c in range(num_classes)]


def sklearn_ap(scores: torch.Tensor, labels: torch.Tensor) -> dict[int, float]:
    """AP in percent of every class with a positive, -1 entries left out."""
    result = {}
    for c in range(scores.shape[1]):
        known = labels[:, c] >= 0
        if (labels[known, c] == 1).any():
            result[c] = 100 * average_precision_score(labels[known, c] == 1, scores[known, c].double())
    return result


def evaluated(scores: torch.Tensor, labels: torch.Tensor, names: list[str]) -> dict[str, float | None]:
    """The evaluation's per-class AP of ``scores`` (what a run hands the plots): its metrics'."""
    return compute_metrics(scores, labels, names)["per_class_ap"]


class RecordingWriter:
    def __init__(self) -> None:
        self.images: list[tuple[str, tuple[int, ...], int, str]] = []

    def add_image(self, tag: str, image: np.ndarray, step: int, dataformats: str) -> None:
        self.images.append((tag, image.shape, step, dataformats))


@pytest.mark.slow  # over 2 s of the fast run's time
def test_write_plots_files_and_tensorboard_images(tmp_path):
    scores, labels, names = problem(12)
    writer = RecordingWriter()
    written = plots.write_plots(
        tmp_path, HISTORY, scores, labels, names, evaluated(scores, labels, names), writer=writer
    )

    expected = [tmp_path / "plots" / f"{n}.png" for n in ("per_class_ap", "pr_curves", "training_curves")]
    assert written == expected
    for path, (tag, shape, step, layout) in zip(expected, writer.images, strict=True):
        with Image.open(path) as png:
            assert png.format == "PNG" and png.width >= 600 and png.height >= 300
            assert shape == (png.height, png.width, 3)
        assert (tag, step, layout) == (f"plots/{path.stem}", 4, "HWC")
    assert not list((tmp_path / "plots").glob(".*tmp"))  # atomic writes leave no temporary file


@pytest.mark.slow
def test_real_summary_writer_receives_the_figures(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    scores, labels, names = problem(6)
    with SummaryWriter(str(tmp_path / "tb")) as writer:
        plots.write_plots(
            tmp_path, HISTORY, scores, labels, names, evaluated(scores, labels, names), writer=writer
        )
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["images"]) == [
        "plots/per_class_ap",
        "plots/pr_curves",
        "plots/training_curves",
    ]


def test_bars_are_the_sklearn_ap_best_first_and_skip_classes_without_positive():
    scores, labels, names = problem(12)
    reference = sklearn_ap(scores, labels)
    assert 1 not in reference
    ap = torch.tensor([reference.get(c, float("nan")) / 100 for c in range(12)], dtype=torch.float64)
    figure = plots.per_class_ap_figure(ap, (labels == 1).sum(0), names)
    axes = figure.axes[0]
    widths = [bar.get_width() for bar in axes.patches]
    order = sorted(reference, key=lambda c: -reference[c])
    np.testing.assert_allclose(widths, [reference[c] for c in order], atol=1e-9)
    shown = [tick.get_text().split(" ")[0] for tick in axes.get_yticklabels()]
    assert shown == [names[c] for c in order]
    assert f"mAP@class {np.mean(list(reference.values())):.1f}" in axes.get_title()


def test_write_plots_draws_the_evaluations_per_class_ap_which_is_sklearns(tmp_path, monkeypatch):
    """The AP write_plots draws is the evaluation's (its metrics' ``per_class_ap``, read, not computed
    again: a changed value is drawn as given), and that equals scikit-learn's."""
    drawn = []
    monkeypatch.setattr(
        plots, "per_class_ap_figure", lambda ap, *args: drawn.append(ap) or plots._figure(1, 1)
    )
    monkeypatch.setattr(plots, "pr_curves_figure", lambda *args: plots._figure(1, 1))
    scores, labels, names = problem(8)
    per_class_ap = evaluated(scores, labels, names)
    plots.write_plots(tmp_path, [], scores, labels, names, per_class_ap)
    reference = sklearn_ap(scores, labels)
    expected = [reference.get(c, float("nan")) / 100 for c in range(8)]
    np.testing.assert_allclose(drawn[0].numpy(), expected, rtol=1e-12)
    per_class_ap[names[0]] = 12.5
    plots.write_plots(tmp_path, [], scores, labels, names, per_class_ap)
    assert drawn[1][0].item() == 0.125
    torch.testing.assert_close(drawn[1][1:], drawn[0][1:], rtol=0, atol=0, equal_nan=True)


def test_many_classes_show_the_best_and_worst_half_of_max_bars():
    scores, labels, names = problem(150, seed=1)
    reference = sklearn_ap(scores, labels)
    order = sorted(reference, key=lambda c: -reference[c])
    half = plots.MAX_BARS // 2
    ap = torch.tensor([reference.get(c, float("nan")) / 100 for c in range(150)], dtype=torch.float64)
    axes = plots.per_class_ap_figure(ap, (labels == 1).sum(0), names).axes[0]
    shown = [tick.get_text().split(" ")[0] for tick in axes.get_yticklabels()]
    assert shown == [names[c] for c in order[:half] + order[-half:]]


# "_": class names with a leading underscore, which matplotlib leaves out of a legend it collects itself
@pytest.mark.parametrize("prefix", ["", "_"])
def test_pr_curves_show_the_best_and_worst_classes(prefix: str):
    scores, labels, names = problem(12)
    names = [prefix + name for name in names]
    reference = sklearn_ap(scores, labels)
    order = sorted(reference, key=lambda c: -reference[c])
    ap = torch.tensor([reference.get(c, float("nan")) / 100 for c in range(12)], dtype=torch.float64)
    best, worst = plots.pr_curves_figure(scores, labels, ap, names).axes
    k = plots.PR_CLASSES
    assert [t.get_text().split()[0] for t in best.get_legend().get_texts()] == [names[c] for c in order[:k]]
    assert [t.get_text().split()[0] for t in worst.get_legend().get_texts()] == [
        names[c] for c in order[::-1][:k]
    ]
    curve = best.get_lines()[0]
    assert curve.get_xdata().max() == 1.0 and curve.get_ydata().min() > 0  # recall reaches 1


def test_without_matplotlib_one_line_and_nothing_written(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    scores, labels, names = problem(4)
    with caplog.at_level(logging.INFO, logger="mlcls"):
        assert (
            plots.write_plots(tmp_path, HISTORY, scores, labels, names, evaluated(scores, labels, names))
            == []
        )
    assert [r.getMessage() for r in caplog.records] == [
        "plots skipped: matplotlib is not installed (pip install mlcls[plots])"
    ]
    assert not (tmp_path / "plots").exists()


def test_class_names_with_dollars_are_drawn_as_they_are_not_as_math(tmp_path):
    scores, labels, names = problem(6)
    names[0], names[2], names[3] = "price_$5_to_$10", "cost_$x^2$", "$"
    written = plots.write_plots(tmp_path, HISTORY, scores, labels, names, evaluated(scores, labels, names))
    assert [path.name for path in written] == ["per_class_ap.png", "pr_curves.png", "training_curves.png"]

    ap = torch.tensor([sklearn_ap(scores, labels).get(c, float("nan")) / 100 for c in range(6)])
    figures = [
        plots.per_class_ap_figure(ap, (labels == 1).sum(0), names),
        plots.pr_curves_figure(scores, labels, ap, names),
    ]
    texts = list(figures[0].axes[0].get_yticklabels())
    texts += [text for axes in figures[1].axes for text in axes.get_legend().get_texts()]
    drawn = {name: 0 for name in names if "$" in name}
    for figure in figures:
        figure.canvas.draw()
    for text in texts:
        literal = text.get_text().replace(r"\$", "$")
        name = next((n for n in drawn if literal.startswith(n + " ")), None)
        if name is None:
            continue
        drawn[name] += 1
        # the same characters drawn with math text off: the label is the literal name, same width
        reference = text.figure.text(
            0, 0, literal, fontproperties=text.get_fontproperties(), parse_math=False
        )
        renderer = text.figure.canvas.get_renderer()
        assert text.get_window_extent(renderer).width == pytest.approx(
            reference.get_window_extent(renderer).width
        ), literal
    assert all(drawn.values()), drawn  # each name appears as a tick label (and some in a legend)
