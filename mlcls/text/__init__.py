"""Class embeddings from the class names: the queries of the text-query heads (``model.head=mldecoder_zsl``
and ``model.head=cosine``, :mod:`mlcls.models.heads.text_query`).

The ``text`` config group (configs/text/) names an *encoder*: any object with ``encode(names: list[str]) ->
Tensor (C, D)`` and a ``source: str`` attribute naming it (its kind, file path and model), built with
``hydra.utils.instantiate(cfg.text)``. ``words`` (:mod:`.words`) needs no file; ``vectors``, ``sentence`` and
``clip`` read a local word-vector file or model. An encoder should load its file in ``encode``, not when it
is built: :func:`class_embeddings` builds it to read its ``source`` even when the embeddings are cached.

Every config has the ``text`` key (train.yaml's defaults: ``text: words``); only a text-query head uses it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate

from mlcls.errors import ConfigError, shown
from mlcls.text.classes import MAX_CLASSES, check_class_names, parse_classes, read_class_list

# Class lists whose embeddings stay in memory, least recently used dropped first: a run embeds one or two
# lists (training, prediction), so a handful bounds the cache at a handful of (C, D) tensors.
CACHE_SIZE = 8
# The widest embedding accepted from an encoder: CLIP's text towers give 512 to 1024, sentence models 384
# to 1024, word vectors 300; (MAX_CLASSES, MAX_DIM) float32 is 1.6 GB, the most one class list can cost.
MAX_DIM = 4096

_cache: OrderedDict[tuple[str, tuple[str, ...]], torch.Tensor] = OrderedDict()


class TextEncoder(Protocol):
    """What a ``text`` config instantiates."""

    source: str  # the encoder's identity: kind, file path, model (the cache key; stored in checkpoints)

    def encode(self, names: list[str]) -> torch.Tensor:
        """One row per name, (C, D); need not be normalised."""
        ...


def build_encoder(text_cfg: Mapping[str, Any] | TextEncoder) -> TextEncoder:
    """The encoder of a ``text`` config (``_target_`` and its options), or ``text_cfg`` itself when it is one
    already; :class:`ConfigError` when it has no ``encode`` or no ``source``."""
    try:
        encoder = text_cfg if hasattr(text_cfg, "encode") else instantiate(text_cfg)
    except InstantiationException as exc:  # Hydra's two-line wrapper: the encoder's own error in one line
        cause = exc.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        reason = str(cause or exc).strip().splitlines()
        raise ConfigError(f"text: cannot build the encoder ({type(cause).__name__}: {reason[-1]})") from None
    source = getattr(encoder, "source", None)
    if not callable(getattr(encoder, "encode", None)) or not isinstance(source, str):
        raise ConfigError(
            f"text: {type(encoder).__name__} is not a text encoder; expected an object with encode(names) "
            "and a source string (configs/text/)"
        )
    return encoder


def class_embeddings(text_cfg: Mapping[str, Any] | TextEncoder, names: Sequence[str]) -> torch.Tensor:
    """The embeddings of class ``names`` from the ``text`` config's encoder: float32 (C, D), each row of
    unit L2 norm, row ``c`` for ``names[c]``.

    Cached in memory by (the encoder's ``source``, the names in order), :data:`CACHE_SIZE` lists at most;
    each call returns its own copy. The names are checked first (:func:`check_class_names`: at most
    :data:`MAX_CLASSES`, no duplicates, no control characters), and what the encoder returns after: one
    row per name, at most :data:`MAX_DIM` wide, finite, no row of zero norm -- a one-line
    :class:`ConfigError` otherwise.
    """
    names = check_class_names(names)
    encoder = build_encoder(text_cfg)
    key = (encoder.source, tuple(names))
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key].clone()
    raw = torch.as_tensor(encoder.encode(list(names)))
    if raw.ndim != 2 or raw.shape[0] != len(names) or not 1 <= raw.shape[1] <= MAX_DIM:
        raise ConfigError(
            f"text encoder {encoder.source} gave embeddings of shape {tuple(raw.shape)} for "
            f"{len(names)} classes; expected ({len(names)}, D) with 1 <= D <= {MAX_DIM}"
        )
    raw = raw.double()
    if not torch.isfinite(raw).all():
        row = int((~torch.isfinite(raw)).any(1).nonzero()[0])
        raise ConfigError(
            f"text encoder {encoder.source}: class {shown(names[row])} has a non-finite embedding"
        )
    norms = raw.norm(dim=1, keepdim=True)
    if (norms == 0).any():
        row = int((norms[:, 0] == 0).nonzero()[0])
        raise ConfigError(
            f"text encoder {encoder.source}: class {shown(names[row])} has an all-zero embedding; expected "
            "a direction to compare images with"
        )
    embeddings = (raw / norms).float()
    _cache[key] = embeddings
    while len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return embeddings.clone()


# The longest stored text source, in characters (a kind, a path, a model name).
MAX_SOURCE_CHARS = 4096


def encoder_from_stored(record: Any) -> TextEncoder:
    """The encoder of a checkpoint's ``text`` record (``{"source": ..., "config": ...}``, written by
    :func:`mlcls.engine.checkpoint.text_record`), which is data from someone else: its ``_target_`` must
    be a class defined in a module of :mod:`mlcls.text` (no other callable is ever reached from a file),
    its options plain values (no nested ``_target_``, no ``_args_`` or ``_partial_``), and the encoder
    built must name the stored ``source``. A one-line :class:`ConfigError` otherwise."""
    if not isinstance(record, Mapping) or not isinstance(record.get("config"), Mapping):
        raise ConfigError(
            f"the text record is {shown(record)}; expected {{'source': ..., 'config': {{...}}}}"
        )
    stored = record.get("source")
    if not isinstance(stored, str) or not 0 < len(stored) <= MAX_SOURCE_CHARS:
        raise ConfigError(f"the text source is {shown(stored)}; expected its name (a string)")
    config = dict(record["config"])
    target = config.get("_target_")
    odd = next(
        (key for key in config if key != "_target_" and (not isinstance(key, str) or key[:1] == "_")), None
    )
    if odd is not None:
        raise ConfigError(f"the text config has the key {shown(odd)}; expected _target_ and plain options")
    values = [x for v in config.values() for x in (v if isinstance(v, list) else [v])]
    if not all(isinstance(x, (str, int, float, bool, type(None))) and "${" not in str(x) for x in values):
        raise ConfigError(
            "the text config holds a nested value or an interpolation; expected plain options (strings, "
            "numbers, lists of them)"
        )
    try:
        cls = get_class(target) if isinstance(target, str) and target.startswith("mlcls.text.") else None
    except Exception:  # hydra's locate: import errors, a missing attribute
        cls = None
    if cls is None or not cls.__module__.startswith("mlcls.text.") or not hasattr(cls, "encode"):
        raise ConfigError(
            f"the text config's _target_ is {shown(target)}; expected a text encoder of mlcls.text"
        )
    encoder = build_encoder(config)
    if encoder.source != stored:
        raise ConfigError(
            f"the stored text config builds the encoder {shown(encoder.source)}, not the stored source "
            f"{shown(stored)}; the class embeddings would not match the trained head"
        )
    return encoder


# What the encoders that load a model (``text=sentence``, ``text=clip``) share: the optional package they
# need, imported with a one-line error naming the extra, and the Hugging Face Hub held offline while a
# model loads, so a name that is not a local file never turns into a download.
# The environment variables that put huggingface_hub, transformers and datasets offline.
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def require(module: str, extra: str, source: str) -> ModuleType:
    """``import module``, or a one-line :class:`ConfigError` saying which extra of mlcls installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"text={source} needs the package {module} ({exc}); expected it installed: "
            f"pip install 'mlcls[{extra}]'"
        ) from None


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """The Hugging Face Hub offline inside the block: its variables set to 1, and huggingface_hub's
    ``HF_HUB_OFFLINE`` flag (read once when it is imported, then on every request) set too; both restored
    after, since timm's pretrained weights (``model.pretrained=true``) come from the Hub."""
    saved = {name: os.environ.get(name) for name in OFFLINE_VARIABLES}
    os.environ.update(dict.fromkeys(OFFLINE_VARIABLES, "1"))
    try:
        constants = importlib.import_module("huggingface_hub.constants")
    except ImportError:
        constants = None
    flag = getattr(constants, "HF_HUB_OFFLINE", None)
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if constants is not None:
            constants.HF_HUB_OFFLINE = flag


def phrase(name: str) -> str:
    """The text a language model reads for class ``name``: its underscores as spaces (``traffic_light`` ->
    ``traffic light``), as zero-shot CLIP writes class names; hyphens stay (``t-shirt``)."""
    return " ".join(name.replace("_", " ").split())


__all__ = [
    "CACHE_SIZE",
    "MAX_CLASSES",
    "MAX_DIM",
    "TextEncoder",
    "build_encoder",
    "check_class_names",
    "class_embeddings",
    "encoder_from_stored",
    "parse_classes",
    "read_class_list",
]
