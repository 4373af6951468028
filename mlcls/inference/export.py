"""Export a checkpoint's network to TorchScript or ONNX, with its class names and preprocessing inside.

Both formats take ``images``, a float32 (B, 3, H, W) batch already preprocessed as the metadata's
``preprocess`` spec says, any batch size B, and return ``logits`` (B, C). The metadata
(:func:`export_metadata`) travels in the file:

* TorchScript: the extra file ``mlcls.json`` (``torch.jit.load(path, _extra_files={"mlcls.json": ""})``);
* ONNX: ``metadata_props``, one entry per top-level key, each value JSON-encoded (onnxruntime:
  ``session.get_modelmeta().custom_metadata_map``).

:func:`read_metadata` reads either back. Thresholds are logits, ``-Infinity`` for a class always predicted
(Python's ``json`` reads it), ``null`` when the checkpoint has none. The TorchScript
module is traced (timm networks have no data-dependent control flow); ONNX uses the TorchScript-based
exporter (``dynamo=False``), which needs only the ``onnx`` package (``pip install mlcls[export]``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mlcls import __version__
from mlcls.config_tree import nested_get
from mlcls.data.pipeline.preprocess import input_size
from mlcls.errors import InferenceError
from mlcls.inference.predictor import InferenceModel, load_inference_model
from mlcls.io import atomic_write, atomic_write_bytes

log = logging.getLogger("mlcls")

EXPORT_FORMATS = ("torchscript", "onnx")
SUFFIXES = {"torchscript": ".torchscript.pt", "onnx": ".onnx"}
TORCHSCRIPT_METADATA = "mlcls.json"
INPUT_NAME, OUTPUT_NAME = "images", "logits"


@contextlib.contextmanager
def _quiet_deprecation() -> Iterator[None]:
    """Silence torch's deprecation notices of ``torch.jit`` and of the TorchScript-based ONNX exporter."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield


def export_metadata(inference: InferenceModel) -> dict[str, Any]:
    """Everything a deployment needs besides the weights: classes, preprocessing, thresholds, I/O layout."""
    height, width = input_size(inference.preprocess)
    thresholds = None if inference.thresholds is None else inference.thresholds.tolist()
    return {
        "mlcls_version": __version__,
        "classes": inference.classes,
        "preprocess": inference.preprocess,
        "thresholds": thresholds,
        "thresholds_split": inference.thresholds_split,
        "input": {
            "name": INPUT_NAME,
            "shape": ["batch", 3, height, width],
            "dtype": "float32",
            "description": "RGB images after the preprocess steps, NCHW",
        },
        "output": {
            "name": OUTPUT_NAME,
            "shape": ["batch", len(inference.classes)],
            "dtype": "float32",
            "description": "per-class logits; probability = sigmoid(logit); class c is predicted when "
            "logit >= thresholds[c] (probability >= 0.5 when thresholds is null)",
        },
        "model": nested_get(inference.config, "model", "name"),
        "checkpoint": str(inference.checkpoint),
    }


def export_onnx(
    model: nn.Module, example: torch.Tensor, path: Path, metadata: dict[str, Any], opset: int = 17
) -> None:
    """Export ``model`` (eval mode) to ONNX with a dynamic batch axis and ``metadata`` in metadata_props."""
    try:
        import onnx
    except ImportError as exc:
        raise InferenceError("ONNX export needs the onnx package: pip install mlcls[export]") from exc
    buffer = io.BytesIO()
    with _quiet_deprecation():
        torch.onnx.export(
            model.eval(),
            (example,),
            buffer,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=opset,
            dynamo=False,
        )
    proto = onnx.load_from_string(buffer.getvalue())
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, json.dumps(value)
    atomic_write_bytes(path, proto.SerializeToString())


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata :func:`export_checkpoint` stored in ``path`` (TorchScript or ONNX)."""
    path = Path(path)
    if path.suffix == ".onnx":
        import onnx

        proto = onnx.load(str(path), load_external_data=False)
        return {entry.key: json.loads(entry.value) for entry in proto.metadata_props}
    extra = {TORCHSCRIPT_METADATA: ""}
    with _quiet_deprecation():
        torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    return json.loads(extra[TORCHSCRIPT_METADATA])


def export_checkpoint(
    checkpoint: str | Path,
    fmt: str,
    out: str | Path | None = None,
    opset: int = 17,
    verify: bool = True,
    trust: bool = False,
) -> tuple[Path, float | None]:
    """Export ``checkpoint`` (plain data unless ``trust``) to ``fmt`` (:data:`EXPORT_FORMATS`) at ``out``
    (default: beside it, ``<stem>.onnx`` or ``<stem>.torchscript.pt``); the path written and, with
    ``verify``, the largest absolute logit difference from the PyTorch model on a random batch of 3, a size
    other than the traced one of 2 (None when not verified, or ONNX without onnxruntime); the random
    batches are reproducible (seeds 0 and 1)."""
    if fmt not in EXPORT_FORMATS:
        raise InferenceError(f"format={fmt!r}; expected one of {', '.join(EXPORT_FORMATS)}")
    inference = load_inference_model(checkpoint, device="cpu", trust=trust)
    path = Path(out) if out else Path(checkpoint).with_name(Path(checkpoint).stem + SUFFIXES[fmt])
    metadata = export_metadata(inference)
    height, width = input_size(inference.preprocess)
    example, images = (
        torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))
        for batch, seed in ((2, 0), (3, 1))
    )
    model = inference.model.eval()
    if fmt == "onnx":
        export_onnx(model, example, path, metadata, opset)
    else:
        with _quiet_deprecation():
            traced = torch.jit.trace(model, example)
            extra = {TORCHSCRIPT_METADATA: json.dumps(metadata)}
            atomic_write(path, lambda f: torch.jit.save(traced, f, _extra_files=extra))
    if not verify:
        return path, None
    if fmt == "onnx":
        try:
            import onnxruntime
        except ImportError:
            log.info("onnxruntime is not installed: %s not verified (pip install mlcls[export])", path)
            return path, None
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        exported = torch.from_numpy(session.run([OUTPUT_NAME], {INPUT_NAME: images.numpy()})[0])
    else:
        with torch.no_grad(), _quiet_deprecation():
            exported = torch.jit.load(str(path), map_location="cpu")(images)
    with torch.no_grad():
        expected = model(images)
    return path, (exported - expected).abs().max().item()
