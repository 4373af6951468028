"""Class embeddings from the class names: the queries of the text-query heads (``model/head=mldecoder_zsl``
and ``model/head=cosine``, :mod:`mlcls.models.heads.text_query`).

The ``text`` config group (configs/text/) names an *encoder* (:class:`TextEncoder`); ``vectors``,
``sentence`` and ``clip`` read a local file or model in ``encode``, not when built, so that a cached class
list costs no read.

:func:`offline` sets ``huggingface_hub.constants.HF_HUB_OFFLINE`` for the duration of a load: the library
reads its ``HF_HUB_OFFLINE`` variable once, at import, and has no public switch (``is_offline_mode`` only
reads it), and timm needs the Hub outside the block.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate

from mlcls.errors import ConfigError, shown
from mlcls.io import FileTooLargeError, read_text

# Class names given by a user come from someone else: every bound holds before they are used. The most
# classes a list may name: OpenImages has ~20,000 trainable classes, RAM++'s open vocabulary ~4,600 tags;
# each class costs one embedding row (D floats) and one logit per image.
MAX_CLASSES = 100_000
# The longest class name, in characters: a name is a few words (a sentence with a prompt at most); a text
# encoder's cost grows with it.
MAX_NAME_CHARS = 1000


def check_class_names(names: Sequence[str]) -> list[str]:
    """``names`` as a list, checked: 1 to :data:`MAX_CLASSES` names, each a string of 1 to
    :data:`MAX_NAME_CHARS` characters with no control or other unprintable character and no leading or
    trailing space, none twice. A one-line :class:`ConfigError` names the first fault."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ConfigError(f"class names {shown(names)}; expected a list of strings")
    if not 1 <= len(names) <= MAX_CLASSES:
        raise ConfigError(f"{len(names)} class names; expected 1 to {MAX_CLASSES:,}")
    seen: set[str] = set()
    for index, name in enumerate(names):
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise ConfigError(
                f"class name #{index + 1} {shown(name)}; expected a string of 1 to {MAX_NAME_CHARS} "
                "characters"
            )
        if not name.isprintable() or name != name.strip():
            raise ConfigError(
                f"class name #{index + 1} {shown(name)} holds a control character or surrounding space; "
                "expected printable text"
            )
        if name in seen:
            raise ConfigError(f"class name #{index + 1} {shown(name)} is named twice; expected each once")
        seen.add(name)
    return list(names)


def read_class_list(path: str | Path) -> list[str]:
    """The class names of file ``path`` (UTF-8, at most ``CAPS["class list"]`` bytes), one a line (surrounding
    spaces and blank lines skipped; reading stops at the first over :data:`MAX_CLASSES`), checked."""
    try:
        text = read_text(path, "class list")
    except (OSError, UnicodeDecodeError, FileTooLargeError) as exc:
        raise ConfigError(f"class list {path}: cannot be read ({exc})") from None
    names: list[str] = []
    for line in io.StringIO(text, newline="\n"):
        name = line.strip("\n").strip(" \t\r")
        if not name:
            continue
        if len(names) == MAX_CLASSES:
            raise ConfigError(
                f"class list {path} names more than {MAX_CLASSES:,} classes; expected at most that"
            )
        names.append(name)
    if not names:
        raise ConfigError(f"class list {path} names no class; expected one name a line")
    try:
        return check_class_names(names)
    except ConfigError as exc:
        raise ConfigError(f"class list {path}: {exc}") from None


def parse_classes(value: str | Sequence[str]) -> list[str]:
    """The classes a command line names with ``classes=``: a list as it is; a string naming an existing file
    read as a class list (:func:`read_class_list`); any other string split on commas (``a,b,c``)."""
    if not isinstance(value, str):
        return check_class_names([str(name) for name in value])
    if os.path.exists(value):
        return read_class_list(value)
    return check_class_names([name.strip() for name in value.split(",")])


# Class lists whose embeddings stay in memory, least recently used dropped first: a run embeds one or two
# lists (training, prediction), so a handful bounds the cache at a handful of (C, D) tensors.
CACHE_SIZE = 8
# The widest embedding accepted from an encoder: CLIP's text towers give 512 to 1024, sentence models 384
# to 1024, word vectors 300; (MAX_CLASSES, MAX_DIM) float32 is 1.6 GB, the most one class list can cost.
MAX_DIM = 4096
# The rows normalised at a time: (256, MAX_DIM) float64 is 8 MB, whatever the number of classes.
NORMALISED_ROWS = 256

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
    unit L2 norm, row ``c`` for ``names[c]``; cached by (``source``, names), :data:`CACHE_SIZE` lists at
    most, each call getting its own copy. What the encoder returns is checked: one row per name, at most
    :data:`MAX_DIM` wide, finite, no row of zero norm; a one-line :class:`ConfigError` otherwise.

    Memory past the encoder's rows: the cached (C, D) float32 and the caller's copy (8 x D bytes a class),
    and :data:`NORMALISED_ROWS` rows at a time in float64 while they are normalised (:func:`unit_rows`)."""
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
    embeddings = torch.empty(raw.shape, dtype=torch.float32)
    for start in range(0, len(names), NORMALISED_ROWS):
        block = raw[start : start + NORMALISED_ROWS].double()
        if not torch.isfinite(block).all():
            row = start + int((~torch.isfinite(block)).any(1).nonzero()[0])
            raise ConfigError(
                f"text encoder {encoder.source}: class {shown(names[row])} has a non-finite embedding; "
                "expected finite numbers"
            )
        if not block.any(1).all():
            row = start + int((~block.any(1)).nonzero()[0])
            raise ConfigError(
                f"text encoder {encoder.source}: class {shown(names[row])} has an all-zero embedding; "
                "expected a direction to compare images with"
            )
        embeddings[start : start + NORMALISED_ROWS] = unit_rows(block)
    _cache[key] = embeddings
    while len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return embeddings.clone()


def unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """float64 ``rows`` (finite, none all zero) divided by their L2 norms. Each row is first divided by its
    largest magnitude (exact to half an ulp), so that its squares neither overflow (a value of 1e300) nor
    all underflow (1e-310): the norm of a finite non-zero row is always finite and positive."""
    scaled = rows / rows.abs().amax(dim=1, keepdim=True)
    return scaled / torch.linalg.vector_norm(scaled, dim=1, keepdim=True)


# The longest stored text source, in characters (a kind, a path, a model name).
MAX_SOURCE_CHARS = 4096


def encoder_from_stored(record: Any) -> TextEncoder:
    """The encoder of a checkpoint's ``text`` record (``{"source": ..., "config": ...}``), data from someone
    else: its ``_target_`` must be a class of :mod:`mlcls.text` (no other callable is ever reached from a
    file), its options plain values, and the encoder built must name the stored ``source``; a one-line
    :class:`ConfigError` otherwise."""
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


# The variables that hold the Hugging Face Hub offline while sentence or clip loads a model (a name that is
# not a local file never turns into a download).
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
    """The Hugging Face Hub offline inside the block (its variables, and huggingface_hub's flag read once at
    import); both restored after, since timm's pretrained weights come from the Hub."""
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
