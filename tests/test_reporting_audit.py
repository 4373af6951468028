"""``mlcls-data audit``: K-fold out-of-sample probabilities, cleanlab's ranking, its files, resuming."""

from __future__ import annotations

import csv
import re
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import distinct_colours
from omegaconf import OmegaConf
from PIL import Image

from mlcls.cli.data import main
from mlcls.reporting.audit import fold_rows

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 230), "yellow": (230, 220, 30)}
IMAGES, SIDE, PATCH = 240, 32, 14
FLIPPED_SHARE = 0.1
# The audit's precision at k (k = the labels flipped) must reach this; chance is k / (images x classes).
PRECISION_FLOOR = 0.5
# Epochs per fold: 4 reach a precision of 0.79 at k=24 (1 or 2 threads), 6 reached 0.79-0.83, 3 0.62.
EPOCHS = 4


def write_flipped_csv(root: Path, seed: int = 0) -> tuple[np.ndarray, set[tuple[int, int]]]:
    """``root/train.csv`` (one column per colour) and ``root/images/NNN.png``: each image a grey noisy
    square holding a patch of each of its colours (each present with probability 0.4, independently).
    One label of 10 % of the images, drawn at random, is flipped in the CSV. Returns the true labels
    (images, colours) and the flipped ``(row, column)`` entries."""
    rng = np.random.default_rng(seed)
    truth = (rng.random((IMAGES, len(COLOURS))) < 0.4).astype(int)
    (root / "images").mkdir(parents=True)
    for i, row in enumerate(truth):
        pixels = np.clip(rng.normal(128, 20, (SIDE, SIDE, 3)), 0, 255).astype(np.uint8)
        for column in np.flatnonzero(row):
            x, y = rng.integers(0, SIDE - PATCH, 2)
            pixels[y : y + PATCH, x : x + PATCH] = list(COLOURS.values())[column]
        Image.fromarray(pixels).save(root / "images" / f"{i:03d}.png")
    rows = rng.choice(IMAGES, int(FLIPPED_SHARE * IMAGES), replace=False)
    flipped = {(int(row), int(rng.integers(len(COLOURS)))) for row in rows}
    given = truth.copy()
    for row, column in flipped:
        given[row, column] = 1 - given[row, column]
    lines = ["image," + ",".join(COLOURS)]
    lines += [f"images/{i:03d}.png," + ",".join(map(str, row)) for i, row in enumerate(given)]
    (root / "train.csv").write_text("\n".join(lines) + "\n")
    return truth, flipped


