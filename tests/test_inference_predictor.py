"""mlcls-predict: image discovery, labels against an independent timm + torchvision reference, the CLI."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_main
from inference_fixtures import reference_logits, trained_run, write_images

from mlcls.cli import predict as predict_cli
from mlcls.inference.predictor import ImageFiles, find_images, load_inference_model, predict_images


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory)


@pytest.fixture
def images(tmp_path) -> tuple[Path, list[Path], Path]:
    """A folder of 7 readable images (some nested) and one corrupt file; (folder, readable, corrupt)."""
    folder = tmp_path / "photos"
    readable = write_images(folder)
    corrupt = folder / "corrupt.jpg"
    corrupt.write_bytes(b"\xff\xd8 this is not a JPEG")
    return folder, readable, corrupt


def expected_labels(logits: torch.Tensor, chosen: np.ndarray, classes: list[str]) -> list[list[str]]:
    """Names of the chosen classes of each row, by decreasing logit."""
    return [
        [classes[c] for c in np.argsort(-row.numpy(), kind="stable") if keep[c]]
        for row, keep in zip(logits, chosen, strict=True)
    ]


def test_find_images_files_folders_globs(tmp_path):
    for name in ("a.jpg", "B.JPG", "sub/c.png", "sub/deep/d.webp", "notes.txt", "sub/e.jpeg"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    folder = [tmp_path / n for n in ("B.JPG", "a.jpg", "sub/c.png", "sub/deep/d.webp", "sub/e.jpeg")]
    assert find_images(tmp_path) == folder
    assert find_images(str(tmp_path / "sub" / "*.*")) == [tmp_path / "sub/c.png", tmp_path / "sub/e.jpeg"]
    assert find_images(str(tmp_path / "**" / "*.jp*g")) == [tmp_path / "a.jpg", tmp_path / "sub/e.jpeg"]
    # an explicit file is taken whatever its extension; duplicates are dropped, order kept
    assert find_images([tmp_path / "notes.txt", tmp_path / "sub", tmp_path / "sub/c.png"]) == [
        tmp_path / "notes.txt",
        tmp_path / "sub/c.png",
        tmp_path / "sub/deep/d.webp",
        tmp_path / "sub/e.jpeg",
    ]
    assert find_images(str(tmp_path / "nothing*.png")) == []


@pytest.mark.slow
def test_calibrated_checkpoint_uses_its_thresholds_and_preprocessing(run_dir, images):
    folder, readable, corrupt = images
    inference = load_inference_model(run_dir / "calibrated.pt", device="cpu")
    predictions, unreadable = predict_images(inference, find_images(folder), batch_size=3)

    assert [path for path, _ in unreadable] == [corrupt]
    assert [p.image for p in predictions] == [str(p) for p in readable]
    # calibrated.pt stores the paper transform while its dataset config says light: predict must use paper
    logits = reference_logits(run_dir / "calibrated.pt", readable, "paper")
    assert not torch.allclose(
        logits, reference_logits(run_dir / "calibrated.pt", readable, "light"), atol=1e-3
    )
    thresholds = np.linspace(-1.5, 0.5, 12)
    chosen = logits.double().numpy() >= thresholds
    assert chosen.any() and not chosen.all()
    assert [[name for name, _ in p.labels] for p in predictions] == expected_labels(
        logits, chosen, inference.classes
    )
    probabilities = torch.sigmoid(logits.double())
    for prediction, row in zip(predictions, probabilities, strict=True):
        for name, score in prediction.labels:
            assert score == pytest.approx(row[inference.classes.index(name)].item(), abs=1e-5)


@pytest.mark.slow
def test_checkpoint_without_thresholds_uses_its_transform_half_probability_global_threshold_top_k(
    run_dir, images
):
    folder, readable, _ = images
    inference = load_inference_model(run_dir / "plain.pt", device="cpu")
    assert inference.thresholds is None
    logits = reference_logits(run_dir / "plain.pt", readable, "light")
    probabilities = torch.sigmoid(logits.double()).numpy()

    default, _ = predict_images(inference, readable, batch_size=4)
    assert [[n for n, _ in p.labels] for p in default] == expected_labels(
        logits, probabilities >= 0.5, inference.classes
    )
    low, _ = predict_images(inference, readable, threshold=0.3)
    assert [[n for n, _ in p.labels] for p in low] == expected_labels(
        logits, probabilities >= 0.3, inference.classes
    )
    top, _ = predict_images(inference, readable, top_k=2)
    best_two = np.zeros_like(probabilities, dtype=bool)
    np.put_along_axis(best_two, np.argsort(-probabilities, axis=1, kind="stable")[:, :2], True, axis=1)
    assert [[n for n, _ in p.labels] for p in top] == expected_labels(logits, best_two, inference.classes)


@pytest.mark.slow
def test_cli_writes_table_and_json_lines_and_skips_unreadable(run_dir, images, tmp_path, monkeypatch, capsys):
    folder, readable, corrupt = images
    out = tmp_path / "predictions.jsonl"
    monkeypatch.chdir(tmp_path)
    checkpoint = run_dir / "calibrated.pt"
    argv = ["mlcls-predict", f"checkpoint={checkpoint}", f"images={folder}", f"out={out}", "workers=0"]
    code, err, stdout = run_main(predict_cli.main, argv, monkeypatch, capsys)
    assert code == 0, err[-20:]
    stderr = "\n".join(err)
    assert f"skipped unreadable image {corrupt}" in stderr
    assert "7 images labelled by per-class thresholds" in stderr
    table = stdout.strip().splitlines()
    assert table[0].split() == ["image", "labels", "(probability)"] and len(table) == 1 + len(readable)

    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["image"] for r in records] == [str(p) for p in readable]
    logits = reference_logits(run_dir / "calibrated.pt", readable, "paper")
    classes = torch.load(run_dir / "calibrated.pt", weights_only=False)["classes"]
    expected = expected_labels(logits, logits.double().numpy() >= np.linspace(-1.5, 0.5, 12), classes)
    assert [[label["label"] for label in r["labels"]] for r in records] == expected
    for record, line in zip(records, table[1:], strict=True):
        image, *cells = line.split()
        assert image == record["image"]
        shown = (
            [(name, float(score)) for name, score in zip(cells[::2], cells[1::2], strict=True)]
            if cells != ["-"]
            else []
        )
        assert [name for name, _ in shown] == [label["label"] for label in record["labels"]]
        for (_, score), label in zip(shown, record["labels"], strict=True):
            assert score == pytest.approx(label["score"], abs=5e-4 + 1e-6)  # table: 3 decimals


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["images=NOWHERE/*.png"],
            "mlcls: error: no image matched images=NOWHERE/*.png; give a file, a folder or a quoted glob",
        ),
        (["threshold=1.5"], "mlcls: error: threshold=1.5; expected a probability in [0, 1]"),
        (["top_k=0"], "mlcls: error: top_k=0; expected a positive integer"),
        (["checkpoint=missing.pt"], "mlcls: error: checkpoint missing.pt does not exist"),
    ],
)
@pytest.mark.slow
def test_cli_user_errors_are_one_line_with_status_2(
    run_dir, images, tmp_path, monkeypatch, capsys, args, message
):
    folder, _, _ = images
    defaults = {"checkpoint": str(run_dir / "plain.pt"), "images": str(folder)}
    defaults.update(arg.split("=", 1) for arg in args)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mlcls-predict", *(f"{k}={v}" for k, v in defaults.items())])
    with pytest.raises(SystemExit) as exit_info:
        predict_cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]


@pytest.mark.slow
def test_summary_names_the_classes_without_a_calibrated_threshold(
    run_dir, images, tmp_path, monkeypatch, capsys
):
    """A class calibrated without a validation positive (threshold +inf) is never listed, and the summary
    says which classes those are; one image: "1 image", not "1 images"."""
    state = torch.load(run_dir / "calibrated.pt", weights_only=False)
    classes = state["classes"]
    thresholds = torch.full((len(classes),), -math.inf, dtype=torch.float64)  # every other class: always
    thresholds[[0, 3]] = math.inf
    checkpoint = tmp_path / "no_positive.pt"
    torch.save({**state, "thresholds": thresholds}, checkpoint)
    _, readable, _ = images
    monkeypatch.setattr(
        sys, "argv", ["mlcls-predict", f"checkpoint={checkpoint}", f"images={readable[0]}", "workers=0"]
    )
    predict_cli.main()
    out, err = capsys.readouterr()
    listed = out.splitlines()[1].split()[1::2]  # the table's row: image, then name and probability pairs
    assert sorted(listed) == sorted(c for i, c in enumerate(classes) if i not in (0, 3))
    assert err.strip().splitlines() == [
        "mlcls: 1 image labelled by per-class thresholds calibrated on the validation set (max F1); not "
        f"calibrated, no positive validation label, never predicted: {classes[0]}, {classes[3]} "
        "(threshold= or top_k= score them)"
    ]


def test_predict_reads_a_16_bit_png_as_training_does(tmp_path):
    """mlcls-predict's reader scales 16-bit greyscale to 8 bits (v >> 8), as the training datasets do;
    PIL's own convert("RGB") would saturate nearly every pixel at 255."""
    from PIL import Image

    values = np.random.default_rng(1).integers(0, 2**16, size=(20, 30), dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "deep.png")
    Image.fromarray((values >> 8).astype(np.uint8)).convert("RGB").save(tmp_path / "flat.png")
    files = ImageFiles([tmp_path / "deep.png", tmp_path / "flat.png"], lambda image: np.asarray(image))
    (_, deep, _), (_, flat, _) = files[0], files[1]
    np.testing.assert_array_equal(deep, flat)
