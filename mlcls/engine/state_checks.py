"""Checks of a resumed checkpoint's state against the live objects, before any ``load_state_dict``.

Plain data can still hold a state no run wrote: an optimizer moment of one element for a 3 x 3 weight (a
fused kernel then writes out of bounds), infinite values, a negative epoch. The first mismatch is one
:class:`CheckpointError` line; only the optimizer's probe allocates, and a moment laid out otherwise than its
weight (a channels_last run resumed without it, or crafted: a fused kernel would read it in the weight's
order) is copied into the weight's layout.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import nn

from mlcls.engine.checkpoint import CheckpointError, EpochProgress
from mlcls.engine.ema import ModelEma
from mlcls.errors import first_line, is_integer, is_number

COUNT_MAX = 2**62  # a counter no run reaches: epochs, steps, images, seconds when no tighter bound is known
RANKS_MAX = 2**16  # processes a checkpoint may have been written by
SCHEDULER_COUNTERS = ("last_epoch", "_step_count")  # torch LRScheduler's iteration counters
SCALER_COUNTERS = ("_growth_tracker",)  # GradScaler's finite steps since the last growth
GROUP_MEMBERS = frozenset({"params", "name", "param_names"})  # a param group's keys that are no setting
SQUARED_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq"})  # Adam's second moments: square roots taken


@dataclass(frozen=True)
class RunBounds:
    """What this run allows a resumed state to hold (None: unbounded but for :data:`COUNT_MAX`)."""

    epochs: int | None = None
    iters_per_epoch: int | None = None
    num_classes: int | None = None

    @property
    def total_iters(self) -> int:
        if self.epochs is None or self.iters_per_epoch is None:
            return COUNT_MAX
        return self.epochs * self.iters_per_epoch


def describe(value: Any) -> str:
    """A short account of ``value`` for an error line (a tensor's dtype and shape, a number's value)."""
    if isinstance(value, torch.Tensor):
        where = " on the meta device (no values)" if value.is_meta else ""
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}{where}"
    if is_integer(value) and abs(value) >= 10**15:
        return f"{'-' if value < 0 else ''}an integer of {value.bit_length()} bits"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value)} characters"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def refuse(field: str, value: Any, expected: str) -> CheckpointError:
    return CheckpointError(f"{field} holds {describe(value)}; expected {expected}")


def check_int(value: Any, field: str, low: int, high: int) -> int:
    if not is_integer(value) or not low <= value <= high:
        raise refuse(field, value, f"an integer from {low} to {high}")
    return value


def check_number(value: Any, field: str, low: float = -math.inf, high: float = math.inf) -> float:
    if not is_number(value) or not math.isfinite(value) or not low <= value <= high:
        raise refuse(field, value, f"a finite number in [{low}, {high}]")
    return value


def _dense(tensor: torch.Tensor) -> bool:
    """Strided with values (not meta), each element of its extent once (contiguous in some dimension order):
    what kernels assume."""
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
        return False
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape, strict=True) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _memory_order(tensor: torch.Tensor) -> list[int]:
    """Strides of the dimensions of more than one element: equal for two dense tensors of one shape when the
    k-th element in memory is the same element of both."""
    return [stride for stride, size in zip(tensor.stride(), tensor.shape, strict=True) if size > 1]


def check_tensor(
    value: Any, field: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``value`` if it is a dense tensor of ``shape`` and ``dtype`` (None: any floating dtype)."""
    kind = "floating" if dtype is None else str(dtype).removeprefix("torch.")
    expected = f"a dense {kind} tensor of shape {tuple(shape)}"
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape) or not _dense(value):
        raise refuse(field, value, expected)
    if (dtype is None and not value.dtype.is_floating_point) or (dtype is not None and value.dtype != dtype):
        raise refuse(field, value, expected)
    return value


def check_finite(value: torch.Tensor, field: str, low: float = -math.inf) -> None:
    """A floating ``value``'s elements finite and >= ``low``: an infinite moment resumes without a word."""
    bad = int((~torch.isfinite(value) | (value < low)).sum()) if value.dtype.is_floating_point else 0
    if bad:
        floor = "" if low == -math.inf else f" and at least {low:g}"
        raise CheckpointError(f"{field} holds {bad} values not finite{floor}; expected finite values{floor}")


