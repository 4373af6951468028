"""What a loss config says about the loss, without building it: its short name and the rows M its
buckets see. Used by provenance and the paper tables, which read the resolved config of finished runs."""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any


def loss_name(loss: Mapping[str, Any]) -> str:
    """Short name of the loss a config builds (``twoway``, ``bce``, ...): the config's ``name`` key (older
    runs), else the ``name`` of the ``_target_`` class, else the last component of its path.

    Only mlcls's own loss modules are imported to read the class: a run directory or a checkpoint from
    someone else names its ``_target_``, and importing an arbitrary module runs its code. A target that
    cannot be imported still gives its path's last component, so an error or a table can name the loss.
    """
    if loss.get("name"):
        return str(loss["name"])
    target = loss.get("_target_")
    if not target:
        raise ValueError("a loss config needs _target_ (the loss class, e.g. mlcls.losses.TwoWayLoss)")
    module_path, _, class_name = str(target).rpartition(".")
    if not re.fullmatch(r"mlcls\.losses(\.[a-z_][a-z0-9_]*)?", module_path):
        return class_name
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError, ValueError):
        return class_name
    return str(getattr(cls, "name", class_name))


def effective_bucket_size(loss: Mapping[str, Any], batch_size: int, world_size: int) -> int | None:
    """Rows M of the logit matrix a bucketed loss sees, or None for a loss without buckets:
    ``loss.bucket_size`` when set; otherwise the whole batch the loss is given, the per-process batch
    ``batch_size / world_size`` or the global batch under ``loss.gather`` (see
    :class:`~mlcls.losses.TwoWayLoss`)."""
    if "bucket_size" not in loss:
        return None
    if loss["bucket_size"] is not None:
        return int(loss["bucket_size"])
    return int(batch_size) if loss.get("gather") else int(batch_size) // int(world_size)
