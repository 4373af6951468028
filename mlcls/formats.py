"""The one layout number of every file mlcls writes for itself to read again -- checkpoints and packed
datasets' ``manifest.json`` -- and the one function that brings what it read to that layout.

Every such file holds ``format`` (:data:`FORMAT`); a change a reader must know of raises it by one and adds
its step to :func:`upgrade`, which refuses in one line what it cannot read, with what to do instead.

* 1: checkpoints with the configs' old key names (``mlcls.renamed``); packs with a dense label row per
  sample (never read: pack again).
* 2: configs' new key names; packs' sparse label rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlcls.errors import is_integer
from mlcls.renamed import upgrade_config

FORMAT = 2
KINDS = ("checkpoint", "pack")


def upgrade(
    document: dict[str, Any], kind: str, where: str, error: Callable[[str], Exception]
) -> dict[str, Any]:
    """``document`` (a checkpoint's state or a pack's manifest, as read from ``where``) in the layout of
    :data:`FORMAT`, changed in place. ``error(message)`` is the exception raised for a file that cannot be
    read: a format that is not an integer in [1, FORMAT], or a pack of format 1."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {', '.join(KINDS)}")
    stored = document.get("format", 1)
    if not is_integer(stored) or not 1 <= stored <= FORMAT:
        raise error(
            f"{where} is of {kind} format {repr(stored)[:40]}; this mlcls reads formats 1 to {FORMAT} "
            "(a newer mlcls wrote it: upgrade mlcls)"
        )
    if kind == "pack" and stored < 2:
        raise error(
            f"{where} is of pack format {stored}, this mlcls reads format {FORMAT}; pack the dataset again"
        )
    if kind == "checkpoint" and isinstance(document.get("config"), dict):
        document["config"] = upgrade_config(document["config"])
    document["format"] = FORMAT
    return document
