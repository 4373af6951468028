"""The one reader of run directories, which may be anyone's: where runs are (:func:`find_run_dirs`), their
``results.json`` (every field the reports use type-checked) and ``config.yaml`` (no YAML aliases, nesting
capped), each through :mod:`mlcls.io`'s one door (a regular file within its cap, opened once without
blocking). See docs/report.md, "What mlcls-report and mlcls-tables read, and what is bounded"."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from mlcls.config_tree import nested_get
from mlcls.errors import is_integer
from mlcls.io import read_json, read_yaml
from mlcls.reporting.paper import ReportError

# Nesting deeper than this in a run's config is refused (an mlcls config is 3 levels deep; the readers
# recurse through it).
MAX_CONFIG_DEPTH = 32
# The largest whole number a results.json field may hold: any count or epoch of a run is far below it, and a
# float can hold it (a larger integer fails to format or to convert).
MAX_INT = 2**53


def is_float_number(value: Any) -> bool:
    """A float (finite or not), or an int a float holds exactly (at most :data:`MAX_INT` in size); not a
    bool: :func:`mlcls.errors.is_number` bounded as a run's figures and settings are shown."""
    return isinstance(value, float) or (is_integer(value) and abs(value) <= MAX_INT)


def yaml_text(value: Any) -> str:
    """A config value as written in a YAML file: null, true/false, a list as JSON, numbers and text as
    they are."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return json.dumps(value, default=str)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _count(value: Any) -> bool:
    return is_integer(value) and 0 <= value <= MAX_INT


def _kind(value: Any) -> str:
    """What a JSON value is, for a message: its type, and short values themselves."""
    if value is None or isinstance(value, bool) or is_float_number(value):
        return json.dumps(value)
    if isinstance(value, str):
        return f"the text {json.dumps(value[:40])}" + ("..." if len(value) > 40 else "")
    return {dict: "an object", list: "a list", int: "a whole number beyond 2**53"}.get(type(value), "a value")


# What a leaf of results.json may hold, and the words of the refusal.
LEAVES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "figure": (lambda v: v is None or is_float_number(v), "a number or null"),
    "percent": (
        lambda v: v is None or (is_float_number(v) and (math.isnan(v) or 0 <= v <= 100)),
        "a number from 0 to 100, NaN (undefined) or null",
    ),
    "seconds": (
        lambda v: v is None or (is_float_number(v) and 0 <= v < math.inf),
        "a finite number >= 0 or null",
    ),
    "count": (lambda v: v is None or _count(v), "a whole number >= 0 or null"),
    "epoch": (_count, "a whole number >= 0"),
    "processes": (lambda v: _count(v) and v >= 1, "a whole number >= 1"),
    "name": (lambda v: v is None or isinstance(v, str), "a name"),
    "object": (lambda v: v is None or isinstance(v, Mapping), "an object or null"),
}
# The figures of results.json's metrics.zsl and metrics.gzsl that mlcls-tables --runs shows.
ZERO_SHOT_FIGURES = ("mAP_class", "mAP_sample", "F1_top3", "F1_top5")
# The fields of results.json that mlcls-report and mlcls-tables read, and what each must hold where present: a
# leaf of LEAVES, an object of such fields ({"*": leaf}: every field), or a list of objects ([fields]).
RESULTS_FIELDS: dict[str, Any] = {
    "metrics": {
        **dict.fromkeys(("CF1", "OF1"), "figure"),
        **dict.fromkeys(("mAP_class", "mAP_sample"), "percent"),
        **dict.fromkeys(("zsl", "gzsl"), dict.fromkeys(ZERO_SHOT_FIGURES, "percent")),
    },
    "best": {"epoch": "epoch", "mAP_class": "figure", "weights": "name"},
    "per_class_ap": {"*": "figure"},
    "history": [{"epoch": "epoch", "loss": "figure", "mAP_class": "figure", "mAP_sample": "figure"}],
    "dataset": {"name": "name", "train_size": "count", "val_size": "count", "num_classes": "count"},
    "provenance": {
        "world_size": "processes",
        "wall_time_s": "seconds",
        "device": "object",
        "config": "object",
    },
    "epochs_completed": "count",
    "resumes": "count",
    "world_size": "processes",
}


def _wrong(node: Any, spec: Any) -> str | None:
    """What is wrong with ``node`` under ``spec`` (:data:`RESULTS_FIELDS`), ``"<field> is ..., expected
    ..."``, or None."""
    if isinstance(spec, str):
        ok, expected = LEAVES[spec]
        return None if ok(node) else f"is {_kind(node)}; expected {expected}"
    if isinstance(spec, list):
        if not isinstance(node, list):
            return f"is {_kind(node)}; expected a list"
        return next(
            (f"[{k}] {wrong}" for k, item in enumerate(node) if (wrong := _wrong(item, spec[0]))), None
        )
    if not isinstance(node, Mapping):
        return f"is {_kind(node)}; expected an object"
    fields = node.items() if "*" in spec else ((key, node[key]) for key in spec if key in node)
    return next(
        (f"{key} {wrong}" for key, v in fields if (wrong := _wrong(v, spec.get(key, spec.get("*"))))), None
    )


