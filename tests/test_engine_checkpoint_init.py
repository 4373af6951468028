"""model.init_from: fine-tuning starts from an mlcls checkpoint; where its classes differ (a new tag list),
the head rows of the tags both lists name are the file's, matched by name, the others a fresh head's, and
the rest of the network is the file's."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import TINY, compose_config

from mlcls.engine.checkpoint import init_from_checkpoint, save_checkpoint
from mlcls.engine.config_checks import check_config
from mlcls.errors import ConfigError
from mlcls.inference.predictor import load_inference_model
from mlcls.models import create_model


def write_checkpoint(path, classes: list[str], name: str = "resnet10t", head: str = "linear") -> dict:
    """An mlcls checkpoint of ``name`` with a ``head`` head over ``classes``, random weights (an ML-Decoder
    of 4 queries)."""
    torch.manual_seed(123)
    model = create_model(
        name, len(classes), pretrained=False, head=head, **({"num_groups": 4} if head == "mldecoder" else {})
    )
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    config = {"model": {"name": name, "head": head, "num_groups": 4}}
    save_checkpoint({"model": weights, "classes": classes, "config": config}, path)
    return weights


# Each head's entries with one row per class, spelt out (an ML-Decoder of num_groups >= C: one query each).
CLASS_ROWS = {
    "linear": ["fc.weight", "fc.bias"],
    "mldecoder": [
        "head.decoder.query_embed.weight",
        "head.decoder.duplicate_pooling",
        "head.decoder.duplicate_pooling_bias",
    ],
    "csra": ["head.multi_head.0.head.weight"],
    "cosine": ["head.class_embeddings"],  # its projection and scale are shared by all classes: the file's
}


def embeddings(classes: list[str]) -> torch.Tensor:
    """Unit rows, one a class, each drawn from a seed of its name: a text encoder's stand-in."""
    rows = [torch.randn(8, generator=torch.Generator().manual_seed(sum(map(ord, name)))) for name in classes]
    return torch.nn.functional.normalize(torch.stack(rows), dim=1)


def small_model(head: str, classes: list[str], num_groups: int = 4, seed: int = 0) -> torch.nn.Module:
    """timm's test network with a ``head`` head over ``classes`` (a small ML-Decoder)."""
    torch.manual_seed(seed)
    options = {"mldecoder": {"num_groups": num_groups, "embed_dim": 16}}.get(head, {})
    if head == "cosine":
        options = {"class_embeddings": embeddings(classes)}
    return create_model("test_resnet", len(classes), pretrained=False, head=head, **options)


def write_small(path, head: str, classes: list[str], num_groups: int = 4) -> dict:
    """A checkpoint of :func:`small_model` (seed 123) over ``classes``; its weights."""
    stored = {k: v.clone() for k, v in small_model(head, classes, num_groups, seed=123).state_dict().items()}
    save_checkpoint({"model": stored, "classes": classes, "config": {}}, path)
    return stored


@pytest.mark.parametrize("head", list(CLASS_ROWS))
def test_same_classes_load_every_weight_a_new_tag_list_keeps_the_shared_rows(tmp_path, caplog, head):
    path = tmp_path / "start.pt"
    stored_classes = ["cat", "dog", "bird"]
    stored = write_small(path, head, stored_classes)
    model = small_model(head, stored_classes)
    init_from_checkpoint(model, str(path), stored_classes)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, stored[key], atol=0, rtol=0, msg=key)

    # disjoint; the same tags in another order; two kept, two new, one dropped
    for classes in (["a", "b"], ["dog", "cat", "bird"], ["fish", "bird", "cat", "owl"]):
        model = small_model(head, classes)
        fresh = {key: value.clone() for key, value in model.state_dict().items()}
        with caplog.at_level(logging.INFO, logger="mlcls"):
            init_from_checkpoint(model, str(path), classes)
        kept = [name for name in classes if name in stored_classes]
        lines = [r.message for r in caplog.records if "model.init_from" in r.message]
        assert len(lines) == 1 and lines[0].endswith(
            f"{len(kept)} kept (their head rows, by name), {len(classes) - len(kept)} new (initialised as a "
            f"fresh head), {len(set(stored_classes) - set(classes))} dropped"
        )
        caplog.clear()
        for key, value in model.state_dict().items():
            if key not in CLASS_ROWS[head]:
                torch.testing.assert_close(value, stored[key], atol=0, rtol=0, msg=key)
                continue
            for c, name in enumerate(classes):
                source = stored[key][stored_classes.index(name)] if name in kept else fresh[key][c]
                torch.testing.assert_close(value[c], source, atol=0, rtol=0, msg=f"{key} {name}")


