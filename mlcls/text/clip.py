"""``text=clip``: class embeddings from open_clip's text tower (``text.model``, an open_clip model name such
as ``ViT-B-32``) with the weights of a local checkpoint file (``text.path``), and the optional extra
``pip install 'mlcls[clip]'``.

A class name's phrase is put in ``text.template`` (CLIP's zero-shot prompt) and embedded by
``model.encode_text``. Nothing is downloaded: the model is built from open_clip's own config with no
pretrained weights, the Hub offline, and the weights read by mlcls itself (:func:`load_weights`), never
from an OpenAI TorchScript archive, which is code. The text tower's weights must all be in the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mlcls.errors import ConfigError, first_line, is_integer, listed, printable
from mlcls.models.weights import read_weights
from mlcls.text import offline, phrase, require

# open_clip model names that fetch a config or weights from elsewhere.
REMOTE_SCHEMAS = ("hf-hub:", "local-dir:")
# The keys of a checkpoint a one-line error names before it counts the rest.
MAX_NAMED_KEYS = 5


class ClipEncoder:
    """open_clip's text tower ``model`` with the weights of the file ``path``, run on the CPU in
    :meth:`encode` over ``template`` filled with each class name, ``batch_size`` prompts at a time."""

    def __init__(
        self, path: str | os.PathLike, model: str, template: str = "a photo of a {}", batch_size: int = 256
    ) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ConfigError(f"text.path={path!r}; expected the path of an open_clip checkpoint file")
        if not isinstance(model, str) or not model or model.startswith(REMOTE_SCHEMAS):
            raise ConfigError(
                f"text.model={model!r}; expected an open_clip model name such as ViT-B-32 (open_clip's "
                "list_models(); hf-hub: and local-dir: names are not read)"
            )
        if not isinstance(template, str) or template.count("{}") != 1:
            raise ConfigError(f"text.template={template!r}; expected a prompt holding {{}} once")
        if not is_integer(batch_size) or batch_size < 1:
            raise ConfigError(f"text.batch_size={batch_size!r}; expected a positive integer")
        self.path, self.model, self.template, self.batch_size = Path(path), model, template, batch_size
        self.source = f"clip({model}, {os.path.abspath(self.path)}, template={template!r})"

    def encode(self, names: list[str]) -> torch.Tensor:
        """float32 (C, D): ``encode_text`` of each name's prompt (before normalisation)."""
        library = require("open_clip", "clip", "clip")
        with offline():
            if library.get_model_config(self.model) is None:
                raise ConfigError(
                    f"text.model={self.model!r} is not an open_clip model; expected one of open_clip's "
                    "list_models(), e.g. ViT-B-32"
                )
            state = load_weights(self.path)
            try:
                model = library.create_model(
                    self.model, pretrained=None, pretrained_image=False, pretrained_text=False, device="cpu"
                )
                tokenizer = library.get_tokenizer(self.model)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ConfigError(
                    f"text.model={self.model!r} cannot be built offline ({first_line(exc)})"
                ) from None
        where = printable(str(self.path))
        try:
            result = model.load_state_dict(state, strict=False)
        except RuntimeError as exc:
            raise ConfigError(
                f"text.path {where} does not fit text.model={self.model!r} ({first_line(exc)})"
            ) from None
        # every parameter and buffer of the text tower (all but ``visual.``), no key the model lacks
        missing = [key for key in result.missing_keys if not key.startswith("visual.")]
        for keys, what in ((missing, "lacks"), (result.unexpected_keys, "has keys the model lacks:")):
            if keys:
                raise ConfigError(
                    f"text.path {where} {what} {listed(keys, MAX_NAMED_KEYS)}; expected the "
                    f"weights of the open_clip model {self.model!r}"
                )
        prompts = [self.template.replace("{}", phrase(name)) for name in names]
        model.eval()
        with torch.inference_mode():
            rows = [
                model.encode_text(tokenizer(prompts[start : start + self.batch_size])).float()
                for start in range(0, len(prompts), self.batch_size)
            ]
        return torch.cat(rows)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of the checkpoint file ``path``, read as data by
    :func:`mlcls.models.weights.read_weights` (a ``.safetensors`` file, or a ``torch.save`` file with
    ``weights_only=True``; a ``{"state_dict": ...}`` wrapper and DDP's ``module.`` prefix removed); anything
    else is one line."""
    return read_weights(path, "text.path", "an open_clip checkpoint file", "CLIP checkpoint", ("state_dict",))
