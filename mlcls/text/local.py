"""What the text sources that load a model (``text=sentence``, ``text=clip``) share: the optional package
they need, imported with a one-line error naming the extra, and the Hugging Face Hub held offline while a
model loads, so a name that is not a local file never turns into a download."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

from mlcls.errors import ConfigError

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
