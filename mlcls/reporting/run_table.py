"""Runs side by side (``mlcls-tables --runs``), one row per run. Columns, in order:

- the config keys whose values differ between the runs' resolved configs (dotted, ``loss.tp``): the keys a
  sweep varied; where the class a group builds differs (``loss=twoway,bce``), the group is one column naming
  it instead of its keys, which are not comparable;
- ``status`` (:func:`run_status`; ``unreadable: <why>`` for a run whose results.json or config.yaml cannot
  be read: it is listed without settings or figures, and the other runs are compared);
- ``mAP_class``, ``mAP_sample`` (%, the last evaluation), :data:`ZERO_SHOT_COLUMNS` when a run has
  ``metrics.zsl`` / ``metrics.gzsl``, ``best_epoch`` (of the best mAP@class), ``epochs_completed``,
  ``wall_time_s``, ``run`` (the directory).

The runs may be anyone's: their figures are checked (:func:`mlcls.reporting.run_files.check_results`: a
percentage from 0 to 100, NaN shown as no value), their text has every unprintable character but a line break
or a tab as its Python escape (:func:`shown_text`: no escape sequence reaches a terminal), and
:mod:`mlcls.reporting.render` shows that text as it is in every form.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlcls.config_tree import flatten_config, nested_get
from mlcls.errors import printable
from mlcls.losses.spec import loss_name
from mlcls.reporting.paper import ReportError
from mlcls.reporting.run_files import (
    ZERO_SHOT_FIGURES,
    find_run_dirs,
    is_float_number,
    natural_order,
    read_run,
    yaml_text,
)
from mlcls.reporting.runs import built_name, epochs_left

FIGURE_COLUMNS = ("status", "mAP_class", "mAP_sample", "best_epoch", "epochs_completed", "wall_time_s", "run")
# metrics.zsl / metrics.gzsl figures shown, as <set>.<figure>, when a run has them.
ZERO_SHOT_COLUMNS = tuple(f"{group}.{figure}" for group in ("zsl", "gzsl") for figure in ZERO_SHOT_FIGURES)
# Sorted highest first by --sort; every other column lowest (or alphabetically) first.
HIGHER_IS_BETTER = ("mAP_class", "mAP_sample", *ZERO_SHOT_COLUMNS)
# Settings that say where and how a run was launched, not what it was.
LAUNCH_KEYS = ("trainer.resume",)
BUILT = "_target_"


@dataclass(frozen=True)
class RunsTable:
    """``rows`` (one dict per run, keyed by ``columns``; None where a run has no value) under ``columns``."""

    columns: tuple[str, ...]
    rows: tuple[dict[str, Any], ...]


def flat_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every leaf of ``config`` under its dotted key (:func:`mlcls.config_tree.flatten_config`); each group
    that names the class it builds (``_target_``) also appears under its own key with that class's short
    name."""

    def built(dotted: str, group: Mapping[str, Any]) -> str | None:
        if not group.get(BUILT):
            return None
        return loss_name(group) if dotted == "loss" else built_name(group)

    return flatten_config(config, built)


def differing_keys(settings: Sequence[Mapping[str, Any]]) -> list[str]:
    """The keys whose value (absent counting as one) is not the same in every one of ``settings``, in the
    order they first appear, without :data:`LAUNCH_KEYS`; the keys inside a group whose ``_target_``
    differs are left out: the group's own key names what each run built."""
    keys = list(dict.fromkeys(key for run in settings for key in run))
    missing = object()
    differ = {
        key for key in keys if len({json.dumps(run.get(key, missing), default=repr) for run in settings}) > 1
    }
    rebuilt = {key[: -len(BUILT) - 1] for key in differ if key.endswith(f".{BUILT}")}

    def inside_rebuilt(key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:end]) in rebuilt for end in range(1, len(parts)))

    return [key for key in keys if key in differ and key not in LAUNCH_KEYS and not inside_rebuilt(key)]


