"""The one reader of run directories, which may be anyone's: where runs are (:func:`find_run_dirs`), their
``results.json`` (every field the reports use type-checked) and ``config.yaml`` (no YAML aliases, nesting
capped), each through :mod:`mlcls.io`'s one door (a regular file within its cap, opened once without
blocking). See docs/report.md, "What mlcls-report and mlcls-tables read, and what is bounded"."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from mlcls.io import read_json, read_yaml
from mlcls.reporting.paper import ReportError

# Nesting deeper than this in a run's config is refused (an mlcls config is 3 levels deep; the readers
# recurse through it).
MAX_CONFIG_DEPTH = 32
# The largest whole number a results.json field may hold: any count or epoch of a run is far below it, and a
# float can hold it (a larger integer fails to format or to convert).
MAX_INT = 2**53


def is_number(value: Any) -> bool:
    """A finite or infinite float, or an int of at most :data:`MAX_INT` in size; not a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and abs(value) <= MAX_INT)


def yaml_text(value: Any) -> str:
    """A config value as written in a YAML file: null, true/false, a list as JSON, numbers and text as
    they are."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return json.dumps(value, default=str)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _fields(checks: Mapping[str, tuple[Callable[[Any], bool], str]]) -> Callable[[Any], str | None]:
    """A check of a JSON object whose fields, where present, pass ``checks`` (field: (check, expected));
    returns what is wrong (``"<field> is ..., expected ..."``) or None."""

    def check(node: Any) -> str | None:
        if not isinstance(node, Mapping):
            return f"is {_kind(node)}; expected an object"
        for key, (ok, expected) in checks.items():
            if key in node and not ok(node[key]):
                return f"{key} is {_kind(node[key])}; expected {expected}"
        return None

    return check


def _kind(value: Any) -> str:
    """What a JSON value is, for a message: its type, and short values themselves."""
    if value is None or isinstance(value, bool) or is_number(value):
        return json.dumps(value)
    if isinstance(value, str):
        return f"the text {json.dumps(value[:40])}" + ("..." if len(value) > 40 else "")
    return {dict: "an object", list: "a list", int: "a whole number beyond 2**53"}.get(type(value), "a value")


_FIGURE = (_optional(is_number), "a number or null")
_COUNT = (_optional(_count), "a whole number >= 0 or null")
_ENTRY = _fields(
    {"epoch": (_count, "a whole number >= 0"), "loss": _FIGURE, "mAP_class": _FIGURE, "mAP_sample": _FIGURE}
)
# The fields of results.json that mlcls-report and mlcls-tables read, and what each must hold where present.
RESULTS_FIELDS: dict[str, Callable[[Any], str | None]] = {
    "metrics": _fields({key: _FIGURE for key in ("mAP_class", "mAP_sample", "CF1", "OF1")}),
    "best": _fields(
        {
            "epoch": (_count, "a whole number >= 0"),
            "mAP_class": _FIGURE,
            "weights": (_optional(lambda v: isinstance(v, str)), "a name"),
        }
    ),
    "per_class_ap": lambda node: (
        _fields({})(node)
        or next(
            (
                f"{key} is {_kind(v)}; expected a number or null"
                for key, v in node.items()
                if not _FIGURE[0](v)
            ),
            None,
        )
    ),
    "history": lambda node: (
        f"is {_kind(node)}; expected a list"
        if not isinstance(node, list)
        else next((f"[{k}] {wrong}" for k, entry in enumerate(node) if (wrong := _ENTRY(entry))), None)
    ),
    "dataset": _fields(
        {
            "name": (_optional(lambda v: isinstance(v, str)), "a name"),
            "train_size": _COUNT,
            "val_size": _COUNT,
            "num_classes": _COUNT,
        }
    ),
    "provenance": _fields(
        {
            "world_size": (lambda v: _count(v) and v >= 1, "a whole number >= 1"),
            "wall_time_s": _FIGURE,
            "device": (_optional(lambda v: isinstance(v, Mapping)), "an object or null"),
            "config": (_optional(lambda v: isinstance(v, Mapping)), "an object or null"),
        }
    ),
}
RESULTS_SCALARS = {
    "epochs_completed": _COUNT,
    "resumes": _COUNT,
    "world_size": (lambda v: _count(v) and v >= 1, "a whole number >= 1"),
}


def check_results(results: Any, path: Path) -> dict[str, Any]:
    """``results`` (read from ``path``) if it is a JSON object whose fields that mlcls-report and mlcls-tables
    read hold what they should (:data:`RESULTS_FIELDS`, :data:`RESULTS_SCALARS`; a field may be absent or
    null); :class:`ReportError` naming the first that does not, in one line."""
    if not isinstance(results, dict):
        raise ReportError(f"{path}: a JSON {type(results).__name__}; expected an object")
    for key, check in RESULTS_FIELDS.items():
        wrong = None if results.get(key) is None else check(results[key])
        if wrong:
            raise ReportError(f"{path}: {key} {wrong}")
    for key, (ok, expected) in RESULTS_SCALARS.items():
        if key in results and not ok(results[key]):
            raise ReportError(f"{path}: {key} is {_kind(results[key])}; expected {expected}")
    return results


def read_results(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir/results.json`` as a dict, None when the run wrote none (yet). Read through
    :func:`mlcls.io.read_json` (a regular file of at most ``CAPS["results"]`` bytes, nesting bounded) and
    checked (:func:`check_results`); :class:`ReportError` in one line otherwise."""
    results_path = Path(run_dir) / "results.json"
    try:
        results = read_json(results_path, "results")
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{results_path}: not valid JSON ({exc})") from None
    except (OSError, ValueError) as exc:  # not a regular file, too large, nested too deep
        raise ReportError(error_text(exc, results_path)) from None
    return check_results(results, results_path)


def read_run(run_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(results, config)`` of the run in ``run_dir`` (:func:`read_results`, :func:`read_config`); each
    None when the run has none."""
    results = read_results(run_dir)
    return results, read_config(run_dir, results)


def read_config(run_dir: Path, results: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The resolved config of a run: ``provenance.config`` of its results, else its ``config.yaml`` (read
    through :func:`mlcls.io.read_yaml`: a regular file of at most ``CAPS["config"]`` bytes, no YAML alias);
    None when it has neither. :class:`ReportError` in one line for a config that is not a mapping or is
    nested over :data:`MAX_CONFIG_DEPTH` levels."""
    provenance = (results or {}).get("provenance")
    config = provenance.get("config") if isinstance(provenance, dict) else None
    config_path = Path(run_dir) / "config.yaml"
    if config is None:
        try:
            config = read_yaml(config_path, "config")
        except FileNotFoundError:
            return None
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
    return config


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