def check_like(stored: Any, live: Any, field: str, counters: dict[str, int], name: str = "") -> None:
    """``stored`` has ``live``'s structure (a state dict, a scheduler's state): dicts of the same keys, an
    integer under a key of ``counters`` in [0, counters[key]], other integers, bools, strings and None equal
    to the live ones; floats finite; tensors of the live shape and dtype."""
    if isinstance(live, dict):
        if not isinstance(stored, dict):
            raise refuse(field, stored, f"a dict of this run's {len(live)} entries")
        missing = next((key for key in live if key not in stored), None)
        if missing is not None:
            raise CheckpointError(f"{field} lacks {missing}; expected this run's {len(live)} entries")
        extra = next((key for key in stored if key not in live), None)
        if extra is not None:
            raise CheckpointError(f"{field} holds {describe(extra)}, which this run lacks")
        for key, value in live.items():
            check_like(stored[key], value, f"{field}[{key!r}]", counters, str(key))
    elif isinstance(live, (list, tuple)):
        if not isinstance(stored, (list, tuple)) or len(stored) != len(live):
            raise refuse(field, stored, f"a list of {len(live)} items")
        for index, (item, reference) in enumerate(zip(stored, live, strict=True)):
            check_like(item, reference, f"{field}[{index}]", counters)
    elif isinstance(live, torch.Tensor):
        check_tensor(stored, field, tuple(live.shape), live.dtype)
    elif isinstance(live, float):
        check_number(stored, field)
    elif name in counters and type(live) is int:
        check_int(stored, field, 0, counters[name])
    elif type(stored) is not type(live) or stored != live:
        raise refuse(field, stored, f"{describe(live)}, this run's")


def weights_difference(
    expected: Mapping[str, torch.Tensor], found: Mapping[str, Any], model: str
) -> str | None:
    """The first way the weights ``found`` in a file differ from ``model``'s state dict ``expected`` in keys
    and shapes (``load_state_dict(strict=True)``'s rule), as a clause of an error line; None if they fit."""
    for key, tensor in expected.items():
        if key not in found:
            return f"{key} {tuple(tensor.shape)} of {model} is not in the file"
        if found[key].shape != tensor.shape:
            return f"{key} is {tuple(found[key].shape)} in the file, {tuple(tensor.shape)} in {model}"
    extra = next((key for key in found if key not in expected), None)
    return None if extra is None else f"the file has {extra}, which {model} lacks"


def check_optimizer(stored: Any, optimizer: torch.optim.Optimizer) -> None:
    """The live groups (names, sizes, hyperparameters of the live types) and, per parameter, the states a
    probe step makes: a dense floating tensor of the parameter's shape, finite (second moments >= 0), put
    in the parameter's layout; or a finite ``step`` >= 0."""
    live_groups = optimizer.param_groups
    if not isinstance(stored, dict) or not isinstance(stored.get("param_groups"), list):
        raise refuse("optimizer", stored, "a dict of state and param_groups")
    groups, per_param = stored["param_groups"], stored.get("state")
    hint = "resume with the run's model and optim.*_weight_decay settings"  # build_optimizer's groups
    if len(groups) != len(live_groups):
        raise refuse("optimizer param_groups", groups, f"{len(live_groups)} groups, this run's ({hint})")
    if not isinstance(per_param, dict):
        raise refuse("optimizer state", per_param, "a dict of parameter ids to states")
    params: dict[int, tuple[int, torch.Tensor]] = {}  # stored id -> (group, live parameter)
    for index, (group, live) in enumerate(zip(groups, live_groups, strict=True)):
        field = f"optimizer param_groups[{index}]"
        if not isinstance(group, dict):
            raise refuse(field, group, "a dict")
        ids = group.get("params")
        if not isinstance(ids, list) or len(ids) != len(live["params"]):
            raise refuse(f"{field}['params']", ids, f"a list of {len(live['params'])} parameter ids")
        for position, param_id in enumerate(ids):
            check_int(param_id, f"{field}['params'][{position}]", 0, COUNT_MAX)
            if param_id in params:
                raise CheckpointError(f"{field} names parameter {param_id} twice; expected distinct ids")
            params[param_id] = (index, live["params"][position])
        if group.get("name") != live.get("name"):
            raise refuse(f"{field}['name']", group.get("name"), f"{live.get('name')!r}, this run's ({hint})")
        _check_hyperparameters(group, live, field)
    kinds: dict[int, dict[str, str]] = {}  # per group, probed once
    for param_id, state in per_param.items():
        if param_id not in params:
            raise refuse("optimizer state key", param_id, "one of the parameter ids of param_groups")
        index, param = params[param_id]
        if index not in kinds:
            kinds[index] = _probe_state(optimizer, groups[index], f"optimizer param_groups[{index}]")
        _check_param_state(state, kinds[index], param, f"optimizer state[{param_id}]")


