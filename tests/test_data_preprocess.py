"""The preprocess spec rebuilds exactly the dataset's evaluation transform, without a dataset config."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_config
from PIL import Image

from mlcls.data import build_dataset
from mlcls.data.pipeline.preprocess import input_size
from mlcls.errors import ConfigError
from mlcls.inference import InferenceError, build_eval_transform, preprocess_spec, spec_from_checkpoint


def photo(width: int, height: int) -> Image.Image:
    """A non-square RGB image with structure in both directions (resize and crop both matter)."""
    g = torch.Generator().manual_seed(width * 1000 + height)
    pixels = (torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8)
    return Image.fromarray(pixels.numpy())


# Command-line overrides of the dataset's normalisation: none (ImageNet's) and a non-default one.
NORMALISATIONS = {
    "imagenet": ([], [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    "custom": (["dataset.mean=[0.5,0.25,0]", "dataset.std=[0.25,0.5,1]"], [0.5, 0.25, 0.0], [0.25, 0.5, 1.0]),
}


@pytest.mark.parametrize("normalisation", list(NORMALISATIONS))
@pytest.mark.parametrize(
    ("kind", "size"),
    [("paper", 224), ("paper", 32), ("light", 64), ("light", 37), ("strong", 64), ("strong", 37)],
)
def test_spec_transform_equals_the_dataset_eval_transform(kind, size, normalisation):
    """mlcls-predict's and the ONNX export's preprocessing (the spec the trainer stores, rebuilt by
    ``build_eval_transform``) is the evaluation transform ``build_dataset`` gives the same dataset config,
    its ``dataset.mean`` and ``dataset.std`` included."""
    overrides, mean, std = NORMALISATIONS[normalisation]
    size_keys = [f"dataset.transform={kind}", f"dataset.image_size={size}", "dataset.val_size=1"]
    dataset_cfg = compose_config(["dataset=synthetic", *size_keys, *overrides]).dataset
    spec = preprocess_spec(dataset_cfg)
    assert json.loads(json.dumps(spec)) == spec  # JSON-ready: stored in checkpoints and export metadata
    assert (spec["mean"], spec["std"]) == (mean, std)
    rebuilt, reference = build_eval_transform(spec), build_dataset(dataset_cfg, train=False).transform
    for image in (photo(300, 200), photo(50, 90)):
        out = rebuilt(image)
        assert out.shape == (3, size, size) and input_size(spec) == (size, size)
        assert torch.equal(out, reference(image))


def test_spec_values_are_the_documented_ones():
    assert preprocess_spec({"transform": "paper", "image_size": 224}) == {
        "transform": "paper",
        "image_size": 224,
        "resize": 256,
        "crop": 224,
        "interpolation": "bilinear",
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
    }
    light = preprocess_spec({"transform": "light", "image_size": 64})
    assert (light["resize"], light["crop"]) == ([64, 64], None)
    strong = preprocess_spec({"transform": "strong", "image_size": 448})  # squash-resize, no crop
    assert (strong["transform"], strong["resize"], strong["crop"]) == ("strong", [448, 448], None)
    # build_dataset's default transform is "paper"
    assert preprocess_spec({"image_size": 96})["transform"] == "paper"


def test_checkpoint_spec_wins_over_its_dataset_config_and_is_required():
    """The stored spec is read as stored; a checkpoint without one is refused in one line (its dataset config
    is no longer read in its place: no released checkpoint lacks the spec)."""
    stored = preprocess_spec({"transform": "paper", "image_size": 48})
    config = {"dataset": {"transform": "light", "image_size": 32}}
    assert spec_from_checkpoint({"preprocess": stored, "config": config}) == stored
    with pytest.raises(
        InferenceError,
        match=r"^the checkpoint holds no preprocess spec; expected a mapping with keys transform, ",
    ):
        spec_from_checkpoint({"config": config})


def test_bad_specs_are_one_line_errors():
    with pytest.raises(InferenceError, match="unknown transform 'fancy'"):
        preprocess_spec({"transform": "fancy", "image_size": 32})
    with pytest.raises(InferenceError, match="image_size"):
        preprocess_spec({"transform": "light"})
    with pytest.raises(InferenceError, match="holds no preprocess spec"):
        spec_from_checkpoint({"model": {}})
    with pytest.raises(InferenceError, match="lacks crop"):
        build_eval_transform({k: v for k, v in preprocess_spec({"image_size": 32}).items() if k != "crop"})
    with pytest.raises(ConfigError, match=r"^preprocess.std=\[1, 0, 1\]; expected 3 numbers > 0"):
        build_eval_transform({**preprocess_spec({"image_size": 32}), "std": [1, 0, 1]})  # from a checkpoint