def check_results(results: Any, path: Path) -> dict[str, Any]:
    """``results`` (read from ``path``) if it is a JSON object whose fields that mlcls-report and mlcls-tables
    read hold what they should (:data:`RESULTS_FIELDS`; an object field may be absent or null);
    :class:`ReportError` naming the first that does not, in one line."""
    if not isinstance(results, dict):
        raise ReportError(f"{path}: a JSON {type(results).__name__}; expected an object")
    for key, spec in RESULTS_FIELDS.items():
        if key in results and (isinstance(spec, str) or results[key] is not None):
            wrong = _wrong(results[key], spec)
            if wrong:
                raise ReportError(f"{path}: {key} {wrong}")
    return results


def read_run(run_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(results, config)`` of the run in ``run_dir``, each None when the run has none (yet), else
    :class:`ReportError` in one line. Its results: ``results.json``, a regular file of at most
    ``CAPS["results"]`` bytes, nesting bounded, checked (:func:`check_results`). Its resolved config:
    ``provenance.config`` of the results, else ``config.yaml`` (a regular file of at most ``CAPS["config"]``
    bytes, no YAML alias), a mapping nesting at most :data:`MAX_CONFIG_DEPTH` levels."""
    results_path, config_path = Path(run_dir) / "results.json", Path(run_dir) / "config.yaml"
    try:
        results = read_json(results_path, "results")
    except FileNotFoundError:
        results = None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{results_path}: not valid JSON ({exc})") from None
    except (OSError, ValueError) as exc:  # not a regular file, too large, nested too deep
        raise ReportError(error_text(exc, results_path)) from None
    else:
        results = check_results(results, results_path)
    config = nested_get(results, "provenance", "config")
    if config is None:
        try:
            config = read_yaml(config_path, "config")
        except FileNotFoundError:
            return results, None
        except yaml.YAMLError as exc:
            raise ReportError(f"{config_path}: not valid YAML ({' '.join(str(exc).split())})") from None
        except (OSError, ValueError) as exc:  # not a regular file, too large, an alias, nested too deep
            raise ReportError(error_text(exc, config_path)) from None
    if config is not None and not isinstance(config, dict):
        raise ReportError(f"{run_dir}: the run's config is a {type(config).__name__}; expected a mapping")
    if config is not None and _depth(config) > MAX_CONFIG_DEPTH:
        raise ReportError(
            f"{run_dir}: the run's config nests over {MAX_CONFIG_DEPTH} levels; not an mlcls config"
        )
    return results, config


def _depth(node: Any) -> int:
    """How deep ``node`` (plain dicts and lists) nests, found without recursion."""
    deepest, pending = 0, [(node, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > MAX_CONFIG_DEPTH:
                    return depth + 1
                pending.append((child, depth + 1))
        deepest = max(deepest, depth)
    return deepest


def error_text(exc: BaseException, path: Path | None = None) -> str:
    """``exc``'s message on one line, naming ``path`` (if given) when it does not already."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if path is None or str(path) in text else f"{path}: {text}"


def config_groups(config: Mapping[str, Any], where: Path | str, groups: Iterable[str]) -> None:
    """:class:`ReportError` in one line unless each of ``groups`` of ``config`` is a mapping (``loss``
    naming its ``_target_`` or ``name``), as in every config mlcls-train writes."""
    for group in groups:
        if not isinstance(config.get(group), Mapping):
            raise ReportError(
                f"{where}: the run's config has no {group} group (a mapping); not an mlcls config"
            )
    loss = config.get("loss")
    if isinstance(loss, Mapping) and not any(
        isinstance(loss.get(k), str) and loss.get(k) for k in ("_target_", "name")
    ):
        raise ReportError(
            f"{where}: the run's loss config names no _target_ (the loss class); not an mlcls config"
        )


def find_run_dirs(path: Path | str, markers: tuple[str, ...] = ("results.json",)) -> list[Path]:
    """The run directories at or below ``path``: those holding one of ``markers`` (``config.yaml`` also
    finds runs that stopped before their first evaluation), hidden folders skipped, sorted with job numbers
    in numeric order (``2`` before ``10``)."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"{path}: no such directory")
    if any((path / marker).is_file() for marker in markers):
        return [path]
    found = {
        hit.parent
        for marker in markers
        for hit in path.rglob(marker)
        if not any(part.startswith(".") for part in hit.relative_to(path).parts[:-1])
    }
    return sorted(found, key=natural_order)


def natural_order(path: Path) -> list[tuple[int, int | str]]:
    """Sort key of a path comparing its runs of digits as numbers."""
    parts = re.split(r"(\d+)", str(path))
    return [(0, int(part)) if part.isdigit() else (1, part) for part in parts]
