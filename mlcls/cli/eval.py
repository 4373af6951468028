"""``mlcls-eval``: the figures of a checkpoint on its validation set, or on your own test file or folder.

mlcls-eval checkpoint=outputs/2026-01-01/12-00-00/checkpoints/best.pt
mlcls-eval checkpoint=runs/mine/checkpoints/best.pt dataset.val_file=test.csv     # a CSV run's test list
torchrun --nproc_per_node=4 -m mlcls.eval checkpoint=... dataset.root=/data/coco

Any ``dataset.<key>=value`` replaces that key of the checkpoint's dataset config (an unknown key is
refused). Under ``dataset.unseen_classes`` the evaluation set's classes beyond the checkpoint's are scored
from their text embeddings (ZSL / GZSL figures; a head without text queries is refused).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from mlcls import config_dir
from mlcls.cli.errors import require_keys, user_errors
from mlcls.cli.overrides import closest_keys, run_command
from mlcls.config_tree import nested_get
from mlcls.data import build_dataset
from mlcls.data.loader import build_eval_loader
from mlcls.data.shards.reader import expand_urls, is_local
from mlcls.data.views import unseen_class_names
from mlcls.engine import distributed as dist_utils
from mlcls.engine.config_checks import resolve_amp
from mlcls.engine.evaluate import ZeroShot, evaluate
from mlcls.errors import ConfigError, shown
from mlcls.inference.predictor import load_inference_model
from mlcls.io import read_yaml, write_json
from mlcls.metrics.store import Storage
from mlcls.models.heads import TEXT_HEADS
from mlcls.models.heads.text_query import text_query_head
from mlcls.text import encoder_from_stored

USAGE = "mlcls-eval checkpoint=<run>/checkpoints/best.pt [dataset.val_file=test.csv | dataset.root=<folder>]"

# Keys of a dataset config that name where shards are read from (configs/dataset/shards.yaml).
SOURCE_KEYS = ("urls", "val_urls", "meta", "root")
# Nesting deeper than this in a stored config is refused (every shipped dataset config is 2 levels deep).
MAX_DEPTH = 16


def stored_plain(value: Any, where: str, depth: int = 0) -> Any:
    """``value`` (a config read from a checkpoint, at key ``where``) as plain containers and scalars, never
    resolved; :class:`ConfigError` for anything else: an interpolation ``${…}`` (resolving could read the
    environment or files, or call resolvers), another object, a key not a string, too deep a nesting."""
    if depth > MAX_DEPTH:
        raise ConfigError(
            f"the checkpoint's {where} is nested over {MAX_DEPTH} levels deep; not an mlcls config"
        )
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str) or "${" in key:
                raise ConfigError(f"the checkpoint's {where} has the key {shown(key)}; expected plain names")
        return {key: stored_plain(item, f"{where}.{key}", depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [stored_plain(item, f"{where}[{k}]", depth + 1) for k, item in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        raise ConfigError(
            f"the checkpoint's {where} is {shown(value)}, an interpolation; a config read from a file is "
            "never resolved (it could read your environment or files, or run commands)"
        )
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ConfigError(
        f"the checkpoint's {where} holds a {type(value).__name__}; a stored config holds plain values only"
    )


def evaluation_dataset_config(
    run_dataset: DictConfig | dict, overrides: dict[str, Any], classes: list[str]
) -> dict[str, Any]:
    """The checkpoint's dataset config (:func:`stored_plain`) with the keys of ``overrides`` replaced (null:
    the checkpoint's; an unknown key names the closest ones), and a ``classes`` key set to the checkpoint's
    ``classes``: a test file is read in the trained order, and an unknown name is an error, not a class.
    """
    run_dataset = stored_plain(run_dataset, "dataset")
    if not isinstance(run_dataset, dict):
        raise ConfigError(f"the checkpoint's dataset config is a {type(run_dataset).__name__}, not a mapping")
    overrides = {key: value for key, value in overrides.items() if value is not None}
    name = run_dataset.get("name", "?")
    for key in overrides:
        if key not in run_dataset:
            raise ConfigError(
                f"unknown option dataset.{key} for the checkpoint's dataset ({name}): "
                f"{closest_keys(str(key), [str(k) for k in run_dataset], 'dataset')}"
            )
    merged = {**run_dataset, **overrides}
    if "classes" in merged and "classes" not in overrides:
        merged["classes"] = list(classes)
    return merged


def packaged_dataset_targets() -> set[str]:
    """The ``_target_`` of every dataset config mlcls ships (``configs/dataset/*.yaml``)."""
    targets = set()
    for path in (config_dir() / "dataset").glob("*.yaml"):
        node = OmegaConf.create(read_yaml(path, "config"))
        target = OmegaConf.select(node, "dataset._target_") or node.get("_target_")
        if target:
            targets.add(str(target))
    return targets


def _hydra_keys(node: Any, where: str) -> list[str]:
    """The places within ``node`` (plain containers) of a key Hydra acts on (any ``_key``)."""
    if isinstance(node, dict):
        found = [f"{where}.{key}" for key in node if key.startswith("_")]
        return found + [
            place for key, value in node.items() for place in _hydra_keys(value, f"{where}.{key}")
        ]
    if isinstance(node, list):
        return [place for k, value in enumerate(node) for place in _hydra_keys(value, f"{where}[{k}]")]
    return []


def check_dataset_target(dataset_cfg: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` unless ``dataset_cfg`` (from a checkpoint) names one of mlcls's datasets
    and no other key Hydra acts on: Hydra would call whatever a file names."""
    known = packaged_dataset_targets()
    target = dataset_cfg.get("_target_")
    nested = [place for place in _hydra_keys(dataset_cfg, "dataset") if place != "dataset._target_"]
    if not isinstance(target, str) or target not in known or nested:
        what = f"{nested[0]} is set" if nested else f"dataset._target_={target!r}"
        raise ConfigError(
            f"the checkpoint's {what}; only mlcls's datasets are built from a file "
            f"({', '.join(sorted(known))}), unless trust_checkpoint=true"
        )


def check_shard_sources(dataset_cfg: dict[str, Any], given: set[str]) -> None:
    """Raise :class:`ConfigError` when a shard source the checkpoint names (:data:`SOURCE_KEYS`, not the
    user's ``given``) is not a local file: a ``pipe:`` would run here, a URL would be fetched."""
    for key in SOURCE_KEYS:
        value = dataset_cfg.get(key)
        if key in given or value in (None, ""):
            continue
        for url in expand_urls(value) if isinstance(value, (str, list)) else [value]:
            if not isinstance(url, str) or not is_local(url):
                raise ConfigError(
                    f"the checkpoint's dataset.{key} reads {shown(url)}, not a local file; shards named by "
                    "a checkpoint are read from local files only (a pipe: command would run here, a URL "
                    f"would be fetched): give dataset.{key}=… yourself, or trust_checkpoint=true for a file "
                    "you wrote"
                )


def evaluation_dataset(
    run_dataset: DictConfig | dict, given: dict[str, Any], classes: list[str], trust: bool = False
) -> Any:
    """The evaluation split of a checkpoint's dataset config with the user's ``given`` keys
    (:func:`evaluation_dataset_config`); unless ``trust``, built only when it names one of mlcls's datasets
    and local shard sources (:func:`check_dataset_target`, :func:`check_shard_sources`). The one object
    checked is the one built."""
    dataset_cfg = evaluation_dataset_config(run_dataset, given, classes)
    if not trust:
        check_dataset_target(dataset_cfg)
        check_shard_sources(dataset_cfg, set(given))
    return build_dataset(dataset_cfg, train=False)


def unseen_text_source(inference: Any, trust: bool) -> Any:
    """What embeds the unseen classes: the checkpoint's stored text encoder
    (:func:`mlcls.text.encoder_from_stored`: a class of mlcls.text, plain options), or with ``trust`` the
    run's text config as it is."""
    if trust:
        return stored_plain(inference.config.get("text"), "text")
    if inference.text is None:
        raise ConfigError(
            f"{inference.checkpoint} holds no text source ('text') to embed the unseen classes; pass "
            "trust_checkpoint=true for a file you wrote"
        )
    return encoder_from_stored(inference.text)


def zero_shot_evaluation(
    inference: Any, text: Any, unseen: Any, dataset_classes: list[str], zsl_images: Any = None
) -> ZeroShot | None:
    """The zero-shot evaluation of the checkpoint's model on ``dataset_classes``, embedded by ``text``
    (:func:`unseen_text_source`), its ZSL figures on ``zsl_images`` (``metrics.zsl_images``; None: the
    run's, ``all`` where the run has none)."""
    if zsl_images is None:
        zsl_images = nested_get(inference.config, "metrics", "zsl_images") or "all"
    try:
        named = unseen_class_names(unseen, dataset_classes)
        return ZeroShot.of(inference.classes, dataset_classes, text, named, images=zsl_images)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def checkpoint_metrics(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate ``cfg.checkpoint``; every process returns the same figures. The checkpoint's dataset config
    is merged with the user's ``dataset.*`` (:func:`evaluation_dataset`)."""
    require_keys(cfg, USAGE)
    info, trust = dist_utils.init_distributed(cfg.device, key="device"), cfg.trust_checkpoint
    inference = load_inference_model(cfg.checkpoint, info.device, trust=trust)
    if "dataset" not in inference.config:
        raise ConfigError(f"{cfg.checkpoint} holds no dataset config; is it an mlcls checkpoint?")
    given = {k: v for k, v in OmegaConf.to_container(cfg.dataset, resolve=True).items() if v is not None}
    unseen = given.pop("unseen_classes", None) or nested_get(inference.config, "dataset", "unseen_classes")
    if unseen and text_query_head(inference.model) is None:  # only it scores untrained classes
        head = nested_get(inference.config, "model", "head", "name")  # checked by load_inference_model
        raise ConfigError(
            f"dataset.unseen_classes: {inference.checkpoint} has model/head={shown(head)}, without text "
            f"queries: it scores only the {len(inference.classes)} classes it was trained on; expected a "
            f"checkpoint of model/head={' or '.join(TEXT_HEADS)}"
        )
    text = unseen_text_source(inference, trust) if unseen else None  # checked before any data is read
    dataset = evaluation_dataset(inference.config["dataset"], given, inference.classes, trust)
    if len(dataset) == 0:
        raise ConfigError(
            f"the evaluation set of {cfg.checkpoint} holds no image; give dataset.<key>=… of one"
        )
    zero_shot = (
        zero_shot_evaluation(inference, text, unseen, list(dataset.classes), cfg.metrics.zsl_images)
        if unseen
        else None
    )
    if zero_shot is None and list(dataset.classes) != inference.classes:
        raise ConfigError(
            f"the evaluation set's classes ({len(dataset.classes)}: {', '.join(dataset.classes[:5])}, …) "
            f"differ from the model's ({len(inference.classes)}: {', '.join(inference.classes[:5])}, …)"
        )
    loader = build_eval_loader(dataset, cfg.batch_size, cfg.workers, info.rank, info.world_size, info.device)
    amp = resolve_amp(cfg.amp, info.device)
    storage = Storage.of(cfg.metrics)
    evaluation = evaluate(inference.model, loader, info.device, inference.classes, amp, zero_shot, storage)
    return {**evaluation.metrics, "checkpoint": str(cfg.checkpoint), "num_samples": len(dataset)}


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="eval")
def _hydra_main(cfg: DictConfig) -> None:
    with user_errors():
        try:
            metrics = checkpoint_metrics(cfg)
        finally:
            dist_utils.cleanup()
    if int(os.environ.get("RANK", "0")) == 0:
        if cfg.output:
            write_json(metrics, cfg.output)
        print(json.dumps(metrics))  # one JSON line, per-class AP included


def main() -> None:
    # dataset.<key>=value as ++dataset.<key>=value: the keys are the checkpoint's dataset config's, unknown
    # to eval.yaml, and checked against it by evaluation_dataset_config
    sys.argv[1:] = [f"++{a.lstrip('+')}" if a.lstrip("+").startswith("dataset.") else a for a in sys.argv[1:]]
    run_command("eval", _hydra_main)


if __name__ == "__main__":
    sys.exit(main())