def _check_hyperparameters(group: dict[str, Any], live: dict[str, Any], field: str) -> None:
    """The live group's keys (``param_names`` optional), each of the live value's type; numbers finite."""
    missing = next((key for key in live if key not in GROUP_MEMBERS and key not in group), None)
    extra = next((key for key in group if key not in GROUP_MEMBERS and key not in live), None)
    if missing is not None or extra is not None:
        what = f"lacks {missing}" if missing is not None else f"holds {extra}, which this optimizer lacks"
        raise CheckpointError(
            f"{field} {what}; expected the keys {', '.join(k for k in live if k != 'params')}"
        )
    for key, reference in live.items():
        if key in GROUP_MEMBERS:
            continue
        value, where = group[key], f"{field}[{key!r}]"
        if reference is None or isinstance(reference, bool):  # a switch: foreach, fused, nesterov, ...
            if value is not None and not isinstance(value, bool):
                raise refuse(where, value, "True, False or None")
        elif isinstance(reference, (int, float)):
            check_number(value, where)
        elif isinstance(reference, (list, tuple)):  # betas
            if not isinstance(value, (list, tuple)) or len(value) != len(reference):
                raise refuse(where, value, f"{len(reference)} numbers")
            for position, item in enumerate(value):
                check_number(item, f"{where}[{position}]")
        elif type(value) is not type(reference):
            raise refuse(where, value, f"a {type(reference).__name__}")


def _probe_state(optimizer: torch.optim.Optimizer, group: dict[str, Any], field: str) -> dict[str, str]:
    """Per key of the state one step of ``optimizer``'s class with ``group``'s settings makes, on a
    two-element parameter on the live device: "param" (the parameter's shape), "scalar" or "none"."""
    device = optimizer.param_groups[0]["params"][0].device
    settings = {k: v for k, v in group.items() if k not in GROUP_MEMBERS}
    probe_param = torch.zeros(2, device=device, requires_grad=True)
    probe_param.grad = torch.zeros(2, device=device)
    try:
        probe = type(optimizer)([{"params": [probe_param], **settings}])
        probe.step()
    except Exception as exc:  # noqa: BLE001 - the optimizer's own refusal of the stored settings
        raise CheckpointError(
            f"{field}'s settings are refused by {type(optimizer).__name__} ({first_line(exc)}); expected "
            "this run's"
        ) from None
    tensor = lambda value: isinstance(value, torch.Tensor) and value.dim() > 0  # noqa: E731
    return {
        key: "none" if value is None else "param" if tensor(value) else "scalar"
        for key, value in probe.state[probe_param].items()
    }


def _check_param_state(state: Any, kinds: dict[str, str], param: torch.Tensor, field: str) -> None:
    if not isinstance(state, dict) or set(state) != set(kinds):
        raise refuse(field, state, f"a dict with keys {', '.join(kinds) or 'none'}")
    for key, kind in kinds.items():
        value = state[key]
        if kind == "scalar":
            number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if isinstance(value, torch.Tensor) and (value.dim() != 0 or value.is_complex()):
                raise refuse(f"{field}[{key!r}]", value, "a 0-d tensor or a number")
            check_number(number, f"{field}[{key!r}]", 0.0)
        elif not (kind == "none" and value is None):
            where = f"{field}[{key!r}]"
            check_tensor(value, where, tuple(param.shape))
            if _memory_order(value) != _memory_order(param):  # a fused kernel reads it in param's layout
                state[key] = torch.empty_like(param, dtype=value.dtype, device=value.device).copy_(value)
            check_finite(value, where, 0.0 if key in SQUARED_STATES else -math.inf)


def check_rng(states: Any) -> None:
    """Every rank's generator states, each tried on a private generator first."""
    if not isinstance(states, list) or not 1 <= len(states) <= RANKS_MAX:
        raise refuse("rng", states, f"a list of 1 to {RANKS_MAX} ranks' generator states")
    live = torch.get_rng_state()
    for rank, state in enumerate(states):
        field = f"rng[{rank}]"
        if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= state.keys():
            raise refuse(field, state, "a dict with python, numpy and torch")
        check_tensor(state["torch"], f"{field}['torch']", tuple(live.shape), live.dtype)
        _try_state(lambda s=state: torch.Generator().set_state(s["torch"]), f"{field}['torch']")
        _check_python_rng(state["python"], f"{field}['python']")
        _check_numpy_rng(state["numpy"], f"{field}['numpy']")
        if "cuda" in state:
            _check_cuda_rng(state["cuda"], f"{field}['cuda']")


