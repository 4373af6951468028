"""``text=sentence``: class embeddings from a local sentence-transformers model folder (``text.path``),
with the optional extra ``pip install 'mlcls[sentence]'``.

The folder is someone else's files, so before the library sees it (:func:`check_model_folder`):

* it must be a local folder: a Hub name is refused, never downloaded, and the model loads with the Hub
  offline (:func:`mlcls.text.offline`, ``local_files_only``);
* no code of the folder runs: ``trust_remote_code=False``, every module ``modules.json`` names must be one
  of sentence-transformers' own module classes (``sentence_transformers.*``, resolved as the library
  resolves it: a subclass of its ``Module``, :func:`check_module_classes`), and pickle files
  (``pytorch_model.bin``, ``*.pt``, ...: unpickling can run code) are refused, safetensors weights required;
* it is walked with its links followed (:func:`model_files`): a link (to a file or a folder) whose target
  is outside the folder is refused, so is a link to a folder holding it (a loop); every file reached is a
  regular file (a pipe would block the loader); :data:`MAX_FOLDER_ENTRIES` files and folders at most,
  :data:`MAX_FOLDER_DEPTH` folders deep at most, ``CAPS["checkpoint"]`` bytes in all.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from mlcls.errors import ConfigError, first_line, is_integer, printable, shown
from mlcls.io import CAPS, read_json
from mlcls.text import offline, phrase, require

# Weight files that are pickles: loading one can run code.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib"})
# The most files and folders a model folder may hold: a model with its tokenizer and a few modules holds 10
# to 30, a Hub snapshot with ONNX and OpenVINO exports about 50.
MAX_FOLDER_ENTRIES = 1000
# The most folders a model folder may nest, one in another: its modules' folders are one level down
# (``1_Pooling``, ``2_Dense``), its exports one or two (``onnx/``, ``openvino/``).
MAX_FOLDER_DEPTH = 16


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
        check_module_classes(folder, library)
        with offline():
            try:
                model = library.SentenceTransformer(
                    str(folder),
                    device="cpu",
                    local_files_only=True,
                    trust_remote_code=False,
                    model_kwargs={"use_safetensors": True},
                )
            except (
                OSError,
                ValueError,
                KeyError,
                TypeError,
                RuntimeError,
                AttributeError,
                ImportError,
            ) as exc:
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
    """``path`` if its files may be handed to the library (the module's rules, but for the classes
    ``modules.json`` names: :func:`check_module_classes`), else a one-line :class:`ConfigError`."""
    where = printable(str(path))
    if not path.is_dir():
        raise ConfigError(
            f"text.path {where} is not a local folder; expected a sentence-transformers model folder on this "
            "machine (nothing is downloaded)"
        )
    total, weights = 0, 0
    for name, size in model_files(path):
        if Path(name).suffix.lower() in PICKLE_SUFFIXES:
            raise ConfigError(
                f"text.path {where} holds the pickle file {shown(name)} (loading a pickle can run code); "
                "expected safetensors weights only: remove or convert it"
            )
        weights += name.endswith(".safetensors")
        total += size
    if total > CAPS["checkpoint"]:
        raise ConfigError(f"text.path {where} holds {total / 2**30:.1f} GiB; expected a model folder")
    if not weights:
        raise ConfigError(
            f"text.path {where} holds no .safetensors file; expected the model's weights in one"
        )
    for module in read_modules(path):
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


def model_files(path: Path) -> Iterator[tuple[str, int]]:
    """Each file under the folder ``path``, walked with links followed, as (its path relative to ``path``,
    its size); a one-line :class:`ConfigError` at the first entry that is not a regular file or a folder,
    a link leaving ``path``, a link to a folder holding it (a loop), a folder over :data:`MAX_FOLDER_DEPTH`
    deep or that cannot be listed, or past :data:`MAX_FOLDER_ENTRIES` entries. The walk keeps a stack of
    folders (a recursion would end in a traceback a thousand folders deep)."""
    where, inside, top = printable(str(path)), os.path.realpath(path), os.stat(path)
    stack = [(str(path), ((top.st_dev, top.st_ino),))]  # a folder and the folders holding it, itself last
    count = 0
    while stack:
        folder, holders = stack.pop()
        for entry in _entries(folder, path):
            count += 1
            if count > MAX_FOLDER_ENTRIES:
                raise ConfigError(
                    f"text.path {where} holds over {MAX_FOLDER_ENTRIES} files and folders; expected a model "
                    "folder"
                )
            name = os.path.relpath(entry.path, path)
            info = _followed(entry, inside, f"text.path {where}: {shown(name)}")
            if not stat.S_ISDIR(info.st_mode):
                yield name, info.st_size
            elif (info.st_dev, info.st_ino) in holders:
                raise ConfigError(
                    f"text.path {where}: {shown(name)} links to a folder holding it (a loop); expected a "
                    "model folder"
                )
            elif len(holders) > MAX_FOLDER_DEPTH:
                raise ConfigError(
                    f"text.path {where}: {shown(name)} is over {MAX_FOLDER_DEPTH} folders deep; expected a "
                    "model folder"
                )
            else:
                stack.append((entry.path, (*holders, (info.st_dev, info.st_ino))))


def _entries(folder: str, path: Path) -> Iterator[os.DirEntry]:
    """The entries of ``folder`` (under the model folder ``path``); one line if it cannot be listed."""
    try:
        with os.scandir(folder) as entries:
            yield from entries
    except OSError as exc:
        raise ConfigError(
            f"text.path {printable(str(path))}: cannot list {shown(os.path.relpath(folder, path))} "
            f"({exc.strerror}); expected a readable model folder"
        ) from None


def _followed(entry: os.DirEntry, inside: str, what: str) -> os.stat_result:
    """The status of ``entry`` after its links (what the loader would open): a folder or a regular file
    under the real path ``inside``, else a one-line :class:`ConfigError` starting with ``what``."""
    if entry.is_symlink():
        target = os.path.realpath(entry.path)
        if os.path.commonpath([inside, target]) != inside:
            raise ConfigError(
                f"{what} links to {shown(target)}, outside the folder; expected the model's files inside it "
                "(copy them in with cp -rL)"
            )
    try:
        info = os.stat(entry.path)
    except OSError:
        info = None
    if info is None or not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
        raise ConfigError(f"{what} is not a regular file; expected model files")
    return info


def read_modules(path: Path) -> list[dict]:
    """The modules the folder ``path``'s ``modules.json`` lists (none without one): a list of objects, else
    a one-line :class:`ConfigError`."""
    if not (path / "modules.json").exists():
        return []
    modules = read_json(path / "modules.json", "config")
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise ConfigError(
            f"text.path {printable(str(path))}: modules.json is not a list of modules; expected one"
        )
    return modules


def check_module_classes(path: Path, library: ModuleType) -> None:
    """Each class the folder ``path``'s ``modules.json`` names, resolved as sentence-transformers resolves
    it (``import_from_string``), must be a subclass of the library's own ``Module`` (its Transformer,
    Pooling, Normalize, Dense, ...): a function or any other class of the library is a one-line
    :class:`ConfigError`, not a traceback from inside the library."""
    base = library.base.modules.Module
    for module in read_modules(path):
        kind = module["type"]  # a sentence_transformers.* name: check_model_folder
        try:
            named = library.util.import_from_string(kind)
        except Exception:  # noqa: BLE001 - importing a module of the library: whatever it raises
            named = None
        if not (isinstance(named, type) and issubclass(named, base)):
            raise ConfigError(
                f"text.path {printable(str(path))}: modules.json names {shown(kind)}, not a module class of "
                "sentence-transformers; expected one such as "
                "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
            )
