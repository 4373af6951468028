"""``mlcls-import``: the authors' released ML-Decoder, ASL or CSRA checkpoint as an mlcls checkpoint.

    mlcls-import mldecoder tresnet_l_COCO__448_90_0.pth out=mldecoder_l_coco.pt
    mlcls-import asl Open_ImagesV6_TRresNet_L_448.pth out=asl_oi.pt classes=oi_classes.txt
    mlcls-import csra resnet101_voc07_head1_lam0.1_94.7.pth out=csra_voc.pt
    mlcls-import mldecoder_zsl model-highest.ckpt out=zsl.pt classes=seen925.txt vectors=glove.6B.300d.txt

The file is read as data (:mod:`mlcls.inference.released` maps each format); ``out`` serves every mlcls
command and ``model.init_from``. Options: ``classes=FILE`` (one name a line, in the model's order, read by
:func:`mlcls.text.read_class_list`: needed where the file names none and its class count is unknown),
``image_size=N`` (default: the authors'), ``lam=X`` (CSRA's lambda: default the authors' for their
released files; required for any other) and ``vectors=FILE`` (``mldecoder_zsl``, the zero-shot model
ML-Decoder's ``train_zsl_nus.py`` saves: the word-vector file its queries come from, with ``classes=``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mlcls.cli.errors import user_errors
from mlcls.engine.checkpoint import save_checkpoint
from mlcls.errors import ConfigError, plural, shown
from mlcls.inference.released import FORMATS, import_released
from mlcls.text import read_class_list

USAGE = (
    "mlcls-import {mldecoder,mldecoder_zsl,asl,csra} FILE out=OUT.pt [classes=FILE] [image_size=N] [lam=X] "
    "[vectors=FILE]"
)
OPTIONS = ("out", "classes", "image_size", "lam", "vectors")


def parse_options(pairs: list[str]) -> dict[str, str]:
    """``key=value`` arguments as a dict; :class:`ConfigError` for another form, an unknown key or no out."""
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in OPTIONS or not value:
            raise ConfigError(
                f"unexpected argument {shown(pair)}; expected one of {', '.join(OPTIONS)}=…; usage: {USAGE}"
            )
        options[key] = value
    if "out" not in options:
        raise ConfigError(f"missing out=… (required); usage: {USAGE}")
    return options


def _number(options: dict[str, str], key: str, kind: type) -> Any:
    if key not in options:
        return None
    try:
        value = kind(options[key])
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise ConfigError(f"{key}={shown(options[key])}; expected a positive {kind.__name__}")
    return value


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Convert the file the command line names and write the checkpoint; return a summary of it."""
    parser = argparse.ArgumentParser(prog="mlcls-import", usage=USAGE, description=__doc__.splitlines()[0])
    parser.add_argument("format", choices=sorted(FORMATS), help="the authors' code the file comes from")
    parser.add_argument("file", help="the released checkpoint")
    parser.add_argument(
        "options", nargs="*", help="out=OUT.pt (required), classes=FILE, image_size=N, lam=X, vectors=FILE"
    )
    args = parser.parse_args(argv)
    with user_errors():
        options = parse_options(args.options)
        classes = read_class_list(options["classes"]) if "classes" in options else None
        checkpoint = import_released(
            args.format,
            args.file,
            classes=classes,
            image_size=_number(options, "image_size", int),
            lam=_number(options, "lam", float),
            vectors=options.get("vectors"),
        )
        save_checkpoint(checkpoint, options["out"])
    model = checkpoint["config"]["model"]
    return {
        "path": options["out"],
        "format": args.format,
        "model": model["name"],
        "head": model["head"]["name"],
        "classes": len(checkpoint["classes"]),
        "image_size": checkpoint["preprocess"]["image_size"],
    }


def main(argv: list[str] | None = None) -> None:
    summary = run(argv)
    print(json.dumps(summary))
    print(
        f"mlcls: {summary['path']}: {summary['model']} with a {summary['head']} head, "
        f"{plural(summary['classes'], 'class')}, "
        f"{summary['image_size']} px input in [0, 1]",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