def shown_text(value: Any) -> Any:
    """``value``, a text with each unprintable character (an escape sequence's ESC, a C1 control, U+202E,
    ...) but a line break or a tab (which each renderer shows as such) as its Python escape
    (:func:`mlcls.errors.printable`); a number, a list (written as JSON) or None as it is."""
    if not isinstance(value, str):
        return value
    return "".join(char if char in "\t\n\r" else printable(char) for char in value)


def run_status(config: Mapping[str, Any] | None, results: Mapping[str, Any] | None) -> str:
    """``finished``, ``unfinished (k of n epochs)`` (stopped, preempted or still running) or ``failed`` (no
    results: stopped, or running, before its first evaluation); ``, resumed n×`` added."""
    if results is None:
        return "failed"
    left = epochs_left(config or {}, results)
    status = f"unfinished ({left[0]} of {left[1]} epochs)" if left else "finished"
    resumes = results.get("resumes") or 0
    return f"{status}, resumed {resumes}×" if resumes else status


def _figures(run_dir: Path, results: Mapping[str, Any] | None, status: str) -> dict[str, Any]:
    results = results or {}  # its objects checked by check_results
    metrics, best = results.get("metrics") or {}, results.get("best") or {}
    figures = {
        "status": status,
        "mAP_class": metrics.get("mAP_class"),
        "mAP_sample": metrics.get("mAP_sample"),
    }
    for column in ZERO_SHOT_COLUMNS:
        group, figure = column.split(".")
        figures[column] = (metrics.get(group) or {}).get(figure)
    for column in ("mAP_class", "mAP_sample", *ZERO_SHOT_COLUMNS):  # NaN: undefined (no positive), no value
        if isinstance(figures[column], float) and math.isnan(figures[column]):
            figures[column] = None
    return {
        **figures,
        "best_epoch": best.get("epoch"),
        "epochs_completed": results.get("epochs_completed"),
        "wall_time_s": nested_get(results, "provenance", "wall_time_s"),
        "run": str(run_dir),
    }


def runs_table(paths: Iterable[Path | str], sort: str | None = None) -> RunsTable:
    """Every run at or below ``paths`` (a directory holding ``config.yaml`` or ``results.json``), one row
    each, in path order (job numbers numerically), or ordered by column ``sort``: the mAP columns highest
    first, every other lowest first; runs without a value last."""
    paths = [Path(path) for path in paths]
    markers = ("config.yaml", "results.json")
    run_dirs = sorted(
        {run_dir for path in paths for run_dir in find_run_dirs(path, markers)}, key=natural_order
    )
    if not run_dirs:
        listed = ", ".join(map(str, paths))
        raise ReportError(f"no run in {listed}: a run directory holds config.yaml or results.json")
    settings, figures = [], []
    for run_dir in run_dirs:
        try:
            results, config = read_run(run_dir)
        except ReportError as exc:
            settings.append({})
            figures.append(_figures(run_dir, None, f"unreadable: {exc}"))
            continue
        settings.append(flat_settings(config or {}))
        figures.append(_figures(run_dir, results, run_status(config, results)))
    keys = differing_keys(settings)
    zero_shot = any(figure[column] is not None for figure in figures for column in ZERO_SHOT_COLUMNS)
    figure_columns = (
        (*FIGURE_COLUMNS[:3], *ZERO_SHOT_COLUMNS, *FIGURE_COLUMNS[3:]) if zero_shot else FIGURE_COLUMNS
    )
    columns = tuple(shown_text(column) for column in (*keys, *figure_columns))
    rows = []
    for run, figure in zip(settings, figures, strict=True):
        values = [*(run.get(key) for key in keys), *(figure[column] for column in figure_columns)]
        rows.append(dict(zip(columns, map(shown_text, values), strict=True)))
    if sort is not None and sort not in columns:
        raise ReportError(f"--sort {sort}: no such column; the columns are {', '.join(columns)}")
    sign = -1 if sort in HIGHER_IS_BETTER else 1

    def order(row: dict[str, Any]) -> tuple:  # numbers before text, None last
        value = row[sort]
        if value is None:
            return (2, 0, "")
        return (0, sign * value, "") if is_float_number(value) else (1, 0, yaml_text(value))

    return RunsTable(columns, tuple(rows if sort is None else sorted(rows, key=order)))
