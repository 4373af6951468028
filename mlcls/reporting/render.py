"""The tables of mlcls-tables as text: a filled paper table as Markdown (the paper's layout) and CSV (one
line per cell), the runs side by side (:mod:`mlcls.reporting.run_table`) as Markdown, CSV and JSON.

Text from runs (paths, config values) is shown as it is, never as markup or formulas: in Markdown
:func:`markdown_text` escapes it, in CSV :func:`spreadsheet_text` keeps a spreadsheet from running it; JSON
holds the values unchanged.
"""

from __future__ import annotations

import csv
import html
import io
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mlcls.errors import plural
from mlcls.io import atomic_write_bytes
from mlcls.reporting.run_files import is_float_number, yaml_text
from mlcls.reporting.run_table import HIGHER_IS_BETTER, RunsTable
from mlcls.reporting.table_specs import FilledCell, FilledTable

# The first characters that make a spreadsheet read a cell as a formula (OWASP's CSV injection list).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")

# The characters markdown_text escapes with a backslash (the backslash first: it escapes the others).
MARKDOWN_ESCAPED = "\\|[]*~`"
# An underscore that may open or close emphasis: not between two letters or digits (CommonMark never
# reads one within a word as emphasis, so batch_size and mAP_class stay as they are).
EMPHASIS_UNDERSCORE = re.compile(r"(?<![^\W_])_|_(?![^\W_])")

CSV_COLUMNS = ("table", "row", "column", "metric", "ours", "paper", "diff", "runs", "deviations", "run_dirs")


def markdown_text(text: str) -> str:
    """``text`` for a Markdown table cell or list item, shown as it is: ``&``, ``<`` and ``>`` as HTML
    entities (no raw HTML), ``|`` escaped (no new cell), ``[`` and ``]`` escaped (no link or image),
    ``*``, ``~``, backticks and the underscores of :data:`EMPHASIS_UNDERSCORE` escaped (no emphasis,
    strike-through or code span: ``_target_`` stays ``_target_``), a backslash too, so that none undoes an
    escape; each line break as ``<br>`` (no new row)."""
    escaped = html.escape(text, quote=False)
    for char in MARKDOWN_ESCAPED:
        escaped = escaped.replace(char, "\\" + char)
    escaped = EMPHASIS_UNDERSCORE.sub(r"\\_", escaped)
    return "<br>".join(escaped.splitlines())


def spreadsheet_text(text: str) -> str:
    """``text`` for a CSV cell: with a ``'`` in front when it starts like a formula (:data:`FORMULA_STARTS`),
    which a spreadsheet then shows as text instead of running it (OWASP's advice), and each line break as
    ``\\n``, which the CSV writer quotes (a lone ``\\r`` it would leave bare, ending the row)."""
    guarded = "'" + text if text.startswith(FORMULA_STARTS) else text
    return guarded.replace("\r\n", "\n").replace("\r", "\n")


