"""A stored config's tree: a value read through plain dicts (:func:`nested_get`), and the config as a flat
table, every leaf under its dotted key (MLflow's params, the report's and the runs table's columns)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any


def nested_get(tree: Any, *keys: str, default: Any = None) -> Any:
    """``tree[keys[0]][keys[1]]...`` through plain dicts (a stored config, any shape); ``default`` where a
    key is absent or a level is not a dict."""
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree


def flatten_config(
    config: Mapping[str, Any], group_value: Callable[[str, Mapping[str, Any]], Any] | None = None
) -> dict[str, Any]:
    """Every leaf of ``config`` under its dotted key, in the config's order; a list is one value. A group
    (a nested mapping) for which ``group_value(dotted_key, group)`` is not None also appears under its own
    key, with that value, before its leaves. Walked with an explicit stack: never a RecursionError."""
    flat: dict[str, Any] = {}
    stack: list[tuple[str, Iterator[tuple[Any, Any]]]] = [("", iter(config.items()))]
    while stack:
        prefix, items = stack[-1]
        for key, value in items:
            dotted = f"{prefix}{key}"
            if isinstance(value, Mapping):
                shown = None if group_value is None else group_value(dotted, value)
                if shown is not None:
                    flat[dotted] = shown
                stack.append((f"{dotted}.", iter(value.items())))
                break
            flat[dotted] = value
        else:
            stack.pop()
    return flat
