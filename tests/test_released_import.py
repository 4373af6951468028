"""mlcls-import: the authors' released checkpoints (ML-Decoder, ASL, CSRA) as mlcls checkpoints.

No released file can be downloaded here: each test writes a state dict under the released key names and
shapes (random values), converts it with the command, loads it strictly through mlcls.inference and
compares its logits with an independent float64 reference: timm's TResNet loaded from the released keys by
timm's own converter (``checkpoint_filter_fn``) or torchvision's ResNet-101 (CSRA's backbone class), and the
heads from their equations (tests/test_models_heads.py)."""

from __future__ import annotations

import contextlib
import io
import os
import zipfile

import pytest
import timm
import torch
import torchvision
from hostile import bounded
from test_models_heads import reference_csra, reference_mldecoder
from timm.layers import ConvNormAct
from timm.models.tresnet import checkpoint_filter_fn
from torch import nn

from mlcls.cli.import_ import main
from mlcls.data.datasets.voc import VOC_CLASSES
from mlcls.errors import InferenceError
from mlcls.inference.predictor import load_inference_model
from mlcls.inference.released import COCO_CLASSES, convert_weights, released_classes, released_model_config
from mlcls.models.heads import MLDecoder
from mlcls.models.released import TRESNETS, tresnet_variant

SIZE = 64  # input side of the tests: TResNet and ResNet reduce it 32 times, to 2 x 2 positions


