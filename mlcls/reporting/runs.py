"""Finished runs as the paper tables see them: where a run is, what it was, what it scored, and how it
departs from the paper's protocol.

A run is placed by its resolved config only (never by its directory name): ``provenance.config`` in its
``results.json``, else the run's ``config.yaml``. Buckets are identified by their number per batch,
``k = trainer.batch_size / M`` (M: rows of the logit matrix, :func:`mlcls.losses.spec.effective_bucket_size`):
the paper's M = 128 at batch 512 is k = 4, on 4 GPUs or on one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mlcls.io import read_json, read_yaml
from mlcls.losses.spec import effective_bucket_size, loss_name
from mlcls.reporting.paper import ReportError, load_paper

METRICS = {"mAP_class": "mAP@class", "mAP_sample": "mAP@sample"}
# The ImageNet weights of each Table 7 backbone (timm names): the torchvision weights where timm has them;
# timm has no torchvision V1 RegNetY-32GF, so its pycls (original RegNet) weights stand for them.
PAPER_WEIGHTS = {
    "resnet50": "resnet50.tv_in1k",
    "resnext50_32x4d": "resnext50_32x4d.tv_in1k",
    "densenet169": "densenet169.tv_in1k",
    "regnety_320": "regnety_320.pycls_in1k",
}
# Config groups checked by the name of what they build (the paper's SGD, cosine schedule).
NAMED_GROUPS = ("optim", "sched")


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
    weights tag), ``loss`` (:func:`mlcls.losses.spec.loss_name`), ``loss.<key>`` for every scalar loss
    setting, and ``buckets`` (buckets per batch, ``trainer.batch_size / M``) for the losses that have buckets.
    """
    loss = config["loss"]
    batch_size = int(config["trainer"]["batch_size"])
    attributes: dict[str, Any] = {
        "dataset": config["dataset"]["name"],
        "backbone": architecture(config),
        "loss": loss_name(loss),
    }
    for key, value in loss.items():
        if key not in ("_target_", "name", "bucket_size", "gather") and not isinstance(value, (dict, list)):
            attributes[f"loss.{key}"] = value
    rows = effective_bucket_size(loss, batch_size, world_size)
    if rows is not None:
        attributes["buckets"] = batch_size / rows
    return attributes


def architecture(config: Mapping[str, Any]) -> str:
    """The timm architecture of a run: ``model.name`` without its weights tag (``resnet50.tv_in1k``)."""
    return str(config["model"]["name"]).split(".")[0]


def built_name(group: Mapping[str, Any]) -> str | None:
    """Short name of what a config group builds: ``torch.optim.SGD`` -> ``sgd`` (the last part of its
    ``_target_``, lower case); configs of older runs name it with a ``name`` key, used when present."""
    if group.get("name"):
        return str(group["name"])
    target = group.get("_target_")
    return None if not target else str(target).rsplit(".", 1)[-1].lower()


