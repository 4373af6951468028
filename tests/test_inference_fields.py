"""A checkpoint's fields are checked before its model is built: class count, head options and preprocessing
against the stored weights (one line, bounded memory), odd-typed fields, NaN weights."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import torch
from hostile import bounded
from inference_fixtures import PAPER_SPEC, trained_run, write_images

from mlcls.cli import predict as predict_cli
from mlcls.errors import InferenceError
from mlcls.inference.predictor import load_inference_model, predict_images
from mlcls.models import create_model

# How far the address space of the process that loads a crafted checkpoint may grow (RLIMIT_AS): the
# genuine model is 20 MB; the models the crafted files describe need 2 to 19 GB.
HEADROOM = 1 << 30


def status(field: str) -> int:
    """A field of this process's /proc/self/status, in bytes."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith(field + ":")).split()[1]) << 10


def limited_loads(image: Path, checkpoints: list[Path]) -> list[dict]:
    """Loads each checkpoint and predicts ``image`` with it (run by :func:`hostile.bounded`, in a forked child
    whose address space may grow by :data:`HEADROOM`); per checkpoint, the error's type and message and the
    peak resident memory above the one before (Linux's VmHWM, reset through /proc/self/clear_refs before
    each load)."""
    outcomes = []
    for checkpoint in checkpoints:
        before = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        try:
            predict_images(load_inference_model(checkpoint, device="cpu"), [image])
            error, message = None, None
        except BaseException as exc:  # noqa: BLE001 - every outcome is what the test asserts on
            error, message = type(exc).__name__, str(exc)
        outcomes.append({"error": error, "message": message, "grown": status("VmHWM") - before})
    return outcomes


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> dict:
    """The fields of the tiny run's calibrated checkpoint that prediction reads (resnet10t, linear head, 12
    classes)."""
    run_dir = trained_run(tmp_path_factory)
    state = torch.load(run_dir / "calibrated.pt", weights_only=False)
    fields = ("format", "model", "classes", "config", "preprocess", "thresholds", "thresholds_split")
    return {key: state[key] for key in fields}


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("photos"), count=1)[0]


def save(state: dict, path: Path) -> Path:
    torch.save(state, path)
    return path


def mldecoder_state(genuine: dict, embedding: int, weights: dict[str, torch.Tensor]) -> dict:
    """``genuine`` turned into an ML-Decoder checkpoint of width ``embedding`` holding ``weights``."""
    state = copy.deepcopy(genuine)
    state["config"]["model"]["head"] = {"name": "mldecoder", "embed_dim": embedding, "num_groups": 4}
    state["model"] = weights
    return state