def released_tresnet(name: str, num_classes: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of the authors' TResNet ``name`` (InPlace-ABN layout, ``body.*``), random values:
    each of timm's ConvNormAct ``P`` is ``P.0`` (conv) and ``P.1`` (InPlace-ABN), or ``P.0.0`` and ``P.0.1``
    where a blur follows; ABN scales of both signs (the layer applies ``|w| + eps``); the SE layers and the
    linear head ``head.fc`` have the same names in both."""
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    released, paths = {}, []
    for path, module in model.named_modules():
        if not isinstance(module, ConvNormAct):
            continue
        paths.append(path)
        nested = module.aa is not None and not isinstance(module.aa, nn.Identity)
        conv, norm = (f"{path}.0.0", f"{path}.0.1") if nested else (f"{path}.0", f"{path}.1")
        released[f"{conv}.weight"] = torch.randn(module.conv.weight.shape) * 0.05
        channels = module.bn.weight.shape[0]
        released[f"{norm}.weight"] = torch.randn(channels)
        released[f"{norm}.bias"] = torch.randn(channels) * 0.1
        released[f"{norm}.running_mean"] = torch.randn(channels) * 0.1
        released[f"{norm}.running_var"] = torch.rand(channels) + 0.5
        released[f"{norm}.num_batches_tracked"] = torch.tensor(7)
    for key, value in model.state_dict().items():
        if not any(key.startswith((f"{path}.conv.", f"{path}.bn.")) for path in paths):
            released[key] = torch.randn(value.shape) * 0.05
    assert len(released) == len(model.state_dict())
    return released


def timm_reference(name: str, released: dict, num_classes: int = 0) -> nn.Module:
    """timm's ``name`` loaded strictly from ``released`` by timm's own converter, in float64, eval mode."""
    model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    model.load_state_dict(checkpoint_filter_fn(dict(released), model), strict=True)
    return model.double().eval()


def released_mldecoder_head(in_features: int, classes: int, groups: int) -> dict[str, torch.Tensor]:
    """The released ML-Decoder's ``head.*`` entries (its structure: tests/test_models_heads.py), random."""
    head = MLDecoder(in_features, classes, num_groups=groups)
    return {f"head.{key}": torch.randn(value.shape) * 0.05 for key, value in head.state_dict().items()}


def import_file(tmp_path, fmt: str, state: dict, *options: str):
    """Save ``state`` as the released file, run ``mlcls-import fmt FILE out=...``; the loaded model."""
    source, out = tmp_path / "released.pth", tmp_path / "imported.pt"
    torch.save(state, source)
    main([fmt, str(source), f"out={out}", *options])
    return load_inference_model(out, "cpu")


@pytest.mark.slow
def test_mldecoder_tresnet_m_coco_matches_timm_and_the_head_equations(tmp_path):
    torch.manual_seed(0)
    weights = {**released_tresnet("tresnet_m"), **released_mldecoder_head(2048, 80, 100)}
    inference = import_file(tmp_path, "mldecoder", {"model": weights, "epoch": 3})
    assert inference.classes == list(COCO_CLASSES)
    model = inference.config["model"]
    head = model["head"]
    assert (model["name"], head["name"], head["num_groups"], head["embed_dim"]) == (
        "tresnet_m",
        "mldecoder",
        80,
        768,
    )
    # the authors' evaluation: Resize((224, 224)), [0, 1] pixels
    assert inference.preprocess["resize"] == [224, 224] and inference.preprocess["crop"] is None
    assert inference.preprocess["mean"] == [0.0, 0.0, 0.0] and inference.preprocess["std"] == [1.0, 1.0, 1.0]
    assert inference.config["dataset"]["name"] == "coco"
    images = torch.rand(2, 3, SIZE, SIZE)
    backbone = timm_reference("tresnet_m", {k: v for k, v in weights.items() if k.startswith("body.")})
    head = MLDecoder(2048, 80, num_groups=100)
    head.load_state_dict({k.removeprefix("head."): v for k, v in weights.items() if k.startswith("head.")})
    with torch.no_grad():
        expected = reference_mldecoder(head, backbone.forward_features(images.double()))
        torch.testing.assert_close(inference.model(images).double(), expected, atol=2e-4, rtol=2e-4)


@pytest.mark.slow
def test_asl_tresnet_m_with_a_class_file_matches_timm(tmp_path, capsys):
    torch.manual_seed(1)
    full = released_tresnet("tresnet_m", num_classes=7)
    # files of InPlace-ABN before its version 2 have no num_batches_tracked
    weights = {key: value for key, value in full.items() if not key.endswith("num_batches_tracked")}
    names = tmp_path / "names.txt"
    names.write_text("".join(f"class {i}\n" for i in range(7)))
    inference = import_file(tmp_path, "asl", {"state_dict": weights}, f"classes={names}", "image_size=448")
    assert inference.classes == [f"class {i}" for i in range(7)]
    assert inference.config["model"]["head"]["name"] == "linear"
    assert inference.preprocess["resize"] == [448, 448]
    assert inference.config["dataset"]["name"] == "csv"
    assert (
        ": tresnet_m with a linear head, 7 classes, 448 px input" in capsys.readouterr().err
    )  # not "classs"
    reference = timm_reference("tresnet_m", full, num_classes=7)
    images = torch.rand(2, 3, SIZE, SIZE)
    with torch.no_grad():
        torch.testing.assert_close(
            inference.model(images).double(), reference(images.double()), atol=2e-4, rtol=2e-4
        )


def released_csra(classes: int, heads: int) -> dict[str, torch.Tensor]:
    """CSRA's ``ResNet_CSRA`` state dict: torchvision's ResNet-101 without ``fc`` and ``classifier.multi_head
    .{i}.head.weight`` (C, 2048, 1, 1) per head; random values."""
    with torch.device("meta"):
        names = torchvision.models.resnet101().state_dict()
    weights = {}
    for key, value in names.items():
        if key.startswith("fc."):
            continue
        if key.endswith("num_batches_tracked"):
            weights[key] = torch.tensor(5)
        elif key.endswith("running_var"):
            weights[key] = torch.rand(value.shape) + 0.5
        else:
            weights[key] = torch.randn(value.shape) * (0.02 if value.ndim == 4 else 0.1)
    for i in range(heads):
        weights[f"classifier.multi_head.{i}.head.weight"] = torch.randn(classes, 2048, 1, 1)
    return weights


@pytest.mark.parametrize(("classes", "heads", "lam", "temperatures"), [(80, 4, 0.5, [1, 2, 4, None])])
@pytest.mark.slow
def test_csra_resnet101_matches_torchvision_and_the_head_equations(
    tmp_path, classes, heads, lam, temperatures
):
    torch.manual_seed(classes)
    weights = released_csra(classes, heads)
    prefixed = {f"module.{key}": value for key, value in weights.items()}  # saved from nn.DataParallel
    inference = import_file(tmp_path, "csra", prefixed)
    model = inference.config["model"]
    head = model["head"]
    assert (model["name"], head["name"], head["num_heads"], head["lam"]) == (
        "resnet101",
        "csra",
        heads,
        lam,
    )
    assert inference.config["dataset"]["name"] == ("voc2007" if classes == 20 else "coco")
    assert inference.preprocess["resize"] == [448, 448] and inference.preprocess["std"] == [1.0, 1.0, 1.0]
    assert inference.classes[:2] == (["aeroplane", "bicycle"] if classes == 20 else ["person", "bicycle"])
    resnet = torchvision.models.resnet101()
    resnet.fc = nn.Identity()
    resnet.load_state_dict({k: v for k, v in weights.items() if not k.startswith("classifier.")}, strict=True)
    resnet = resnet.double().eval()
    images = torch.rand(2, 3, SIZE, SIZE)
    with torch.no_grad():
        x = resnet.maxpool(resnet.relu(resnet.bn1(resnet.conv1(images.double()))))
        features = resnet.layer4(resnet.layer3(resnet.layer2(resnet.layer1(x))))
        head_weights = [weights[f"classifier.multi_head.{i}.head.weight"] for i in range(heads)]
        expected = reference_csra(head_weights, temperatures, lam, features)
        torch.testing.assert_close(inference.model(images).double(), expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", sorted(TRESNETS))
def test_each_tresnet_variant_is_told_by_its_released_names(name):
    """ML-Decoder's TResNet-L is timm's tresnet_v2_l and its XL the tresnet_v2_xl mlcls registers; ASL's are
    tresnet_l and tresnet_xl."""
    with torch.device("meta"):
        assert tresnet_variant(released_tresnet_names(name)) == name


def released_tresnet_names(name: str) -> dict[str, torch.Tensor]:
    """Released keys and shapes (meta tensors) of TResNet ``name``: its stem and the blocks of each layer."""
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, num_classes=0)
    layers = TRESNETS[name][0]
    assert [len(getattr(model.body, f"layer{i}")) for i in range(1, 5)] == list(layers)
    keys = {"body.conv1.0.weight": model.body.conv1.conv.weight}
    for i, count in enumerate(layers, 1):
        for block in range(count):
            keys[f"body.layer{i}.{block}.conv1.0.weight"] = torch.empty(1, device="meta")
    if hasattr(model.body.layer1[0], "conv3"):
        keys["body.layer1.0.conv3.0.weight"] = torch.empty(1, device="meta")
    return keys


def one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_a_file_of_another_format_stops_at_its_first_key(tmp_path, capsys):
    torch.manual_seed(0)
    source = tmp_path / "csra.pth"
    torch.save({"conv1.weight": torch.randn(64, 3, 7, 7), "bn1.weight": torch.randn(64)}, source)
    err = one_line_error(capsys, ["mldecoder", str(source), f"out={tmp_path / 'o.pt'}"])
    assert "does not fit format mldecoder" in err and "'conv1.weight'" in err
    weights = {**released_tresnet("tresnet_m", num_classes=5)}
    weights["body.layer1.0.se.extra.weight"] = torch.randn(3)
    torch.save({"model": weights}, source)
    err = one_line_error(capsys, ["asl", str(source), f"out={tmp_path / 'o.pt'}"])
    assert "'body.layer1.0.se.extra.weight' has no place in tresnet_m" in err
    del weights["body.layer1.0.se.extra.weight"]
    weights["head.fc.bias"] = torch.randn(6)
    torch.save({"model": weights}, source)
    err = one_line_error(capsys, ["asl", str(source), f"out={tmp_path / 'o.pt'}"])
    assert "head.fc.bias is (6,), (5,) in tresnet_m" in err
    assert not (tmp_path / "o.pt").exists()


def test_class_names_are_required_where_the_file_has_none(tmp_path, capsys):
    with pytest.raises(
        ValueError, match="holds 9605 classes \\(Open Images\\) but not their names; give them with classes="
    ):
        released_classes(9605, None, {}, "oi.pth")
    assert released_classes(20, None, {}, "f") == list(VOC_CLASSES)  # CSRA's voc_cls_id order
    torch.manual_seed(0)
    source = tmp_path / "asl.pth"
    torch.save({"model": released_tresnet("tresnet_m", num_classes=5)}, source)
    err = one_line_error(capsys, ["asl", str(source), f"out={tmp_path / 'o.pt'}"])
    assert "holds 5 classes but not their names; give them with classes=" in err
    err = one_line_error(capsys, ["asl", str(source), "classes.txt"])
    assert "unexpected argument 'classes.txt'" in err


# CSRA's lambda per released file, by (heads, classes), typed from CSRA's README (Kevinz-code/CSRA at
# c8480d1): VOC 2007 1 head at 0.1; COCO ResNet-101 4 heads at 0.5; COCO ResNet-cut (CutMix) 6 heads at 0.4.
CSRA_README_LAM = {(1, 20): 0.1, (4, 80): 0.5, (6, 80): 0.4}


def csra_heads(classes: int, heads: int) -> dict[str, torch.Tensor]:
    """The head entries of a CSRA file (meta tensors): what its lambda is told by."""
    with torch.device("meta"):
        return {
            f"classifier.multi_head.{i}.head.weight": torch.empty(classes, 2048, 1, 1) for i in range(heads)
        }


def test_csra_lam_is_its_authors_for_each_released_file_and_asked_for_otherwise():
    """The 6-head COCO file was trained at lam 0.4, not the 0.5 of the 4-head one (old: 0.5 for every
    80-class file); a file of other heads or classes stops with one line asking for lam=."""
    for (heads, classes), lam in CSRA_README_LAM.items():
        config = released_model_config("csra", csra_heads(classes, heads))
        assert (config["head"]["num_heads"], config["head"]["lam"]) == (heads, lam)
    assert released_model_config("csra", csra_heads(80, 6), lam=0.25)["head"]["lam"] == 0.25
    for heads, classes in [(2, 80), (1, 80), (4, 20), (1, 14)]:
        with pytest.raises(InferenceError) as error:
            released_model_config("csra", csra_heads(classes, heads))
        message = str(error.value)
        assert "none of its authors' released files" in message and "give lam=X" in message
        assert len(message.splitlines()) == 1
    with pytest.raises(InferenceError, match=r"it has 5 heads; CSRA's code builds \[1, 2, 4, 6, 8\]"):
        released_model_config("csra", csra_heads(80, 5), lam=0.3)  # old: a ValueError traceback


KEYS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("key_type", [int, str])
def test_idx_to_class_is_taken_in_the_files_order(key_type):
    """The authors' infer.py names output i by the i-th of ``idx_to_class.values()``. For the string keys
    "0".."11", sorting (old) gives "0", "1", "10", "11", "2", ...: the names differ from index 2 on."""
    table = {key_type(index): f"name {index}" for index in KEYS}
    assert released_classes(12, None, {"idx_to_class": table}, "f") == [f"name {index}" for index in KEYS]


def test_duplicate_class_names_are_refused_in_one_line():
    for given, meta in [(["a", "b", "a"], {}), (None, {"idx_to_class": {0: "cat", 1: "cat", 2: "dog"}})]:
        with pytest.raises(
            InferenceError, match="names '(a|cat)' twice \\(entries 0 and (2|1)\\); expected distinct"
        ):
            released_classes(3, given, meta, "f")


def test_a_non_numeric_block_key_stops_in_one_line():
    """Old: ``ValueError: invalid literal for int() with base 10: 'x'``, a traceback."""
    with torch.device("meta"):
        weights = released_tresnet("tresnet_m", num_classes=3)
    weights["body.layer2.x.conv1.0.weight"] = weights["body.conv1.0.weight"]
    config = released_model_config("asl", weights)
    with pytest.raises(
        InferenceError, match="its key 'body.layer2.x.conv1.0.weight' has no place in tresnet_m"
    ):
        convert_weights("asl", weights, config)


def import_outcome(argv: list[str]) -> tuple[int, str]:
    """``mlcls-import argv`` in this process: its exit status and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exit_info:
            return int(exit_info.code), err.getvalue()
    return 0, err.getvalue()


def assert_one_line(outcome, *expected: str) -> None:
    assert not outcome.escaped and outcome.error is None, (outcome.error, outcome.message, outcome.trace)
    code, err = outcome.value
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("mlcls: error: "), err
    assert all(text in err for text in expected), err


@pytest.mark.slow
def test_a_released_file_with_a_deflated_member_is_refused_before_it_is_unpacked(tmp_path):
    """64 MiB of weights deflated into a file of about 64 kB: refused in one line under a cap of 32 MiB
    (old: unpacked by torch.load, +300 MB RSS for a 0.29 MB file)."""
    torch.save({"conv1.weight": torch.zeros(16 * 2**20)}, tmp_path / "stored.pth")
    source = tmp_path / "deflated.pth"
    with zipfile.ZipFile(tmp_path / "stored.pth") as stored, zipfile.ZipFile(source, "w") as deflated:
        for info in stored.infolist():
            deflated.writestr(info.filename, stored.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)
    assert source.stat().st_size < 2**20
    outcome = bounded(
        import_outcome, ["csra", str(source), f"out={tmp_path / 'o.pt'}"], memory_mb=32, seconds=20
    )
    assert_one_line(outcome, "is compressed", "torch.save stores members uncompressed")
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.slow
def test_a_device_or_a_pipe_is_refused_at_once(tmp_path):
    """``/dev/zero`` as the released file, and a FIFO without a writer as ``classes=`` (old: blocked for
    good), each stop with one line naming what the path is."""
    outcome = bounded(
        import_outcome, ["csra", "/dev/zero", f"out={tmp_path / 'o.pt'}"], memory_mb=64, seconds=10
    )
    assert_one_line(outcome, "/dev/zero is a character device; expected a regular file")
    fifo = tmp_path / "classes.fifo"
    os.mkfifo(fifo)
    argv = ["asl", "/dev/null", f"out={tmp_path / 'o.pt'}", f"classes={fifo}"]
    outcome = bounded(import_outcome, argv, memory_mb=64, seconds=10)
    # classes= is read by mlcls.text.read_class_list, as mlcls-predict's classes= file
    expected = "is a pipe (FIFO); expected a regular file"
    assert_one_line(outcome, f"class list {fifo}: cannot be read", expected)
