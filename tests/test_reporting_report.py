"""The run report: written by a tiny training run, its galleries checked against the saved predictions, the
label-error ranking against known flips, the CLI, and the page in a real browser (headless Chromium)."""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import numpy as np
import pytest
import torch
from conftest import TINY_RESNET10T as TINY
from conftest import compose_config, distinct_colours
from omegaconf import OmegaConf
from PIL import Image
from sklearn.metrics import average_precision_score

import mlcls.engine.evaluate as evaluate_module
import mlcls.metrics.ap as ap_module
from mlcls.cli.report import main as report_main
from mlcls.cli.train import run
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.engine.config_checks import check_config
from mlcls.errors import ConfigError
from mlcls.metrics import compute_metrics, store_metrics
from mlcls.metrics.ap import ranked_positives
from mlcls.reporting import report, report_data, run_files
from mlcls.reporting.report_data import ValPredictions, label_issues, load_val_predictions

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FOOTER_RGB = (0x1D, 0x2B, 0x3A)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished tiny run (75 validation images, 12 classes) with its report, and what was computed while
    it trained and reported: ``"evaluation"`` for each evaluation's figures, ``"per-class AP"`` for each
    ranking of the classes' scores behind an AP (:func:`mlcls.metrics.ap.ranked_positives` along dim 0)."""
    out = tmp_path_factory.mktemp("run")
    computed: list[str] = []

    def ranked(scores, labels, dim):
        computed.extend(["per-class AP"] if dim == 0 else [])
        return ranked_positives(scores, labels, dim)

    def figures(*args, **kwargs):
        computed.append("evaluation")
        return store_metrics(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ap_module, "ranked_positives", ranked)
        patch.setattr(evaluate_module, "store_metrics", figures)
        run(compose_config([*TINY, "trainer.report=true"]), run_dir=out)
    return out, computed


@pytest.fixture(scope="module")
def run_dir(trained) -> Path:
    return trained[0]


