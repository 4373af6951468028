"""A tagger end to end on the CPU: a generated caption folder (48 images, 300 tags) trains, evaluates, writes
caption files, exports to ONNX and reports, from one tiny run. ONNX Runtime's scores of a batch of 16 are
the reference for mlcls-predict's scores and caption files."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, compose_config, run_main
from PIL import Image

from mlcls.cli.eval import main as eval_main
from mlcls.cli.export import main as export_main
from mlcls.cli.predict import main as predict_main
from mlcls.data.pipeline.preprocess import build_eval_transform

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def write_caption_folder(root: Path, count: int = 48, tags: int = 300) -> Path:
    """``count`` 32 px images in two folders, each tagged with its colour (what a model can learn) and six
    of ``tags`` others drawn at random; the tag list of all of them, most of them on no image."""
    generator = random.Random(0)
    vocabulary = root.parent / "tags.txt"
    vocabulary.write_text("\n".join([*COLOURS, *(f"tag_{t:03d}" for t in range(tags))]))
    for i in range(count):
        colour = list(COLOURS)[i % 3]
        folder = root / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.clip(
            np.array(COLOURS[colour]) + np.random.default_rng(i).normal(0, 20, (32, 32, 3)), 0, 255
        )
        Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i:03d}.png")
        extra = generator.sample([f"tag_{t:03d}" for t in range(tags)], 6)
        (folder / f"{i:03d}.txt").write_text(", ".join([colour, *extra]))
    return vocabulary


@pytest.mark.slow
def test_a_caption_folder_trains_evaluates_writes_captions_exports_and_reports(tmp_path, monkeypatch, capsys):
    onnxruntime = pytest.importorskip("onnxruntime")
    from mlcls.cli.train import run

    root, run_dir = tmp_path / "captions", tmp_path / "run"
    vocabulary = write_caption_folder(root)
    dataset = [
        f"dataset.vocabulary={vocabulary}",
        "dataset=captions",
        f"dataset.root={root}",
        "dataset.val_fraction=0.25",
        "dataset.image_size=32",
    ]
    tiny = [o for o in TINY if not o.startswith("dataset")]  # dataset=synthetic and its keys
    run(compose_config([*tiny, *dataset, "trainer.epochs=1", "trainer.report=true"]), run_dir=run_dir)
    checkpoint = run_dir / "checkpoints" / "best.pt"
    results = json.loads((run_dir / "results.json").read_text())
    classes = list(results["per_class_ap"])
    assert classes == vocabulary.read_text().splitlines()  # 303 tags, in the list's order

    code, err, out = run_main(
        eval_main, ["mlcls-eval", f"checkpoint={checkpoint}", "workers=0"], monkeypatch, capsys
    )
    assert code == 0, err[-5:]
    assert json.loads(out.strip().splitlines()[-1])["mAP_class"] == pytest.approx(
        results["metrics"]["mAP_class"], abs=1e-4
    )

    # 16 images without captions; mlcls-predict's scores against ONNX Runtime's on the batch of 16
    photos = tmp_path / "photos"
    photos.mkdir()
    images = sorted(root.rglob("*.png"))[:16]
    for image in images:
        shutil.copy(image, photos / image.name)
    onnx_path = tmp_path / "tagger.onnx"
    code, err, _ = run_main(
        export_main,
        ["mlcls-export", f"checkpoint={checkpoint}", "format=onnx", f"out={onnx_path}"],
        monkeypatch,
        capsys,
    )
    assert code == 0, err[-5:]
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    metadata = {k: json.loads(v) for k, v in session.get_modelmeta().custom_metadata_map.items()}
    assert metadata["classes"] == classes and len(metadata["thresholds"]) == len(classes)
    transform = build_eval_transform(metadata["preprocess"])
    paths = sorted(photos.iterdir())
    batch = np.stack([transform(Image.open(p).convert("RGB")).numpy() for p in paths])
    (logits,) = session.run(None, {"images": batch})
    assert logits.shape == (16, len(classes))
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))

    argv = ["mlcls-predict", f"checkpoint={checkpoint}", f"images={photos}", "workers=0", "batch_size=16"]
    code, err, _ = run_main(
        predict_main, [*argv, "threshold=0", f"out={tmp_path / 'all.jsonl'}"], monkeypatch, capsys
    )
    assert code == 0, err[-5:]
    predicted = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert [Path(p["image"]).name for p in predicted] == [p.name for p in paths]
    for row, prediction in zip(scores, predicted, strict=True):
        by_name = {label["label"]: label["score"] for label in prediction["labels"]}
        np.testing.assert_allclose([by_name[name] for name in classes], row, atol=2e-6, rtol=0)

    code, err, _ = run_main(predict_main, [*argv, "format=captions", "top_k=3"], monkeypatch, capsys)
    assert code == 0 and "16 caption files written" in err[-1], err[-5:]
    for path, row in zip(paths, scores, strict=True):
        top = [classes[c] for c in np.argsort(-row, kind="stable")[:3]]
        assert path.with_suffix(".txt").read_text() == ", ".join(top) + "\n"

    page = (run_dir / "report.html").read_text()  # the run's report, written by the run
    assert "tag_" in page and len(page) < 5e6
