"""``mlcls-eval``: the figures of a checkpoint on its validation set, or on your own test file or folder.

mlcls-eval checkpoint=outputs/2026-01-01/12-00-00/checkpoints/best.pt
mlcls-eval checkpoint=runs/mine/checkpoints/best.pt dataset.val_file=test.csv     # a CSV run's test list
torchrun --nproc_per_node=4 -m mlcls.eval checkpoint=... dataset.root=/data/coco

Any ``dataset.<key>=value`` replaces that key of the dataset config stored in the checkpoint; a key that
config does not have is refused with the keys it has.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from mlcls import config_dir
from mlcls.cli.errors import require_keys, user_errors
from mlcls.cli.overrides import closest_keys, run_command
from mlcls.data import build_dataset, current_target
from mlcls.data.loader import build_eval_loader
from mlcls.engine import distributed as dist_utils
from mlcls.engine.checkpoint import write_json
from mlcls.engine.evaluate import evaluate_model
from mlcls.engine.validate import ConfigError, resolve_amp
from mlcls.inference.predictor import load_inference_model

USAGE = "mlcls-eval checkpoint=<run>/checkpoints/best.pt [dataset.val_file=test.csv | dataset.root=<folder>]"


def evaluation_dataset_config(
    run_dataset: DictConfig | dict, overrides: DictConfig | dict, classes: list[str]
) -> DictConfig:
    """The checkpoint's dataset config ``run_dataset`` with the keys of ``overrides`` replaced (a null
    value keeps the checkpoint's).

    A key ``run_dataset`` lacks raises :class:`ConfigError` naming the closest keys. When the dataset config
    has a ``classes`` key (the CSV dataset) that is not overridden, it is set to the checkpoint's
    ``classes``: a test file is read in the order the model was trained with, and a name unknown to the
    model is an error rather than a new class.
    """
    run_dataset = OmegaConf.create(run_dataset)
    given = OmegaConf.to_container(OmegaConf.create(overrides))
    overrides = {key: value for key, value in given.items() if value is not None}
    name = run_dataset.get("name", "?")
    for key in overrides:
        if key not in run_dataset:
            raise ConfigError(
                f"unknown option dataset.{key} for the checkpoint's dataset ({name}): "
                f"{closest_keys(str(key), [str(k) for k in run_dataset], 'dataset')}"
            )
    merged = OmegaConf.merge(run_dataset, overrides)
    if "_target_" in merged:  # a checkpoint written before the data/ split names the old module
        merged._target_ = current_target(merged._target_)
    if "classes" in merged and "classes" not in overrides:
        merged.classes = list(classes)
    return merged


def packaged_dataset_targets() -> set[str]:
    """The ``_target_`` of every dataset config mlcls ships (``configs/dataset/*.yaml``)."""
    targets = set()
    for path in (config_dir() / "dataset").glob("*.yaml"):
        node = OmegaConf.load(path)
        target = OmegaConf.select(node, "dataset._target_") or node.get("_target_")
        if target:
            targets.add(str(target))
    return targets


def _names_a_target(node: Any) -> bool:
    """Whether a ``_target_`` key appears anywhere within ``node`` (a config value)."""
    if OmegaConf.is_dict(node):
        return "_target_" in node or any(_names_a_target(value) for value in node.values())
    return OmegaConf.is_list(node) and any(_names_a_target(value) for value in node)


def check_dataset_target(dataset_cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` unless ``dataset_cfg`` (read from a checkpoint) names one of mlcls's
    dataset classes and no other ``_target_`` within: Hydra would call whatever a file names."""
    known = packaged_dataset_targets()
    target = dataset_cfg.get("_target_")
    nested = [key for key, value in dataset_cfg.items() if key != "_target_" and _names_a_target(value)]
    if target not in known or nested:
        what = f"dataset.{nested[0]} holds a _target_" if nested else f"dataset._target_={target!r}"
        raise ConfigError(
            f"the checkpoint's {what}; only mlcls's datasets are built from a file "
            f"({', '.join(sorted(known))}), unless trust_checkpoint=true"
        )


def evaluate_checkpoint(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate ``cfg.checkpoint``; every process returns the same figures."""
    require_keys(cfg, USAGE)
    info = dist_utils.init_distributed(cfg.device)
    inference = load_inference_model(cfg.checkpoint, info.device, trust=cfg.trust_checkpoint)
    if "dataset" not in inference.config:
        raise ConfigError(f"{cfg.checkpoint} holds no dataset config; is it an mlcls checkpoint?")
    dataset_cfg = evaluation_dataset_config(inference.config["dataset"], cfg.dataset, inference.classes)
    if not cfg.trust_checkpoint:
        check_dataset_target(dataset_cfg)
    dataset = build_dataset(dataset_cfg, train=False)
    if list(dataset.classes) != inference.classes:
        raise ConfigError(
            f"the evaluation set's classes ({len(dataset.classes)}: {', '.join(dataset.classes[:5])}, …) "
            f"differ from the model's ({len(inference.classes)}: {', '.join(inference.classes[:5])}, …)"
        )
    loader = build_eval_loader(dataset, cfg.batch_size, cfg.workers, info.rank, info.world_size, info.device)
    amp = resolve_amp(cfg.amp, info.device)
    metrics = evaluate_model(inference.model, loader, info.device, inference.classes, amp).metrics
    metrics["checkpoint"] = str(cfg.checkpoint)
    metrics["num_samples"] = len(dataset)
    return metrics


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="eval")
def _hydra_main(cfg: DictConfig) -> None:
    with user_errors():
        try:
            metrics = evaluate_checkpoint(cfg)
        finally:
            dist_utils.cleanup()
    if int(os.environ.get("RANK", "0")) == 0:
        if cfg.output:
            write_json(metrics, cfg.output)
        print(json.dumps(metrics))  # one JSON line, per-class AP included


def dataset_overrides_as_replacements(argv: list[str]) -> list[str]:
    """``argv`` with every ``dataset.<key>=value`` (or ``+dataset.…``) written ``++dataset.<key>=value``:
    the keys come from the checkpoint's dataset config, unknown to ``eval.yaml``, and are checked against
    it by :func:`evaluation_dataset_config`."""
    return [f"++{arg.lstrip('+')}" if arg.lstrip("+").startswith("dataset.") else arg for arg in argv]


def main() -> None:
    sys.argv[1:] = dataset_overrides_as_replacements(sys.argv[1:])
    run_command("eval", _hydra_main)


if __name__ == "__main__":
    sys.exit(main())
