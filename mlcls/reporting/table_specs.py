"""The paper's Tables 1-5 and 7 as specifications, and runs placed in them::

    paper_tables.yaml: numbers + layouts ──► table_spec: rows × columns, each cell = the run attributes it
                                             needs (mlcls.reporting.runs) + the paper's number
    fill_table: cell = mean of the matching runs' last-epoch metric ──► mlcls.reporting.render

One builder serves every table: an axis is the product of the levels the layout lists, outermost first; a
cell's paper number is at the layout's path from the levels' keys (schema: head of the layout document).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlcls.reporting.paper import ReportError, load_layouts, load_paper
from mlcls.reporting.runs import METRICS, RunRecord, matches

# T_P -> 0 (Table 1's top row, the hard minimum) is run at this temperature: the loss needs T_P > 0.
HARD_MIN_TP = 0.01
TABLE_NAMES = tuple(load_layouts())


@dataclass(frozen=True)
class Axis:
    """A row or a column of a table: its label, the attributes it fixes, the metric if it carries it, and
    ``keys``: for each level that built it, the level's key and its position in the level."""

    label: tuple[str, ...] | str
    match: Mapping[str, Any] = field(default_factory=dict)
    metric: str | None = None
    keys: Mapping[str, tuple[Any, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class TableSpec:
    """A paper table: layout, the attributes every cell shares, and the paper's number of each cell."""

    name: str
    caption: str
    row_header: tuple[str, ...]
    rows: tuple[Axis, ...]
    columns: tuple[Axis, ...]
    fixed: Mapping[str, Any]
    paper: Mapping[tuple[tuple[str, ...], str], float | None]
    note: str = ""

    def cell_match(self, row: Axis, column: Axis) -> dict[str, Any]:
        return {**self.fixed, **row.match, **column.match}

    def cell_metric(self, row: Axis, column: Axis) -> str:
        metric = row.metric or column.metric
        assert metric is not None, f"{self.name}: cell {row.label} x {column.label} has no metric"
        return metric


@dataclass(frozen=True)
class _Entry:
    """One value of a level: its key (in the paper's numbers), label, attributes and metric."""

    key: Any
    label: str
    match: Mapping[str, Any]
    metric: str | None = None


_MISSING = object()


def _walk(data: Any, path: str, keys: Mapping[str, tuple[Any, int]]) -> Any:
    """The node at dotted ``path`` in ``data``; ``{name}`` is level ``name``'s key, ``#name`` its position.
    :data:`_MISSING` when the path leads nowhere."""
    node = data
    for part in path.split("."):
        if part.startswith("{") and part.endswith("}"):
            step = keys[part[1:-1]][0]
        elif part.startswith("#"):
            step = keys[part[1:]][1]
        else:
            step = part
        in_mapping = isinstance(node, Mapping) and step in node
        in_list = isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node)
        if not (in_mapping or in_list):
            return _MISSING
        node = node[step]
    return node


def _references() -> dict[str, Any]:
    """What ``$a.b`` values and ``{a[b]}`` texts of the layouts name: the paper's numbers and HARD_MIN_TP."""
    return {**load_paper(), "hard_min_tp": HARD_MIN_TP}


def _value(value: Any, keys: Mapping[str, tuple[Any, int]]) -> Any:
    """A layout value: ``"$a.b"`` -> the number at a.b, ``"{name}"`` -> level ``name``'s key, else as is."""
    if not isinstance(value, str):
        return value
    if value.startswith("$"):
        found = _walk(_references(), value[1:], keys)
        if found is _MISSING:
            raise KeyError(f"paper_tables.yaml: {value} names no number")
        return found
    if value.startswith("{") and value.endswith("}") and value[1:-1] in keys:
        return keys[value[1:-1]][0]
    return value


def _attributes(match: Mapping[str, Any], keys: Mapping[str, tuple[Any, int]]) -> dict[str, Any]:
    """Run attributes of a layout's ``match``, numbers as floats; ``M`` (the paper's bucket size) becomes
    buckets per batch."""
    attributes = {key: _value(value, keys) for key, value in match.items()}
    attributes = {
        key: float(value) if isinstance(value, int) and not isinstance(value, bool) else value
        for key, value in attributes.items()
    }
    if "M" in attributes:
        attributes["buckets"] = load_paper()["protocol"]["batch_size"] / attributes.pop("M")
    return attributes


def _entries(level: str | Mapping[str, Any], keys: Mapping[str, tuple[Any, int]]) -> list[_Entry]:
    """The values of one level of an axis, given the keys of the levels outside it."""
    if level == "metric":
        return [_Entry(metric, label, {}, metric) for metric, label in METRICS.items()]
    if "entries" in level:
        return [_Entry(key, entry["label"], entry["match"]) for key, entry in level["entries"].items()]
    found = _walk(load_paper(), level["keys"], keys)
    if found is _MISSING:
        raise KeyError(f"paper_tables.yaml: level {level['name']} has no keys at {level['keys']}")
    label, special = level["label"], level.get("special") or {}
    entries = []
    for key in found:
        if key in special:
            entries.append(_Entry(key, special[key]["label"], special[key]["match"]))
        else:
            text = label[key] if isinstance(label, Mapping) else label.format(**{level["name"]: key})
            entries.append(_Entry(key, text, level["match"]))
    return entries


def _axis(levels: Sequence[str | Mapping[str, Any]], keys: Mapping[str, tuple[Any, int]]) -> list[Axis]:
    """The product of ``levels``, outermost first: one :class:`Axis` per combination of their entries;
    ``keys`` are those of the levels outside them."""
    if not levels:
        return [Axis((), {}, None, keys)]
    level, inner = levels[0], levels[1:]
    name = "metric" if level == "metric" else level["name"]
    axes = []
    for position, entry in enumerate(_entries(level, keys)):
        placed = {**keys, name: (entry.key, position)}
        outer = _attributes(entry.match, placed)
        for axis in _axis(inner, placed):
            label = (entry.label, *axis.label)
            axes.append(Axis(label, {**outer, **axis.match}, entry.metric or axis.metric, axis.keys))
    return axes


def table_spec(name: str) -> TableSpec:
    """The layout, cell definitions and paper numbers of table ``name`` (``table1`` ... ``table7``)."""
    if name not in TABLE_NAMES:
        raise ReportError(f"unknown table {name!r}; expected one of {', '.join(TABLE_NAMES)}")
    layout = load_layouts()[name]
    rows = tuple(_axis(layout["rows"], {}))
    columns = tuple(
        Axis(" ".join(axis.label), axis.match, axis.metric, axis.keys)
        for axis in _axis(layout["columns"], {})
    )
    paper = {}
    for row, column in itertools.product(rows, columns):
        keys = {**row.keys, **column.keys}
        number = None if layout["paper"] is None else _walk(load_paper(), layout["paper"], keys)
        paper[(row.label, column.label)] = None if number in (None, _MISSING) else float(number)
    return TableSpec(
        name=name,
        caption=layout["caption"].format(**_references()),
        row_header=tuple(layout["row_header"]),
        rows=rows,
        columns=columns,
        fixed=_attributes(layout["fixed"], {}),
        paper=paper,
        note=layout.get("note", "").format(**_references()),
    )


@dataclass(frozen=True)
class FilledCell:
    """One cell: the mean of our matching runs (None if none), the paper's number and the difference."""

    row: tuple[str, ...]
    column: str
    metric: str
    ours: float | None
    paper: float | None
    runs: tuple[RunRecord, ...]

    @property
    def diff(self) -> float | None:
        return None if self.ours is None or self.paper is None else self.ours - self.paper

    @property
    def deviations(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d for run in self.runs for d in run.deviations))