def audit_argv(root: Path, out: Path, *extra: str) -> list[str]:
    """The audit of the whole CSV (no image held out for validation) with timm's test_resnet at 32 px."""
    return [
        "audit", "dataset=csv", f"dataset.root={root}", "dataset.labels_column=null",
        "dataset.val_fraction=0", f"dataset.image_size={SIDE}", "dataset.transform=light",
        "model.name=test_resnet",
        "model.pretrained=false", "optim=adamw", "optim.lr_head=5e-3", "optim.lr_backbone=5e-3", "loss=bce",
        f"trainer.epochs={EPOCHS}", "trainer.batch_size=16", "trainer.workers=0", "trainer.device=cpu",
        "folds=2", f"out={out}", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """The flipped CSV audited once: its folder, the audit's folder, the flips, the output and wall time."""
    root = tmp_path_factory.mktemp("flipped")
    _, flipped = write_flipped_csv(root)
    out = root / "audit"
    start = time.perf_counter()
    code = main(audit_argv(root, out))
    return root, out, flipped, code, time.perf_counter() - start


def read_ranking(out: Path) -> list[dict[str, str]]:
    with open(out / "audit.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_the_audit_ranks_the_flipped_labels_first(audited, capsys) -> None:
    root, out, flipped, code, wall = audited
    assert code == 0
    ranking = read_ranking(out)
    k = len(flipped)
    colours = list(COLOURS)
    top = {(int(Path(row["image"]).stem), colours.index(row["class"])) for row in ranking[:k]}
    precision, chance = len(top & flipped) / k, k / (IMAGES * len(COLOURS))
    print(f"audit: precision at k={k} {precision:.3f} (chance {chance:.3f}), wall time {wall:.1f} s")
    assert precision >= PRECISION_FLOOR > 10 * chance


@pytest.mark.slow
def test_the_audit_files_hold_the_ranking(audited) -> None:
    root, out, flipped, _, _ = audited
    ranking = read_ranking(out)
    assert list(ranking[0]) == ["rank", "image", "class", "given_label", "probability", "score"]
    assert [int(row["rank"]) for row in ranking] == list(range(1, len(ranking) + 1))
    assert len(ranking) == IMAGES * len(COLOURS)  # every label known, fewer than top=1000
    scores = [float(row["score"]) for row in ranking]
    assert scores == sorted(scores)
    given = np.loadtxt(root / "train.csv", delimiter=",", skiprows=1, usecols=range(1, 5), dtype=int)
    for row in ranking[:50]:
        i, c = int(Path(row["image"]).stem), list(COLOURS).index(row["class"])
        assert int(row["given_label"]) == given[i, c]
        p = float(row["probability"])  # self-confidence: the probability of the given label
        assert float(row["score"]) == pytest.approx(p if given[i, c] == 1 else 1 - p, abs=2e-6)
    page = (out / "audit.html").read_text()
    assert page.count("<tr>") == len(ranking) + 1
    assert len(re.findall(r'<img data-thumb="t\d+"', page)) == len(ranking)  # each image's data: URI once:
    assert page.count('"data:image/jpeg;base64,') == len({row["image"] for row in ranking})
    assert "http://" not in page and "https://" not in page  # self-contained
    folds = sorted(p.name for p in (out / "folds").glob("*.npz"))
    assert folds == ["fold_0.npz", "fold_1.npz"]
    for fold in range(2):
        with np.load(out / "folds" / f"fold_{fold}.npz") as saved:
            assert saved["rows"].tolist() == fold_rows(IMAGES, 2, fold, 0).tolist()
            assert saved["probabilities"].shape == (IMAGES // 2, len(COLOURS))


@pytest.mark.slow
def test_a_rerun_reads_the_saved_folds_and_states_its_cost(audited, capsys) -> None:
    root, out, _, _, _ = audited
    before = (out / "audit.csv").read_text()
    start = time.perf_counter()
    assert main(audit_argv(root, out)) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == (
        f"audit of csv: 2 trainings of test_resnet for {EPOCHS} epochs each, on about 120 of the 240 "
        f"training images, each scoring the other 120 or so; saved folds in {out / 'folds'} are reused"
    )
    assert f"fold 1/2: read from {out / 'folds' / 'fold_0.npz'}" in printed
    assert f"fold 2/2: read from {out / 'folds' / 'fold_1.npz'}" in printed
    assert (out / "audit.csv").read_text() == before
    assert time.perf_counter() - start < 20  # no training
    lines = printed.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("first 20 of 960 ranked labels")))
    assert len(lines[first + 2 : first + 22]) == 20 and lines[first + 22] == ""
    assert lines[-2:] == [f"wrote {out / 'audit.csv'}", f"wrote {out / 'audit.html'}"]
    # other settings: the saved folds are refused, not mixed in
    assert main(audit_argv(root, out, "trainer.epochs=1")) == 2
    assert capsys.readouterr().err.strip() == (
        f"mlcls-data: error: {out / 'folds' / 'fold_0.npz'} holds the probabilities of an audit with other "
        "settings; pass another out= or delete the folder"
    )


def test_audit_mistakes_are_one_line(tmp_path: Path, capsys) -> None:
    root = tmp_path / "data"
    write_flipped_csv(root)
    for extra, message in (
        (["folds=1"], "folds=1; expected an integer >= 2 (each fold is scored by the others)"),
        (["folds=x"], "folds=x; expected a positive integer"),
    ):
        assert main(audit_argv(root, tmp_path / "out", *extra)) == 2
        assert capsys.readouterr().err.strip() == f"mlcls-data: error: {message}"


def test_packed_shards_are_refused_naming_the_source_to_audit(tmp_path: Path, capsys) -> None:
    """Shards are read in sequence: the audit, which reads the training split by index, says so."""
    out = tmp_path / "packed"
    synthetic = ["dataset=synthetic", "dataset.train_size=8", "dataset.val_size=4", "dataset.image_size=32"]
    assert main(["pack", *synthetic, f"out={out}", "shard_size=4", "max_side=32"]) == 0
    capsys.readouterr()
    assert main(["audit", "dataset=shards", f"dataset.root={out}", "folds=2", f"out={tmp_path / 'a'}"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mlcls-data: error: the training split of shards is read in sequence (packed shards), not by index; "
        "audit the dataset config the shards were packed from"
    )


@pytest.mark.slow
def test_the_audit_page_in_chromium_loads_every_image_and_sorts(audited, tmp_path) -> None:
    """audit.html in headless Chromium: no console message, every thumbnail decoded, a click on a header
    (through ``#sort=``) sorts by that column, and a screenshot that is not blank."""
    from test_reporting_report import body_data, open_page

    _, out, *_ = audited
    page = out / "audit.html"
    ranking = {int(row["rank"]): float(row["probability"]) for row in read_ranking(out)}
    dom, console = open_page(page, "--dump-dom", fragment="#sort=probability")
    assert console == []
    data = body_data(dom)
    assert int(data["images-total"]) > 0 and data["images-loaded"] == data["images-total"]
    ranks = [int(rank) for rank in re.findall(r"<tr><td[^>]*>(\d+)</td>", dom)]  # rank column, as shown
    assert ranks and ranks != sorted(ranks)  # the page was reordered ...
    shown = [ranking[rank] for rank in ranks]
    assert shown == sorted(shown)  # ... by the probability column
    shot = tmp_path / "audit.png"
    open_page(page, f"--screenshot={shot}")
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert distinct_colours(pixels) > 200  # thumbnails and text: not blank


# ----------------------------------------------------------------------- output for others, without training
HOSTILE_IMAGES = ("=HYPERLINK(0).png", "+1.png", "-2.png", "@SUM(1).png", "\x1b[2Jwiped.png", "plain.png")
HOSTILE_CLASSES = ("=cmd", "-minus", "\x1b]0;title\x07bell", "plain")


def write_hostile_csv(root: Path) -> np.ndarray:
    """``root/train.csv``: images named and classes named by someone else (formulas, terminal escapes);
    returns the given labels (images, classes)."""
    root.mkdir(parents=True)
    labels = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 1], [0, 1, 1, 0]])
    for name in HOSTILE_IMAGES:
        Image.new("RGB", (8, 8), (90, 120, 200)).save(root / name, format="PNG")
    with open(root / "train.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", *HOSTILE_CLASSES])
        writer.writerows([name, *row] for name, row in zip(HOSTILE_IMAGES, labels.tolist(), strict=True))
    return labels