def test_grouped_mldecoder_rows_are_refused_when_tags_are_shared(tmp_path, caplog):
    """ML-Decoder with 2 queries for 3 tags: a tag's logit is its group's query output, so its weights are
    no row of its own; sharing a tag is refused in one line, sharing none starts the head afresh."""
    path = tmp_path / "start.pt"
    stored = write_small(path, "mldecoder", ["cat", "dog", "bird"], num_groups=2)
    with pytest.raises(ConfigError, match=r"shares 1 class with this run but its weights are not one row"):
        init_from_checkpoint(small_model("mldecoder", ["cat", "x", "y"], 2), str(path), ["cat", "x", "y"])
    model = small_model("mldecoder", ["x", "y", "z"], num_groups=2)
    fresh = {key: value.clone() for key, value in model.state_dict().items()}
    init_from_checkpoint(model, str(path), ["x", "y", "z"])
    for key, value in model.state_dict().items():
        expected = fresh[key] if key.startswith("head.") else stored[key]
        torch.testing.assert_close(value, expected, atol=0, rtol=0, msg=key)


def test_a_checkpoint_of_another_network_is_refused_naming_the_weight(tmp_path):
    path = tmp_path / "start.pt"
    write_checkpoint(path, ["a", "b"], name="resnet10t")
    model = create_model("resnet18", 2, pretrained=False)
    with pytest.raises(
        ConfigError,
        match=r"model.init_from=.*: conv1.weight \(64, 3, 7, 7\) of this run's model "
        r"is not in the file; the file holds resnet10t with a linear head",
    ):
        init_from_checkpoint(model, str(path), ["a", "b"])


def test_check_config_refuses_a_missing_file():
    cfg = compose_config([*TINY, "model.init_from=/no/such/file.pt"])
    with pytest.raises(ConfigError, match="model.init_from='/no/such/file.pt': no such checkpoint file"):
        check_config(cfg, world_size=1)


@pytest.mark.slow
def test_training_starts_from_an_imported_checkpoint_and_its_checkpoint_predicts(tmp_path):
    """mlcls-train model.init_from=...: the synthetic dataset's classes are not the file's, so the head
    starts afresh; the run's checkpoint (whose config names init_from) loads for prediction."""
    from mlcls.cli.train import run

    start = tmp_path / "start.pt"
    stored = write_checkpoint(start, ["x", "y", "z"])
    overrides = [*TINY, "trainer.epochs=1", "optim.lr_backbone=0.0", "optim.weight_decay=0.0"]
    overrides += ["dataset.train_size=64", "dataset.val_size=32", "model.name=resnet10t"]  # the file's
    run(compose_config([*overrides, f"model.init_from={start}"]), run_dir=tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    inference = load_inference_model(checkpoint, "cpu")
    assert inference.config["model"]["init_from"] == str(start)
    # the backbone did not move (learning rate 0, no decay): it is the file's; BatchNorm statistics aside
    for key, value in inference.model.state_dict().items():
        if not key.startswith("fc.") and "running_" not in key and "num_batches" not in key:
            torch.testing.assert_close(value, stored[key], atol=0, rtol=0, msg=key)
