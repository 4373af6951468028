"""What a run shows a person: the paper's tables beside ours, a run's plots and report page, the label
errors an audit finds.

- :mod:`mlcls.reporting.paper`: the packaged ``paper_tables.yaml``: the paper's numbers, its tables' layout.
- :mod:`mlcls.reporting.runs`: finished runs read from ``results.json``, the attributes that place them in a
  table, and their departures from the paper's protocol.
- :mod:`mlcls.reporting.table_specs`: the paper's Tables 1-5 and 7 built from the layout (rows, columns, the
  attributes of each cell, the paper's numbers) and filled with runs.
- :mod:`mlcls.reporting.render`: a filled table as Markdown and CSV.
- :mod:`mlcls.reporting.sweeps`: the Hydra sweeps that reproduce each table, their smoke versions and cost.
- :mod:`mlcls.reporting.plots`: a finished run's PNG plots (a ``Trainer.on_finish`` hook).
- :mod:`mlcls.reporting.report`, ``report_data``, ``report_html``: ``report.html``, the run report page
  (``mlcls-report``; written at the end of a run with ``trainer.report=true``).
- :mod:`mlcls.reporting.audit`, ``audit_page``: ``mlcls-data audit``, K-fold out-of-sample label errors.
- :mod:`mlcls.reporting.spml`: the single-positive benchmark (Cole et al. 2021): its sweep, cost, and table
  beside the published numbers of ``spml_published.yaml``.
The ``provenance`` block of ``results.json`` is :mod:`mlcls.provenance`'s, below the engine.
"""
