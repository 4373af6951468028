"""``mlcls-reproduce``: one command per paper table: run its Hydra sweeps, then render it beside the paper.

mlcls-reproduce table1 --data-root /data                 # 20 runs on one GPU, then table1.md / table1.csv
mlcls-reproduce table7 --data-root /data --dry-run       # print the 6 sweeps and the GPU-hour estimate
mlcls-reproduce table5 --launcher torchrun --nproc-per-node 4 --data-root /data
mlcls-reproduce table7 --data-root /data hydra/launcher=submitit_slurm hydra.launcher.gpus_per_node=1
mlcls-reproduce all --smoke                               # every table's smoke sweep, on the CPU
mlcls-reproduce presets --data-root /data --dry-run       # the field's recipes (docs/models.md), cost
mlcls-reproduce spml --data-root /data --dry-run          # the single-positive benchmark (docs/reproduce.md)

Other arguments are Hydra overrides appended to every sweep. Sweeps are written to
``<sweep-dir>/<table>/<dataset or smoke>/<job>``, the table to ``<sweep-dir>/<table>.md`` and ``.csv``. Every
run resumes from its checkpoint: the same command with the same ``--sweep-dir`` finishes a reproduction.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from mlcls import config_dir
from mlcls.cli.tables import parse_pairs
from mlcls.errors import failure
from mlcls.reporting.paper import ReportError
from mlcls.reporting.render import write_table
from mlcls.reporting.runs import collect_runs
from mlcls.reporting.spml import SPML_TABLE, collect_spml_runs, fill_spml, job_gpu_hours, spml_sweeps
from mlcls.reporting.sweeps import (
    RATE_SOURCES,
    SMOKE_STAND_INS,
    TRAIN_IMAGES_PER_S,
    Sweep,
    dataset_root,
    describe,
    job_values,
    run_gpu_hours,
    sweep_gpu_hours,
    table_sweeps,
)
from mlcls.reporting.table_specs import TABLE_NAMES, fill_table, table_spec

# The presets beside the paper's tables (configs/experiment/, docs/models.md): one MS-COCO run each, whose
# results.json is the outcome (no paper table to render).
PRESETS = {
    "mldecoder_coco": "ML-Decoder's COCO recipe: TResNet-L 448 px, ML-Decoder head, ASL",
    "twoway_mldecoder_coco": "ML-Decoder's COCO recipe with the two-way loss",
}
# Training cost of TResNet-L at 448 px relative to ResNet-50 at 224 px (run_gpu_hours' unit), measured on one
# H200 with `mlcls-bench step` (bf16, channels_last): tresnet_v2_l with the ML-Decoder head, batch 56, 556
# training images/s against ResNet-50's 4,596 at 224 px, batch 256: 8.3x.
TRESNET_L_448_RATE_H200, RESNET50_224_RATE_H200 = 556, 4596
TRESNET_L_448_COST = RESNET50_224_RATE_H200 / TRESNET_L_448_RATE_H200
ROOT_FORM = "DATASET=PATH, e.g. coco=/data/coco"


def preset_gpu_hours(gpu: str) -> float:
    """GPU-hours of one preset run: ResNet-50's on MS-COCO over the recipe's epochs, times the cost ratio."""
    epochs = OmegaConf.load(config_dir() / "experiment" / "mldecoder_recipe.yaml").trainer.epochs
    return run_gpu_hours("coco", "resnet50", gpu, epochs=epochs) * TRESNET_L_448_COST


class SweepFailed(RuntimeError):
    """A sweep's process (or an in-process Hydra multirun) ended with an error."""


def sweep_commands(sweep: Sweep, launcher: str, nproc_per_node: int) -> list[list[str]]:
    """The command lines that run ``sweep``: one Hydra multirun (job n in ``<dir>/<n>``), or one torchrun
    per job (its processes cannot start a second process group); every job resumes from its checkpoint."""
    if launcher == "torchrun":  # beside the interpreter, else on PATH, else python -m torch.distributed.run
        found = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
        runner = [found] if found else [sys.executable, "-m", "torch.distributed.run"]
        torchrun = [*runner, f"--nproc_per_node={nproc_per_node}", "-m", "mlcls.train"]
        return [
            [*torchrun, *job, f"hydra.run.dir={sweep.directory / str(number)}", "trainer.resume=auto"]
            for number, job in enumerate(sweep.runs())
        ]
    where = ["trainer.resume=auto", f"hydra.sweep.dir={sweep.directory}"]  # job n in <dir>/<n> (train.yaml)
    return [["mlcls-train", "-m", *sweep.overrides, *where]]


