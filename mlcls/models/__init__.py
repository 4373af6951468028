"""Models: any timm backbone with a multi-label classifier head."""

from mlcls.models import released  # noqa: F401 - registers tresnet_v2_xl (ML-Decoder's TResNet-XL) with timm
from mlcls.models.factory import create_model, split_parameters

__all__ = ["create_model", "split_parameters"]
