#!/usr/bin/env bash
# Table 7: 5 losses x 4 backbones x 6 datasets: 120 runs in 6 sweeps, about 210 V100 / 97 A100 GPU-hours.
# Runs the sweep(s), then writes <sweep dir>/table7.md and table7.csv beside the paper's numbers.
#   scripts/reproduce/table7.sh --data-root /data                       # one GPU, batch 512 in 4 buckets of 128
#   scripts/reproduce/table7.sh --data-root /data --launcher torchrun --nproc-per-node 4
#   scripts/reproduce/table7.sh --smoke                                 # seconds on a CPU: embedded data, 2 cells
#   scripts/reproduce/table7.sh --dry-run                               # print the commands and the cost
# Anything else is passed on to every sweep as Hydra overrides (e.g. hydra/launcher=submitit_slurm).
# Details: docs/reproduce.md
set -euo pipefail
exec mlcls-reproduce table7 "$@"