def audit_with(monkeypatch, tmp_path: Path, probabilities) -> Path:
    """The audit of :func:`write_hostile_csv`'s CSV with the folds' probabilities ``probabilities(labels)``
    given instead of trained; returns its output folder."""
    import mlcls.reporting.audit as audit_module

    labels = write_hostile_csv(tmp_path / "data")
    given = probabilities(labels).astype(np.float32)
    monkeypatch.setattr(audit_module, "out_of_sample_probabilities", lambda *args: given)
    out = tmp_path / "audit"
    assert main(audit_argv(tmp_path / "data", out)) == 0
    return out


def test_audit_csv_keeps_formulas_from_running(monkeypatch, tmp_path: Path, capsys) -> None:
    """Every text cell of audit.csv that would start like a formula (=, +, -, @) starts with a ' instead:
    what a spreadsheet then shows as text (OWASP's CSV injection advice)."""
    out = audit_with(monkeypatch, tmp_path, lambda labels: np.full(labels.shape, 0.5))
    ranking = read_ranking(out)
    assert len(ranking) == len(HOSTILE_IMAGES) * len(HOSTILE_CLASSES)
    for row in ranking:
        for cell in row.values():
            assert not cell.startswith(("=", "+", "@")) and (not cell.startswith("-") or float(cell) >= 0)
        original = next(name for name in HOSTILE_CLASSES if row["class"].endswith(name))
        assert row["class"] == ("'" if original[0] in "=+-@" else "") + original
        assert Path(row["image"]).name in HOSTILE_IMAGES  # a path under the pinned root: '/...'
    assert sum(row["class"].startswith("'") for row in ranking) == 2 * len(HOSTILE_IMAGES)


