"""The single-positive benchmark (Cole et al., CVPR 2021): its sweep, cost and table beside the published
numbers (data in ``spml_published.yaml``, each with its paper, table, row and source). The presets
``configs/experiment/spml_<method>.yaml`` extend ``spml.yaml`` (the released protocol); one Hydra multirun per
dataset runs the methods; the table has a row per method and a column per dataset, mAP@class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from mlcls import config_dir
from mlcls.config_tree import nested_get
from mlcls.reporting.paper import ReportError
from mlcls.reporting.runs import RunRecord, collect_runs, protocol_deviations
from mlcls.reporting.sweeps import (
    SMOKE_OVERRIDES,
    Sweep,
    gpu_hours,
    grid_overrides,
    per_dataset_sweeps,
)
from mlcls.reporting.table_specs import Axis, FilledTable, TableSpec, fill_table

SPML_TABLE = "spml"
# Method (spml_<method>.yaml) -> the row's label. A method without its preset yet is a row of the table (its
# published numbers, our cells n/a) but no run of the sweep (:func:`preset_methods`).
SPML_METHODS = {
    "full": "Full labels (BCE)",
    "an": "AN",
    "an_ls": "AN-LS",
    "wan": "WAN",
    "epr": "EPR",
    "em": "EM",
    "em_apl": "EM+APL",
    "role": "ROLE",
    "ll_r": "LL-R",
    "ll_ct": "LL-Ct",
    "ll_cp": "LL-Cp",
    "hill": "Hill",
    "splc": "SPLC",
    "twoway": "Two-way",
}
# Dataset -> column label, and the training / evaluation images mlcls uses (the whole official train split,
# of which spml.yaml holds out dataset.val_fraction to select the epoch; NUS-WIDE: the images listed,
# docs/datasets.md).
SPML_DATASETS = {
    "voc2012": ("VOC12", 5717, 5823),
    "coco": ("COCO", 82081, 40137),
    "nuswide": ("NUS", 161789, 107859),
    "cub": ("CUB", 5994, 5794),
}
SPML_METRIC = "mAP_class"
# The smoke sweep: two methods on the embedded dataset (its AN and two-way rows).
SMOKE_METHODS = ("an", "twoway")
# Cost: ResNet-50's images/s of the cost model (:data:`mlcls.reporting.sweeps.TRAIN_IMAGES_PER_S`) are at
# 224 px; 448 px has 4 times the pixels.
PIXELS_448 = 4.0
PUBLISHED_FIELDS = ("paper", "table", "row", "method", "dataset", "value", "source")
# Settings of spml.yaml checked in every run (what places it on the benchmark's protocol).
PROTOCOL_KEYS = (
    "trainer.epochs",
    "trainer.batch_size",
    "optim._target_",
    "optim.lr_head",
    "optim.lr_backbone",
    "optim.weight_decay",
    "sched.min_lr_ratio",
    "dataset.image_size",
    "dataset.transform",
    "dataset.val_fraction",
    "model.name",
    "model.pretrained",
)


def _experiment(method: str) -> str:
    return f"spml_{method}"


def preset_methods() -> tuple[str, ...]:
    """The methods of :data:`SPML_METHODS` that have their preset ``configs/experiment/spml_<method>.yaml``,
    in the table's order: the runs of the sweep."""
    experiments = config_dir() / "experiment"
    return tuple(method for method in SPML_METHODS if (experiments / f"{_experiment(method)}.yaml").is_file())


def spml_sweeps(
    smoke: bool = False, roots: Mapping[str, str] | None = None, data_root: Path | None = None
) -> list[Sweep]:
    """One sweep per dataset over every method with a preset (``experiment=spml_an,spml_an_ls,...``); in
    smoke mode one of :data:`SMOKE_METHODS` on the embedded dataset. ``roots`` / ``data_root`` as in
    :func:`mlcls.reporting.sweeps.table_sweeps`."""
    if smoke:
        experiments = [_experiment(method) for method in SMOKE_METHODS]
        overrides = [*SMOKE_OVERRIDES, *grid_overrides(experiments, {})]
        return [Sweep(SPML_TABLE, "smoke", tuple(overrides), None)]
    shared = grid_overrides([_experiment(m) for m in preset_methods()], {})
    return per_dataset_sweeps(SPML_TABLE, SPML_DATASETS, shared, roots, data_root)


