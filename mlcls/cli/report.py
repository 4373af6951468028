"""``mlcls-report``: a run's report page, ``RUN_DIR/report.html`` (:mod:`mlcls.reporting.report`).

mlcls-report outputs/2026-01-01/12-00-00          # writes outputs/2026-01-01/12-00-00/report.html

``mlcls-train`` writes it at the end of a run; this writes it again from ``val_predictions.npz`` and the
validation set rebuilt from the run's dataset config, checked as a checkpoint's would be.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mlcls.cli.errors import user_errors
from mlcls.cli.eval import evaluation_dataset
from mlcls.errors import failure
from mlcls.reporting.paper import ReportError
from mlcls.reporting.report import read_report_files, write_report


def validation_set(config: dict, classes: list[str]):
    """The validation split of the run whose ``config`` is given, in the class order of its predictions."""
    dataset = evaluation_dataset(config["dataset"], {}, classes)
    if list(dataset.classes) != classes:
        raise ReportError(
            f"the validation set's classes ({len(dataset.classes)}) differ from the run's predictions' "
            f"({len(classes)})"
        )
    return dataset


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlcls-report",
        description="Write RUN_DIR/report.html: the run's figures, per-class table and curves, its most "
        "confident errors and the suspected label errors of its validation set, with thumbnails.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory of mlcls-train")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with user_errors():
        try:
            start = time.perf_counter()
            files = read_report_files(args.run_dir)  # (results, config, predictions)
            path = write_report(args.run_dir, validation_set(files[1], files[2].classes), files)
        except ReportError as exc:
            return failure("mlcls", exc)
    print(f"{path} ({path.stat().st_size:,} bytes, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
