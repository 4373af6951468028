#!/usr/bin/env bash
# The smoke version of every table (what CI runs through tests/test_cli_reproduce.py): embedded synthetic dataset,
# resnet10t from scratch, one epoch of two iterations on the CPU, two cells per table; then the six tables
# rendered with the paper's numbers beside ours. About a minute on two cores.
set -euo pipefail
exec mlcls-reproduce all --smoke "$@"
