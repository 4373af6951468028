"""The paper's tables beside ours, and where each number comes from.

- :mod:`mlcls.reporting.paper`: the packaged ``paper_tables.yaml``: the paper's numbers, its tables' layout.
- :mod:`mlcls.reporting.runs`: finished runs read from ``results.json``, the attributes that place them in a
  table, and their departures from the paper's protocol.
- :mod:`mlcls.reporting.table_specs`: the paper's Tables 1-5 and 7 built from the layout (rows, columns, the
  attributes of each cell, the paper's numbers) and filled with runs.
- :mod:`mlcls.reporting.render`: a filled table as Markdown and CSV.
- :mod:`mlcls.reporting.sweeps`: the Hydra sweeps that reproduce each table, their smoke versions and cost.
- :mod:`mlcls.provenance`: the ``provenance`` block of ``results.json``.
"""
