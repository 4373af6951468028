"""The one layout number of the files mlcls reads again (checkpoints, packs' ``manifest.json``), the one
function that upgrades what it read, and the config keys renamed on purpose. A change a reader must know of
raises :data:`FORMAT` by one and adds its step to :func:`upgrade`:

* 1: checkpoints with the configs' old key names (:data:`RENAMED_KEYS`); packs with a dense label row per
  sample (never read: pack again).
* 2: configs' new key names; packs' sparse label rows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from mlcls.config_tree import nested_get
from mlcls.errors import is_integer

FORMAT = 2
KINDS = ("checkpoint", "pack")


def upgrade(
    document: dict[str, Any], kind: str, where: str, error: Callable[[str], Exception]
) -> dict[str, Any]:
    """``document`` (a checkpoint or a pack's manifest, read from ``where``) upgraded in place to
    :data:`FORMAT`; ``error(message)`` for a format outside [1, FORMAT] or a pack of format 1."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {', '.join(KINDS)}")
    stored = document.get("format", 1)
    if not is_integer(stored) or not 1 <= stored <= FORMAT:
        raise error(
            f"{where} is of {kind} format {repr(stored)[:40]}; this mlcls reads formats 1 to {FORMAT} "
            "(a newer mlcls wrote it: upgrade mlcls)"
        )
    if kind == "pack" and stored < 2:
        raise error(
            f"{where} is of pack format {stored}, this mlcls reads format {FORMAT}; pack the dataset again"
        )
    if kind == "checkpoint" and isinstance(document.get("config"), dict):
        document["config"] = upgrade_config(document["config"])
    document["format"] = FORMAT
    return document


# Old dotted key -> new dotted key. A plain literal: each rename adds its line here and one in the README.
RENAMED_KEYS: dict[str, str] = {
    "model.drop_rate": "model.head.drop_rate",
    "model.num_groups": "model.head.num_groups",
    "model.decoder_embedding": "model.head.embed_dim",
    "model.csra_heads": "model.head.num_heads",
    "model.csra_lam": "model.head.lam",
    "sched.head_warmup_epochs": "model.head.warmup_epochs",
    "sched.warmup_iters": "sched.warmup_epochs",
    "dataset.holdout": "dataset.val_by",
}

# The head each old flat model key belonged to (a stored config holds every head's; the chosen one's stay).
OLD_HEAD_KEYS = {
    "model.drop_rate": "linear",
    "model.num_groups": "mldecoder",
    "model.decoder_embedding": "mldecoder",
    "model.csra_heads": "csra",
    "model.csra_lam": "csra",
}
# Each head's warm-up in epochs when configs/sched/cosine.yaml's head_warmup_epochs held it.
OLD_HEAD_WARMUP_EPOCHS = {"linear": 0, "mldecoder": 1, "csra": 0}


def renamed_key_message(key: str) -> str | None:
    """The one line for an old ``key`` (or a key inside one) on the command line; None if not renamed."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        old = ".".join(parts[:end])
        if old in RENAMED_KEYS:
            return f'{old} was renamed to {RENAMED_KEYS[old]} (see README, "Renamed keys")'
    return None


def upgrade_config(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of the stored, resolved config ``cfg_dict`` with :data:`RENAMED_KEYS` under their new names.

    The flat model keys become ``model.head.*`` of the chosen head (the others' dropped), with its old
    ``warmup_epochs``; ``sched.warmup_iters`` has no value in epochs without the run's data and is dropped.
    """
    cfg = copy.deepcopy(cfg_dict)
    model = cfg.get("model")
    if isinstance(model, dict) and isinstance(model.get("head", "linear"), str):
        name = model.get("head", "linear")
        head: dict[str, Any] = {"name": name}
        for old, owner in OLD_HEAD_KEYS.items():
            leaf = old.rpartition(".")[2]
            if leaf in model:
                value = model.pop(leaf)
                if owner == name:
                    head[RENAMED_KEYS[old].rpartition(".")[2]] = value
        warmup = nested_get(cfg, "sched", "head_warmup_epochs")
        table = warmup if isinstance(warmup, dict) else OLD_HEAD_WARMUP_EPOCHS
        head["warmup_epochs"] = table.get(name, OLD_HEAD_WARMUP_EPOCHS.get(name, 0))
        model["head"] = head
    sched = cfg.get("sched")
    if isinstance(sched, dict):
        sched.pop("head_warmup_epochs", None)
        sched.pop("warmup_iters", None)
    dataset = cfg.get("dataset")
    if isinstance(dataset, dict) and "holdout" in dataset and "val_by" not in dataset:
        dataset["val_by"] = dataset.pop("holdout")  # the CSV dataset's validation split
    return cfg