class Page(HTMLParser):
    """The report's gallery cards per section (``(image, headline, thumbnail key)``), its thumbnails and
    the per-class table's rows (cell ``data-v`` values)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.cards: dict[str, list[list[str | None]]] = {}
        self.rows: list[list[str]] = []
        self._section = self._details = None
        self._in_headline = self._in_thumbs = self._in_table = False
        self.thumbs_json = ""
        self.feed(text)
        self.thumbs = json.loads(self.thumbs_json)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self._section = a["id"]
        elif tag == "details":
            self._details = a["id"]
        elif tag == "figure":
            self.cards.setdefault(self._details or self._section, []).append([a["data-image"], "", None])
        elif tag == "img" and "data-thumb" in a:
            self.cards[self._details or self._section][-1][2] = a["data-thumb"]
        elif tag == "span" and a.get("class") == "w":
            self._in_headline = True
        elif tag == "script" and a.get("id") == "thumbs":
            self._in_thumbs = True
        elif tag == "table" and a.get("id") == "classes":
            self._in_table = True
        elif tag == "tr" and self._in_table:
            self.rows.append([])
        elif tag == "td" and self._in_table:
            self.rows[-1].append(a["data-v"])

    def handle_endtag(self, tag):
        if tag == "details":
            self._details = None
        elif tag == "span":
            self._in_headline = False
        elif tag == "script":
            self._in_thumbs = False
        elif tag == "table":
            self._in_table = False

    def handle_data(self, data):
        if self._in_headline:
            self.cards[self._details or self._section][-1][1] += data
        elif self._in_thumbs:
            self.thumbs_json += data


def expected_errors(
    p: ValPredictions, kind: str, count: int, cls: int | None = None
) -> list[tuple[str, str]]:
    """The ``count`` most confident errors, recomputed here: (image, class) of the false positives (label 0,
    score >= threshold) by score - threshold, or false negatives (label 1, below) by threshold - score,
    largest first, ties by row then class."""
    cases = []
    for row in range(p.scores.shape[0]):
        for c in range(p.scores.shape[1]) if cls is None else [cls]:
            above = float(p.scores[row, c]) >= p.thresholds[c]
            if kind == "fp" and p.labels[row, c] == 0 and above:
                cases.append((-(float(p.scores[row, c]) - p.thresholds[c]), row, c))
            elif kind == "fn" and p.labels[row, c] == 1 and not above:
                cases.append((-(p.thresholds[c] - float(p.scores[row, c])), row, c))
    return [(p.ids[row], p.classes[c]) for _, row, c in sorted(cases)[:count]]


def shown_errors(cards: list[list[str | None]], kind: str) -> list[tuple[str, str]]:
    word = " predicted" if kind == "fp" else " missed"
    return [(image, headline[: -len(word)]) for image, headline, _ in cards if headline.endswith(word)]


@pytest.mark.slow
def test_train_writes_the_report_whose_galleries_hold_the_wrong_images(run_dir):
    page = Page((run_dir / "report.html").read_text())
    p = load_val_predictions(run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    # the saved predictions are the run's last evaluation: its per-class AP, and last.pt's thresholds
    for c, name in enumerate(p.classes):
        ap = 100 * average_precision_score(p.labels[:, c] == 1, p.scores[:, c])
        assert ap == pytest.approx(results["per_class_ap"][name], abs=1e-6)
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
    np.testing.assert_array_equal(p.thresholds, last["thresholds"].numpy())
    val = SyntheticMultiLabel("val", val_size=75)
    assert p.ids == [s.path for s in val.samples] and p.epoch == 2

    for kind in ("fp", "fn"):
        expected = expected_errors(p, kind, report.OVERALL_CARDS)
        assert len(expected) == report.OVERALL_CARDS
        assert shown_errors(page.cards["errors"], kind) == expected
    worst = min(range(12), key=lambda c: results["per_class_ap"][p.classes[c]])
    for kind in ("fp", "fn"):
        shown = shown_errors(page.cards[f"class-{worst}"], kind)
        assert shown == expected_errors(p, kind, report.PER_CLASS_CARDS, cls=worst)
    # each card's thumbnail is its image: nearer to it than to any other validation image
    for image, _, key in page.cards["errors"][:6]:
        row = p.ids.index(image)
        data = base64.b64decode(page.thumbs[key].split(",", 1)[1])
        shown = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=float)
        distances = [np.abs(shown - np.asarray(val.load_image(i), dtype=float)).mean() for i in range(75)]
        nearest, second = np.argsort(distances)[:2]
        assert nearest == row and distances[row] < distances[second] / 2
    # the table lists every class, worst AP first
    assert [row[0] for row in page.rows[1:]] == sorted(p.classes, key=lambda n: results["per_class_ap"][n])


@pytest.mark.slow
def test_per_class_ap_is_computed_once_per_evaluation_and_read_by_the_plots_and_report(trained):
    """Each evaluation ranks the classes once for their AP; the plots and the report drawn after the last
    one read its per-class AP (old: each ranked them again, two more per run)."""
    _, computed = trained
    assert computed.count("evaluation") == 2  # two epochs, each evaluated
    assert computed == ["evaluation", "per-class AP"] * 2


def report_problem() -> tuple[ValPredictions, dict[str, float | None]]:
    """Predictions of 6 classes (one without a positive, some unknown labels) and the per-class AP an
    evaluation of them holds (its metrics')."""
    rng = np.random.default_rng(4)
    labels = (rng.random((60, 6)) < 0.3).astype(np.int8)
    labels[:, 2] = 0
    labels[rng.random((60, 6)) < 0.1] = -1
    scores = (rng.normal(size=(60, 6)) + 1.5 * (labels == 1)).astype(np.float32)
    p = ValPredictions(
        scores, labels, np.zeros(6), list("abcdef"), [f"i{k}" for k in range(60)], np.arange(60), 1
    )
    return p, compute_metrics(torch.from_numpy(scores), torch.from_numpy(labels), p.classes)["per_class_ap"]


def test_the_report_table_shows_the_evaluations_per_class_ap_which_is_sklearns(monkeypatch):
    p, per_class_ap = report_problem()
    expected = {}
    for c, name in enumerate(p.classes):
        known = p.labels[:, c] >= 0
        truth = p.labels[known, c] == 1
        expected[name] = 100 * average_precision_score(truth, p.scores[known, c]) if truth.any() else None
    assert expected["c"] is None
    for stored in (per_class_ap, None):  # None: a run directory without it, the saved scores ranked instead
        shown = {
            row["name"]: None if np.isnan(row["ap"]) else row["ap"]
            for row in report_data.class_rows(p, stored)
        }
        assert shown.keys() == expected.keys() and shown["c"] is None
        for name, ap in expected.items():
            if ap is not None:
                assert shown[name] == pytest.approx(ap, abs=1e-9)
    # read, not computed again: a stored value is what the table shows, and the scores are not ranked
    monkeypatch.setattr(
        ap_module, "ranked_positives", lambda *args: pytest.fail("per-class AP computed again")
    )
    rows = report_data.class_rows(p, per_class_ap | {"a": 12.5})
    assert next(row["ap"] for row in rows if row["name"] == "a") == 12.5


def test_label_issues_rank_the_flipped_labels_first():
    rng = np.random.default_rng(0)
    truth = rng.random((300, 6)) < 0.3
    scores = np.where(truth, 2.5, -2.5) + rng.normal(0, 1.0, truth.shape) + 1.0  # thresholds at 1.0
    given = truth.copy()
    flipped = rng.choice(300, size=15, replace=False)
    flipped_class = rng.integers(0, 6, size=15)
    given[flipped, flipped_class] = ~given[flipped, flipped_class]
    p = ValPredictions(
        scores.astype(np.float32), given.astype(np.int8), np.full(6, 1.0), list("abcdef"),
        [f"img{k}" for k in range(300)], np.arange(300), 1,
    )  # fmt: skip
    issues, flagged = label_issues(p, np.arange(300), 15)
    hits = {i.row for i in issues} & set(flipped.tolist())
    assert len(hits) >= 13, (len(hits), flagged)  # precision at 15 of at least 0.87; chance: 0.05
    disputed = {i.row: i.cls for i in issues}
    assert all(disputed[r] == c for r, c in zip(flipped, flipped_class, strict=True) if r in hits)
    assert {i.row for i in issues if i.flagged} <= set(flipped.tolist()) and flagged >= 5


@pytest.mark.slow
def test_report_cli_writes_the_page_again_and_samples_large_validation_sets(run_dir, monkeypatch, capsys):
    """The CLI reads results.json and val_predictions.npz once each (old: twice, for the validation set and
    again for the page)."""
    monkeypatch.setattr(report, "MAX_GALLERY_IMAGES", 30)
    opened = []
    for module, name in ((run_files, "read_json"), (report_data, "open_regular")):
        original = getattr(module, name)

        def counted(path, *args, original=original, **kwargs):
            opened.append(Path(path).name)
            return original(path, *args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    (run_dir / "report.html").rename(run_dir / "report_full.html")
    try:
        assert report_main([str(run_dir)]) == 0
        assert sorted(opened) == ["results.json", "val_predictions.npz"]
        assert capsys.readouterr().out.startswith(f"{run_dir / 'report.html'} (")
        text = (run_dir / "report.html").read_text()
    finally:
        (run_dir / "report_full.html").replace(run_dir / "report.html")
    assert "random sample of 30 of the 75 validation images" in text
    page = Page(text)
    shown = {image for key in ("errors", "label-issues") for image, _, _ in page.cards[key]}
    assert 0 < len(shown) <= 30


@pytest.mark.slow
def test_report_lists_the_settings_that_differ_from_the_defaults(run_dir):
    text = (run_dir / "report.html").read_text()
    settings = re.search(r'<section id="settings">(.*?)</section>', text).group(1)
    keys = set(re.findall(r"<code>([\w.]+)</code>", settings))
    defaults = compose_config([])
    expected = set()
    for override in TINY[1:]:  # TINY[0] selects the default dataset
        if override.startswith("trainer.report="):  # the fixture turns the report back on
            continue
        key, value = override.split("=")
        section, name = key.split(".")
        if str(defaults[section][name]).lower() != value.lower():
            expected.add(key)
    assert keys == expected


def test_trainer_report_must_be_a_boolean():
    with pytest.raises(ConfigError, match=r"trainer.report='maybe'; expected true or false"):
        check_config(compose_config([*TINY, "trainer.report=maybe"]), world_size=1)


def test_report_cli_errors_in_one_line(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mlcls: error: ") and "mlcls run directory" in err


# ---------------------------------------------------------------------- a generated run of many classes
TAG_WORDS = (
    "long_hair",
    "smile",
    "outdoors",
    "blue_eyes",
    "holding_umbrella",
    "sky",
    "1girl",
    "täg",
    "</script>&",
)


class GeneratedImages:
    """A validation split of ``count`` generated images (``samples[i].path``, ``picture(i)``): the report's
    thumbnails' source for a run that was not trained."""

    def __init__(self, count: int) -> None:
        self.samples = [SimpleNamespace(path=f"val/{i:05d}.jpg") for i in range(count)]

    def __len__(self) -> int:
        return len(self.samples)

    def picture(self, index: int) -> Image.Image:
        pixels = np.random.default_rng(index).integers(0, 256, (12, 16, 3), dtype=np.uint8)
        return Image.fromarray(pixels).resize((320, 240), Image.Resampling.BILINEAR)


def generated_run(run_dir: Path, num_classes: int, rows: int = 40, seed: int = 0) -> GeneratedImages:
    """Write the files a finished run leaves for its report (``results.json`` with the evaluation's
    per-class AP, ``config.yaml``, ``val_predictions.npz``) for ``num_classes`` tags of Zipf-like frequency
    (most without a validation positive) on ``rows`` generated images; return the images."""
    rng = np.random.default_rng(seed)
    classes = [f"{TAG_WORDS[c % len(TAG_WORDS)]}_{c}" for c in range(num_classes)]
    frequency = np.minimum(0.5, 1.3 / np.arange(1, num_classes + 1) ** 0.9)  # ~27 a row at 75,000
    labels = torch.from_numpy((rng.random((rows, num_classes), dtype=np.float32) < frequency).astype(np.int8))
    scores = torch.from_numpy(rng.normal(size=(rows, num_classes)).astype(np.float32)) + 1.5 * labels
    metrics = compute_metrics(scores, labels, classes)
    per_class_ap = metrics.pop("per_class_ap")
    history = [
        {"epoch": 1, "loss": 0.5, "mAP_class": metrics["mAP_class"], "mAP_sample": metrics["mAP_sample"]}
    ]
    results = {
        "metrics": metrics,
        "per_class_ap": per_class_ap,
        "dataset": {
            "name": "generated",
            "num_classes": num_classes,
            "train_size": 10 * rows,
            "val_size": rows,
        },
        "epochs_completed": 1,
        "history": history,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps(results))
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(compose_config([])))
    images = GeneratedImages(rows)
    thresholds = torch.zeros(num_classes, dtype=torch.float64)
    report_data.save_val_predictions(run_dir, scores, labels, thresholds, classes, images, epoch=1)
    return images


# ---------------------------------------------------------------------- the page in a real browser
def browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Chromium found: apt-get install chromium")


def open_page(page: Path, *args: str, fragment: str = "") -> tuple[str, list[str]]:
    """Run headless Chromium on ``page`` + ``fragment`` with ``args`` (in a window 1280 pixels wide unless
    they say otherwise; the page's scripts and images given 10 s of virtual time); return its stdout and
    the page's console messages."""
    profile = page.parent / ".chromium-profile"
    command = [
        browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
        f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000",
        "--window-size=1280,1000", *args, page.resolve().as_uri() + fragment,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


def body_data(dom: str) -> dict[str, str]:
    body = re.search(r"<body([^>]*)>", dom).group(1)
    return dict(re.findall(r'data-([\w-]+)="([^"]*)"', body))


def table_names(dom: str) -> list[str]:
    table = re.search(r'<table id="classes">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
    return [html.unescape(name) for name in re.findall(r'<tr><td data-v="([^"]*)"', table)]


@pytest.mark.slow
def test_browser_check_sees_console_errors_and_broken_images(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><body><img data-thumb=x src='data:image/png;base64,AAAA'>"
        "<script>window.onload = () => { const i = document.images[0]; document.body.dataset.w = "
        "i.naturalWidth; }; undefinedFunction();</script></body></html>"
    )
    dom, console = open_page(page, "--dump-dom")
    assert body_data(dom)["w"] == "0" and any("undefinedFunction" in line for line in console)


@pytest.mark.slow
def test_report_in_chromium_loads_every_image_sorts_and_screenshots(run_dir, tmp_path):
    page = run_dir / "report.html"
    text = page.read_text()
    results = json.loads((run_dir / "results.json").read_text())
    ap = results["per_class_ap"]

    assert table_names(text) == sorted(ap, key=lambda n: ap[n])  # worst first, as written
    dom, console = open_page(page, "--dump-dom", fragment="#sort=name")
    assert console == [] and table_names(dom) == sorted(ap)
    data = body_data(dom)
    images = len(re.findall(r"<img data-thumb=", text))
    assert images > 40 and int(data["images-total"]) == images and int(data["images-loaded"]) == images
    dom, console = open_page(page, "--dump-dom", fragment="#sort=ap")  # AP is sorted: a click reverses it
    assert console == [] and table_names(dom) == sorted(ap, key=lambda n: -ap[n])

    height, end = int(data["page-height"]), int(data["end-bottom"])
    shot = tmp_path / "report.png"
    open_page(page, f"--window-size=1280,{height}", f"--screenshot={shot}")
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape[0] >= end - 1 and pixels.shape[1] == 1280
    assert distinct_colours(pixels) > 500  # not blank
    footer = pixels[end - 6, 100:1180]
    assert (np.abs(footer.astype(int) - FOOTER_RGB).max(axis=1) <= 2).mean() > 0.9  # the page's end is in it
    target = os.environ.get("MLCLS_WRITE_SCREENSHOT")
    if target:
        Image.fromarray(pixels[: min(height, 1400)]).save(target, optimize=True)
        assert Path(target).stat().st_size < 300_000


def table_rows(page: str, table_id: str) -> list[str]:
    """The class names of the rows of table ``table_id`` of ``page``, in order."""
    table = re.search(rf'<table id="{table_id}"[^>]*>.*?<tbody>(.*?)</tbody>', page, re.S).group(1)
    return [html.unescape(name) for name in re.findall(r'<tr><td data-v="([^"]*)"', table)]


def json_script(page: str, element_id: str) -> object:
    return json.loads(
        re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', page).group(1)
    )


@pytest.fixture
def composed_defaults(monkeypatch):
    """The report's default settings from the suite's cached composition (a fresh one takes 0.3-2 s)."""
    defaults = OmegaConf.to_container(compose_config([]), resolve=True)
    monkeypatch.setattr(report, "default_settings", lambda: defaults)


def test_a_report_of_thousands_of_tags_has_three_tables_a_search_over_all_and_a_bounded_size(
    tmp_path, composed_defaults, monkeypatch
):
    """Over 150 classes the page holds the 50 worst and best by AP and the 50 most frequent, and one JSON
    index of every class for its search box; what grows with the classes is that index alone, projected
    under 5 MB at 75,000 classes (with the 100 classes' details and the thumbnails' budget, whose sizes do
    not depend on the class count)."""
    details, all_details = 10, report.MAX_CLASS_DETAILS  # the rest are projected from the 10's size
    monkeypatch.setattr(report, "MAX_CLASS_DETAILS", details)
    monkeypatch.setattr(report, "MAX_GALLERY_CELLS", 30_000)  # 10 images at 3,000 classes, all 20 at 300
    sizes = {}
    for classes in (300, 3000):
        run_dir = tmp_path / str(classes)
        page = report.write_report(run_dir, generated_run(run_dir, classes, rows=20)).read_text()
        thumbs = len(re.search(r'id="thumbs">(.*?)</script>', page).group(1))
        sizes[classes] = len(page.encode()) - thumbs
    detail_bytes = len(re.search(r'<section id="classes-detail">(.*?)</section>', page).group(1)) / details
    results = json.loads((run_dir / "results.json").read_text())
    p = load_val_predictions(run_dir)
    ap, order = results["per_class_ap"], {name: c for c, name in enumerate(p.classes)}
    positives = (p.labels == 1).sum(0)
    assert sum(value is None for value in ap.values()) > 1000  # most tags have no validation positive

    index = json_script(page, "class-index")
    assert index["name"] == p.classes and index["positives"] == positives.tolist()
    assert index["ap"] == [None if ap[name] is None else round(ap[name], 1) for name in p.classes]
    scored = [name for name in p.classes if ap[name] is not None]
    assert table_rows(page, "classes-worst") == sorted(scored, key=lambda n: (ap[n], order[n]))[:50]
    best = sorted(scored, key=lambda n: (ap[n], order[n]), reverse=True)[:50]
    assert table_rows(page, "classes-best") == best
    frequent = sorted(p.classes, key=lambda n: (-positives[order[n]], order[n]))[:50]
    assert table_rows(page, "classes-frequent") == frequent
    assert '<table id="classes"' not in page and page.count("<tr>") < 200
    assert "random sample of 10 of the 20 validation images" in page
    per_class = (sizes[3000] - sizes[300]) / 2700
    assert per_class < 40  # bytes a class: the index's entry
    more_details = detail_bytes * (all_details - details)
    assert sizes[3000] + per_class * (75_000 - 3000) + more_details + report.MAX_THUMBNAIL_BYTES < 5_000_000


@pytest.mark.slow
def test_the_search_box_finds_any_of_thousands_of_tags_in_chromium(tmp_path, composed_defaults):
    """``#search=`` types a query: the first 50 classes holding it, whatever its case, in class order, and
    their number; names with markup and accents are text, found like any other."""
    page = report.write_report(tmp_path, generated_run(tmp_path, 3000, rows=20))
    classes = load_val_predictions(tmp_path).classes
    for query in ("UMBRELLA_1", "</SCRIPT>&_2", "t\u00e4g_2"):
        dom, console = open_page(page, "--dump-dom", fragment=f"#search={quote(query)}")
        matches = [name for name in classes if query.lower() in name.lower()]
        assert console == [] and int(body_data(dom)["search-matches"]) == len(matches) > 0
        found = re.search(r'<table id="class-search-results"[^>]*>.*?<tbody>(.*?)</tbody>', dom, re.S)
        cells = re.findall(r"<tr><td>(.*?)</td>", found.group(1))
        assert [html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in cells] == matches[: report.TABLE_ROWS]
