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
from mlcls.inference.predictor import load_inference_model, use_classes
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


# ---- mldecoder_zsl: the model ML-Decoder's train_zsl_nus.py saves (torch.save(model.state_dict())), a
# TResNet-L with MLDecoder(zsl=1) (Alibaba-MIIL/ML_Decoder at 8a9e984, src_files/ml_decoder/ml_decoder.py).
# Its queries are word vectors set at run time as a plain attribute (update_wordvecs): the file holds no
# class, and the 300-d vectors are the word-vector file given. Names and shapes below are typed from that
# code: wordvec_proj = Linear(300, E); decoder = nn.TransformerDecoder(TransformerDecoderLayerOptimal, 1)
# with embed_standart = Linear(D, E), duplicate_pooling (E, 1) and duplicate_pooling_bias (1,).
ZSL_CLASSES = ["lake", "sky", "window", "rainbow", "toy"]
WORD_DIM, FEEDFORWARD = 300, 2048


def released_mldecoder_zsl_head(in_features: int, embed: int = 768) -> dict[str, torch.Tensor]:
    """The 20 ``head.*`` entries of MLDecoder(zsl=1)'s state dict, random values (norm scales near 1)."""
    layer = "head.decoder.layers.0."
    shapes = {
        "head.wordvec_proj.weight": (embed, WORD_DIM),
        "head.wordvec_proj.bias": (embed,),
        **{f"{layer}norm{i}.{p}": (embed,) for i in (1, 2, 3) for p in ("weight", "bias")},
        f"{layer}multihead_attn.in_proj_weight": (3 * embed, embed),
        f"{layer}multihead_attn.in_proj_bias": (3 * embed,),
        f"{layer}multihead_attn.out_proj.weight": (embed, embed),
        f"{layer}multihead_attn.out_proj.bias": (embed,),
        f"{layer}linear1.weight": (FEEDFORWARD, embed),
        f"{layer}linear1.bias": (FEEDFORWARD,),
        f"{layer}linear2.weight": (embed, FEEDFORWARD),
        f"{layer}linear2.bias": (embed,),
        "head.decoder.embed_standart.weight": (embed, in_features),
        "head.decoder.embed_standart.bias": (embed,),
        "head.decoder.duplicate_pooling": (embed, 1),
        "head.decoder.duplicate_pooling_bias": (1,),
    }
    head = {key: torch.randn(shape) * 0.05 for key, shape in shapes.items()}
    for key in shapes:
        if ".norm" in key and key.endswith("weight"):
            head[key] = head[key] + 1.0
    return head


def authors_zsl_logits(head: dict[str, torch.Tensor], features: torch.Tensor, wordvecs: torch.Tensor):
    """MLDecoder(zsl=1).forward in eval mode (dropout off), float64, from the released names: memory =
    ReLU(embed_standart(tokens)); queries = ReLU(wordvec_proj(wordvecs)); the layer's t = norm1(q + q),
    t = norm2(t + MultiheadAttention(t, memory, memory)), t = norm3(t + linear2(ReLU(linear1(t)))); then
    the group FC of duplicate factor 1: t @ duplicate_pooling + duplicate_pooling_bias. (B, C)."""
    p = {key: value.double() for key, value in head.items()}
    layer, embed = "head.decoder.layers.0.", p["head.wordvec_proj.weight"].shape[0]
    heads, d = 8, embed // 8

    def linear(x, name):
        return x @ p[f"{name}.weight"].t() + p[f"{name}.bias"]

    def norm(x, name):
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * p[f"{name}.weight"] + p[f"{name}.bias"]

    tokens = features.double().flatten(2).transpose(1, 2)  # (B, N, D)
    memory = torch.relu(linear(tokens, "head.decoder.embed_standart"))  # (B, N, E)
    queries = torch.relu(linear(wordvecs.double(), "head.wordvec_proj"))  # (C, E)
    t = norm(queries + queries, layer + "norm1").expand(memory.shape[0], -1, -1)  # (B, C, E)
    wq, wk, wv = p[layer + "multihead_attn.in_proj_weight"].split(embed)
    bq, bk, bv = p[layer + "multihead_attn.in_proj_bias"].split(embed)
    q, k, v = (x @ w.t() + b for x, w, b in ((t, wq, bq), (memory, wk, bk), (memory, wv, bv)))
    split = lambda x: x.unflatten(-1, (heads, d)).transpose(1, 2)  # noqa: E731  (B, heads, L, d)
    weights = torch.softmax(split(q) @ split(k).transpose(-1, -2) / d**0.5, dim=-1)
    attended = (weights @ split(v)).transpose(1, 2).flatten(2)  # (B, C, E)
    attended = linear(attended, layer + "multihead_attn.out_proj")
    t = norm(t + attended, layer + "norm2")
    t = norm(t + linear(torch.relu(linear(t, layer + "linear1")), layer + "linear2"), layer + "norm3")
    return (t @ p["head.decoder.duplicate_pooling"])[..., 0] + p["head.decoder.duplicate_pooling_bias"][0]