@dataclass(frozen=True)
class FilledTable:
    spec: TableSpec
    cells: tuple[FilledCell, ...]

    @property
    def filled(self) -> int:
        return sum(cell.ours is not None for cell in self.cells)


def fill_table(spec: TableSpec, runs: Sequence[RunRecord]) -> FilledTable:
    """Place every run whose attributes match a cell; a cell's value is the mean over its runs."""
    cells = []
    for row in spec.rows:
        for column in spec.columns:
            metric = spec.cell_metric(row, column)
            wanted = spec.cell_match(row, column)
            hits = tuple(run for run in runs if metric in run.metrics and matches(run.attributes, wanted))
            ours = statistics.fmean(run.metrics[metric] for run in hits) if hits else None
            paper = spec.paper.get((row.label, column.label))
            cells.append(FilledCell(tuple(row.label), column.label, metric, ours, paper, hits))
    return FilledTable(spec, tuple(cells))


def unplaced_runs(runs: Sequence[RunRecord], specs: Iterable[TableSpec]) -> list[RunRecord]:
    """The runs that fill no cell of any of ``specs``."""
    placed = {id(run) for spec in specs for cell in fill_table(spec, runs).cells for run in cell.runs}
    return [run for run in runs if id(run) not in placed]


def placement_problem(
    runs: Sequence[RunRecord], specs: Sequence[TableSpec], stand_ins: Mapping[str, str] | None = None
) -> str | None:
    """Why no run can fill a cell of ``specs`` whatever its loss settings (none has a dataset and a backbone
    of the tables: which the runs have, and the ``--stand-in`` options that would place them), or None."""
    needed: dict[str, list[Any]] = {"dataset": [], "backbone": []}
    for spec in specs:
        for row, column in itertools.product(spec.rows, spec.columns):
            match = spec.cell_match(row, column)
            for key, values in needed.items():
                if key in match and match[key] not in values:
                    values.append(match[key])
    fits = [
        run
        for run in runs
        if all(not values or run.attributes.get(key) in values for key, values in needed.items())
    ]
    if fits or not runs:
        return None
    given = {replacement: ours for ours, replacement in (stand_ins or {}).items()}
    have, wanted, options = [], [], []
    for key, values in needed.items():
        ours = sorted({str(run.attributes[key]) for run in runs})
        have.append(_listed(key, ours))
        if values:
            wanted.append(_listed(key, values))
            target = values[0] if len(values) == 1 else f"<one of {', '.join(map(str, values))}>"
            options += [f"--stand-in {given.get(name, name)}={target}" for name in ours if name not in values]
    return (
        f"none of the {len(runs)} runs can fill a cell of {', '.join(spec.name for spec in specs)}: "
        f"the runs have {' and '.join(have)}, the tables need {' and '.join(wanted)}; "
        f"{' '.join(options)} would place them"
    )


def _listed(noun: str, names: Sequence[Any]) -> str:
    """``dataset coco`` or ``datasets coco, voc2007``."""
    return f"{noun}{'s' if len(names) > 1 else ''} {', '.join(map(str, names))}"
