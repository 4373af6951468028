#!/usr/bin/env bash
# Table 4: multi-similarity and joint-way losses over T_P (MS-COCO, ResNet-50): 6 runs, about 5 V100 / 2.5 A100 GPU-hours.
# Runs the sweep(s), then writes <sweep dir>/table4.md and table4.csv beside the paper's numbers.
#   scripts/reproduce/table4.sh --data-root /data                       # one GPU, batch 512 in 4 buckets of 128
#   scripts/reproduce/table4.sh --data-root /data --launcher torchrun --nproc-per-node 4
#   scripts/reproduce/table4.sh --smoke                                 # seconds on a CPU: embedded data, 2 cells
#   scripts/reproduce/table4.sh --dry-run                               # print the commands and the cost
# Anything else is passed on to every sweep as Hydra overrides (e.g. hydra/launcher=submitit_slurm).
# Details: docs/reproduce.md
set -euo pipefail
exec mlcls-reproduce table4 "$@"
