#!/usr/bin/env bash
# Table 1: two-way loss over T_P x T_N (MS-COCO, ResNet-50): 20 runs, about 18 V100 / 8 A100 GPU-hours.
# Runs the sweep(s), then writes <sweep dir>/table1.md and table1.csv beside the paper's numbers.
#   scripts/reproduce/table1.sh --data-root /data                       # one GPU, batch 512 in 4 buckets of 128
#   scripts/reproduce/table1.sh --data-root /data --launcher torchrun --nproc-per-node 4
#   scripts/reproduce/table1.sh --smoke                                 # seconds on a CPU: embedded data, 2 cells
#   scripts/reproduce/table1.sh --dry-run                               # print the commands and the cost
# Anything else is passed on to every sweep as Hydra overrides (e.g. hydra/launcher=submitit_slurm).
# Details: docs/reproduce.md
set -euo pipefail
exec mlcls-reproduce table1 "$@"
