#!/usr/bin/env bash
# Table 2: logit bias eps at T_P = T_N = 1 (MS-COCO, ResNet-50): 5 runs, about 4 V100 / 2 A100 GPU-hours.
# Runs the sweep(s), then writes <sweep dir>/table2.md and table2.csv beside the paper's numbers.
#   scripts/reproduce/table2.sh --data-root /data                       # one GPU, batch 512 in 4 buckets of 128
#   scripts/reproduce/table2.sh --data-root /data --launcher torchrun --nproc-per-node 4
#   scripts/reproduce/table2.sh --smoke                                 # seconds on a CPU: embedded data, 2 cells
#   scripts/reproduce/table2.sh --dry-run                               # print the commands and the cost
# Anything else is passed on to every sweep as Hydra overrides (e.g. hydra/launcher=submitit_slurm).
# Details: docs/reproduce.md
set -euo pipefail
exec mlcls-reproduce table2 "$@"
