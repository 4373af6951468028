"""``mlcls-predict format=captions``: each image's predicted tags written beside it as its caption file,
``<image stem><caption_ext>``, as a caption folder (:mod:`mlcls.data.datasets.captions`) reads it back.

Tags are ordered by decreasing probability and joined by ``tag_separator`` (``, `` for a comma: the
Danbooru convention ``1girl, long_hair``). An existing caption file is kept as it is, unless
``overwrite`` (replaced) or ``append`` (its tags first, then the predicted ones it lacks). Every file is
written atomically; every existing file is read, through the guarded door, before any is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mlcls.data.datasets.captions import CONTROL, caption_tags
from mlcls.errors import InferenceError, plural, shown
from mlcls.inference.predictor import Prediction
from mlcls.io import atomic_write_bytes


@dataclass(frozen=True)
class CaptionsWritten:
    """How many caption files were ``written`` (new or replaced), ``appended`` to, and ``kept`` as they
    were (they existed, without ``overwrite`` or ``append``)."""

    written: int
    appended: int
    kept: int

    def describe(self) -> str:
        """``"3 caption files written, 1 appended, 2 kept (existing; overwrite=true or append=true)"``."""
        said = f"{plural(self.written, 'caption file')} written"
        if self.appended:
            said += f", {self.appended} appended"
        if self.kept:
            said += f", {self.kept} kept (existing; overwrite=true or append=true replaces or extends them)"
        return said


def check_tags(classes: Sequence[str], separator: str) -> None:
    """One :class:`InferenceError` line for a class name that a caption file cannot hold: one containing
    the separator, a line break or a control character."""
    if not isinstance(separator, str) or not separator or separator.isspace():
        raise InferenceError(
            f"tag_separator={shown(separator)}; expected a character that is not a space, like ,"
        )
    for name in classes:
        if separator in name or CONTROL.search(name) or "\n" in name or "\r" in name or not name.strip():
            raise InferenceError(
                f"the model's class {shown(name)} cannot be written in a caption file separated by "
                f"{separator!r} (it holds the separator, a line break or a control character); choose "
                "another tag_separator"
            )


def check_caption_options(caption_ext: str, overwrite: bool, append: bool) -> None:
    """One :class:`InferenceError` line for a ``caption_ext`` that is no suffix, or both ``overwrite`` and
    ``append``."""
    if overwrite and append:
        raise InferenceError("overwrite=true and append=true: choose one (append keeps the existing tags)")
    if not isinstance(caption_ext, str) or not caption_ext.startswith(".") or len(caption_ext) < 2:
        raise InferenceError(f"caption_ext={shown(caption_ext)}; expected a suffix like .txt")


def write_captions(
    predictions: Sequence[Prediction],
    caption_ext: str = ".txt",
    separator: str = ",",
    overwrite: bool = False,
    append: bool = False,
) -> CaptionsWritten:
    """Write each prediction's tags to ``<image stem><caption_ext>`` beside its image (module docstring)."""
    check_caption_options(caption_ext, overwrite, append)
    check_tags([name for p in predictions for name, _ in p.labels], separator)
    joiner = ", " if separator == "," else separator
    plans: list[tuple[Path, list[str]]] = []
    kept = appended = 0
    for prediction in predictions:
        image = Path(prediction.image)
        path = image.with_name(image.stem + caption_ext)
        tags = [name for name, _ in prediction.labels]
        if path.exists() or path.is_symlink():
            if append:
                existing = caption_tags(str(path), separator, "keep")
                tags = existing + [tag for tag in tags if tag not in set(existing)]
                appended += 1
            elif not overwrite:
                kept += 1
                continue
        plans.append((path, tags))
    for path, tags in plans:
        atomic_write_bytes(path, (joiner.join(tags) + "\n").encode())
    return CaptionsWritten(len(plans) - appended, appended, kept)
