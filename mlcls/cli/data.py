"""``mlcls-data``: inspect a dataset as mlcls will load it.

    mlcls-data stats dataset=coco dataset.root=/data/coco            # sizes, classes, label statistics
    mlcls-data stats dataset=vaw dataset.root=/data/vaw --check      # also decode every image
    mlcls-data stats dataset=csv dataset.root=/data/mine --split val

Overrides are those of ``mlcls-train`` (the same Hydra config). Exit status: 0, 1 when ``--check`` found
unreadable images, 2 for a configuration or layout mistake (printed as one line).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence

from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from mlcls.cli.errors import one_line, plural
from mlcls.cli.overrides import compose_config
from mlcls.data import DatasetError, MultiLabelDataset, build_dataset
from mlcls.data.stats import find_unreadable, label_stats
from mlcls.engine.validate import ConfigError

TOP_CLASSES = 5


def describe(dataset: MultiLabelDataset, title: str) -> None:
    """Print the size and label statistics of one split."""
    stats = label_stats(dataset.labels)
    print(f"\n{title}: {plural(stats.num_samples, 'sample')}")
    print(f"  positive labels per sample: {stats.positives_per_sample:.2f}")
    print(f"  unknown labels (-1): {100 * stats.unknown_share:.2f}% of the {dataset.labels.numel()} entries")
    for name, most in (("most frequent", True), ("least frequent", False)):
        ranked = stats.ranked(dataset.classes, TOP_CLASSES, most)
        print(f"  {name}: {', '.join(f'{cls} {count}' for cls, count in ranked)}")


def check(dataset: MultiLabelDataset, workers: int) -> int:
    """Decode every image of ``dataset``, print the unreadable ones; return their number."""
    checked, unreadable = find_unreadable(dataset, workers)
    print(f"  images checked: {checked}, unreadable: {len(unreadable)}")
    for path, error in unreadable:
        print(f"    {path}: {error}")
    return len(unreadable)


def stats(cfg: DictConfig, splits: Sequence[str], check_images: bool, workers: int) -> int:
    """Print the classes and the statistics of ``splits`` ("train" / "val"); return the exit status."""
    print(f"dataset {cfg.dataset.get('name', '?')} (root: {cfg.dataset.get('root', '-')})")
    unreadable = 0
    for i, split in enumerate(splits):
        dataset = build_dataset(cfg.dataset, train=split == "train")
        if i == 0:
            names = textwrap.fill(
                ", ".join(dataset.classes), width=100, initial_indent="  ", subsequent_indent="  "
            )
            print(f"classes ({len(dataset.classes)}), in label order:\n{names}")
        describe(dataset, f"{split} split ({cfg.dataset.get(f'{split}_split', split)})")
        if check_images:
            unreadable += check(dataset, workers)
    return 1 if unreadable else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mlcls-data``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="mlcls-data", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["stats"], help="stats: sizes, classes and label statistics")
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
        cfg = compose_config("train", args.overrides)
        return stats(cfg, splits, args.check, args.workers)
    except (DatasetError, ConfigError, HydraException, OmegaConfBaseException) as exc:
        print(f"mlcls-data: error: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
