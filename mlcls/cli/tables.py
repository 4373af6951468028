"""``mlcls-tables``: the paper's tables filled with our runs, beside the paper's numbers.

mlcls-tables multirun/reproduce/2026-11-22_10-00-00     # every table that has a run
mlcls-tables RUN_DIR... --table table7 --out reports/    # writes reports/table7.md and table7.csv
mlcls-tables multirun/... --smoke                         # smoke runs: synthetic, resnet10t as coco, resnet50
mlcls-tables multirun/reproduce/.../spml --table spml     # the single-positive benchmark beside its papers
mlcls-tables --runs multirun/2026-11-22/10-00-00         # any runs side by side: what differs, what scored
mlcls-tables --runs runs/ --sort mAP_class --csv          # best first, as CSV (--json: a JSON list)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from mlcls.errors import failure
from mlcls.reporting.paper import ReportError
from mlcls.reporting.render import (
    render_csv,
    render_markdown,
    render_runs_csv,
    render_runs_json,
    render_runs_markdown,
    write_table,
)
from mlcls.reporting.run_table import runs_table
from mlcls.reporting.runs import RunRecord, collect_runs
from mlcls.reporting.spml import SPML_TABLE, collect_spml_runs, fill_spml
from mlcls.reporting.sweeps import SMOKE_STAND_INS
from mlcls.reporting.table_specs import (
    TABLE_NAMES,
    FilledTable,
    fill_table,
    placement_problem,
    table_spec,
    unplaced_runs,
)


def parse_pairs(pairs: Sequence[str], option: str, form: str) -> dict[str, str]:
    """``["a=b", ...]`` given to ``option`` -> ``{"a": "b", ...}``; ``form`` names the expected shape."""
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise ReportError(f"{option} {pair!r}; expected {form}")
        parsed[key] = value
    return parsed


def build_tables(
    runs: Sequence[RunRecord], names: Sequence[str] | None, stand_ins: dict[str, str] | None = None
) -> list[FilledTable]:
    """The requested tables (default: every table with a filled cell); fails when no cell is filled,
    naming the ``--stand-in`` options that would place the runs."""
    tables = [fill_table(table_spec(name), runs) for name in (names or TABLE_NAMES)]
    if not any(table.filled for table in tables):
        shown = ", ".join(table.spec.name for table in tables) if names else "Tables 1, 2, 3, 4, 5, 7"
        raise ReportError(
            placement_problem(runs, [table.spec for table in tables], stand_ins)
            or f"none of the {len(runs)} runs fills a cell of {shown}; see docs/reproduce.md for the "
            "settings each cell needs (smoke runs need --smoke), or compare the runs with mlcls-tables --runs"
        )
    return tables if names else [table for table in tables if table.filled]


def report(
    paths: Sequence[Path | str],
    names: Sequence[str] | None = None,
    out_dir: Path | None = None,
    stand_ins: dict[str, str] | None = None,
    as_csv: bool = False,
) -> str:
    """Read the runs under ``paths``, fill the tables (``spml``: the single-positive benchmark), write them
    to ``out_dir`` if given; return the text."""
    paper_names = [name for name in names or () if name != SPML_TABLE]
    for name in paper_names:
        table_spec(name)  # an unknown name fails before any run is read
    tables = []
    if names and SPML_TABLE in names:
        tables.append(fill_spml(collect_spml_runs(paths, stand_ins)))
        if not tables[0].filled:
            raise ReportError(
                f"no run under {', '.join(map(str, paths))} is a row of the single-positive benchmark "
                "(experiment=spml_<method>; docs/reproduce.md)"
            )
    if paper_names or not names:
        runs = collect_runs(paths, stand_ins)
        paper_tables = build_tables(runs, paper_names or None, stand_ins)
        unplaced = unplaced_runs(runs, [table.spec for table in paper_tables])
        if unplaced:
            listed = ", ".join(str(run.path) for run in unplaced[:5]) + (" ..." if len(unplaced) > 5 else "")
            print(
                f"mlcls-tables: {len(unplaced)} of {len(runs)} runs fill no cell shown: {listed}",
                file=sys.stderr,
            )
        tables += paper_tables
    for table in tables if out_dir is not None else ():
        write_table(table, out_dir)
    return "\n".join((render_csv if as_csv else render_markdown)(table) for table in tables)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlcls-tables",
        description="Render the paper's Tables 1-5 and 7 from runs (results.json), with the paper's numbers; "
        "with --runs, one table of any runs side by side.",
    )
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run or sweep directories")
    p.add_argument(
        "--table",
        action="append",
        help=f"table to render, repeatable: {', '.join(TABLE_NAMES)}, {SPML_TABLE}",
    )
    p.add_argument("--out", type=Path, help="write <table>.md and <table>.csv into this directory")
    p.add_argument(
        "--runs",
        action="store_true",
        help="one row per run: the config values that differ between the runs, mAP, best epoch, epochs, "
        "wall time, status (finished, unfinished, failed, resumed)",
    )
    p.add_argument("--sort", metavar="COLUMN", help="--runs: order by this column (mAP highest first)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="print CSV instead of Markdown")
    form.add_argument("--json", action="store_true", help="--runs: print a JSON list instead of Markdown")
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
        if args.runs:
            paper_options = {"--table": args.table, "--out": args.out, "--stand-in": args.stand_in}
            ignored = [option for option, given in paper_options.items() if given]
            ignored += ["--smoke"] if args.smoke else []
            if ignored:
                raise ReportError(f"{', '.join(ignored)} apply to the paper tables, not to --runs")
            render = render_runs_csv if args.csv else render_runs_json if args.json else render_runs_markdown
            print(render(runs_table(args.run_dirs, args.sort)), end="")
            return 0
        if args.sort or args.json:
            raise ReportError("--sort and --json apply to --runs only; the paper tables have a fixed layout")
        given = parse_pairs(args.stand_in, "--stand-in", "OURS=PAPER, e.g. synthetic=coco")
        stand_ins = {**(SMOKE_STAND_INS if args.smoke else {}), **given}
        print(report(args.run_dirs, args.table, args.out, stand_ins, args.csv), end="")
    except ReportError as exc:
        return failure("mlcls-tables", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
