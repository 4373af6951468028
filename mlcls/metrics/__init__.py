"""Evaluation metrics: pure functions of score and label tensors."""

from mlcls.metrics.ap import average_precision, map_class, map_sample

__all__ = ["average_precision", "map_class", "map_sample"]
