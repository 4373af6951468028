"""The one layout number of the files mlcls reads again (checkpoints, packs' ``manifest.json``). A change a
reader must know of raises :data:`FORMAT` by one; a file of another format is refused in one line, since
no mlcls has been released that wrote an older one (nothing to upgrade).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FORMAT = 2
KINDS = {"checkpoint": "train again", "pack": "pack the dataset again"}


def check_format(
    document: dict[str, Any], kind: str, where: str, error: Callable[[str], Exception]
) -> dict[str, Any]:
    """``document`` (a checkpoint or a pack's manifest, read from ``where``) when it is of :data:`FORMAT`;
    else ``error(message)``, one line naming the format found and what to do."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {', '.join(KINDS)}")
    stored = document.get("format")
    if type(stored) is not int or stored != FORMAT:
        remedy = (
            "a newer mlcls wrote it: upgrade mlcls"
            if type(stored) is int and stored > FORMAT
            else KINDS[kind]
        )
        raise error(
            f"{where} is of {kind} format {repr(stored)[:40]}; this mlcls reads format {FORMAT} ({remedy})"
        )
    return document