def _try_state(set_state: Any, field: str) -> None:
    try:
        set_state()
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(f"{field} is not a generator state ({first_line(exc)})") from None


def _check_python_rng(state: Any, field: str) -> None:
    """``random.getstate()``: (3, 625 integers below 2**32, None or a float)."""
    internal = state[1] if isinstance(state, (tuple, list)) and len(state) == 3 else None
    if (
        not isinstance(internal, (tuple, list))
        or len(internal) != 625
        or not all(type(x) is int and 0 <= x < 2**32 for x in internal)
    ):
        raise refuse(field, state, "Python's (3, 625 integers below 2**32, gauss) state")
    state = (state[0], tuple(internal), state[2])
    _try_state(lambda: random.Random().setstate(state), field)


def _check_numpy_rng(state: Any, field: str) -> None:
    """``np.random.get_state()``: ('MT19937', 624 keys below 2**32, pos, has_gauss, gauss)."""
    keys = state[1] if isinstance(state, (tuple, list)) and len(state) == 5 else None
    if isinstance(keys, torch.Tensor) and keys.dtype == torch.int64 and keys.shape == (624,):
        keys = keys.numpy()
    if (
        not isinstance(keys, np.ndarray)
        or keys.shape != (624,)
        or keys.dtype.kind not in "iu"
        or int(keys.min()) < 0
        or int(keys.max()) >= 2**32
    ):
        raise refuse(field, state, "NumPy's ('MT19937', 624 keys below 2**32, pos, has_gauss, gauss) state")
    restored = (state[0], keys.astype(np.uint32), *state[2:])
    _try_state(lambda: np.random.RandomState().set_state(restored), field)


def _check_cuda_rng(states: Any, field: str) -> None:
    """One uint8 state per CUDA device, at most as many as this process sees, each of its length."""
    devices = torch.cuda.device_count() if torch.cuda.is_available() else RANKS_MAX
    if not isinstance(states, list) or len(states) > devices:
        raise refuse(field, states, f"a list of at most {devices} CUDA generator states")
    for index, state in enumerate(states):
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
            raise refuse(f"{field}[{index}]", state, "a 1-d uint8 tensor")
        if torch.cuda.is_available():
            live = torch.cuda.get_rng_state(index)
            check_tensor(state, f"{field}[{index}]", tuple(live.shape), torch.uint8)


def check_progress(checkpoint: dict[str, Any], bounds: RunBounds) -> None:
    """The :class:`~mlcls.engine.checkpoint.TrainState` fields: epoch and step within this run's, counters
    non-negative and bounded, records of their documented types."""
    epochs = COUNT_MAX if bounds.epochs is None else bounds.epochs
    steps = COUNT_MAX if bounds.iters_per_epoch is None else bounds.iters_per_epoch - 1
    epoch = check_int(checkpoint.get("epoch", 0), "epoch", 0, epochs)
    if epoch == epochs:  # training complete: no step of a further epoch
        steps = 0
    check_int(checkpoint.get("step", 0), "step", 0, steps)
    names = {f.name: f.type for f in fields(EpochProgress)}
    partial = checkpoint.get("partial", [])
    if not isinstance(partial, list) or len(partial) > RANKS_MAX:
        raise refuse("partial", partial, f"a list of at most {RANKS_MAX} ranks' progress")
    for index, progress in enumerate(partial):
        field = f"partial[{index}]"
        if not isinstance(progress, dict) or not progress.keys() <= names.keys():
            raise refuse(field, progress, f"a dict of {', '.join(names)}")
        for key, value in progress.items():
            if names[key] == "int":
                check_int(value, f"{field}[{key!r}]", 0, COUNT_MAX)
            else:
                check_number(value, f"{field}[{key!r}]", -math.inf if key == "loss_sum" else 0.0)
    history = checkpoint.get("history", [])
    if not isinstance(history, list) or len(history) > epoch:
        raise refuse("history", history, f"a list of at most {epoch} records (one per epoch done)")
    for index, record in enumerate(history):
        if not isinstance(record, dict):
            raise refuse(f"history[{index}]", record, "a dict")
        check_int(record.get("epoch"), f"history[{index}]['epoch']", 1, epoch)
        check_number(record.get("images_per_s"), f"history[{index}]['images_per_s']", 0.0)
        _check_plain(record, f"history[{index}]")
    best = checkpoint.get("best")
    if best is not None:
        if not isinstance(best, dict) or best.get("weights") not in ("raw", "ema"):
            raise refuse("best", best, "None or a dict with weights 'raw' or 'ema'")
        check_int(best.get("epoch"), "best['epoch']", 1, max(epoch, 1))
        selection = best.get("selection", best)
        check_number(selection.get("mAP_class") if isinstance(selection, dict) else None, "best mAP_class")
        _check_plain(best, "best")
    metrics = checkpoint.get("last_metrics")
    if metrics is not None and not isinstance(metrics, dict):
        raise refuse("last_metrics", metrics, "None or a dict of metrics")
    _check_plain(metrics, "last_metrics")
    thresholds = checkpoint.get("thresholds")
    if thresholds is not None:
        classes = bounds.num_classes
        if classes is None and isinstance(thresholds, torch.Tensor) and thresholds.dim() == 1:
            classes = len(thresholds)  # a run of unknown classes: any length
        if classes is None:
            raise refuse("thresholds", thresholds, "None or a floating tensor of one threshold per class")
        check_tensor(thresholds, "thresholds", (classes,))
    counts = checkpoint.get("counts", {"skipped_steps": 0, "skipped_images": []})
    if not isinstance(counts, dict) or not isinstance(counts.get("skipped_images"), list):
        raise refuse("counts", counts, "a dict of skipped_steps and skipped_images")
    check_int(counts.get("skipped_steps"), "counts['skipped_steps']", 0, COUNT_MAX)
    if not all(isinstance(name, str) for name in counts["skipped_images"]):
        raise refuse("counts['skipped_images']", counts["skipped_images"], "a list of file names")
    check_number(checkpoint.get("wall_time_s", 0.0), "wall_time_s", 0.0)
    check_int(checkpoint.get("resumes", 0), "resumes", 0, COUNT_MAX)
    check_rng(checkpoint.get("rng"))


