"""Config keys renamed on purpose (README, "Renamed keys"): the table, the one line an old key on the
command line gets (:func:`mlcls.cli.overrides.check_command_line`), and the one upgrade of a stored config
(a checkpoint's, a run's ``config.yaml``) by whoever reads it back. It imports nothing of mlcls.
"""

from __future__ import annotations

import copy
from typing import Any

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

# The head each old flat model key belonged to: a stored config holds every head's keys, the chosen one's
# are kept.
OLD_HEAD_KEYS = {
    "model.drop_rate": "linear",
    "model.num_groups": "mldecoder",
    "model.decoder_embedding": "mldecoder",
    "model.csra_heads": "csra",
    "model.csra_lam": "csra",
}
# Each head's default warm-up in epochs before the head was a config group (configs/sched/cosine.yaml's
# head_warmup_epochs), now configs/model/head/<head>.yaml's warmup_epochs.
OLD_HEAD_WARMUP_EPOCHS = {"linear": 0, "mldecoder": 1, "csra": 0}


def renamed_key_message(key: str) -> str | None:
    """The one line for an old ``key`` given on the command line (or a key inside it, such as
    ``sched.head_warmup_epochs.csra``), or None when ``key`` was not renamed."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        old = ".".join(parts[:end])
        if old in RENAMED_KEYS:
            return f'{old} was renamed to {RENAMED_KEYS[old]} (see README, "Renamed keys")'
    return None


def upgrade_config(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of the plain config ``cfg_dict`` (a stored run's, resolved) with the keys of
    :data:`RENAMED_KEYS` under their new names; a config without old keys comes back equal.

    The flat model keys of a config written before the head was a config group become ``model.head.*`` for
    the chosen head (``model.head`` a name then), the other heads' dropped; the head's ``warmup_epochs`` is
    its old default. ``sched.warmup_epochs`` keeps its resolved value; ``sched.warmup_iters``, in
    iterations, has no value in epochs without the run's data and is dropped with ``head_warmup_epochs``.
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
        warmup = (
            cfg.get("sched", {}).get("head_warmup_epochs") if isinstance(cfg.get("sched"), dict) else None
        )
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