def write_word_vectors(path, names: list[str], seed: int = 0) -> torch.Tensor:
    """A GloVe-format file of one unit 300-d vector per name (printed with every digit), and the vectors."""
    rows = torch.randn(
        len(names), WORD_DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    rows = rows / rows.norm(dim=1, keepdim=True)
    path.write_text(
        "".join(
            f"{name} {' '.join(repr(v) for v in row.tolist())}\n"
            for name, row in zip(names, rows, strict=True)
        )
    )
    return rows


def test_mldecoder_zsl_maps_every_key_of_the_authors_tresnet_l_and_refuses_any_other():
    """All 764 released keys (744 of the TResNet-L body, 20 of the head) land on tresnet_v2_l + mldecoder_zsl,
    whose one other entry is the class embeddings; an extra, a missing, a doubled key or another width is
    one line (old: "its key 'head.wordvec_proj.weight' is none of those")."""
    with torch.device("meta"):
        weights = {**released_tresnet("tresnet_v2_l"), **released_mldecoder_zsl_head(2048)}
    queries = torch.full((len(ZSL_CLASSES), WORD_DIM), WORD_DIM**-0.5)
    assert len(weights) == 764
    config = released_model_config("mldecoder_zsl", weights)
    assert (config["name"], config["head"]) == (
        "tresnet_v2_l",
        {"name": "mldecoder_zsl", "warmup_epochs": 1, "embed_dim": 768},
    )
    converted = convert_weights("mldecoder_zsl", weights, config, queries)
    assert len(converted) == 765 and converted["head.class_embeddings"] is queries
    head_names = {name for name in converted if name.startswith("head.")}
    assert len(head_names) == 21 and not any(".decoder." in name for name in head_names)
    cases = {
        "head.decoder.query_embed.weight": "has no place in tresnet_v2_l",  # the non-zsl MLDecoder's key
        "head.decoder.wordvec_proj.weight": "names head.wordvec_proj.weight, which another entry fills",
    }
    for extra, message in cases.items():
        with pytest.raises(InferenceError, match=message):
            convert_weights(
                "mldecoder_zsl", {**weights, extra: weights["head.wordvec_proj.weight"]}, config, queries
            )
    missing = {key: value for key, value in weights.items() if key != "head.decoder.duplicate_pooling_bias"}
    with pytest.raises(InferenceError, match="it lacks the weights of head.duplicate_pooling_bias"):
        convert_weights("mldecoder_zsl", missing, config, queries)
    with pytest.raises(InferenceError, match=r"head.decoder.duplicate_pooling is \(768, 2\), \(768, 1\)"):
        convert_weights(
            "mldecoder_zsl",
            {**weights, "head.decoder.duplicate_pooling": torch.empty(768, 2, device="meta")},
            config,
            queries,
        )


def test_mldecoder_zsl_needs_its_classes_and_word_vectors(tmp_path, capsys):
    err = one_line_error(capsys, ["mldecoder_zsl", "/dev/null", f"out={tmp_path / 'o.pt'}"])
    assert "give classes=<file of names, one a line> and vectors=" in err
    err = one_line_error(capsys, ["mldecoder", "/dev/null", f"out={tmp_path / 'o.pt'}", "vectors=glove.txt"])
    assert "vectors= is for the zero-shot format mldecoder_zsl" in err


@pytest.mark.slow
def test_mldecoder_zsl_matches_timm_and_the_authors_equations(tmp_path):
    """The authors' model as train_zsl_nus.py saves it (with --model-name tresnet_m, which its create_model
    builds too: the TResNet-L's 764 keys are mapped in the test above), imported with a class list and a
    word-vector file: its logits equal timm's TResNet-M (loaded by timm's converter) under the float64 head
    written above, for the imported classes and, through the stored text source, for others
    (mlcls-predict classes=)."""
    torch.manual_seed(2)
    weights = {**released_tresnet("tresnet_m"), **released_mldecoder_zsl_head(2048)}
    # the random body's features reach 4e3: a smaller projection keeps the decoder's attention logits near
    # a trained model's scale, where float32 holds 1e-5 (0.05 as drawn: 6e-4 in float32, 3e-7 in float64)
    weights["head.decoder.embed_standart.weight"] *= 0.01
    names, vectors = tmp_path / "classes.txt", tmp_path / "glove.txt"
    names.write_text("".join(f"{name}\n" for name in ZSL_CLASSES[:3]))
    wordvecs = write_word_vectors(vectors, ZSL_CLASSES)
    inference = import_file(tmp_path, "mldecoder_zsl", weights, f"classes={names}", f"vectors={vectors}")
    assert inference.classes == ZSL_CLASSES[:3] and inference.text["config"]["path"] == str(vectors)
    assert (inference.config["model"]["name"], inference.preprocess["resize"]) == ("tresnet_m", [448, 448])
    backbone = timm_reference("tresnet_m", {k: v for k, v in weights.items() if k.startswith("body.")})
    images = torch.rand(2, 3, SIZE, SIZE)
    with torch.no_grad():
        features = backbone.forward_features(images.double())
        expected = authors_zsl_logits(weights, features, wordvecs[:3])
        torch.testing.assert_close(inference.model(images).double(), expected, atol=1e-5, rtol=1e-5)
        use_classes(inference, ["toy", "lake"])
        expected = authors_zsl_logits(weights, features, wordvecs[[4, 0]])
        torch.testing.assert_close(inference.model(images).double(), expected, atol=1e-5, rtol=1e-5)