def markdown_table(
    title: str, legend: str, header: Sequence[str], rows: Iterable[Sequence[str]]
) -> list[str]:
    """The lines of a titled Markdown table of cells already escaped: title, legend, header, rule, rows."""
    lines = [f"### {title}", "", legend, "", "| " + " | ".join(header) + " |"]
    return [
        *lines,
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def csv_text(rows: Iterable[Sequence[Any]]) -> str:
    """``rows`` as CSV lines, ``\\n`` ending each."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


def write_table(table: FilledTable, out_dir: Path) -> str:
    """Write ``<out_dir>/<table>.md`` and ``<table>.csv``; return the Markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(table)
    atomic_write_bytes(out_dir / f"{table.spec.name}.md", markdown.encode())
    atomic_write_bytes(out_dir / f"{table.spec.name}.csv", render_csv(table).encode())
    return markdown


def _fmt(value: float | None, missing: str) -> str:
    return missing if value is None else f"{value:.2f}"


def _cell_text(cell: FilledCell) -> str:
    text = f"{_fmt(cell.ours, 'missing')} / {_fmt(cell.paper, 'n/a')}"
    if cell.diff is not None:
        text += f" ({cell.diff:+.2f})"
    if len(cell.runs) > 1:
        text += f" n={len(cell.runs)}"
    if cell.deviations:
        text += " *"
    return text


def render_markdown(table: FilledTable) -> str:
    """The table in the paper's layout; each cell ``ours / paper (ours - paper)``, ``*`` off-protocol."""
    spec = table.spec
    by_position = {(cell.row, cell.column): cell for cell in table.cells}
    header = [*spec.row_header, *(column.label for column in spec.columns)]
    legend = (
        "Each cell: ours / paper (ours − paper), mAP in %; ours = last evaluation, mean of the n runs when "
        "n > 1; missing = no run; n/a = no paper number."
    )
    rows = (
        [*row.label, *(_cell_text(by_position[(tuple(row.label), c.label)]) for c in spec.columns)]
        for row in spec.rows
    )
    lines = [
        *markdown_table(spec.caption, legend, header, rows),
        "",
        f"{table.filled} of {len(table.cells)} cells filled.",
    ]
    if spec.note:
        lines.append(spec.note)
    deviations = Counter(deviation for cell in table.cells for deviation in cell.deviations)
    if deviations:
        lines += ["", "\\* Off the paper's protocol:"]
        lines += [f"- {markdown_text(text)} ({count} cells)" for text, count in deviations.items()]
    return "\n".join(lines) + "\n"


def render_csv(table: FilledTable) -> str:
    """One line per cell (long format): labels as in the paper, full-precision values, empty when missing."""
    return csv_text(
        [
            CSV_COLUMNS,
            *(
                [
                    table.spec.name,
                    " / ".join(cell.row),
                    cell.column,
                    cell.metric,
                    *("" if value is None else repr(value) for value in (cell.ours, cell.paper, cell.diff)),
                    len(cell.runs),
                    spreadsheet_text("; ".join(cell.deviations)),
                    spreadsheet_text(" ".join(str(run.path) for run in cell.runs)),
                ]
                for cell in table.cells
            ),
        ]
    )


def _runs_cell(column: str, value: Any) -> str:
    """A cell of the runs' Markdown table: mAP to 2 decimals, seconds to 1, None empty, text escaped."""
    if value is None:
        return ""
    if column in HIGHER_IS_BETTER and is_float_number(value):
        return f"{value:.2f}"
    if column == "wall_time_s" and is_float_number(value):
        return f"{value:.1f}"
    return markdown_text(yaml_text(value))


def _runs_csv_cell(value: Any) -> str:
    """A cell of the runs' CSV table: numbers in full, None empty, text kept from running as a formula."""
    if value is None:
        return ""
    return yaml_text(value) if is_float_number(value) else spreadsheet_text(yaml_text(value))


def render_runs_markdown(table: RunsTable) -> str:
    """The runs as a Markdown table, a header line above it."""
    lines = markdown_table(
        plural(len(table.rows), "run"),
        "Columns: the settings that differ between the runs; mAP in % at the last evaluation; best_epoch: "
        "that of the best mAP_class.",
        [markdown_text(column) for column in table.columns],
        ([_runs_cell(c, row[c]) for c in table.columns] for row in table.rows),
    )
    return "\n".join(lines) + "\n"


def render_runs_csv(table: RunsTable) -> str:
    """One line per run under the column names; full-precision numbers, empty where a run has no value."""
    rows = [table.columns, *([row[c] for c in table.columns] for row in table.rows)]
    return csv_text([[_runs_csv_cell(value) for value in row] for row in rows])


def render_runs_json(table: RunsTable) -> str:
    """A JSON list of one object per run, its keys the columns in order (null where a run has no value)."""
    return json.dumps(list(table.rows), indent=2, default=str) + "\n"
