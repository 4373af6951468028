"""mlcls-export: TorchScript and ONNX files compute the eager model's logits and carry its metadata."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import error_on_a_full_disk, run_main
from inference_fixtures import PAPER_SPEC, reference_model, trained_run

from mlcls.cli import export as export_cli
from mlcls.inference.export import export_checkpoint, read_metadata


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory)


def random_batch(batch_size: int = 5) -> torch.Tensor:
    """A batch size other than the one traced (2), so a baked-in batch dimension would fail."""
    return torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(123))


def check_metadata(metadata: dict, state: dict) -> None:
    assert metadata["classes"] == state["classes"]
    assert metadata["preprocess"] == PAPER_SPEC
    assert metadata["thresholds"] == pytest.approx(np.linspace(-1.5, 0.5, 12).tolist(), abs=1e-12)
    assert metadata["input"]["shape"] == ["batch", 3, 32, 32]
    assert metadata["output"]["shape"] == ["batch", 12]


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
@pytest.mark.slow
def test_torchscript_matches_eager_model_and_carries_metadata(run_dir, tmp_path):
    path, difference = export_checkpoint(
        run_dir / "calibrated.pt", "torchscript", tmp_path / "m.torchscript.pt"
    )
    assert path == tmp_path / "m.torchscript.pt" and difference is not None and difference < 1e-5

    model, state = reference_model(run_dir / "calibrated.pt")
    extra = {"mlcls.json": ""}
    scripted = torch.jit.load(str(path), _extra_files=extra)
    images = random_batch()
    with torch.no_grad():
        torch.testing.assert_close(scripted(images), model(images), atol=1e-5, rtol=0)
    check_metadata(json.loads(extra["mlcls.json"]), state)


@pytest.mark.slow
def test_onnx_matches_eager_model_and_carries_metadata(run_dir, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    path, difference = export_checkpoint(run_dir / "calibrated.pt", "onnx", tmp_path / "m.onnx")
    assert difference is not None and difference < 1e-5

    model, state = reference_model(run_dir / "calibrated.pt")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    images = random_batch()
    (logits,) = session.run(None, {"images": images.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(logits, model(images).numpy(), atol=1e-5, rtol=0)
    properties = session.get_modelmeta().custom_metadata_map
    check_metadata({key: json.loads(value) for key, value in properties.items()}, state)
    assert read_metadata(path) == {key: json.loads(value) for key, value in properties.items()}


@pytest.mark.slow
def test_cli_exports_beside_the_checkpoint(run_dir, tmp_path, monkeypatch, capsys):
    checkpoint = tmp_path / "plain.pt"
    checkpoint.write_bytes((run_dir / "plain.pt").read_bytes())
    monkeypatch.chdir(tmp_path)
    argv = ["mlcls-export", f"checkpoint={checkpoint}", "format=torchscript"]
    code, err, out = run_main(export_cli.main, argv, monkeypatch, capsys)
    assert code == 0, err[-20:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["path"] == str(tmp_path / "plain.torchscript.pt") and report["max_abs_difference"] < 1e-5
    metadata = read_metadata(tmp_path / "plain.torchscript.pt")
    # an old checkpoint: preprocessing derived from its dataset config (light, 32 px), no thresholds
    assert metadata["preprocess"]["transform"] == "light" and metadata["preprocess"]["resize"] == [32, 32]
    assert metadata["thresholds"] is None


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
@pytest.mark.slow
def test_cli_on_a_full_disk_is_one_line_and_leaves_no_file(run_dir, tmp_path, monkeypatch, capsys, fmt):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "deploy" / f"model.{fmt}"
    argv = ["mlcls-export", f"checkpoint={run_dir / 'plain.pt'}", f"format={fmt}", f"out={out}"]
    line = error_on_a_full_disk(export_cli.main, argv, monkeypatch, capsys)
    assert line.startswith(f"mlcls: error: cannot write {out}: no space left on the")
    assert list(out.parent.iterdir()) == []  # neither the file nor a temporary one


@pytest.mark.slow
def test_cli_rejects_unknown_format_in_one_line(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mlcls-export", f"checkpoint={run_dir / 'plain.pt'}", "format=tflite"])
    with pytest.raises(SystemExit) as exit_info:
        export_cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mlcls: error: format='tflite'; expected one of torchscript, onnx"
    ]
    assert list(tmp_path.iterdir()) == []