def config_value(config: Mapping[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` (``optim.lr_head``), or None when the config has no such key."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def same_setting(ours: Any, wanted: Any) -> bool:
    """Equality with a float tolerance (0.01 and 1e-2, 4 and 4.0 are the same setting)."""
    if isinstance(wanted, (int, float)) and not isinstance(wanted, bool):
        return (
            isinstance(ours, (int, float))
            and not isinstance(ours, bool)
            and math.isclose(ours, wanted, rel_tol=1e-6, abs_tol=1e-12)
        )
    return ours == wanted


def matches(attributes: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """True when the run attributes hold every wanted value."""
    return all(key in attributes and same_setting(attributes[key], value) for key, value in wanted.items())


def yaml_text(value: Any) -> str:
    """A config value as written in a YAML file: null, true/false, numbers and text as they are."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def protocol_checks() -> dict[str, Any]:
    """Config keys and the values the paper's protocol (Sec. 4.1) gives them; ``optim`` and ``sched`` are
    checked by the name of what they build (:func:`built_name`)."""
    protocol = load_paper()["protocol"]
    optimizer = protocol["optimizer"]
    return {
        "trainer.epochs": protocol["epochs"],
        "trainer.batch_size": protocol["batch_size"],
        "optim": optimizer["name"],
        "optim.lr_head": protocol["lr"]["head"],
        "optim.lr_backbone": protocol["lr"]["backbone"],
        "optim.weight_decay": optimizer["weight_decay"],
        "optim.momentum": optimizer["momentum"],
        "optim.nesterov": optimizer["nesterov"],
        "optim.norm_weight_decay": None,  # null: the same weight decay on every parameter
        "optim.bias_weight_decay": None,
        "sched": "cosine",
        "sched.warmup_epochs": 0,
        "sched.min_lr_ratio": 0.0,
        "dataset.image_size": protocol["image_size"]["train"],
        "dataset.transform": "paper",
        "trainer.limit_train_batches": None,
        "trainer.limit_val_batches": None,
        "trainer.grad_clip": None,
        "trainer.ema_decay": None,
        "trainer.eval_amp": "none",  # the authors evaluate in float32
    }


def _follows(config: Mapping[str, Any], key: str, wanted: Any) -> tuple[bool, Any]:
    """Whether ``config`` holds the protocol's value at ``key``, and the value it holds.

    A group of :data:`NAMED_GROUPS` follows when one ``_``-separated part of its built name begins with the
    paper's (``sgd``; ``cosine`` for ``cosine``, ``warmup_cosine`` or ``CosineAnnealingLR``).
    """
    if key in NAMED_GROUPS:
        name = built_name(config.get(key) or {})
        return name is not None and any(part.startswith(wanted) for part in name.split("_")), name
    ours = config_value(config, key)
    if key == "sched.warmup_epochs" and ours is None:  # null: the head's own default
        epochs = config_value(config, "model.head.warmup_epochs")
        return same_setting(epochs or 0, wanted), f"null (model.head.warmup_epochs={epochs})"
    return same_setting(ours, wanted), ours


def protocol_deviations(
    config: Mapping[str, Any],
    results: Mapping[str, Any],
    checks: Mapping[str, Any],
    reference: str = "paper",
) -> list[str]:
    """How a run departs from a protocol, one short phrase each (empty: it follows it): every key of
    ``checks`` whose value ``config`` does not hold (:func:`_follows`), named beside the ``reference``'s
    value, and the epochs it left unfinished."""
    deviations = []
    for key, wanted in checks.items():
        follows, ours = _follows(config, key, wanted)
        if not follows:
            deviations.append(f"{key}={yaml_text(ours)} ({reference} {yaml_text(wanted)})")
    completed, epochs = results.get("epochs_completed"), config_value(config, "trainer.epochs")
    if completed is not None and epochs is not None and completed < epochs:
        deviations.append(f"unfinished: {completed} of {epochs} epochs")
    return deviations


def paper_deviations(
    config: Mapping[str, Any], results: Mapping[str, Any], stand_ins: Mapping[str, str] | None = None
) -> list[str]:
    """How a run departs from the paper's protocol, one short phrase each (empty: it follows it).

    Names the stand-ins (a dataset or backbone counted as another, e.g. in smoke runs), then checks
    :func:`protocol_checks` (the optimiser, schedule, epochs configured and completed, batch size,
    augmentation and image size), mixed precision, the backbone's ImageNet weights and the dataset sizes of
    Table 6.
    """
    stand_ins = stand_ins or {}
    deviations = [
        f"{name} stands in for {replacement}"
        for name, replacement in stand_ins.items()
        if name in (config["dataset"]["name"], architecture(config))
    ]
    deviations += protocol_deviations(config, results, protocol_checks())
    amp = config_value(config, "trainer.amp")
    device = ((results.get("provenance") or {}).get("device") or {}).get("type")
    if amp == "none" or (amp == "auto" and device not in (None, "cuda")):  # auto: float32 off CUDA
        deviations.append("no mixed precision (paper AMP)")
    deviations += _weights_deviations(config, stand_ins)
    name = config["dataset"]["name"]
    sizes = load_paper()["table6_datasets"].get(stand_ins.get(name, name))
    ours_sizes = results.get("dataset") or {}
    if sizes is not None:
        for ours_key, paper_key in (("train_size", "train"), ("val_size", "test")):
            if ours_key in ours_sizes and ours_sizes[ours_key] != sizes[paper_key]:
                ours_count, paper_count = ours_sizes[ours_key], sizes[paper_key]
                deviations.append(f"{paper_key} split {ours_count} samples (paper {paper_count})")
    return deviations


def _weights_deviations(config: Mapping[str, Any], stand_ins: Mapping[str, str]) -> list[str]:
    """How the backbone's starting weights depart from the paper's ImageNet weights (empty: they are them)."""
    model, backbone = config["model"], architecture(config)
    weights = PAPER_WEIGHTS.get(stand_ins.get(backbone, backbone))
    if not model.get("pretrained") and not model.get("checkpoint_path"):
        return [f"not pretrained (paper {weights or 'ImageNet weights'})"]
    if model.get("checkpoint_path"):
        return [f"weights from {model['checkpoint_path']} (unverified)"]
    if weights is not None and model["name"] != weights:
        return [f"weights {model['name']} (paper {weights})"]
    return []


# Nesting deeper than this in a run's config is refused (an mlcls config is 3 levels deep; the readers
# recurse through it).
MAX_CONFIG_DEPTH = 32
# The largest whole number a results.json field may hold: any count or epoch of a run is far below it, and a
# float can hold it (a larger integer fails to format or to convert).
MAX_INT = 2**53


def is_number(value: Any) -> bool:
    """A finite or infinite float, or an int of at most :data:`MAX_INT` in size; not a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and abs(value) <= MAX_INT)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _fields(checks: Mapping[str, tuple[Callable[[Any], bool], str]]) -> Callable[[Any], str | None]:
    """A check of a JSON object whose fields, where present, pass ``checks`` (field: (check, expected));
    returns what is wrong (``"<field> is ..., expected ..."``) or None."""

    def check(node: Any) -> str | None:
        if not isinstance(node, Mapping):
            return f"is {_kind(node)}; expected an object"
        for key, (ok, expected) in checks.items():
            if key in node and not ok(node[key]):
                return f"{key} is {_kind(node[key])}; expected {expected}"
        return None

    return check


def _kind(value: Any) -> str:
    """What a JSON value is, for a message: its type, and short values themselves."""
    if value is None or isinstance(value, bool) or is_number(value):
        return json.dumps(value)
    if isinstance(value, str):
        return f"the text {json.dumps(value[:40])}" + ("..." if len(value) > 40 else "")
    return {dict: "an object", list: "a list", int: "a whole number beyond 2**53"}.get(type(value), "a value")


_FIGURE = (_optional(is_number), "a number or null")
_COUNT = (_optional(_count), "a whole number >= 0 or null")
_ENTRY = _fields(
    {"epoch": (_count, "a whole number >= 0"), "loss": _FIGURE, "mAP_class": _FIGURE, "mAP_sample": _FIGURE}
)
# The fields of results.json that mlcls-report and mlcls-tables read, and what each must hold where present.
RESULTS_FIELDS: dict[str, Callable[[Any], str | None]] = {
    "metrics": _fields({key: _FIGURE for key in ("mAP_class", "mAP_sample", "CF1", "OF1")}),
    "best": _fields(
        {
            "epoch": (_count, "a whole number >= 0"),
            "mAP_class": _FIGURE,
            "weights": (_optional(lambda v: isinstance(v, str)), "a name"),
        }
    ),
    "per_class_ap": lambda node: (
        _fields({})(node)
        or next(
            (
                f"{key} is {_kind(v)}; expected a number or null"
                for key, v in node.items()
                if not _FIGURE[0](v)
            ),
            None,
        )
    ),
    "history": lambda node: (
        f"is {_kind(node)}; expected a list"
        if not isinstance(node, list)
        else next((f"[{k}] {wrong}" for k, entry in enumerate(node) if (wrong := _ENTRY(entry))), None)
    ),
    "dataset": _fields(
        {
            "name": (_optional(lambda v: isinstance(v, str)), "a name"),
            "train_size": _COUNT,
            "val_size": _COUNT,
            "num_classes": _COUNT,
        }
    ),
    "provenance": _fields(
        {
            "world_size": (lambda v: _count(v) and v >= 1, "a whole number >= 1"),
            "wall_time_s": _FIGURE,
            "device": (_optional(lambda v: isinstance(v, Mapping)), "an object or null"),
            "config": (_optional(lambda v: isinstance(v, Mapping)), "an object or null"),
        }
    ),
}
RESULTS_SCALARS = {
    "epochs_completed": _COUNT,
    "resumes": _COUNT,
    "world_size": (lambda v: _count(v) and v >= 1, "a whole number >= 1"),
}


def check_results(results: Any, path: Path) -> dict[str, Any]:
    """``results`` (read from ``path``) if it is a JSON object whose fields that mlcls-report and mlcls-tables
    read hold what they should (:data:`RESULTS_FIELDS`, :data:`RESULTS_SCALARS`; a field may be absent or
    null); :class:`ReportError` naming the first that does not, in one line."""
    if not isinstance(results, dict):
        raise ReportError(f"{path}: a JSON {type(results).__name__}; expected an object")
    for key, check in RESULTS_FIELDS.items():
        wrong = None if results.get(key) is None else check(results[key])
        if wrong:
            raise ReportError(f"{path}: {key} {wrong}")
    for key, (ok, expected) in RESULTS_SCALARS.items():
        if key in results and not ok(results[key]):
            raise ReportError(f"{path}: {key} is {_kind(results[key])}; expected {expected}")
    return results


def read_results(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir/results.json`` as a dict, None when the run wrote none (yet). Read through
    :func:`mlcls.io.read_json` (a regular file of at most ``CAPS["results"]`` bytes, nesting bounded) and
    checked (:func:`check_results`); :class:`ReportError` in one line otherwise."""
    results_path = Path(run_dir) / "results.json"
    try:
        results = read_json(results_path, "results")
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{results_path}: not valid JSON ({exc})") from None
    except (OSError, ValueError) as exc:  # not a regular file, too large, nested too deep
        raise ReportError(_one_line(exc, results_path)) from None
    return check_results(results, results_path)


def read_config(run_dir: Path, results: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The resolved config of a run: ``provenance.config`` of its results, else its ``config.yaml`` (read
    through :func:`mlcls.io.read_yaml`: a regular file of at most ``CAPS["config"]`` bytes, no YAML alias);
    None when it has neither. :class:`ReportError` in one line for a config that is not a mapping or is
    nested over :data:`MAX_CONFIG_DEPTH` levels."""
    provenance = (results or {}).get("provenance")
    config = provenance.get("config") if isinstance(provenance, dict) else None
    config_path = Path(run_dir) / "config.yaml"
    if config is None:
        try:
            config = read_yaml(config_path, "config")
        except FileNotFoundError:
            return None
        except yaml.YAMLError as exc:
            raise ReportError(f"{config_path}: not valid YAML ({' '.join(str(exc).split())})") from None
        except (OSError, ValueError) as exc:  # not a regular file, too large, an alias, nested too deep
            raise ReportError(_one_line(exc, config_path)) from None
    if config is not None and not isinstance(config, dict):
        raise ReportError(f"{run_dir}: the run's config is a {type(config).__name__}; expected a mapping")
    if config is not None and _depth(config) > MAX_CONFIG_DEPTH:
        raise ReportError(
            f"{run_dir}: the run's config nests over {MAX_CONFIG_DEPTH} levels; not an mlcls config"
        )
    return config


def _depth(node: Any) -> int:
    """How deep ``node`` (plain dicts and lists) nests, found without recursion."""
    deepest, pending = 0, [(node, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > MAX_CONFIG_DEPTH:
                    return depth + 1
                pending.append((child, depth + 1))
        deepest = max(deepest, depth)
    return deepest


def _one_line(exc: BaseException, path: Path) -> str:
    """``exc``'s message on one line, naming ``path`` when it does not already."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if str(path) in text else f"{path}: {text}"


def config_groups(config: Mapping[str, Any], where: Path | str, groups: Iterable[str]) -> None:
    """:class:`ReportError` in one line unless each of ``groups`` of ``config`` is a mapping (``loss``
    naming its ``_target_`` or ``name``), as in every config mlcls-train writes."""
    for group in groups:
        if not isinstance(config.get(group), Mapping):
            raise ReportError(
                f"{where}: the run's config has no {group} group (a mapping); not an mlcls config"
            )
    loss = config.get("loss")
    if isinstance(loss, Mapping) and not any(
        isinstance(loss.get(k), str) and loss.get(k) for k in ("_target_", "name")
    ):
        raise ReportError(
            f"{where}: the run's loss config names no _target_ (the loss class); not an mlcls config"
        )


def load_run(run_dir: Path, stand_ins: Mapping[str, str] | None = None) -> RunRecord:
    """Read ``run_dir/results.json`` and the resolved config (``provenance.config``, else ``config.yaml``)."""
    run_dir = Path(run_dir)
    results = read_results(run_dir)
    if results is None:
        raise ReportError(f"{run_dir}: no results.json")
    config = read_config(run_dir, results)
    if config is None:
        raise ReportError(f"{run_dir}: results.json has no provenance.config and there is no config.yaml")
    config_groups(config, run_dir, ("dataset", "model", "loss", "trainer"))
    provenance = results.get("provenance") or {}
    world_size = provenance.get("world_size") or results.get("world_size") or 1
    try:
        attributes = run_attributes(config, world_size)
        deviations = tuple(paper_deviations(config, results, stand_ins))
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        # a config that is a mapping of groups, with a value of another type or missing inside one
        raise ReportError(
            f"{run_dir}: the run's config does not place it ({type(exc).__name__}: {_one_line(exc, run_dir)})"
        ) from None
    for key in ("dataset", "backbone"):
        attributes[key] = (stand_ins or {}).get(attributes[key], attributes[key])
    metrics = results.get("metrics") or {}
    return RunRecord(
        path=run_dir,
        attributes=attributes,
        metrics={k: float(metrics[k]) for k in METRICS if metrics.get(k) is not None},
        deviations=deviations,
    )


def find_run_dirs(path: Path | str, marker: str = "results.json") -> list[Path]:
    """The run directories at or below ``path``: those holding ``marker`` (``results.json``; ``config.yaml``
    also finds runs that stopped before their first evaluation), hidden folders skipped, sorted with job
    numbers in numeric order (``2`` before ``10``)."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"{path}: no such directory")
    if (path / marker).is_file():
        return [path]
    found = {
        hit.parent
        for hit in path.rglob(marker)
        if not any(part.startswith(".") for part in hit.relative_to(path).parts[:-1])
    }
    return sorted(found, key=natural_order)


def natural_order(path: Path) -> list[tuple[int, int | str]]:
    """Sort key of a path comparing its runs of digits as numbers."""
    parts = re.split(r"(\d+)", str(path))
    return [(0, int(part)) if part.isdigit() else (1, part) for part in parts]


def collect_runs(paths: Iterable[Path | str], stand_ins: Mapping[str, str] | None = None) -> list[RunRecord]:
    """Every run under ``paths``: a run directory (holding results.json) or a sweep directory above runs."""
    runs = []
    for path in map(Path, paths):
        found = find_run_dirs(path)
        if not found:
            raise ReportError(f"{path}: no results.json in it or below")
        runs.extend(load_run(run_dir, stand_ins) for run_dir in found)
    return runs
