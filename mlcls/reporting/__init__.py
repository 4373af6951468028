"""What a run shows a person: the paper's tables beside ours (``mlcls-tables``), a run's plots and report
page (``mlcls-report``), the label errors an audit finds (``mlcls-data audit``). Each module's docstring says
what it holds; runs are read in :mod:`mlcls.reporting.run_files` only."""
