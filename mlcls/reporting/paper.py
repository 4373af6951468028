"""The packaged ``paper_tables.yaml``: the paper's numbers and protocol, and the layout of its tables.

Its first YAML document is a copy of the transcription in ``shared/paper/tables.yaml`` (:func:`load_paper`);
the second says how each table is built from those numbers (:func:`load_layouts`, read by
:mod:`mlcls.reporting.table_specs`).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import yaml


class ReportError(ValueError):
    """A run directory or a table request the reporting cannot use; the message says which and why."""


@cache
def _documents() -> tuple[dict[str, Any], dict[str, Any]]:
    text = resources.files("mlcls.reporting").joinpath("paper_tables.yaml").read_text()
    numbers, layouts = yaml.safe_load_all(text)
    return numbers, layouts


def load_paper() -> dict[str, Any]:
    """The paper's numbers and protocol as transcribed: ``protocol``, ``table6_datasets``, ``table7``, ..."""
    return _documents()[0]


def load_layouts() -> dict[str, Any]:
    """Each table's layout: ``table name -> {caption, row_header, fixed, rows, columns, paper, note}``."""
    return _documents()[1]["tables"]
