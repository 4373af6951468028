"""The paper's Tables 1-5 and 7 filled with our runs, beside the paper's numbers.

Flow::

    run dirs ──► load_run: results.json + resolved config ──► run_attributes (dataset, backbone, loss and its
                 parameters, buckets per batch) and protocol_deviations
                     │
    TableSpec (paper layout: rows × columns, each cell = the attributes a run must have + the paper's number)
                     │
                     ▼
    fill_table: cell = mean of the matching runs' last-epoch metric ──► render_markdown · render_csv

A run is placed by its resolved config only (never by its directory name). The paper's numbers are the
packaged ``paper_tables.yaml``, a copy of the transcription in ``shared/paper/tables.yaml``.

Buckets are identified by their number per batch, ``k = trainer.batch_size / M`` (M: rows of the logit
matrix, :func:`mlcls.losses.spec.effective_bucket_size`): the paper's M = 128 at batch 512 is k = 4,
on 4 GPUs or on one. A run that departs from the paper's protocol (fewer epochs, another batch size,
no pretrained weights, a stand-in dataset, ...) still fills its cell, marked and with the departures listed.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from mlcls.losses.spec import effective_bucket_size, loss_name

METRICS = {"mAP_class": "mAP@class", "mAP_sample": "mAP@sample"}
# T_P -> 0 (Table 1's top row, the hard minimum) is run at this temperature: the loss needs T_P > 0.
HARD_MIN_TP = 0.01
# The ImageNet weights of each Table 7 backbone (timm names): the torchvision weights where timm has them;
# timm has no torchvision V1 RegNetY-32GF, so its pycls (original RegNet) weights stand for them.
PAPER_WEIGHTS = {
    "resnet50": "resnet50.tv_in1k",
    "resnext50_32x4d": "resnext50_32x4d.tv_in1k",
    "densenet169": "densenet169.tv_in1k",
    "regnety_320": "regnety_320.pycls_in1k",
}
DATASET_LABELS = {
    "coco": "MSCOCO",
    "vispr": "VISPR",
    "vaw": "VAW",
    "wider": "WIDER",
    "voc2007": "VOC2007",
    "voc2012": "VOC2012",
}
BACKBONE_LABELS = {
    "resnet50": "ResNet-50",
    "resnext50": "ResNeXt-50",
    "densenet169": "DenseNet-169",
    "regnety32gf": "RegNetY-32GF",
}
LOSS_LABELS = {"softmax": "Softmax", "bce": "BCE", "focal": "Focal", "asl": "ASL", "twoway": "Ours"}
TABLE_NAMES = ("table1", "table2", "table3", "table4", "table5", "table7")


class ReportError(ValueError):
    """A run directory or a table request the renderer cannot use; the message says which and why."""


@cache
def load_paper() -> dict[str, Any]:
    """The packaged paper numbers and protocol (``mlcls/reporting/paper_tables.yaml``)."""
    text = resources.files("mlcls.reporting").joinpath("paper_tables.yaml").read_text()
    return yaml.safe_load(text)


# ---------------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class RunRecord:
    """One finished (or partly finished) run: where it is, what it was, what it scored."""

    path: Path
    attributes: dict[str, Any]
    metrics: dict[str, float]
    deviations: tuple[str, ...]


def run_attributes(config: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """The facts that place a run in a table, from its resolved config.

    Keys: ``dataset`` (``dataset.name``), ``backbone`` (the timm architecture, ``model.name`` without its
    weights tag), ``loss`` (``loss.name``), ``loss.<key>`` for every scalar loss setting, and ``buckets``
    (buckets per batch, ``trainer.batch_size / M``) for the losses that have buckets.
    """
    loss = config["loss"]
    batch_size = int(config["trainer"]["batch_size"])
    attributes: dict[str, Any] = {
        "dataset": config["dataset"]["name"],
        "backbone": str(config["model"]["name"]).split(".")[0],
        "loss": loss_name(loss),
    }
    for key, value in loss.items():
        if key not in ("_target_", "name", "bucket_size", "gather") and not isinstance(value, (dict, list)):
            attributes[f"loss.{key}"] = value
    rows = effective_bucket_size(loss, batch_size, world_size)
    if rows is not None:
        attributes["buckets"] = batch_size / rows
    return attributes


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _same(ours: Any, wanted: Any) -> bool:
    """Equality with a float tolerance (0.01 and 1e-2, 4 and 4.0 are the same setting)."""
    if isinstance(wanted, (int, float)) and not isinstance(wanted, bool):
        return (
            isinstance(ours, (int, float))
            and not isinstance(ours, bool)
            and math.isclose(ours, wanted, rel_tol=1e-6, abs_tol=1e-12)
        )
    return ours == wanted


def _plain(value: Any) -> str:
    """A config value as written in a YAML file: null, true/false, numbers and text as they are."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def protocol_checks() -> dict[str, Any]:
    """Config keys and the values the paper's protocol (Sec. 4.1) gives them."""
    protocol = load_paper()["protocol"]
    optimizer = protocol["optimizer"]
    return {
        "trainer.epochs": protocol["epochs"],
        "trainer.batch_size": protocol["batch_size"],
        "optim.name": optimizer["name"],
        "optim.lr_head": protocol["lr"]["head"],
        "optim.lr_backbone": protocol["lr"]["backbone"],
        "optim.weight_decay": optimizer["weight_decay"],
        "optim.momentum": optimizer["momentum"],
        "optim.nesterov": optimizer["nesterov"],
        "sched.name": "cosine",
        "sched.warmup_iters": 0,
        "sched.min_lr_ratio": 0.0,
        "dataset.image_size": protocol["image_size"]["train"],
        "dataset.transform": "paper",
        "trainer.limit_train_batches": None,
        "trainer.limit_val_batches": None,
        "trainer.grad_clip": None,
        "trainer.ema_decay": None,
    }


