"""Checkpoints of text-query heads: they store their class embeddings and text source, predict their own
classes without the encoder, check the stored embeddings before the model is built (crafted files, bounded),
score class names given at prediction time (``mlcls-predict classes=...``), and export."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config
from hostile import bounded
from test_text_words import many_words, reference_embedding

from mlcls.cli import predict as predict_cli
from mlcls.data.pipeline.preprocess import preprocess_spec
from mlcls.engine.build import build_model, class_queries
from mlcls.engine.checkpoint import save_checkpoint, text_record
from mlcls.engine.state import plain
from mlcls.errors import InferenceError
from mlcls.inference.export import export_checkpoint
from mlcls.inference.predictor import load_inference_model, use_classes
from mlcls.text import parse_classes
from mlcls.text.words import MAX_WORDS, WordsEncoder

CLASSES = ["red_circle", "green_square", "blue_triangle"]
MODEL = ["model.name=resnet10t", "model.pretrained=false", "dataset.image_size=32", "text.dim=24"]


def write_checkpoint(path: Path, head: str) -> tuple[Path, torch.nn.Module]:
    """A checkpoint as the trainer writes it (its fields, not its training) of a fresh ``head`` model."""
    cfg = compose_config([f"model/head={head}", *MODEL])
    torch.manual_seed(0)
    model = build_model(cfg.model, len(CLASSES), torch.device("cpu"), **class_queries(cfg, CLASSES)).eval()
    state = {
        "model": model.state_dict(),
        "classes": CLASSES,
        "config": plain(cfg),
        "preprocess": preprocess_spec(cfg.dataset),
        "thresholds": None,
        "text": text_record(cfg),
    }
    save_checkpoint(state, path)
    return path, model


@pytest.fixture(scope="module")
def cosine_checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    return write_checkpoint(tmp_path_factory.mktemp("cosine") / "cosine.pt", "cosine")


def test_the_checkpoint_stores_the_embeddings_names_and_text_source(cosine_checkpoint):
    state = torch.load(cosine_checkpoint[0], weights_only=True)
    assert state["classes"] == CLASSES
    assert state["text"] == {
        "source": "words(dim=24, seed=0)",
        "config": {"_target_": "mlcls.text.words.WordsEncoder", "dim": 24, "seed": 0},
    }
    expected = torch.tensor([reference_embedding(name, 24, 0) for name in CLASSES], dtype=torch.float64)
    torch.testing.assert_close(state["model"]["head.class_embeddings"].double(), expected, atol=1e-6, rtol=0)


def test_a_checkpoint_predicts_its_own_classes_without_the_encoder(cosine_checkpoint, monkeypatch):
    path, model = cosine_checkpoint
    monkeypatch.setattr(WordsEncoder, "encode", lambda self, names: pytest.fail("the encoder was called"))
    inference = load_inference_model(path, device="cpu")
    images = torch.randn(2, 3, 32, 32)
    assert inference.classes == CLASSES
    with torch.no_grad():
        torch.testing.assert_close(inference.model(images), model(images), rtol=0, atol=0)


def test_names_given_at_prediction_are_scored_by_the_equation_of_the_head(cosine_checkpoint):
    path, model = cosine_checkpoint
    inference = load_inference_model(path, device="cpu")
    names = ["purple_circle", "square", "green red"]  # not trained on; "purple" never seen
    use_classes(inference, names)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        logits = inference.model(images).double()
        pooled = model.forward_features(images).double().mean(dim=(2, 3))
    head = model.head
    projected = pooled @ head.proj.weight.detach().double().t()
    text = torch.tensor([reference_embedding(name, 24, 0) for name in names], dtype=torch.float64)
    cosines = (projected / projected.norm(dim=1, keepdim=True)) @ text.t()
    assert inference.classes == names and inference.thresholds is None
    torch.testing.assert_close(logits, math.exp(head.log_scale.item()) * cosines, rtol=1e-4, atol=1e-4)


def test_mldecoder_zsl_checkpoint_scores_other_classes(tmp_path):
    path, _ = write_checkpoint(tmp_path / "zsl.pt", "mldecoder_zsl")
    inference = load_inference_model(path, device="cpu")
    use_classes(inference, ["blue_circle", "red", "green_triangle", "cross"])
    with torch.no_grad():
        assert inference.model(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def load_and_use(path: Path, names: list[str] | None) -> list[str]:
    inference = load_inference_model(path, device="cpu")
    if names is not None:
        use_classes(inference, names)
    return inference.classes


def crafted(source: Path, target: Path, change) -> Path:
    state = torch.load(source, weights_only=True)
    change(state)
    save_checkpoint(state, target)
    return target


def _scale_row(state):
    state["model"]["head.class_embeddings"][1] *= 2


def _nan(state):
    state["model"]["head.class_embeddings"][0, 3] = float("nan")


def _narrow(state):
    narrow = state["model"]["head.class_embeddings"][:, :16]
    state["model"]["head.class_embeddings"] = narrow / narrow.norm(dim=1, keepdim=True)


def _drop_class(state):
    state["classes"] = state["classes"][:2]


def _drop_embeddings(state):
    del state["model"]["head.class_embeddings"]


def _foreign_target(state):
    state["text"]["config"]["_target_"] = "os.system"


def _interpolation(state):
    state["text"]["config"]["dim"] = "${oc.env:HOME}"


def _other_source(state):
    state["text"]["source"] = "words(dim=24, seed=1)"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "names", "message"),
    [
        (_drop_class, None, r"are torch.float32 \(3, 24\) for 2 class names; expected a floating-point row"),
        (_nan, None, "the class embeddings hold a non-finite value; expected unit rows"),
        (_scale_row, None, "the class embedding of 'green_square' has norm 2; expected unit rows"),
        (_narrow, None, r"head.proj.weight is \(24, 512\) in the file, \(16, 512\) in the model"),
        (
            _drop_embeddings,
            None,
            "its cosine head scores class embeddings, but the weights hold no head.class",
        ),
        (_foreign_target, ["x"], "_target_ is 'os.system'; expected a text encoder of mlcls.text"),
        (_interpolation, ["x"], "an interpolation; expected plain options"),
        (_other_source, ["x"], r"not the stored source 'words\(dim=24, seed=1\)'"),
    ],
)
def test_crafted_embeddings_or_text_source_are_refused_in_one_line(
    cosine_checkpoint, tmp_path, change, names, message
):
    path = crafted(cosine_checkpoint[0], tmp_path / "crafted.pt", change)
    outcome = bounded(load_and_use, path, names, memory_mb=1024, seconds=20)
    assert not outcome.escaped and outcome.error == "InferenceError", outcome.trace
    assert re.search(message, outcome.message), outcome.message
    assert "\n" not in outcome.message


@pytest.mark.slow
def test_a_class_list_of_too_many_words_is_one_line(cosine_checkpoint, tmp_path):
    """``mlcls-predict classes=FILE`` with names of 200,001 words in all (an 800 KB list): one line before
    any word's vector is drawn (the code before this drew one per distinct word and kept them all: 3.06 GB
    for 1 M distinct words)."""
    path = tmp_path / "classes.txt"
    path.write_text("\n".join(many_words(MAX_WORDS + 1)) + "\n")
    outcome = bounded(
        lambda: load_and_use(cosine_checkpoint[0], parse_classes(str(path))), memory_mb=512, seconds=20
    )
    assert not outcome.escaped and outcome.error == "InferenceError", outcome
    assert outcome.message.endswith(
        f"hold {MAX_WORDS + 1:,} words; expected at most {MAX_WORDS:,} in all (a few words a class)"
    )


def test_a_checkpoint_without_text_queries_refuses_class_names_in_one_line(tmp_path):
    path, _ = write_checkpoint(tmp_path / "linear.pt", "linear")
    assert torch.load(path, weights_only=True)["text"] is None
    with pytest.raises(InferenceError) as info:
        load_and_use(path, ["red_circle"])
    assert str(info.value) == (
        f"{path} has a linear head without text queries: it scores its own 3 classes only; classes= needs "
        "a checkpoint of a text-query head (model/head=mldecoder_zsl or cosine)"
    )


def test_classes_on_the_command_line_is_one_string_for_hydra():
    assert predict_cli.quote_class_list(["classes=a,b c", "top_k=1", "classes=[x,y]", "classes=one"]) == [
        "classes='a,b c'",
        "top_k=1",
        "classes=[x,y]",
        "classes=one",
    ]
    assert predict_cli.quote_class_list(["classes=it's,b"]) == ["classes='it\\'s,b'"]


def test_a_text_head_checkpoint_exports_its_own_classes(cosine_checkpoint, tmp_path):
    out, difference = export_checkpoint(cosine_checkpoint[0], "torchscript", tmp_path / "m.torchscript.pt")
    assert out.is_file() and difference is not None and difference < 1e-4


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> Path:
    """One epoch of the cosine head on a tiny synthetic set (64 images of 32 px): its last.pt."""
    from mlcls.cli.train import run

    run_dir = tmp_path_factory.mktemp("text_run") / "run"
    overrides = [
        *TINY,
        "model/head=cosine",
        "trainer.epochs=1",
        "dataset.train_size=64",
        "dataset.val_size=32",
    ]
    run(compose_config([*overrides]), run_dir=run_dir)
    return run_dir / "checkpoints" / "last.pt"


@pytest.mark.slow
def test_a_trained_text_head_predicts_class_names_it_never_trained_on(text_run, tmp_path):
    from inference_fixtures import write_images

    folder = tmp_path / "photos"
    write_images(folder, count=3)
    names = "purple_circle,red,square"
    cfg = compose_config(
        [f"checkpoint={text_run}", f"images={folder}", f"classes='{names}'", "top_k=2", "workers=0"],
        "predict",
    )
    predictions, unreadable, rule = predict_cli.run(cfg)
    assert not unreadable and len(predictions) == 3 and "top 2" in rule
    for prediction in predictions:
        assert len(prediction.labels) == 2 and {name for name, _ in prediction.labels} <= set(
            names.split(",")
        )
    own = compose_config([f"checkpoint={text_run}", f"images={folder}", "top_k=1", "workers=0"], "predict")
    assert {name for p in predict_cli.run(own)[0] for name, _ in p.labels} <= set(
        torch.load(text_run, weights_only=True)["classes"]
    )