def run_sweep(sweep: Sweep, launcher: str, nproc_per_node: int) -> None:
    """Run one sweep: torchrun child processes, or ``mlcls-train -m`` in this process on a borrowed
    ``sys.argv``; a failed job raises :class:`SweepFailed`."""
    from mlcls.cli import train

    for command in sweep_commands(sweep, launcher, nproc_per_node):
        if launcher == "torchrun":
            done = subprocess.run(command, check=False)
            if done.returncode != 0:
                raise SweepFailed(f"torchrun ended with exit status {done.returncode}: {shlex.join(command)}")
            continue
        saved, sys.argv = sys.argv, command
        try:
            train.main()
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise SweepFailed(
                    f"the sweep stopped with exit status {exc.code}; the failing job's error is above"
                ) from None
        finally:
            sys.argv = saved


def placed(sweep: Sweep, overrides: Sequence[str], directory: Path) -> Sweep:
    """``sweep`` with the user's ``overrides`` appended, written to ``directory``."""
    return dataclasses.replace(sweep, overrides=(*sweep.overrides, *overrides), directory=directory)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlcls-reproduce",
        description="Run the Hydra sweeps of a paper table and render it beside the paper's numbers.",
        epilog="Other arguments are Hydra overrides appended to every sweep (e.g. hydra/launcher=...).",
    )
    p.add_argument(
        "table",
        help=f"the paper table to reproduce: {', '.join(TABLE_NAMES)} or all; or a preset: "
        f"{', '.join(PRESETS)} or presets; or {SPML_TABLE} (the single-positive benchmark)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny CPU version: embedded data, 2 cells per table")
    p.add_argument("--dry-run", action="store_true", help="print the sweeps and their cost, run nothing")
    p.add_argument(
        "--launcher", choices=("local", "torchrun"), default="local", help="how each run is started"
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        help="GPUs per run: under torchrun (default 4), or what a cluster launcher gives a job (default 1)",
    )
    p.add_argument("--sweep-dir", type=Path, help="default multirun/reproduce/<date>_<time>[_smoke]")
    p.add_argument("--data-root", type=Path, help="folder holding the datasets (coco/, voc/, vispr/, ...)")
    p.add_argument("--root", action="append", default=[], metavar="DATASET=PATH", help="one dataset's root")
    p.add_argument("--gpu", choices=sorted(TRAIN_IMAGES_PER_S), default="v100", help="GPU of the estimate")
    return p


def print_commands(sweep: Sweep, args: argparse.Namespace) -> None:
    """The launch commands of ``sweep``, one line each."""
    for command in sweep_commands(sweep, args.launcher, args.nproc_per_node):
        print(shlex.join(command))


# A plan prints its sweeps, their cost and commands; it returns the sweeps and what to print once run.
Plan = tuple[list[Sweep], Callable[[], None]]


def plan_presets(
    args: argparse.Namespace, roots: dict[str, str], overrides: Sequence[str], out: Path
) -> Plan:
    """The run of each preset of ``args.table``; its results.json is the outcome."""
    sweeps = []
    for preset in list(PRESETS) if args.table == "presets" else [args.table]:
        root = roots.get("coco") or (args.data_root and dataset_root("coco", args.data_root))
        own = (f"experiment={preset}", *([f"dataset.root={root}"] if root else []))
        sweeps.append(placed(Sweep(preset, "coco", own, "coco"), overrides, out / preset))
        hours = preset_gpu_hours(args.gpu)
        print(
            f"# {preset}: {PRESETS[preset]}; 1 run, about {hours:.0f} {args.gpu} GPU-hours (TResNet-L 448 px"
            f" at {TRESNET_L_448_COST:.1f}x ResNet-50's cost, the ratio of rates measured on an H200)"
        )
        print_commands(sweeps[-1], args)
    return sweeps, lambda: print(f"# results in {out}/<preset>/0/results.json")


