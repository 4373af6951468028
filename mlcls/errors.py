"""Errors a user fixes by changing the command line or the config (the CLIs print them as one line), and
the wording shared by messages."""

from __future__ import annotations

import sys
from collections.abc import Sequence


class ConfigError(ValueError):
    """The resolved configuration is invalid; the message says which key and what is expected."""


class InferenceError(ValueError):
    """Bad input to prediction, evaluation or export: no image matched, an invalid threshold, an unusable
    checkpoint or preprocessing spec, a model whose scores are NaN."""


def failure(prog: str, error: object, status: int = 2, *notes: str) -> int:
    """Print ``<prog>: error: <error>`` and each note as ``<prog>: <note>`` on stderr; return ``status``."""
    for line in (f"error: {error}", *notes):
        print(f"{prog}: {line}", file=sys.stderr)
    return status


def is_integer(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an int to Python, never a count to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool`` (finite or not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plural(count: int, noun: str) -> str:
    """``"1 image"``, ``"3 images"``, ``"2 classes"`` (``-es`` after s, x, z, sh, tch)."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {noun}es" if noun.endswith(("s", "x", "z", "sh", "tch")) else f"{count} {noun}s"


def printable(text: str) -> str:
    """``text`` with every unprintable character (controls, DEL, U+202E, U+2028, ...) as its Python escape:
    a name from someone else can neither drive the terminal nor start a forged row."""
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text
    )


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (else its type's name), :func:`printable`."""
    lines = str(error).strip().splitlines()
    return printable(lines[0].strip()) if lines else type(error).__name__


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a value read from a file, quoted in a one-line error."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def listed(values: Sequence[object], limit: int) -> str:
    """The first ``limit`` of ``values``, each :func:`shown`, then how many more: ``'a', 'b' and 3 more``."""
    named = ", ".join(shown(value) for value in values[:limit])
    return named + (f" and {len(values) - limit} more" if len(values) > limit else "")