def benchmark_preset() -> DictConfig:
    """``configs/experiment/spml.yaml``, the benchmark's protocol, read afresh (a caller may change it)."""
    return OmegaConf.load(config_dir() / "experiment" / "spml.yaml")


def job_gpu_hours(job: Mapping[str, str], gpu: str = "v100") -> float:
    """Estimated GPU-hours of one job of the benchmark's sweep (:func:`mlcls.reporting.sweeps.job_values`),
    :func:`mlcls.reporting.sweeps.gpu_hours` at ResNet-50's cost times :data:`PIXELS_448`: each of
    ``spml.yaml``'s ``trainer.epochs`` trains the training split less its ``dataset.val_fraction`` and
    evaluates the test split and the held-out share; ``em_apl`` adds a forward pass over the trained images
    after each epoch from its warm-up (``protocol.em_apl_warmup``) to the last but one."""
    preset = benchmark_preset()
    dataset, method = job["dataset"], job["experiment"].removeprefix("spml_")
    _, train, test = SPML_DATASETS[dataset]
    held_out = float(preset.dataset.val_fraction) * train
    trained = train - held_out
    epochs = int(preset.trainer.epochs)
    apl_passes = epochs - int(preset.protocol.em_apl_warmup[dataset]) if method == "em_apl" else 0
    return gpu_hours(epochs * trained, epochs * (test + held_out) + apl_passes * trained, gpu, PIXELS_448)


@cache
def load_published() -> tuple[dict[str, Any], ...]:
    """The published numbers of ``spml_published.yaml`` (:func:`check_published`)."""
    text = resources.files("mlcls.reporting").joinpath("spml_published.yaml").read_text()
    return check_published(yaml.safe_load(text))


