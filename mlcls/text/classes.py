"""Class names given by a user: a class list file (one name a line) or a comma-separated list, checked
before anything is built from them. Names come from someone else's file, so every bound holds before the
names are used, and a bad name is quoted escaped (``repr``) in a one-line error."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

from mlcls.errors import ConfigError, shown
from mlcls.io import FileTooLargeError, read_text

# The most classes a list may name: OpenImages has ~20,000 trainable classes, RAM++'s open vocabulary
# ~4,600 tags; each class costs one embedding row (D floats) and one logit per image.
MAX_CLASSES = 100_000
# The longest class name, in characters: a name is a few words (a sentence with a prompt at most); a text
# encoder's cost grows with it.
MAX_NAME_CHARS = 1000


def check_class_names(names: Sequence[str]) -> list[str]:
    """``names`` as a list, checked: 1 to :data:`MAX_CLASSES` names, each a string of 1 to
    :data:`MAX_NAME_CHARS` characters with no control or other unprintable character and no leading or
    trailing space, none twice. A one-line :class:`ConfigError` names the first fault."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ConfigError(f"class names {shown(names)}; expected a list of strings")
    if not 1 <= len(names) <= MAX_CLASSES:
        raise ConfigError(f"{len(names)} class names; expected 1 to {MAX_CLASSES:,}")
    seen: set[str] = set()
    for index, name in enumerate(names):
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise ConfigError(
                f"class name #{index + 1} {shown(name)}; expected a string of 1 to {MAX_NAME_CHARS} "
                "characters"
            )
        if not name.isprintable() or name != name.strip():
            raise ConfigError(
                f"class name #{index + 1} {shown(name)} holds a control character or surrounding space; "
                "expected printable text"
            )
        if name in seen:
            raise ConfigError(f"class name #{index + 1} {shown(name)} is named twice; expected each once")
        seen.add(name)
    return list(names)


def read_class_list(path: str | Path) -> list[str]:
    """The class names of file ``path``, one a line (surrounding spaces and blank lines skipped), checked by
    :func:`check_class_names`. The file is read through :func:`mlcls.io.read_text` (a regular file of UTF-8
    text, at most ``CAPS["class list"]`` bytes), and its lines are counted while they are read, so a file
    of more than :data:`MAX_CLASSES` names stops at the first one over: one line of error, whatever the
    file holds."""
    try:
        text = read_text(path, "class list")
    except (OSError, UnicodeDecodeError, FileTooLargeError) as exc:
        raise ConfigError(f"class list {path}: cannot be read ({exc})") from None
    names: list[str] = []
    for line in io.StringIO(text, newline="\n"):
        name = line.strip("\n").strip(" \t\r")
        if not name:
            continue
        if len(names) == MAX_CLASSES:
            raise ConfigError(
                f"class list {path} names more than {MAX_CLASSES:,} classes; expected at most that"
            )
        names.append(name)
    if not names:
        raise ConfigError(f"class list {path} names no class; expected one name a line")
    try:
        return check_class_names(names)
    except ConfigError as exc:
        raise ConfigError(f"class list {path}: {exc}") from None


def parse_classes(value: str | Sequence[str]) -> list[str]:
    """The classes a command line names with ``classes=``: a list as it is; a string naming an existing file
    read as a class list (:func:`read_class_list`); any other string split on commas (``a,b,c``)."""
    if not isinstance(value, str):
        return check_class_names([str(name) for name in value])
    if os.path.exists(value):
        return read_class_list(value)
    return check_class_names([name.strip() for name in value.split(",")])