def test_the_printed_suspects_carry_no_terminal_escape(monkeypatch, tmp_path: Path, capsys) -> None:
    audit_with(monkeypatch, tmp_path, lambda labels: np.full(labels.shape, 0.5))
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "\x07" not in printed
    assert "\\x1b[2Jwiped.png" in printed and "\\x1b]0;title\\x07bell" in printed  # shown, escaped


def test_the_audit_states_the_out_of_fold_map_and_warns_below_the_helpful_level(
    monkeypatch, tmp_path: Path, capsys
) -> None:
    from sklearn.metrics import average_precision_score

    from mlcls.reporting.audit import HELPFUL_MAP

    good = audit_with(monkeypatch, tmp_path / "good", lambda labels: 0.1 + 0.8 * labels)
    printed = capsys.readouterr()
    assert "out-of-fold mAP@class 100.0% (classes with a positive: 4 of 4)" in printed.out.splitlines()
    assert printed.err == ""
    assert "out-of-fold mAP@class 100.0%" in (good / "audit.html").read_text()

    # probabilities that rank each class's positives below its negatives, but for one
    reversed_order = np.random.default_rng(0).random((6, 4)) * 0.01
    audit_with(monkeypatch, tmp_path / "bad", lambda labels: 0.9 - 0.8 * labels + reversed_order)
    printed = capsys.readouterr()
    labels = write_hostile_csv(tmp_path / "reference")
    expected = 100 * average_precision_score(labels, 0.9 - 0.8 * labels + reversed_order, average="macro")
    assert expected < HELPFUL_MAP
    assert f"out-of-fold mAP@class {expected:.1f}% (classes with a positive: 4 of 4)" in printed.out
    assert printed.err.count("\n") == 1 and printed.err.startswith(
        f"mlcls-data: warning: the folds' models reach an out-of-fold mAP@class of {expected:.1f}%, below "
        f"{HELPFUL_MAP:g}%"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"folds": 1, "fold": 0}, "folds=1; expected an integer >= 2"),
        ({"folds": True, "fold": 0}, "folds=True; expected an integer >= 2"),
        ({"folds": 3, "fold": 3}, "fold=3; expected an integer from 0 to 2"),
        ({"folds": 9, "fold": 0}, "the training split has 8 samples, fewer than folds=9"),
    ],
)
def test_a_stored_fold_split_with_wrong_folds_is_one_line(options, message) -> None:
    """A fold run's config.yaml (someone else's, read back by mlcls-eval) builds its FoldSplit with what
    it holds: a wrong count or fold is one line, not a slice error or an empty fold."""
    from conftest import compose_config

    from mlcls.data import build_dataset
    from mlcls.data.datasets.base import DatasetConfigError

    source = compose_config(["dataset=synthetic", "dataset.train_size=8", "dataset.image_size=16"]).dataset
    fold_cfg = {
        "_target_": "mlcls.reporting.audit.FoldSplit",
        "_recursive_": False,
        "name": "fold",
        "val_split": "heldout",
        "image_size": 16,
        "source": OmegaConf.to_container(source, resolve=True),
        "seed": 0,
        **options,
    }
    with pytest.raises(DatasetConfigError) as raised:
        build_dataset(OmegaConf.create(fold_cfg), train=False)
    assert str(raised.value) == message


