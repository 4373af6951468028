"""The paper's tables beside ours, and where each number comes from.

- :mod:`mlcls.reporting.tables`: the paper's Tables 1-5 and 7 (layout, cell definitions, the packaged paper
  numbers in ``paper_tables.yaml``), runs placed in them by their resolved config, Markdown and CSV rendering.
- :mod:`mlcls.reporting.sweeps`: the Hydra sweeps that reproduce each table, their smoke versions and cost.
- :mod:`mlcls.reporting.provenance`: the ``provenance`` block of ``results.json``.
"""
