"""``mlcls-data``: inspect a dataset as mlcls will load it.

    mlcls-data stats dataset=coco dataset.root=/data/coco            # sizes, classes, label statistics
    mlcls-data stats dataset=vaw dataset.root=/data/vaw --check      # also decode every image
    mlcls-data stats dataset=csv dataset.root=/data/mine --split val
    mlcls-data pack dataset=coco dataset.root=/data/coco out=/data/coco320 shard_size=1000 max_side=320
    mlcls-data verify /data/coco320                                  # every shard against the manifest
    mlcls-data audit dataset=csv dataset.root=/data/mine folds=5 out=audit   # suspected label errors

Overrides are those of ``mlcls-train``. ``pack`` also takes :data:`PACK_OPTIONS`: ``out=`` (required),
``shard_size=`` (samples per shard), ``max_side=``, ``quality=`` (JPEG quality of re-encoded images),
``subsampling=`` (auto keeps a JPEG's own, else 444; or 444, 422, 420), ``seed=`` (the training split's
order), ``workers=`` (processes) and ``overwrite=true`` (replace a split packed with other settings).
``audit`` (:mod:`mlcls.reporting.audit`) trains ``folds=`` times, each on all folds of the training split
but one, and ranks the given labels (``top=`` of them) into ``out=``/audit.csv and .html; folds that start
from weights (``model.pretrained``, ``model.checkpoint_path``, ``model.init_from``) train with
``experiment=finetune`` unless an ``experiment=`` is given or ``recipe=none``. Exit status: 1
when images are unreadable, skipped or a packed file has a problem; 2 for a configuration mistake.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from mlcls.cli.errors import USER_ERRORS, error_line
from mlcls.cli.overrides import compose_config
from mlcls.data import build_dataset
from mlcls.data.datasets.base import MultiLabelDataset, find_unreadable
from mlcls.data.datasets.labels import label_counts
from mlcls.data.datasets.observed import ALL_LABELS
from mlcls.data.shards.pack import pack_split, write_sidecars
from mlcls.data.shards.reader import verify_pack
from mlcls.data.views import TrainingView
from mlcls.errors import ConfigError, failure, plural, printable
from mlcls.reporting.audit import FINETUNE, audit, fold_overrides

TOP_CLASSES = 5
PACK_OPTIONS = {  # pack_split's keywords, with their defaults
    "out": None,
    "shard_size": 1000,
    "max_side": 320,
    "quality": 90,
    "subsampling": "auto",
    "seed": 0,
    "workers": 1,
    "overwrite": False,
}
TEXT_PACK_OPTIONS = ("out", "subsampling")  # the others are positive integers or booleans
AUDIT_OPTIONS = {"folds": 5, "out": "audit", "seed": 0, "top": 1000, "recipe": "auto"}
BOOLEANS = {"true": True, "false": False}
# The source's settings that training from its shards takes as defaults (dataset=shards reads them from the
# manifest), and those the pack's "train with:" line repeats where the source's config set them otherwise.
SOURCE_DATASET_KEYS = ("image_size", "transform")
SOURCE_MODEL_KEYS = ("model.name", "model.pretrained")


def describe(dataset: MultiLabelDataset, title: str) -> None:
    """Print the size and label statistics of one split as its observed-label regime shows them (with
    each class's counts under a regime that hides labels)."""
    stats = label_counts(dataset)
    observed = getattr(dataset, "observed", ALL_LABELS)
    print(f"\n{title}: {plural(stats.num_samples, 'sample')}")
    if observed.hides_labels:
        fraction = f", fraction {observed.fraction:g}" if observed.regime == "partial" else ""
        print(f"  observed labels: {observed.regime} (seed {observed.seed}{fraction})")
    print(f"  positive labels per sample: {stats.positives_per_sample:.2f}")
    entries = stats.num_samples * stats.num_classes
    print(f"  unknown labels (-1): {100 * stats.unknown_share:.2f}% of the {entries} entries")
    for name, most in (("most frequent", True), ("least frequent", False)):
        ranked = stats.ranked(dataset.classes, TOP_CLASSES, most)
        print(f"  {name}: {', '.join(f'{printable(cls)} {count}' for cls, count in ranked)}")
    if observed.hides_labels:
        print("  observed per class: positives / negatives / unknown")
        for name, positives, negatives in zip(
            dataset.classes, stats.positives.tolist(), stats.negatives.tolist(), strict=True
        ):
            unknown = stats.num_samples - positives - negatives
            print(f"    {printable(name)}: {positives} / {negatives} / {unknown}")


def check(dataset: MultiLabelDataset, workers: int) -> int:
    """Decode every image of ``dataset``, print the unreadable ones; return their number."""
    checked, unreadable = find_unreadable(dataset, workers)
    print(f"  images checked: {checked}, unreadable: {len(unreadable)}")
    for path, error in unreadable:
        print(f"    {printable(path)}: {printable(error)}")
    return len(unreadable)


def stats(cfg: DictConfig, splits: Sequence[str], check_images: bool, workers: int) -> int:
    """Print the classes and the statistics of ``splits`` ("train" / "val"); return the exit status."""
    print(f"dataset {cfg.dataset.get('name', '?')} (root: {cfg.dataset.get('root', '-')})")
    unreadable = 0
    for i, split in enumerate(splits):
        dataset = build_dataset(cfg.dataset, train=split == "train")
        if i == 0:
            names = textwrap.fill(
                ", ".join(map(printable, dataset.classes)),
                width=100,
                initial_indent="  ",
                subsequent_indent="  ",
            )
            print(f"classes ({len(dataset.classes)}), in label order:\n{names}")
        describe(dataset, f"{split} split ({cfg.dataset.get(f'{split}_split', split)})")
        if check_images:
            unreadable += check(dataset, workers)
    return 1 if unreadable else 0


def split_options(
    overrides: Sequence[str], defaults: dict[str, Any], text_keys: Sequence[str]
) -> tuple[dict[str, Any], list[str]]:
    """A command's own ``key=value`` options (the keys of ``defaults``: booleans, text of ``text_keys``,
    else integers >= 0) and the remaining config overrides."""
    options, rest = dict(defaults), []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key in defaults:
            if isinstance(defaults[key], bool):
                if value.lower() not in BOOLEANS:
                    raise ConfigError(f"{key}={value}; expected true or false")
                options[key] = BOOLEANS[value.lower()]
            elif key not in text_keys and not value.isdigit():
                raise ConfigError(f"{key}={value}; expected a positive integer")
            else:
                options[key] = value if key in text_keys else int(value)
        else:
            rest.append(override)
    return options, rest


def pack(cfg: DictConfig, splits: Sequence[str], options: dict[str, Any], progress: bool) -> int:
    """Pack ``splits`` of ``cfg.dataset`` into ``options["out"]``; print a report; return the exit status."""
    out = Path(options["out"])
    reports, names, dataset = [], {}, None
    for split in splits:
        dataset = build_dataset(cfg.dataset, train=split == "train")
        if isinstance(dataset, TrainingView):  # the data is packed; the regime is drawn when training
            dataset = dataset.source
        dataset.transform = None  # the packed images are the source images, resized
        names[split] = cfg.dataset.get(f"{split}_split", split)
        report = pack_split(dataset, role=split, shuffle=split == "train", progress=progress, **options)
        reports.append(report)
        print(
            f"{split}: {report.samples} samples in {len(report.shards)} shards ({report.written} written, "
            f"{report.kept} kept from an earlier run), {len(report.skipped)} unreadable images skipped"
        )
        for skipped in report.skipped:
            print(f"  skipped {skipped['path']}: {skipped['error']}")
    source = {key: cfg.dataset[key] for key in SOURCE_DATASET_KEYS if key in cfg.dataset}
    write_sidecars(
        out, dataset, names, reports, options["max_side"], options["quality"], options["subsampling"], source
    )
    if splits[0] == "train":  # with the source's SOURCE_MODEL_KEYS where dataset=shards's differ (the demo's)
        plain = compose_config("train", ["dataset=shards"])
        command = ["mlcls-train", "dataset=shards", f"dataset.root={out}"]
        for key in SOURCE_MODEL_KEYS:
            value = OmegaConf.select(cfg, key)
            if value != OmegaConf.select(plain, key):
                command.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
        print(f"train with: {' '.join(command)}")
    return 1 if any(report.skipped for report in reports) else 0


def verify(arguments: Sequence[str]) -> int:
    """``mlcls-data verify DIR``: print each problem of the packed folder (or that it is intact); return
    the exit status."""
    if len(arguments) != 1 or "=" in arguments[0]:
        raise ConfigError(
            f"verify takes one folder, the one mlcls-data pack wrote; got {' '.join(arguments)}"
        )
    problems = verify_pack(arguments[0])
    for problem in problems:
        print(problem)
    if not problems:
        print(f"{arguments[0]}: every shard and sidecar is as packed")
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mlcls-data``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="mlcls-data", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command",
        choices=["stats", "pack", "verify", "audit"],
        help="stats: sizes, classes and label statistics; pack: write WebDataset shards; verify DIR: check "
        "every packed file against the manifest; audit: rank the training labels likely wrong",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. dataset=coco dataset.root=/data")
    parser.add_argument(
        "--check", action="store_true", help="decode every image and list the unreadable ones"
    )
    parser.add_argument(
        "--split", choices=["train", "val", "both"], default="both", help="split(s) to describe"
    )
    parser.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 1), help="threads for --check"
    )
    args = parser.parse_intermixed_args(argv)
    splits = ["train", "val"] if args.split == "both" else [args.split]
    try:
        if args.command == "verify":
            return verify(args.overrides)
        if args.command == "pack":
            options, overrides = split_options(args.overrides, PACK_OPTIONS, TEXT_PACK_OPTIONS)
            if not options["out"]:
                raise ConfigError("pack needs out=DIR, the folder of the shards")
            return pack(compose_config("train", overrides), splits, options, sys.stderr.isatty())
        if args.command == "audit":
            options, overrides = split_options(args.overrides, AUDIT_OPTIONS, ("out", "recipe"))
            cfg = compose_config("train", overrides)
            recipe = fold_overrides(cfg, overrides, options["recipe"])
            if recipe is not None:
                print(f"the folds start from weights: {FINETUNE} (recipe=none keeps the config as given)")
                cfg = compose_config("train", recipe)
            audit(cfg, options["folds"], options["seed"], options["out"], options["top"])
            return 0
        cfg = compose_config("train", args.overrides)
        return stats(cfg, splits, args.check, args.workers)
    except (HydraException, *USER_ERRORS) as exc:
        return failure("mlcls-data", error_line(exc))


if __name__ == "__main__":
    sys.exit(main())