def test_a_saved_fold_is_checked_before_it_is_loaded(tmp_path: Path) -> None:
    """An earlier audit's fold file, read back: a genuine one as saved; one without its settings, or whose
    deflated member would expand to 64 MB, is one line before any array is loaded (old: a KeyError
    traceback, and the whole member unpacked)."""
    import tracemalloc

    from mlcls.errors import ConfigError
    from mlcls.reporting.audit import read_fold

    rows, probs = np.arange(4), np.full((4, 3), 0.5, dtype=np.float32)
    np.savez(tmp_path / "good.npz", rows=rows, probabilities=probs, settings=np.array("{}"))
    settings, read_rows, read_probs = read_fold(tmp_path / "good.npz")
    assert settings == "{}" and read_rows.tolist() == rows.tolist() and read_probs.tolist() == probs.tolist()
    np.savez(tmp_path / "no_settings.npz", rows=rows, probabilities=probs)
    bomb = np.zeros((1 << 14, 1 << 10), dtype=np.float32)  # 64 MB of zeros, under 100 kB deflated
    np.savez_compressed(tmp_path / "bomb.npz", rows=rows, probabilities=bomb, settings=np.array("{}"))
    for name, reason in (("no_settings", "no array 'settings'"), ("bomb", "its members declare 67,109,")):
        tracemalloc.start()
        try:
            with pytest.raises(ConfigError) as raised:
                read_fold(tmp_path / f"{name}.npz")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        message = str(raised.value)
        assert (
            message.startswith(f"{tmp_path / name}.npz is not a fold of mlcls-data audit (")
            and reason in message
        )
        assert "\n" not in message and peak < 32 << 20, (message, peak)


def test_folds_that_start_from_weights_take_the_fine_tune_recipe(monkeypatch, tmp_path: Path, capsys) -> None:
    """Started from weights, the folds train with experiment=finetune's schedule, classifier and augmentation;
    what the command line sets still wins (its rates, its epochs). The folds' probabilities are given, not
    trained: the test reads the config the folds would train with."""
    import mlcls.reporting.audit as audit_module

    write_hostile_csv(tmp_path / "data")
    seen = []
    monkeypatch.setattr(
        audit_module,
        "out_of_sample_probabilities",
        lambda cfg, num_rows, *args: seen.append(cfg) or np.full((num_rows, 4), 0.5, np.float32),
    )
    argv = [arg for arg in audit_argv(tmp_path / "data", tmp_path / "out") if arg != "model.pretrained=false"]
    assert main([*argv, "model.pretrained=true"]) == 0
    (cfg,) = seen
    recipe = (cfg.sched.decay_start, cfg.sched.warmup_epochs, cfg.model.classifier_init)
    assert recipe == (0.75, 1, "torch")
    given = (cfg.optim.lr_head, cfg.trainer.epochs, cfg.dataset.transform)
    assert given == (5e-3, EPOCHS, "light")  # the command line's
    printed = capsys.readouterr()
    assert "the folds start from weights: experiment=finetune (recipe=none keeps" in printed.out
    assert "what helps: experiment=finetune" in printed.err  # 0.5 everywhere: an mAP below the level


def test_the_folds_keep_their_config_from_scratch_with_another_experiment_or_when_told() -> None:
    from conftest import compose_config

    from mlcls.reporting.audit import fold_overrides

    overrides = ["dataset=csv", "model.pretrained=true"]
    cfg = compose_config(overrides)
    assert fold_overrides(cfg, overrides, "auto") == ["experiment=finetune", *overrides]
    assert fold_overrides(cfg, overrides, "none") is None
    assert fold_overrides(cfg, [*overrides, "experiment=paper"], "auto") is None
    for weights in ("checkpoint_path", "init_from"):
        cfg.model.pretrained, cfg.model[weights] = False, "weights.pt"
        assert fold_overrides(cfg, overrides, "auto") is not None, weights
        cfg.model[weights] = None
    assert fold_overrides(cfg, overrides, "auto") is None  # from scratch
    with pytest.raises(ValueError, match="recipe 'paper'; expected one of 'auto', 'none'"):
        fold_overrides(cfg, overrides, "paper")
