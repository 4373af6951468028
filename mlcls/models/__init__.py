"""Models: any timm backbone with a multi-label classifier head."""

from mlcls.models.factory import create_model, split_parameters

__all__ = ["create_model", "split_parameters"]