def protocol_deviations(
    config: Mapping[str, Any], results: Mapping[str, Any], stand_ins: Mapping[str, str] | None = None
) -> list[str]:
    """How a run departs from the paper's protocol, one short phrase each (empty: it follows it).

    Checks the optimiser, schedule, epochs (configured and completed), batch size, augmentation and image
    size, mixed precision, the backbone's ImageNet weights, the dataset sizes of Table 6, and names the
    stand-ins (a dataset or backbone counted as another, e.g. in smoke runs).
    """
    deviations = []
    for name, replacement in (stand_ins or {}).items():
        if name in (config["dataset"]["name"], str(config["model"]["name"]).split(".")[0]):
            deviations.append(f"{name} stands in for {replacement}")
    for key, wanted in protocol_checks().items():
        ours = _get(config, key)
        if not _same(ours, wanted):
            deviations.append(f"{key}={_plain(ours)} (paper {_plain(wanted)})")
    if _get(config, "trainer.amp") == "none":
        deviations.append("no mixed precision (paper AMP)")
    completed, epochs = results.get("epochs_completed"), _get(config, "trainer.epochs")
    if completed is not None and epochs is not None and completed < epochs:
        deviations.append(f"unfinished: {completed} of {epochs} epochs")
    model = config["model"]
    architecture = str(model["name"]).split(".")[0]
    weights = PAPER_WEIGHTS.get((stand_ins or {}).get(architecture, architecture))
    if not model.get("pretrained") and not model.get("checkpoint_path"):
        deviations.append(f"not pretrained (paper {weights or 'ImageNet weights'})")
    elif model.get("checkpoint_path"):
        deviations.append(f"weights from {model['checkpoint_path']} (unverified)")
    elif weights is not None and model["name"] != weights:
        deviations.append(f"weights {model['name']} (paper {weights})")
    name = config["dataset"]["name"]
    sizes = load_paper()["table6_datasets"].get((stand_ins or {}).get(name, name))
    ours_sizes = results.get("dataset") or {}
    if sizes is not None:
        for ours_key, paper_key in (("train_size", "train"), ("val_size", "test")):
            if ours_key in ours_sizes and ours_sizes[ours_key] != sizes[paper_key]:
                ours_count, paper_count = ours_sizes[ours_key], sizes[paper_key]
                deviations.append(f"{paper_key} split {ours_count} samples (paper {paper_count})")
    return deviations