def _check_plain(value: Any, field: str, depth: int = 0) -> None:
    """JSON-like data (None, bools, numbers, strings, lists, dicts with string keys), at most 8 deep."""
    if depth > 8:
        raise refuse(field, value, "records nested at most 8 deep")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise refuse(f"{field} key", key, "a string")
            _check_plain(item, f"{field}[{key!r}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{field}[{index}]", depth + 1)
    elif value is not None and not isinstance(value, (bool, int, float, str)):
        raise refuse(field, value, "a number, a string or None")


def check_part(name: str, stored: Any, part: Any, bounds: RunBounds) -> None:
    """Raise :class:`CheckpointError` unless ``stored`` fits the live ``part`` (model, optimizer, scheduler,
    loss or EMA) and ``bounds``: the one check of a part's state, its ``load_state_dict`` checks nothing."""
    total = bounds.total_iters
    if isinstance(part, torch.optim.Optimizer):
        check_optimizer(stored, part)
    elif isinstance(part, torch.optim.lr_scheduler.LRScheduler):
        counters = dict.fromkeys(SCHEDULER_COUNTERS, total if total == COUNT_MAX else total + 1)
        check_like(stored, part.state_dict(), name, counters)
    elif isinstance(part, ModelEma):
        if not isinstance(stored, dict) or stored.keys() != {"module", "updates"}:
            raise refuse("ema", stored, "a dict of module and updates")
        check_like(stored["module"], part.module.state_dict(), "ema module", {})
        check_int(stored["updates"], "ema updates", 0, total)
    elif isinstance(part, nn.Module):  # the model, the loss's state (and its epoch)
        check_like(stored, part.state_dict(), name, {"epoch": bounds.epochs or COUNT_MAX})
        if name == "loss":  # estimates the loss reads as numbers: ROLE's label table, pseudo-labels
            for key, value in stored.items():
                if isinstance(value, torch.Tensor):
                    check_finite(value, f"loss[{key!r}]")
    else:
        raise TypeError(f"resume part {name}: {type(part).__name__} has no state check")


def check_resume_state(
    checkpoint: dict[str, Any],
    parts: dict[str, Any],
    scaler: torch.amp.GradScaler,
    load_scaler: bool,
    bounds: RunBounds,
) -> None:
    """Raise :class:`CheckpointError` at the first field that does not fit the live ``parts`` (name ->
    :func:`check_part`), ``scaler`` (when ``load_scaler``) and ``bounds``."""
    for name, part in parts.items():
        if checkpoint.get(name) is not None:
            check_part(name, checkpoint[name], part, bounds)
    live_scaler = scaler.state_dict()
    if load_scaler and live_scaler:
        counters = dict.fromkeys(SCALER_COUNTERS, COUNT_MAX)
        check_like(checkpoint["scaler"], live_scaler, "scaler", counters)
        check_number(checkpoint["scaler"]["scale"], "scaler['scale']", 2.0**-126, 2.0**127)
    check_progress(checkpoint, bounds)
