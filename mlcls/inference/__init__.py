"""Using a trained model: preprocessing spec, calibrated thresholds, prediction on image files, export.

checkpoint ──► load_inference_model ──► predict_images (files · folders · globs) ──► labels + scores
    │                 ▲                        ▲
    │      preprocess spec (resize, crop,      select_labels: top_k · global threshold ·
    │      mean/std) from the checkpoint       calibrated per-class thresholds · 0.5
    ▼
export_checkpoint ──► TorchScript / ONNX with classes, preprocessing and thresholds as metadata
"""

from mlcls.data.pipeline.preprocess import build_eval_transform, preprocess_spec, spec_from_checkpoint
from mlcls.errors import InferenceError
from mlcls.metrics.thresholds import calibrate_thresholds, select_labels

__all__ = [
    "InferenceError",
    "build_eval_transform",
    "calibrate_thresholds",
    "preprocess_spec",
    "select_labels",
    "spec_from_checkpoint",
]