def check_published(document: Any) -> tuple[dict[str, Any], ...]:
    """The entries of a published-numbers document, each checked: every field of
    :data:`PUBLISHED_FIELDS` present (``source``: the address the number was read from), a known method and
    dataset, a number for ``value``, and no two entries for one cell. :class:`ReportError` names the first
    entry that fails."""
    entries = (document or {}).get("published") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ReportError("spml_published.yaml: expected a mapping with a list under 'published'")
    seen = set()
    for number, entry in enumerate(entries):
        where = f"spml_published.yaml: entry {number}"
        if not isinstance(entry, dict):
            raise ReportError(f"{where} is a {type(entry).__name__}; expected a mapping")
        missing = [field for field in PUBLISHED_FIELDS if entry.get(field) in (None, "")]
        if missing:
            raise ReportError(
                f"{where} lacks {', '.join(missing)}; every number needs {', '.join(PUBLISHED_FIELDS)}"
            )
        if entry["method"] not in SPML_METHODS or entry["dataset"] not in SPML_DATASETS:
            raise ReportError(
                f"{where}: method {entry['method']!r} / dataset {entry['dataset']!r}; expected one of "
                f"{', '.join(SPML_METHODS)} / {', '.join(SPML_DATASETS)}"
            )
        value = entry["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
            raise ReportError(f"{where}: value {value!r}; expected a mAP in % (a number in [0, 100])")
        cell = (entry["method"], entry["dataset"])
        if cell in seen:
            raise ReportError(f"{where}: a second number for {cell[0]} on {cell[1]}")
        seen.add(cell)
    return tuple(entries)


def _method_of(config: Mapping[str, Any], attributes: Mapping[str, Any]) -> str | None:
    """The benchmark row of a run: ``full`` for BCE on all labels, else the loss (``ll`` by its mode,
    ``em`` with ``loss.apl`` as ``em_apl``); None for a run that is no row of the table."""
    observed = nested_get(config, "dataset", "observed") or "all"
    loss = attributes["loss"]
    if observed == "all":
        return "full" if loss == "bce" else None
    if observed != "single_positive":
        return None
    method = f"ll_{attributes.get('loss.mode')}" if loss == "ll" else loss
    if loss == "em" and nested_get(config, "loss", "apl"):
        method = "em_apl"
    return method if method in SPML_METHODS and method != "full" else None


def benchmark_checks(config: Mapping[str, Any], method: str | None) -> dict[str, Any]:
    """The values ``spml.yaml`` gives :data:`PROTOCOL_KEYS` (those it sets), for
    :func:`mlcls.reporting.runs.protocol_deviations`; EM and EM+APL take their authors' batch size and lr
    per dataset (``em_batch_size``, ``em_lr``), LL its own lr with the classifier's at 10x (``ll_lr``,
    ``ll_lr_head``)."""
    preset = benchmark_preset()
    dataset = nested_get(config, "dataset", "name")
    if method in ("em", "em_apl") and dataset in preset.protocol.em_lr:
        preset.protocol.batch_size = preset.protocol.em_batch_size[dataset]
        preset.protocol.lr = preset.protocol.em_lr[dataset]
    elif method in ("ll_r", "ll_ct", "ll_cp"):
        preset.protocol.lr = preset.protocol.ll_lr
        preset.optim.lr_head = preset.protocol.ll_lr_head
    wanted = {key: OmegaConf.select(preset, key) for key in PROTOCOL_KEYS}
    return {key: value for key, value in wanted.items() if value is not None}


def reported_metrics(results: Mapping[str, Any]) -> Mapping[str, Any]:
    """The validation metrics a run reports in the table: those of the epoch its held-out split selected
    (``best``, ``selected_on: holdout``), as the benchmark's code reports the test set at that epoch; else
    those of its last evaluation (a run without a held-out split)."""
    best = results.get("best") or {}
    return best if best.get("selected_on") == "holdout" else results.get("metrics") or {}


def collect_spml_runs(
    paths: Sequence[Path | str], stand_ins: Mapping[str, str] | None = None
) -> list[RunRecord]:
    """Every run under ``paths`` that is a row of the benchmark, with ``method`` among its attributes and
    its deviations from ``spml.yaml``. ``stand_ins`` renames datasets (``synthetic`` -> ``coco``)."""
    return collect_runs(paths, stand_ins, _spml_place, renamed=("dataset",))


def _spml_place(
    config: Mapping[str, Any], results: Mapping[str, Any], attributes: dict[str, Any]
) -> tuple[list[str], Mapping[str, Any]] | None:
    method = attributes["method"] = _method_of(config, attributes)
    if method is None:
        return None
    deviations = protocol_deviations(config, results, benchmark_checks(config, method), "benchmark")
    return deviations, reported_metrics(results)


def spml_spec() -> TableSpec:
    """The benchmark's table: a row per method, a column per dataset, the published numbers in the cells."""
    published = {(entry["method"], entry["dataset"]): float(entry["value"]) for entry in load_published()}
    rows = tuple(Axis((label,), {"method": method}, SPML_METRIC) for method, label in SPML_METHODS.items())
    columns = tuple(Axis(label, {"dataset": dataset}) for dataset, (label, _, _) in SPML_DATASETS.items())
    paper = {
        (row.label, column.label): published.get((row.match["method"], column.match["dataset"]))
        for row in rows
        for column in columns
    }
    sources = sorted({f"{entry['paper']} {entry['table']} ({entry['source']})" for entry in load_published()})
    return TableSpec(
        name=SPML_TABLE,
        caption="Single-positive benchmark, end-to-end ResNet-50 at 448 px: mAP@class (%)",
        row_header=("Method",),
        rows=rows,
        columns=columns,
        fixed={},
        paper=paper,
        note=f"Published numbers: {'; '.join(sources) if sources else 'none entered yet'} "
        "(mlcls/reporting/spml_published.yaml).",
    )


def fill_spml(runs: Sequence[RunRecord]) -> FilledTable:
    """The benchmark's table, each cell the mean of its runs' :func:`reported_metrics` mAP@class."""
    return fill_table(spml_spec(), runs)