def plan_spml(args: argparse.Namespace, roots: dict[str, str], overrides: Sequence[str], out: Path) -> Plan:
    """The single-positive benchmark's sweeps (one per dataset), rendered beside the published numbers."""
    sweeps = [
        placed(sweep, overrides, out / SPML_TABLE / sweep.name)
        for sweep in spml_sweeps(args.smoke, roots, args.data_root)
    ]
    runs = sum(len(sweep.runs()) for sweep in sweeps)
    hours_of = {} if args.smoke else {s.name: sweep_gpu_hours([s], args.gpu, job_gpu_hours) for s in sweeps}
    cost = "" if args.smoke else f", about {sum(hours_of.values()):.0f} {args.gpu} GPU-hours"
    print(f"# {SPML_TABLE}: single-positive benchmark; {len(sweeps)} sweep(s), {runs} runs{cost}")
    for sweep in sweeps:
        hours = "" if args.smoke else f" ({hours_of[sweep.name]:.0f} {args.gpu} GPU-hours)"
        print(f"# {sweep.name}: {', '.join(job_values(job)['experiment'] for job in sweep.runs())}{hours}")
        print_commands(sweep, args)

    def finish() -> None:
        stand_ins = SMOKE_STAND_INS if args.smoke else None
        print(write_table(fill_spml(collect_spml_runs([out / SPML_TABLE], stand_ins)), out), end="")
        print(f"# table written to {out}/{SPML_TABLE}.md and .csv")

    return sweeps, finish


def plan_tables(args: argparse.Namespace, roots: dict[str, str], overrides: Sequence[str], out: Path) -> Plan:
    """The sweeps of each paper table of ``args.table``, rendered beside the paper's numbers."""
    tables = list(TABLE_NAMES) if args.table == "all" else [args.table]
    sweeps = []
    for table in tables:
        own = [
            placed(sweep, overrides, out / table / sweep.name)
            for sweep in table_sweeps(table, args.smoke, args.nproc_per_node, roots, args.data_root)
        ]
        runs = sum(len(s.runs()) for s in own)
        cost = "" if args.smoke else f", about {sweep_gpu_hours(own, args.gpu):.0f} {args.gpu} GPU-hours"
        print(f"# {table}: {describe(table)}; {len(own)} sweep(s), {runs} runs{cost}")
        for sweep in own:
            print_commands(sweep, args)
        sweeps += own

    def finish() -> None:
        stand_ins = SMOKE_STAND_INS if args.smoke else None
        texts = [  # each table from its own sweeps
            write_table(fill_table(table_spec(table), collect_runs([out / table], stand_ins)), out)
            for table in tables
        ]
        print("\n".join(texts), end="")
        print(f"# tables written to {out}/<table>.md and .csv")

    return sweeps, finish


def main(argv: Sequence[str] | None = None) -> int:
    command_line = parser()
    args, overrides = command_line.parse_known_args(argv)
    if args.nproc_per_node is None:
        args.nproc_per_node = 4 if args.launcher == "torchrun" else 1
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        command_line.error(f"unrecognized arguments: {' '.join(unknown)}")
    stamp = f"{datetime.now():%Y-%m-%d_%H-%M-%S}{'_smoke' if args.smoke else ''}"
    sweep_dir = (args.sweep_dir or Path("multirun/reproduce") / stamp).absolute()
    if not args.smoke:
        rate, source = TRAIN_IMAGES_PER_S[args.gpu], RATE_SOURCES[args.gpu]
        print(f"# GPU-hours at ResNet-50's {rate:,.0f} training images/s at 224 px ({source})")
    try:
        if args.table in PRESETS or args.table == "presets":
            if args.smoke:
                raise ReportError("the presets have no smoke version; drop --smoke (or use --dry-run)")
            plan = plan_presets
        elif args.table == SPML_TABLE:
            plan = plan_spml
        elif args.table in (*TABLE_NAMES, "all"):
            plan = plan_tables
        else:
            raise ReportError(
                f"unknown table {args.table!r}; expected one of {', '.join(TABLE_NAMES)} or all, "
                f"or a preset: {', '.join(PRESETS)} or presets, or {SPML_TABLE}"
            )
        sweeps, finish = plan(args, parse_pairs(args.root, "--root", ROOT_FORM), overrides, sweep_dir)
        if not args.dry_run:
            for sweep in sweeps:
                run_sweep(sweep, args.launcher, args.nproc_per_node)
            finish()
    except SweepFailed as exc:
        return failure("mlcls-reproduce", exc, 1, f"the same command with --sweep-dir {sweep_dir} resumes")
    except ReportError as exc:
        return failure("mlcls-reproduce", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
