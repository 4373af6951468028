"""The Hydra multirun sweeps that reproduce each paper table (``mlcls-reproduce``), their smoke versions and
their cost: one multirun per dataset (Table 7 has six, the ablations one, on MS-COCO), each over the paper
presets (``experiment=paper_<loss>``) and the table's grid. The smoke version runs two cells of the grid on
the embedded synthetic dataset with a tiny model, at 1/32 of the paper's batch (bucket sizes shrink by 32).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from mlcls import config_dir
from mlcls.reporting.paper import ReportError, load_paper
from mlcls.reporting.runs import PAPER_WEIGHTS
from mlcls.reporting.table_specs import HARD_MIN_TP, TABLE_NAMES

# The smoke run: embedded dataset, tiny model, one epoch of two iterations on the CPU. Batch 16 = 512 / 32.
SMOKE_SCALE = 32
SMOKE_OVERRIDES = (
    "dataset=synthetic",
    "dataset.train_size=64",
    "dataset.val_size=32",
    "dataset.image_size=32",
    "model.name=resnet10t",
    "model.pretrained=false",
    "trainer.epochs=1",
    "trainer.batch_size=16",
    "trainer.limit_train_batches=2",
    "trainer.workers=0",
    "trainer.device=cpu",
    "trainer.amp=none",
    "trainer.log_every=1000",
    "trainer.report=false",
)
# How a smoke table is read: the synthetic dataset and resnet10t stand in for MS-COCO and ResNet-50.
SMOKE_STAND_INS = {"synthetic": "coco", "resnet10t": "resnet50"}

# Cost model of docs/reproduce.md: training images/s of ResNet-50 at 224 px with AMP on one GPU (the H200's
# measured with mlcls-bench step, batch 256, bf16, data on the GPU: docs/performance.md; the others
# published), evaluation 3x faster than training, other backbones relative to ResNet-50 (timm's throughputs).
TRAIN_IMAGES_PER_S = {"v100": 1200.0, "a100": 2600.0, "h200": 4596.0}
RATE_SOURCES = {
    "v100": "published V100 figures, not measured by mlcls",
    "a100": "published A100 figures, not measured by mlcls",
    "h200": "measured on one H200 with mlcls-bench step, bf16",
}
EVAL_SPEEDUP = 3.0
BACKBONE_COST = {"resnet50": 1.0, "resnext50_32x4d": 1.5, "densenet169": 1.7, "regnety_320": 7.0}


@dataclass(frozen=True)
class TableGrid:
    """What a table sweeps: the paper presets, the other swept keys, the datasets; full and smoke."""

    experiments: tuple[str, ...]
    grid: Mapping[str, Sequence[object]]
    smoke_grid: Mapping[str, Sequence[object]]
    smoke_experiments: tuple[str, ...] = ()  # none: the experiments
    datasets: tuple[str, ...] = ("coco",)
    gather_under_ddp: bool = False  # M larger than the per-GPU batch needs the global batch (Table 5)
    description: str = ""


def _grids() -> dict[str, TableGrid]:
    paper = load_paper()
    t1, t2, t5 = paper["table1_temperature"], paper["table2_logit_bias"], paper["table5_bucket_size"]
    bucket = paper["protocol"]["bucket_size"]
    batch = paper["protocol"]["batch_size"]
    return {
        "table1": TableGrid(
            experiments=("paper_twoway",),
            grid={"loss.tp": [HARD_MIN_TP if tp == 0 else tp for tp in t1["tp"]], "loss.tn": t1["tn"]},
            smoke_grid={"loss.tp": [1, 4], "loss.tn": [1]},
            description="two-way loss, T_P x T_N",
        ),
        "table2": TableGrid(
            experiments=("paper_twoway",),
            grid={"loss.tp": [1], "loss.tn": [1], "loss.margin": t2["eps"]},
            smoke_grid={"loss.tp": [1], "loss.tn": [1], "loss.margin": [4, 8]},
            description="two-way loss at T_P = T_N = 1, logit bias ε",
        ),
        "table3": TableGrid(
            experiments=("paper_twoway", "paper_softmax"),
            grid={"loss.ways": ["both", "class", "sample"]},
            smoke_grid={"loss.ways": ["class"]},
            description="two-way and softmax losses, sample/class/both ways",
        ),
        "table4": TableGrid(
            experiments=("paper_multisim", "paper_joint"),
            grid={"loss.tp": [1, 2, 4]},
            smoke_grid={"loss.tp": [4]},
            description="multi-similarity (eq. 20) and joint-way (eq. 22) losses over T_P",
        ),
        "table5": TableGrid(
            experiments=("paper_twoway",),
            grid={"protocol.bucket_size": t5["M"]},
            smoke_grid={"protocol.bucket_size": [bucket // SMOKE_SCALE, batch // SMOKE_SCALE]},
            gather_under_ddp=True,
            description=f"two-way loss, bucket size M at batch {batch}",
        ),
        "table7": TableGrid(
            experiments=tuple(f"paper_{loss}" for loss in ("softmax", "bce", "focal", "asl", "twoway")),
            grid={"model.name": list(PAPER_WEIGHTS.values())},
            smoke_experiments=("paper_twoway", "paper_bce"),
            smoke_grid={},
            datasets=tuple(paper["table6_datasets"]),
            description="softmax, BCE, focal, ASL and two-way losses x 4 backbones x 6 datasets",
        ),
    }


@dataclass(frozen=True)
class Sweep:
    """One Hydra multirun, ``mlcls-train -m <overrides>``, writing its jobs to ``directory/<job number>``
    (None: Hydra's default); ``dataset`` None in smoke mode."""

    table: str
    name: str
    overrides: tuple[str, ...]
    dataset: str | None
    directory: Path | None = None

    def runs(self) -> list[list[str]]:
        """The overrides of each job of this sweep (:func:`expand`)."""
        return expand(self.overrides)


def _value(value: object) -> str:
    """A value as Hydra's override grammar reads it back: true/false, 0.5 (not 0.50), text as is."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def grid_overrides(experiments: Sequence[str], grid: Mapping[str, Sequence[object]]) -> list[str]:
    """Hydra overrides of a grid. Hydra composes the config without the swept overrides before it expands
    a sweep; when the presets are swept that config lacks their keys (loss.*, protocol.*), so a single value
    is forced in with ``++``."""
    overrides = [f"experiment={','.join(experiments)}"]
    for key, values in grid.items():
        forced = len(experiments) > 1 and len(values) == 1 and key.split(".")[0] in ("loss", "protocol")
        overrides.append(f"{'++' if forced else ''}{key}={','.join(map(_value, values))}")
    return overrides


def dataset_root(name: str, data_root: Path) -> Path:
    """Where dataset ``name`` lives under ``data_root``: its config's default ``root``, ``data/`` replaced."""
    default = Path(OmegaConf.load(config_dir() / "dataset" / f"{name}.yaml")["root"])
    parts = default.parts[1:] if default.parts and default.parts[0] == "data" else (default.name,)
    return Path(data_root, *parts)


def table_sweeps(
    table: str,
    smoke: bool = False,
    nproc_per_node: int = 1,
    roots: Mapping[str, str] | None = None,
    data_root: Path | None = None,
) -> list[Sweep]:
    """The sweeps of ``table`` (``table1`` ... ``table7``); ``smoke``: the reduced grid on the embedded
    dataset. ``nproc_per_node`` > 1 turns on ``loss.gather`` where M exceeds the per-process batch (Table 5).
    ``roots``: dataset name -> ``dataset.root``, else ``data_root`` (:func:`dataset_root`), else the
    configs' defaults."""
    grids = _grids()
    if table not in grids:
        raise ReportError(f"unknown table {table!r}; expected one of {', '.join(TABLE_NAMES)}")
    spec = grids[table]
    extra = ["loss.gather=true"] if spec.gather_under_ddp and nproc_per_node > 1 else []
    if smoke:
        overrides = [
            *SMOKE_OVERRIDES,
            *grid_overrides(spec.smoke_experiments or spec.experiments, spec.smoke_grid),
        ]
        if "protocol.bucket_size" not in spec.smoke_grid:
            bucket = load_paper()["protocol"]["bucket_size"] // SMOKE_SCALE
            overrides.append(f"++protocol.bucket_size={bucket}")
        return [Sweep(table, "smoke", (*overrides, *extra), None)]
    shared = [*grid_overrides(spec.experiments, spec.grid), *extra]
    return per_dataset_sweeps(table, spec.datasets, shared, roots, data_root)


def per_dataset_sweeps(
    table: str,
    datasets: Sequence[str],
    shared: Sequence[str],
    roots: Mapping[str, str] | None,
    data_root: Path | None,
) -> list[Sweep]:
    """One sweep of ``table`` per dataset: ``dataset=<name>``, ``shared``, its ``dataset.root``."""
    sweeps = []
    for dataset in datasets:
        overrides = [f"dataset={dataset}", *shared]
        if roots and dataset in roots:
            overrides.append(f"dataset.root={roots[dataset]}")
        elif data_root is not None:
            overrides.append(f"dataset.root={dataset_root(dataset, data_root)}")
        sweeps.append(Sweep(table, dataset, tuple(overrides), dataset))
    return sweeps


def describe(table: str) -> str:
    """One line on what ``table``'s sweep varies."""
    return _grids()[table].description


def expand(overrides: Sequence[str]) -> list[list[str]]:
    """The jobs of ``mlcls-train -m <overrides>``: each job's overrides for every combination of the
    comma-separated values (Hydra's basic sweeper). A key given twice keeps its last spelling and values, so
    an override appended by the user replaces the table's."""
    keyed: dict[str, tuple[str, list[str]]] = {}  # key without +/++/~ -> (key as written, values)
    for override in overrides:
        key, _, value = override.partition("=")
        values, depth, quote, current = [], 0, "", ""  # split at commas outside brackets and quotes
        for char in value:
            if quote:
                quote = "" if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char in "[({":
                depth += 1
            elif char in "])}":
                depth -= 1
            elif char == "," and depth == 0:
                values.append(current)
                current = ""
                continue
            current += char
        keyed[key.lstrip("+~")] = (key, [*values, current])
    written = [key for key, _ in keyed.values()]
    combos = itertools.product(*(values for _, values in keyed.values()))
    return [[f"{key}={value}" for key, value in zip(written, combo, strict=True)] for combo in combos]


def job_values(job: Sequence[str]) -> dict[str, str]:
    """``["experiment=paper_bce", "loss.tp=4"]`` -> ``{"experiment": "paper_bce", "loss.tp": "4"}``."""
    return {key.lstrip("+~"): value for key, _, value in (override.partition("=") for override in job)}


def gpu_hours(trained_images: float, evaluated_images: float, gpu: str = "v100", cost: float = 1.0) -> float:
    """The cost model's one formula, GPU-hours on one ``gpu`` (multi-GPU runs take about as many, spread):
    ``(trained_images + evaluated_images / EVAL_SPEEDUP) x cost / TRAIN_IMAGES_PER_S[gpu] / 3600``, each image
    counted once per pass; ``cost`` relative to ResNet-50 at 224 px (:data:`BACKBONE_COST`; 4 for 448 px)."""
    return (trained_images + evaluated_images / EVAL_SPEEDUP) * cost / TRAIN_IMAGES_PER_S[gpu] / 3600.0


def run_gpu_hours(dataset: str, architecture: str, gpu: str = "v100", epochs: int | None = None) -> float:
    """Estimated GPU-hours of one run of the paper's protocol on one ``gpu``: :func:`gpu_hours` of the
    training split of Table 6 trained and its test split evaluated every epoch, at the backbone's
    :data:`BACKBONE_COST`."""
    paper = load_paper()
    sizes = paper["table6_datasets"][dataset]
    epochs = paper["protocol"]["epochs"] if epochs is None else epochs
    return gpu_hours(epochs * sizes["train"], epochs * sizes["test"], gpu, BACKBONE_COST[architecture])


def paper_job_gpu_hours(job: Mapping[str, str], gpu: str = "v100") -> float:
    """:func:`run_gpu_hours` of one job of a paper table's sweep (:func:`job_values`), ResNet-50 unless
    ``model.name`` says."""
    architecture = job.get("model.name", PAPER_WEIGHTS["resnet50"]).split(".")[0]
    return run_gpu_hours(job["dataset"], architecture, gpu)


def sweep_gpu_hours(
    sweeps: Sequence[Sweep],
    gpu: str = "v100",
    job_hours: Callable[[Mapping[str, str], str], float] = paper_job_gpu_hours,
) -> float:
    """Sum of ``job_hours(job_values(job), gpu)`` over every job of ``sweeps``."""
    return sum(job_hours(job_values(job), gpu) for sweep in sweeps for job in sweep.runs())