def load_run(run_dir: Path, stand_ins: Mapping[str, str] | None = None) -> RunRecord:
    """Read ``run_dir/results.json`` and the resolved config (``provenance.config``, else ``config.yaml``)."""
    run_dir = Path(run_dir)
    results_path = run_dir / "results.json"
    try:
        results = json.loads(results_path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{run_dir}: no results.json") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{results_path}: not valid JSON ({exc})") from None
    provenance = results.get("provenance") or {}
    config = provenance.get("config")
    if config is None:
        config_path = run_dir / "config.yaml"
        if not config_path.is_file():
            raise ReportError(f"{run_dir}: results.json has no provenance.config and there is no config.yaml")
        config = yaml.safe_load(config_path.read_text())
    world_size = int(provenance.get("world_size", results.get("world_size", 1)))
    attributes = run_attributes(config, world_size)
    for key in ("dataset", "backbone"):
        attributes[key] = (stand_ins or {}).get(attributes[key], attributes[key])
    metrics = results.get("metrics") or {}
    return RunRecord(
        path=run_dir,
        attributes=attributes,
        metrics={k: float(metrics[k]) for k in METRICS if metrics.get(k) is not None},
        deviations=tuple(protocol_deviations(config, results, stand_ins)),
    )


def collect_runs(paths: Iterable[Path | str], stand_ins: Mapping[str, str] | None = None) -> list[RunRecord]:
    """Every run under ``paths``: a run directory (holding results.json) or a sweep directory above runs."""
    runs = []
    for path in map(Path, paths):
        if not path.exists():
            raise ReportError(f"{path}: no such directory")
        if (path / "results.json").is_file():
            found = [path / "results.json"]
        else:
            found = sorted(path.rglob("results.json"))
        if not found:
            raise ReportError(f"{path}: no results.json in it or below")
        runs.extend(load_run(result.parent, stand_ins) for result in found)
    return runs


# ---------------------------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Axis:
    """A row or a column of a table: its label, the attributes it fixes and, if it carries it, the metric."""

    label: tuple[str, ...] | str
    match: Mapping[str, Any] = field(default_factory=dict)
    metric: str | None = None


@dataclass(frozen=True)
class TableSpec:
    """A paper table: layout, the attributes every cell shares, and the paper's number of each cell."""

    name: str
    caption: str
    row_header: tuple[str, ...]
    rows: tuple[Axis, ...]
    columns: tuple[Axis, ...]
    fixed: Mapping[str, Any]
    paper: Mapping[tuple[tuple[str, ...], str], float | None]
    note: str = ""

    def cell_match(self, row: Axis, column: Axis) -> dict[str, Any]:
        return {**self.fixed, **row.match, **column.match}

    def cell_metric(self, row: Axis, column: Axis) -> str:
        metric = row.metric or column.metric
        assert metric is not None, f"{self.name}: cell {row.label} x {column.label} has no metric"
        return metric


