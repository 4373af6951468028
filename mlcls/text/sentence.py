"""``text=sentence``: class embeddings from a local sentence-transformers model folder (``text.path``),
with the optional extra ``pip install 'mlcls[sentence]'``.

The folder is someone else's files, so before the library sees it (:func:`check_model_folder`):

* it must be a local folder: a Hub name is refused, never downloaded, and the model loads with the Hub
  offline (:func:`mlcls.text.offline`, ``local_files_only``);
* no code of the folder runs: ``trust_remote_code=False``, every module ``modules.json`` names must be one
  of sentence-transformers' own (``sentence_transformers.*``), and pickle files (``pytorch_model.bin``,
  ``*.pt``, ...: unpickling can run code) are refused, safetensors weights required;
* every file in it is a regular file (a pipe would block the loader), :data:`MAX_FOLDER_FILES` at most,
  ``CAPS["checkpoint"]`` bytes in all.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch

from mlcls.errors import ConfigError, first_line, is_integer, printable, shown
from mlcls.io import CAPS, read_json
from mlcls.text import offline, phrase, require

# Weight files that are pickles: loading one can run code.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib"})
# The most files a model folder may hold: a model with its tokenizer and a few modules holds 10 to 30,
# a Hub snapshot with ONNX and OpenVINO exports about 50.
MAX_FOLDER_FILES = 1000


class SentenceEncoder:
    """The sentence-transformers model of the local folder ``path``, loaded in :meth:`encode` on the CPU."""

    def __init__(self, path: str | os.PathLike, batch_size: int = 64) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ConfigError(
                f"text.path={path!r}; expected the local folder of a sentence-transformers model"
            )
        if not is_integer(batch_size) or batch_size < 1:
            raise ConfigError(f"text.batch_size={batch_size!r}; expected a positive integer")
        self.path, self.batch_size = Path(path), batch_size
        self.source = f"sentence({os.path.abspath(self.path)})"

    def encode(self, names: list[str]) -> torch.Tensor:
        """float32 (C, D): the model's embedding of each name's phrase (before normalisation)."""
        folder = check_model_folder(self.path)
        library = require("sentence_transformers", "sentence", "sentence")
        with offline():
            try:
                model = library.SentenceTransformer(
                    str(folder),
                    device="cpu",
                    local_files_only=True,
                    trust_remote_code=False,
                    model_kwargs={"use_safetensors": True},
                )
            except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
                raise ConfigError(
                    f"text.path {printable(str(folder))} cannot be loaded as a sentence-transformers model "
                    f"({first_line(exc)})"
                ) from None
            with torch.inference_mode():
                rows = model.encode(
                    [phrase(name) for name in names],
                    batch_size=self.batch_size,
                    convert_to_tensor=True,
                    normalize_embeddings=False,
                    show_progress_bar=False,
                )
        return rows.float().cpu()


def check_model_folder(path: Path) -> Path:
    """``path`` if the library may load it (the module's rules), else a one-line :class:`ConfigError`."""
    where = printable(str(path))
    if not path.is_dir():
        raise ConfigError(
            f"text.path {where} is not a local folder; expected a sentence-transformers model folder on this "
            "machine (nothing is downloaded)"
        )
    total, count, weights = 0, 0, 0
    for root, _, files in os.walk(path):
        for file in files:
            count += 1
            if count > MAX_FOLDER_FILES:
                raise ConfigError(
                    f"text.path {where} holds over {MAX_FOLDER_FILES} files; expected a model folder"
                )
            name = os.path.join(root, file)
            try:
                info = os.stat(name)  # after a link: what the loader would open
            except OSError:
                info = None
            if info is None or not stat.S_ISREG(info.st_mode):
                raise ConfigError(
                    f"text.path {where}: {shown(os.path.relpath(name, path))} is not a regular file; "
                    "expected model files"
                )
            if Path(file).suffix.lower() in PICKLE_SUFFIXES:
                raise ConfigError(
                    f"text.path {where} holds the pickle file {shown(os.path.relpath(name, path))} "
                    "(loading a pickle can run code); expected safetensors weights only: remove or convert it"
                )
            weights += file.endswith(".safetensors")
            total += info.st_size
    if total > CAPS["checkpoint"]:
        raise ConfigError(f"text.path {where} holds {total / 2**30:.1f} GiB; expected a model folder")
    if not weights:
        raise ConfigError(
            f"text.path {where} holds no .safetensors file; expected the model's weights in one"
        )
    if not (path / "modules.json").exists():
        return path
    modules = read_json(path / "modules.json", "config")
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise ConfigError(f"text.path {where}: modules.json is not a list of modules; expected one")
    for module in modules:
        kind, folder = module.get("type"), module.get("path", "")
        if not isinstance(kind, str) or not kind.startswith("sentence_transformers."):
            raise ConfigError(
                f"text.path {where}: modules.json names the module {shown(kind)}; expected one of "
                "sentence-transformers' own (sentence_transformers.*): no code of the folder is run"
            )
        if not isinstance(folder, str) or os.path.isabs(folder) or ".." in Path(folder).parts:
            raise ConfigError(
                f"text.path {where}: modules.json names the folder {shown(folder)}; expected one inside"
            )
    return path
