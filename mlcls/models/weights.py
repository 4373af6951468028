"""Weights files read as data: a local file of pretrained weights (``model.checkpoint_path``, text=clip's
``text.path``) and the rule that names its tensors after the network's (``model.checkpoint_names``).

A file is read once, through :func:`mlcls.torchfile.open_checkpoint` (a ``torch.save`` zip archive, checked
and capped before ``torch.load(weights_only=True)``) or as a ``.safetensors`` file read whole under
``CAPS["checkpoint"]``. A file in torch's format from before 1.6 (a bare pickle stream, as some packages on
PyPI ship) is refused with the one line that converts it.

Names (:data:`CHECKPOINT_NAMES`):

* ``timm``: the file's names are timm's for the architecture (timm's own checkpoint conversions apply).
* ``by_order``: the file holds the same architecture under other names (another implementation's),
  with its classifier: its i-th tensor is the i-th of timm's ``state_dict()`` of the model built with its
  pretrained classifier. The counts must be equal and every pair of shapes too; anything else is refused
  in one line naming the first tensor that does not fit, never loaded in part.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path

import timm
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from mlcls.errors import ConfigError, first_line, printable, shown
from mlcls.io import (
    CAPS,
    FileTooLargeError,
    NotRegularFileError,
    UnsafeFileError,
    open_regular,
    read_regular_bytes,
)
from mlcls.torchfile import check_nesting, open_checkpoint

CHECKPOINT_NAMES = ("timm", "by_order")
# The entries of a training checkpoint that hold its weights, timm's order of preference (EMA first).
WRAPPERS = ("state_dict_ema", "model_ema", "state_dict", "model")
# The first bytes of a file torch.save wrote before torch 1.6: a pickle (protocol 2) of its magic number.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
CONVERT = "python -c \"import torch; torch.save(torch.load('{path}', weights_only=True), '{path}.pt')\""


def read_weights(
    path: str | Path,
    key: str,
    expected: str,
    what: str = "weights file",
    wrappers: tuple[str, ...] = WRAPPERS,
) -> dict[str, torch.Tensor]:
    """The state dict in the weights file ``path`` (the config key ``key`` names it, ``what`` it is called
    in a refusal; ``expected`` says what it should be): the first of ``wrappers`` that holds a dict, else the
    file's top level, with DDP's ``module.`` prefix removed. A one-line :class:`ConfigError` for a missing
    or unreadable file or one holding anything but tensors by name; :class:`~mlcls.io.UnsafeFileError` (and
    the other refusals of :func:`~mlcls.torchfile.open_checkpoint`) for a file not as ``torch.save`` writes
    it."""
    path = Path(path).expanduser()
    where = printable(str(path))
    try:
        if path.suffix == ".safetensors":
            state = load_safetensors(read_regular_bytes(path, CAPS["checkpoint"], what))
        else:
            with open_checkpoint(path, what) as file:
                state = torch.load(file, map_location="cpu", weights_only=True)
            check_nesting(state, where)
    except FileNotFoundError:
        raise ConfigError(f"{key}: no file {where}; expected {expected}") from None
    except UnsafeFileError as exc:
        if _is_legacy(path):
            raise UnsafeFileError(
                f"{key} {where} is in torch's format from before 1.6 (a bare pickle stream), which is not "
                f"read; convert a file you trust once with: {CONVERT.format(path=where)}"
            ) from None
        raise exc from None
    except (NotRegularFileError, FileTooLargeError):
        raise
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError, EOFError, SafetensorError) as exc:
        raise ConfigError(
            f"{key} {where} cannot be read as weights ({first_line(exc)}); expected a .safetensors file "
            "or a state dict saved by torch.save (not a TorchScript archive)"
        ) from None
    if isinstance(state, dict):
        state = next((state[name] for name in wrappers if isinstance(state.get(name), dict)), state)
    if (
        not isinstance(state, dict)
        or not state
        or not all(isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in state.items())
    ):
        raise ConfigError(f"{key} {where} holds no state dict; expected tensors by parameter name")
    return {name.removeprefix("module."): value for name, value in state.items()}


def _is_legacy(path: Path) -> bool:
    """Whether ``path``, refused as a checkpoint, starts as torch's format from before 1.6
    (:data:`LEGACY_MAGIC`): looked at through the guarded door again, its first bytes only (the file may
    have been replaced by a pipe since)."""
    try:
        with open_regular(path, max_bytes=CAPS["checkpoint"], what="weights file") as file:
            return file.read(len(LEGACY_MAGIC)) == LEGACY_MAGIC
    except (OSError, NotRegularFileError, FileTooLargeError):
        return False


def pretrained_state(name: str, path: str | Path, names: str = "timm") -> dict[str, torch.Tensor]:
    """The weights of timm model ``name`` in the file ``path`` (``model.checkpoint_path``) under timm's
    names, as ``names`` (``model.checkpoint_names``, :data:`CHECKPOINT_NAMES`) says they are given."""
    if names not in CHECKPOINT_NAMES:
        raise ConfigError(f"model.checkpoint_names={names!r}; expected one of {', '.join(CHECKPOINT_NAMES)}")
    state = read_weights(path, "model.checkpoint_path", f"the weights of {name}")
    if names == "timm":
        return state
    return renamed_by_order(state, template_shapes(name), f"model.checkpoint_path {printable(str(path))}")


def template_shapes(name: str) -> dict[str, torch.Size]:
    """The names and shapes, in ``state_dict()`` order, of timm model ``name`` with its pretrained classifier
    (the class count of its pretrained config, else timm's default), built on the meta device: no memory."""
    cfg = timm.models.get_pretrained_cfg(name)
    classes = {"num_classes": cfg.num_classes} if cfg is not None and cfg.num_classes else {}
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **classes)
    return {key: value.shape for key, value in model.state_dict().items()}


def renamed_by_order(
    state: Mapping[str, torch.Tensor], template: Mapping[str, torch.Size], where: str
) -> dict[str, torch.Tensor]:
    """``state``'s tensors under ``template``'s names, the i-th to the i-th: the counts must be equal and each
    pair of shapes too, else a one-line :class:`ConfigError` (``where`` names the file) naming the first
    tensor that does not fit."""
    if len(state) != len(template):
        raise ConfigError(
            f"model.checkpoint_names=by_order: {where} holds {len(state)} tensors, the model "
            f"{len(template)}; expected the same architecture's tensors, classifier included, in the "
            "model's order"
        )
    renamed = {}
    pairs = zip(state.items(), template.items(), strict=True)
    for index, ((given, tensor), (target, shape)) in enumerate(pairs):
        if tensor.shape != shape:
            raise ConfigError(
                f"model.checkpoint_names=by_order: tensor {index} of {where}, {shown(given)} "
                f"{tuple(tensor.shape)}, does not fit the model's {target} {tuple(shape)}; expected the same "
                "architecture's tensors in the model's order"
            )
        renamed[target] = tensor
    return renamed
