"""``mlcls-predict``: labels and scores of new images from a checkpoint, as a table and as JSON lines.

mlcls-predict checkpoint=outputs/run/checkpoints/best.pt images=photos/
mlcls-predict checkpoint=best.pt images='photos/**/*.jpg' top_k=3 out=predictions.jsonl
mlcls-predict checkpoint=best.pt images=photos/ classes=red_circle,blue_star    (a text-query head's)
mlcls-predict checkpoint=tagger.pt images=photos/ format=captions    (photos/0001.txt beside 0001.jpg)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from mlcls import config_dir
from mlcls.cli.errors import require_keys, user_errors
from mlcls.cli.overrides import run_command
from mlcls.errors import InferenceError, is_integer, is_number, plural, printable, shown
from mlcls.inference.captions import check_caption_options, check_tags, write_captions
from mlcls.inference.predictor import (
    Prediction,
    find_images,
    format_table,
    load_inference_model,
    predict_images,
    use_classes,
)
from mlcls.io import atomic_write_bytes
from mlcls.metrics.thresholds import describe_rule
from mlcls.text import parse_classes

USAGE = "mlcls-predict checkpoint=<run>/checkpoints/best.pt images=<file | folder | 'glob/*.jpg'>"
FORMATS = ("table", "captions")  # format=: print a table, or write caption files beside the images


def run(cfg: DictConfig) -> tuple[list[Prediction], list[tuple[Path, str]], str]:
    """Predict ``cfg.images`` with ``cfg.checkpoint``: the predictions, the unreadable files, the rule."""
    require_keys(cfg, USAGE)
    threshold, top_k = cfg.threshold, cfg.top_k
    if threshold is not None and (not is_number(threshold) or not 0 <= threshold <= 1):
        raise InferenceError(f"threshold={threshold!r}; expected a probability in [0, 1]")
    if top_k is not None and (not is_integer(top_k) or top_k < 1):
        raise InferenceError(f"top_k={top_k!r}; expected a positive integer")
    if cfg.format not in FORMATS:
        raise InferenceError(f"format={shown(cfg.format)}; expected one of {', '.join(FORMATS)}")
    if cfg.format == "captions":
        check_caption_options(cfg.caption_ext, cfg.overwrite, cfg.append)
    names = None
    if cfg.get("classes") is not None:  # read before any image or checkpoint: a bad list fails at once
        given = cfg.classes
        names = parse_classes(OmegaConf.to_container(given) if OmegaConf.is_list(given) else str(given))
    sources = OmegaConf.to_container(cfg.images) if OmegaConf.is_list(cfg.images) else str(cfg.images)
    paths = find_images(sources)
    if not paths:
        raise InferenceError(f"no image matched images={sources}; give a file, a folder or a quoted glob")
    inference = load_inference_model(cfg.checkpoint, cfg.device, trust=cfg.trust_checkpoint)
    if names is not None:
        use_classes(inference, names)
    if cfg.format == "captions":  # before any image is read: a tag a caption file cannot hold
        check_tags(inference.classes, cfg.tag_separator)
    predictions, unreadable = predict_images(
        inference, paths, cfg.batch_size, cfg.workers, threshold=cfg.threshold, top_k=cfg.top_k
    )
    if not predictions:
        raise InferenceError(
            f"none of the {plural(len(paths), 'matched file')} is a readable image, e.g. {paths[0]}"
        )
    rule = describe_rule(
        inference.thresholds, cfg.threshold, cfg.top_k, inference.classes, inference.thresholds_split
    )
    return predictions, unreadable, rule


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="predict")
def _hydra_main(cfg: DictConfig) -> None:
    with user_errors():
        predictions, unreadable, rule = run(cfg)
    for path, reason in unreadable:
        print(f"mlcls: warning: skipped unreadable image {printable(f'{path} ({reason})')}", file=sys.stderr)
    if cfg.out:
        text = "".join(json.dumps(p.to_json()) + "\n" for p in predictions)
        with user_errors():  # a full disk
            atomic_write_bytes(Path(cfg.out), text.encode())
    written = None
    if cfg.format == "captions":
        with user_errors():
            written = write_captions(
                predictions, cfg.caption_ext, cfg.tag_separator, cfg.overwrite, cfg.append
            )
    elif not cfg.quiet:
        print(format_table(predictions))
    summary = f"mlcls: {plural(len(predictions), 'image')} labelled by {printable(rule)}"
    if written is not None:
        summary += f"; {written.describe()}"
    if unreadable:
        summary += f"; {len(unreadable)} unreadable skipped"
    if cfg.out:
        summary += f"; JSON lines in {cfg.out}"
    print(summary, file=sys.stderr)


def quote_class_list(argv: list[str]) -> list[str]:
    """``classes=a,b,c`` quoted as one string for Hydra (unquoted it is a sweep, refused in a single run)."""
    quoted = []
    for arg in argv:
        key, equals, value = arg.partition("=")
        if key == "classes" and equals and value[:1] not in ("'", '"', "[") and "," in value:
            arg = "classes='" + value.replace("'", "\\'") + "'"  # Hydra escapes quotes alone
        quoted.append(arg)
    return quoted


def main() -> None:
    sys.argv[1:] = quote_class_list(sys.argv[1:])
    run_command("predict", _hydra_main)


if __name__ == "__main__":
    sys.exit(main())