def decoder_weights(embedding: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The state dict of the tiny run's network with a 4-query ML-Decoder of width ``embedding``."""
    with torch.device(device):
        model = create_model(
            "resnet10t", 12, pretrained=False, head="mldecoder", embed_dim=embedding, num_groups=4
        )
    return {key: value.detach() for key, value in model.state_dict().items()}


@pytest.mark.slow
def test_crafted_sizes_are_one_line_before_any_model_is_built(genuine, image, tmp_path):
    """The issue's checkpoints: a wide decoder over a narrow one's weights, the same decoder's weights as
    stride-0 expansions of a single stored value (shapes that fit, 19 GB of memory they do not hold), a
    million class names over 12 classifier rows, a 40,000-pixel resize. Each is refused in one line while
    the process may grow by :data:`HEADROOM` only, with a peak resident memory less than 400 MB above the
    one before (reading a million class names alone takes 170 MB)."""
    narrow = decoder_weights(8)
    wide_shapes = decoder_weights(40_000, device="meta")
    expanded = {
        key: narrow[key]
        if key.startswith("backbone.")
        else torch.zeros((), dtype=value.dtype).expand(value.shape)
        for key, value in wide_shapes.items()
    }
    attention = "head.decoder.layers.0.multihead_attn.in_proj_weight"
    assert expanded[attention].shape == (120_000, 40_000)  # 19.2 GB as float32
    many_classes = {
        **copy.deepcopy(genuine),
        "classes": [f"c{i}" for i in range(100_000)],  # within the data.pkl scan's object count
        "thresholds": None,
    }
    cases = [
        (save(genuine, tmp_path / "genuine.pt"), None),  # the control: loads and predicts in these bounds
        (
            save(mldecoder_state(genuine, 40_000, narrow), tmp_path / "wide.pt"),
            rf"{tmp_path / 'wide.pt'}: weights do not fit the model its config describes for 12 class names: "
            r"head\.decoder\.\S+ is \(\d+(, \d+)*\) in the file, \([^)]*\b40000\b[^)]*\) in the model",
        ),
        (
            save(mldecoder_state(genuine, 40_000, expanded), tmp_path / "expanded.pt"),
            rf"{tmp_path / 'expanded.pt'}: the weights head\.decoder\.\S+ \(\d+(, \d+)*\) are backed by \d+ "
            r"stored bytes, fewer than their \d+ values need; expected one stored value per element",
        ),
        (
            save(many_classes, tmp_path / "classes.pt"),
            rf"{tmp_path / 'classes.pt'}: weights do not fit the model its config describes for 100000 "
            rf"class names: fc\.weight is \(12, {genuine['model']['fc.weight'].shape[1]}\) in the file, "
            rf"\(100000, {genuine['model']['fc.weight'].shape[1]}\) in the model",
        ),
        (
            save({**genuine, "preprocess": {**PAPER_SPEC, "resize": 40_000}}, tmp_path / "resize.pt"),
            r"preprocess\.resize=40000; expected a size of 1 to 4096 pixels, or \[h, w\] of such sizes",
        ),
    ]
    described = sum(value.numel() * value.element_size() for value in expanded.values())
    assert (tmp_path / "expanded.pt").stat().st_size < described / 500
    child = bounded(limited_loads, image, [path for path, _ in cases], memory_mb=HEADROOM >> 20, seconds=300)
    assert child.error is None, child.trace[-3000:]
    outcomes = child.value
    assert len(outcomes) == len(cases)
    for outcome, (path, pattern) in zip(outcomes, cases, strict=True):
        assert outcome["grown"] < 400 << 20, (path.name, outcome["grown"])
        if pattern is None:
            assert outcome["error"] is None, (path.name, outcome)
            continue
        assert outcome["error"] == "InferenceError", (path.name, outcome)
        assert re.fullmatch(pattern, outcome["message"]), (path.name, outcome["message"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"classes": torch.arange(12)},
            "'classes' is a Tensor; expected the list of class names (is it an mlcls checkpoint?)",
        ),
        ({"classes": ["a", 3, *"bcdefghijk"]}, "'classes' holds 3 (int); expected class names (strings)"),
        ({"classes": []}, "has no class names ('classes' is empty); is it an mlcls checkpoint?"),
        (
            {"config": "model: resnet10t"},
            "'config' is a str; expected the run's config as a mapping of sections (model, dataset, ...)",
        ),
        ({"model": ["fc.weight"]}, "'model' is a list; expected the state dict (names to tensors)"),
        ({"model": {"fc.weight": "zeros"}}, "the weights 'fc.weight' are a str; expected a dense tensor"),
        (
            {"model": {"fc.bias": torch.zeros(12).to_sparse()}},
            "the weights 'fc.bias' are a torch.sparse_coo tensor; expected a dense tensor",
        ),
        ({"model": {"fc.bias": torch.empty(12, device="meta")}}, "'fc.bias' are a meta tensor; expected"),
        ({"thresholds": "high"}, "'thresholds' is a str that is not a list of numbers"),
        ({"thresholds": torch.full((12,), torch.nan)}, "the stored thresholds hold NaN"),
        # before: a checkpoint without the key was read as calibrated on the validation set
        ({"thresholds_split": None}, "'thresholds_split' is None; expected one of validation, holdout"),
        (
            {"config": {"model": {"name": "resnet10t", "head": {"name": "mldecoder", "embed_dim": 10**12}}}},
            "cannot build the checkpoint's model: ",  # torch's own words: its sizes overflow
        ),
        ({"preprocess": "paper"}, "the checkpoint's preprocess is a str; expected a mapping with keys"),
        ({"preprocess": {**PAPER_SPEC, "crop": 0}}, "preprocess.crop=0; expected a size of 1 to 4096 pixels"),
        ({"preprocess": {**PAPER_SPEC, "resize": [37, True]}}, "preprocess.resize=[37, True]; expected"),
        ({"preprocess": {**PAPER_SPEC, "image_size": "32"}}, "preprocess.image_size='32'; expected a size"),
        (
            {"preprocess": {**PAPER_SPEC, "transform": "fancy"}},
            "preprocess.transform='fancy'; expected one of",
        ),
        ({"preprocess": {**PAPER_SPEC, "interpolation": ["x"]}}, "preprocess.interpolation=['x']; expected"),
    ],
)
@pytest.mark.slow
def test_odd_typed_fields_are_one_line(genuine, tmp_path, change, message):
    checkpoint = save({**genuine, **change}, tmp_path / "odd.pt")
    with pytest.raises(InferenceError) as error:
        load_inference_model(checkpoint, device="cpu")
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("rule", [{}, {"threshold": 0.5}, {"top_k": 2}])
@pytest.mark.slow
def test_nan_weights_are_one_line_under_every_rule(genuine, tmp_path, rule):
    """A NaN in one classifier row makes that class's score NaN for every image: no rule may drop the class
    silently (the calibrated thresholds did) or end in a traceback (top_k, threshold did)."""
    weights = {key: value.clone() for key, value in genuine["model"].items()}
    weights["fc.weight"][3, 0] = torch.nan
    checkpoint = save({**genuine, "model": weights}, tmp_path / "nan.pt")
    images = write_images(tmp_path / "photos", count=3)
    inference = load_inference_model(checkpoint, device="cpu")
    with pytest.raises(InferenceError) as error:
        predict_images(inference, images, **rule)
    assert str(error.value) == (
        "the model's scores are NaN for 3 of 3 images: its weights hold NaN or infinite values (a diverged "
        "run or a damaged checkpoint)"
    )


@pytest.mark.slow
def test_nan_weights_in_mlcls_predict_are_one_line_with_status_2(genuine, tmp_path, monkeypatch, capsys):
    weights = {key: value.clone() for key, value in genuine["model"].items()}
    weights["conv1.0.weight"].fill_(torch.nan)
    checkpoint = save({**genuine, "model": weights}, tmp_path / "nan.pt")
    image = write_images(tmp_path / "photos", count=1)[0]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mlcls-predict", f"checkpoint={checkpoint}", f"images={image}"])
    with pytest.raises(SystemExit) as exit_info:
        predict_cli.main()
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        "mlcls: error: the model's scores are NaN for 1 of 1 image: its weights hold NaN or infinite values "
        "(a diverged run or a damaged checkpoint)"
    ]
