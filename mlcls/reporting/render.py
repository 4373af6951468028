"""A filled paper table as Markdown (the paper's layout) and CSV (one line per cell).

Text from runs (paths, config values) is shown as it is, never as markup or formulas: in Markdown
:func:`markdown_text` escapes it, in CSV :func:`spreadsheet_text` keeps a spreadsheet from running it.
"""

from __future__ import annotations

import csv
import html
import io
import re
from pathlib import Path

from mlcls.io import atomic_write_bytes
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


def write_table(table: FilledTable, out_dir: Path) -> tuple[Path, Path]:
    """Write ``<out_dir>/<table>.md`` and ``<table>.csv``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown, table_csv = out_dir / f"{table.spec.name}.md", out_dir / f"{table.spec.name}.csv"
    atomic_write_bytes(markdown, render_markdown(table).encode())
    atomic_write_bytes(table_csv, render_csv(table).encode())
    return markdown, table_csv


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
    lines = [
        f"### {spec.caption}",
        "",
        "Each cell: ours / paper (ours − paper), mAP in %; ours = last evaluation, mean of the n runs when "
        "n > 1; missing = no run; n/a = no paper number.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for row in spec.rows:
        texts = [_cell_text(by_position[(tuple(row.label), column.label)]) for column in spec.columns]
        lines.append("| " + " | ".join([*row.label, *texts]) + " |")
    lines += ["", f"{table.filled} of {len(table.cells)} cells filled."]
    if spec.note:
        lines.append(spec.note)
    deviations: dict[str, int] = {}
    for cell in table.cells:
        for deviation in cell.deviations:
            deviations[deviation] = deviations.get(deviation, 0) + 1
    if deviations:
        lines += ["", "\\* Off the paper's protocol:"]
        lines += [f"- {markdown_text(text)} ({count} cells)" for text, count in deviations.items()]
    return "\n".join(lines) + "\n"


def render_csv(table: FilledTable) -> str:
    """One line per cell (long format): labels as in the paper, full-precision values, empty when missing."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for cell in table.cells:
        writer.writerow(
            [
                table.spec.name,
                " / ".join(cell.row),
                cell.column,
                cell.metric,
                "" if cell.ours is None else repr(cell.ours),
                "" if cell.paper is None else repr(cell.paper),
                "" if cell.diff is None else repr(cell.diff),
                len(cell.runs),
                spreadsheet_text("; ".join(cell.deviations)),
                spreadsheet_text(" ".join(str(run.path) for run in cell.runs)),
            ]
        )
    return out.getvalue()