def matches(attributes: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """True when the run attributes hold every wanted value."""
    return all(key in attributes and _same(attributes[key], value) for key, value in wanted.items())


def _metric_rows() -> tuple[Axis, ...]:
    return tuple(Axis((label,), metric=metric) for metric, label in METRICS.items())


def _metric_columns(axes: Sequence[tuple[str, Mapping[str, Any]]]) -> tuple[Axis, ...]:
    """One column per (metric, axis), mAP@class block first, as the paper lays out Tables 1 and 7."""
    return tuple(
        Axis(f"{label} {name}", match, metric) for metric, label in METRICS.items() for name, match in axes
    )


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _ablation_fixed(loss: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ablations' setting (Sec. 4.2): MS-COCO, ResNet-50, plus the given loss attributes."""
    return {"dataset": "coco", "backbone": "resnet50", **(loss or {})}


def _paper_buckets() -> float:
    protocol = load_paper()["protocol"]
    return protocol["batch_size"] / protocol["bucket_size"]


def twoway_defaults(**overrides: Any) -> dict[str, Any]:
    """Attributes of the paper's two-way loss (T_P = 4, T_N = 1, both ways, no bias, M = 128)."""
    defaults = load_paper()["protocol"]["loss_defaults"]
    return {
        "loss": "twoway",
        "loss.tp": defaults["tp"],
        "loss.tn": defaults["tn"],
        "loss.ways": "both",
        "loss.margin": 0.0,
        "buckets": _paper_buckets(),
        **overrides,
    }


def _table1() -> TableSpec:
    data = load_paper()["table1_temperature"]
    rows = tuple(
        Axis(("→0" if tp == 0 else f"{tp:g}",), {"loss.tp": HARD_MIN_TP if tp == 0 else float(tp)})
        for tp in data["tp"]
    )
    columns = _metric_columns([(f"T_N={tn:g}", {"loss.tn": float(tn)}) for tn in data["tn"]])
    paper = {}
    for row, tp in zip(rows, data["tp"], strict=True):
        for metric in METRICS:
            block = [c for c in columns if c.metric == metric]
            for column, value in zip(block, data["tp"][tp][metric], strict=True):
                paper[(row.label, column.label)] = _number(value)
    return TableSpec(
        name="table1",
        caption="Table 1. Performance results with various temperatures (MS-COCO, ResNet-50).",
        row_header=("T_P",),
        rows=rows,
        columns=columns,
        fixed=_ablation_fixed(
            {k: v for k, v in twoway_defaults().items() if k not in ("loss.tp", "loss.tn")}
        ),
        paper=paper,
        note=f"T_P → 0 (the hard minimum) is run as T_P = {HARD_MIN_TP}.",
    )


def _table2() -> TableSpec:
    data = load_paper()["table2_logit_bias"]
    columns = tuple(Axis(f"ε={eps:g}", {"loss.margin": float(eps)}) for eps in data["eps"])
    rows = _metric_rows()
    paper = {}
    for eps, column in zip(data["eps"], columns, strict=True):
        values = data["values"].get(eps)
        for index, row in enumerate(rows):
            paper[(row.label, column.label)] = None if values is None else _number(values[index])
    return TableSpec(
        name="table2",
        caption="Table 2. Performance results by applying logit bias ε (MS-COCO, ResNet-50, T_P = T_N = 1).",
        row_header=("",),
        rows=rows,
        columns=columns,
        fixed=_ablation_fixed(twoway_defaults(**{"loss.tp": 1.0, "loss.tn": 1.0})),
        paper=paper,
        note="n/a: not legible in the source text. " + data.get("note", ""),
    )


def _table3() -> TableSpec:
    data = load_paper()["table3_ways"]
    buckets = {"buckets": _paper_buckets()}
    losses = {
        "twoway": ("(a) Ours", twoway_defaults()),
        "softmax": ("(b) Softmax", {"loss": "softmax"}),
    }
    columns, paper = [], {}
    rows = _metric_rows()
    for loss, (label, match) in losses.items():
        for way in ("both", "class", "sample"):
            # The sample way never mixes rows, so its number does not depend on the buckets.
            cell = {k: v for k, v in match.items() if k != "buckets"}
            cell.update({"loss.ways": way, **(buckets if way != "sample" else {})})
            column = Axis(f"{label} {way}", cell)
            columns.append(column)
            for index, row in enumerate(rows):
                paper[(row.label, column.label)] = _number(data[loss][way][index])
    return TableSpec(
        name="table3",
        caption="Table 3. Performance regarding ways to compute multi-label loss (MS-COCO, ResNet-50).",
        row_header=("way",),
        rows=rows,
        columns=tuple(columns),
        fixed=_ablation_fixed(),
        paper=paper,
        note="n/a: not legible in the source text.",
    )


def _table4() -> TableSpec:
    data = load_paper()["table4_related"]
    losses = {
        "multisim_eq20": ("(a) Multi-sim (20)", {"loss": "multisim"}),
        "joint_eq22": (
            "(b) Joint-way (22)",
            {"loss": "joint", "loss.tn": 1.0, "loss.margin": 0.0, "buckets": _paper_buckets()},
        ),
    }
    rows = _metric_rows()
    columns, paper = [], {}
    for key, (label, match) in losses.items():
        for index, tp in enumerate(data[key]["tp"]):
            column = Axis(f"{label} T_P={tp:g}", {**match, "loss.tp": float(tp)})
            columns.append(column)
            for row in rows:
                paper[(row.label, column.label)] = _number(data[key][row.metric][index])
    return TableSpec(
        name="table4",
        caption="Table 4. Performance results by other related loss functions (MS-COCO, ResNet-50).",
        row_header=("",),
        rows=rows,
        columns=tuple(columns),
        fixed=_ablation_fixed(),
        paper=paper,
    )


def _table5() -> TableSpec:
    data = load_paper()["table5_bucket_size"]
    batch = load_paper()["protocol"]["batch_size"]
    columns = tuple(Axis(f"M={m}", {"buckets": batch / m}) for m in data["M"])
    rows = _metric_rows()
    paper = {(row.label, column.label): None for row in rows for column in columns}
    return TableSpec(
        name="table5",
        caption=f"Table 5. Performance about bucket size M in a batch size of {batch} (MS-COCO, ResNet-50).",
        row_header=("",),
        rows=rows,
        columns=columns,
        fixed=_ablation_fixed({k: v for k, v in twoway_defaults().items() if k != "buckets"}),
        paper=paper,
        note=(
            f"n/a: not legible in the source text ({data.get('note', '')}). A run is placed by its number of "
            f"buckets per batch, batch / M: M={batch // 4} at batch {batch} is 4 buckets."
        ),
    )


def table7_losses() -> dict[str, dict[str, Any]]:
    """Attributes of each loss of Table 7 with the paper's settings (Sec. 4.3)."""
    hyper = load_paper()["table7"]["hyperparameters"]
    return {
        "softmax": {"loss": "softmax", "loss.ways": "sample"},
        "bce": {"loss": "bce", "loss.pos_weight": "freq"},  # "weighted by class frequencies [25]"
        "focal": {"loss": "focal", "loss.gamma": float(hyper["focal"]["gamma"]), "loss.alpha": None},
        "asl": {
            "loss": "asl",
            "loss.gamma_pos": float(hyper["asl"]["gamma_pos"]),
            "loss.gamma_neg": float(hyper["asl"]["gamma_neg"]),
            "loss.clip": float(hyper["asl"]["clip"]),
        },
        "twoway": twoway_defaults(),
    }


def _table7() -> TableSpec:
    data = load_paper()["table7"]
    backbones = data["backbones"]  # paper key -> timm architecture
    columns = _metric_columns(
        [(BACKBONE_LABELS[key], {"backbone": architecture}) for key, architecture in backbones.items()]
    )
    rows, paper = [], {}
    for dataset, label in DATASET_LABELS.items():
        for loss, match in table7_losses().items():
            row = Axis((label, LOSS_LABELS[loss]), {"dataset": dataset, **match})
            rows.append(row)
            for column in columns:
                key = next(k for k, arch in backbones.items() if arch == column.match["backbone"])
                index = list(METRICS).index(column.metric)
                paper[(row.label, column.label)] = _number(data[dataset][loss][key][index])
    return TableSpec(
        name="table7",
        caption="Table 7. Classification accuracies (%) on diverse datasets with various CNNs.",
        row_header=("dataset", "loss"),
        rows=tuple(rows),
        columns=columns,
        fixed={},
        paper=paper,
        note="Focal: γ = 2; ASL: γ+ = 0, γ- = 4, m = 0.05; BCE weighted by class frequencies.",
    )


_BUILDERS = {
    "table1": _table1,
    "table2": _table2,
    "table3": _table3,
    "table4": _table4,
    "table5": _table5,
    "table7": _table7,
}


def table_spec(name: str) -> TableSpec:
    """The layout, cell definitions and paper numbers of table ``name`` (``table1`` ... ``table7``)."""
    if name not in _BUILDERS:
        raise ReportError(f"unknown table {name!r}; expected one of {', '.join(TABLE_NAMES)}")
    return _BUILDERS[name]()


# ---------------------------------------------------------------------------------------------- filling
@dataclass(frozen=True)
class FilledCell:
    """One cell: the mean of our matching runs (None if none), the paper's number and the difference."""

    row: tuple[str, ...]
    column: str
    metric: str
    ours: float | None
    paper: float | None
    runs: tuple[RunRecord, ...]

    @property
    def diff(self) -> float | None:
        return None if self.ours is None or self.paper is None else self.ours - self.paper

    @property
    def deviations(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d for run in self.runs for d in run.deviations))


@dataclass(frozen=True)
class FilledTable:
    spec: TableSpec
    cells: tuple[FilledCell, ...]

    @property
    def filled(self) -> int:
        return sum(cell.ours is not None for cell in self.cells)


def fill_table(spec: TableSpec, runs: Sequence[RunRecord]) -> FilledTable:
    """Place every run whose attributes match a cell; a cell's value is the mean over its runs."""
    cells = []
    for row in spec.rows:
        for column in spec.columns:
            metric = spec.cell_metric(row, column)
            wanted = spec.cell_match(row, column)
            hits = tuple(run for run in runs if metric in run.metrics and matches(run.attributes, wanted))
            ours = statistics.fmean(run.metrics[metric] for run in hits) if hits else None
            paper = spec.paper.get((row.label, column.label))
            cells.append(FilledCell(tuple(row.label), column.label, metric, ours, paper, hits))
    return FilledTable(spec, tuple(cells))


def unplaced_runs(runs: Sequence[RunRecord], specs: Iterable[TableSpec]) -> list[RunRecord]:
    """The runs that fill no cell of any of ``specs``."""
    placed = {id(run) for spec in specs for cell in fill_table(spec, runs).cells for run in cell.runs}
    return [run for run in runs if id(run) not in placed]


# ---------------------------------------------------------------------------------------------- rendering
def write_table(table: FilledTable, out_dir: Path) -> tuple[Path, Path]:
    """Write ``<out_dir>/<table>.md`` and ``<table>.csv``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown, table_csv = out_dir / f"{table.spec.name}.md", out_dir / f"{table.spec.name}.csv"
    markdown.write_text(render_markdown(table))
    table_csv.write_text(render_csv(table))
    return markdown, table_csv


def _fmt(value: float | None, missing: str) -> str:
    return missing if value is None else f"{value:.2f}"


def _cell_text(cell: FilledCell) -> str:
    text = f"{_fmt(cell.ours, 'missing')} / {_fmt(cell.paper, 'n/a')}"
    if cell.diff is not None:
        text += f" ({cell.diff:+.2f})"
    if len(cell.runs) > 1:
        text += f" n={len(cell.runs)}"
    if cell.deviations:
        text += " *"
    return text


def render_markdown(table: FilledTable) -> str:
    """The table in the paper's layout; each cell ``ours / paper (ours - paper)``, ``*`` off-protocol."""
    spec = table.spec
    by_position = {(cell.row, cell.column): cell for cell in table.cells}
    header = [*spec.row_header, *(column.label for column in spec.columns)]
    lines = [
        f"### {spec.caption}",
        "",
        "Each cell: ours / paper (ours − paper), mAP in %; ours = last evaluation, mean of the n runs when "
        "n > 1; missing = no run; n/a = no paper number.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for row in spec.rows:
        texts = [_cell_text(by_position[(tuple(row.label), column.label)]) for column in spec.columns]
        lines.append("| " + " | ".join([*row.label, *texts]) + " |")
    lines += ["", f"{table.filled} of {len(table.cells)} cells filled."]
    if spec.note:
        lines.append(spec.note)
    deviations: dict[str, int] = {}
    for cell in table.cells:
        for deviation in cell.deviations:
            deviations[deviation] = deviations.get(deviation, 0) + 1
    if deviations:
        lines += ["", "\\* Off the paper's protocol:"]
        lines += [f"- {text} ({count} cells)" for text, count in deviations.items()]
    return "\n".join(lines) + "\n"


CSV_COLUMNS = ("table", "row", "column", "metric", "ours", "paper", "diff", "runs", "deviations", "run_dirs")


def render_csv(table: FilledTable) -> str:
    """One line per cell (long format): labels as in the paper, full-precision values, empty when missing."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for cell in table.cells:
        writer.writerow(
            [
                table.spec.name,
                " / ".join(cell.row),
                cell.column,
                cell.metric,
                "" if cell.ours is None else repr(cell.ours),
                "" if cell.paper is None else repr(cell.paper),
                "" if cell.diff is None else repr(cell.diff),
                len(cell.runs),
                "; ".join(cell.deviations),
                " ".join(str(run.path) for run in cell.runs),
            ]
        )
    return out.getvalue()
