"""``mlcls-tables``: the paper's tables filled with our runs, beside the paper's numbers.

mlcls-tables multirun/reproduce/2026-11-22_10-00-00     # every table that has a run
mlcls-tables RUN_DIR... --table table7 --out reports/    # writes reports/table7.md and table7.csv
mlcls-tables multirun/... --smoke                         # smoke runs: synthetic, resnet10t as coco, resnet50
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from mlcls.reporting.paper import ReportError
from mlcls.reporting.render import render_csv, render_markdown, write_table
from mlcls.reporting.runs import RunRecord, collect_runs
from mlcls.reporting.sweeps import SMOKE_STAND_INS
from mlcls.reporting.table_specs import TABLE_NAMES, FilledTable, fill_table, table_spec, unplaced_runs


def failure(prog: str, error: Exception, status: int = 2, *notes: str) -> int:
    """Print ``<prog>: error: <error>`` and each note as ``<prog>: <note>`` on stderr; return ``status``."""
    for line in (f"error: {error}", *notes):
        print(f"{prog}: {line}", file=sys.stderr)
    return status


def parse_pairs(pairs: Sequence[str], option: str, form: str) -> dict[str, str]:
    """``["a=b", ...]`` given to ``option`` -> ``{"a": "b", ...}``; ``form`` names the expected shape."""
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise ReportError(f"{option} {pair!r}; expected {form}")
        parsed[key] = value
    return parsed


def parse_stand_ins(pairs: Sequence[str]) -> dict[str, str]:
    """``["synthetic=coco"]`` -> ``{"synthetic": "coco"}``."""
    return parse_pairs(pairs, "--stand-in", "OURS=PAPER, e.g. synthetic=coco")


def build_tables(runs: Sequence[RunRecord], names: Sequence[str] | None) -> list[FilledTable]:
    """The requested tables (default: every table with at least one filled cell)."""
    tables = [fill_table(table_spec(name), runs) for name in (names or TABLE_NAMES)]
    if names:
        return tables
    tables = [table for table in tables if table.filled]
    if not tables:
        raise ReportError(
            f"none of the {len(runs)} runs fills a cell of Tables {', '.join(n[5:] for n in TABLE_NAMES)}; "
            "see docs/reproduce.md for the settings each cell needs (smoke runs need --smoke)"
        )
    return tables


def report(
    paths: Sequence[Path | str],
    names: Sequence[str] | None = None,
    out_dir: Path | None = None,
    stand_ins: dict[str, str] | None = None,
    as_csv: bool = False,
) -> str:
    """Read the runs under ``paths``, fill the tables, write them to ``out_dir`` if given; return the text."""
    for name in names or ():
        table_spec(name)  # an unknown name fails before any run is read
    runs = collect_runs(paths, stand_ins)
    tables = build_tables(runs, names)
    if out_dir is not None:
        for table in tables:
            write_table(table, out_dir)
    unplaced = unplaced_runs(runs, [table.spec for table in tables])
    if unplaced:
        listed = ", ".join(str(run.path) for run in unplaced[:5]) + (" ..." if len(unplaced) > 5 else "")
        print(
            f"mlcls-tables: {len(unplaced)} of {len(runs)} runs fill no cell shown: {listed}", file=sys.stderr
        )
    render = render_csv if as_csv else render_markdown
    return "\n".join(render(table) for table in tables)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlcls-tables",
        description="Render the paper's Tables 1-5 and 7 from runs (results.json), with the paper's numbers.",
    )
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run or sweep directories")
    p.add_argument("--table", action="append", help=f"table to render, repeatable: {', '.join(TABLE_NAMES)}")
    p.add_argument("--out", type=Path, help="write <table>.md and <table>.csv into this directory")
    p.add_argument("--csv", action="store_true", help="print CSV instead of Markdown")
    p.add_argument(
        "--stand-in",
        action="append",
        default=[],
        metavar="OURS=PAPER",
        help="count dataset or backbone OURS as the paper's PAPER (e.g. synthetic=coco)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="read smoke runs: " + ", ".join(f"{k} as {v}" for k, v in SMOKE_STAND_INS.items()),
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        stand_ins = {**(SMOKE_STAND_INS if args.smoke else {}), **parse_stand_ins(args.stand_in)}
        print(report(args.run_dirs, args.table, args.out, stand_ins, args.csv), end="")
    except ReportError as exc:
        return failure("mlcls-tables", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
