"""The run's state: where training stands (:class:`TrainState`), the random generators (seeding, saving,
restoring), and the checks of a stored state against the live objects before any ``load_state_dict``
(:func:`check_resume_state`). Files are :mod:`mlcls.engine.checkpoint`'s.

Plain data can still hold a state no run wrote: an optimizer moment of one element for a 3 x 3 weight (a
fused kernel then writes out of bounds), infinite values, a NumPy generator position past its key. The first
mismatch is one :class:`CheckpointError` line. Each optimizer state tensor is checked against its parameter
(a moment laid out otherwise is copied into its layout, the order a fused kernel reads); each generator
state is tried on a private generator.

Private names of torch read here: the scheduler's ``_step_count`` and GradScaler's ``_growth_tracker`` are
keys of their public ``state_dict()``, counters torch has no public name for, bounded by name.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from mlcls.errors import first_line, is_integer, is_number

COUNT_MAX = 2**62  # a counter no run reaches: epochs, steps, images, seconds when no tighter bound is known
RANKS_MAX = 2**16  # processes a checkpoint may have been written by
SCHEDULER_COUNTERS = ("last_epoch", "_step_count")  # torch LRScheduler's iteration counters
SCALAR_STATES = frozenset({"step", "mu_product", "eta", "mu"})  # torch's per-parameter numbers; other keys
SQUARED_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq"})  # hold moments of the parameter's shape


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, or holds a state that does not fit this run."""


def plain(data: Any) -> Any:
    """``data`` with what ``torch.load(weights_only=True)`` refuses made plain: NumPy arrays become tensors
    (unsigned integers as int64), NumPy scalars Python numbers, OmegaConf configs dicts and lists."""
    if isinstance(data, (DictConfig, ListConfig)):
        return OmegaConf.to_container(data, resolve=True)
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data.astype(np.int64) if data.dtype.kind == "u" else data.copy())
    if isinstance(data, np.generic):
        return data.item()
    if isinstance(data, dict):
        return {key: plain(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(plain(value) for value in data)
    return data


@dataclass
class EpochProgress:
    """One rank's sums over the steps of the current epoch so far (restored by a mid-epoch resume)."""

    loss_sum: float = 0.0  # over the applied steps
    seen: int = 0
    time_s: float = 0.0
    skipped_steps: int = 0  # non-finite steps skipped


@dataclass
class TrainState:
    """Where training stands: ``epoch`` epochs complete plus ``step`` steps of the next one with every
    rank's :class:`EpochProgress` (``partial``), and the run's records (bounded by :func:`check_progress`)."""

    epoch: int = 0
    step: int = 0
    partial: list[EpochProgress] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None  # epoch, mAP@class, mAP@sample, weights "raw" or "ema"
    last_metrics: dict[str, Any] | None = None
    thresholds: torch.Tensor | None = None  # the raw weights' calibrated ones
    counts: dict[str, Any] = field(default_factory=lambda: {"skipped_steps": 0, "skipped_images": []})
    wall_time_s: float = 0.0
    rng: list[dict[str, Any]] = field(default_factory=list)
    resumes: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)  # partial's EpochProgress too

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {f.name for f in fields(self)}
        for key, value in state.items():
            if key in names:
                setattr(self, key, value)
        self.partial = [EpochProgress(**p) for p in state.get("partial", [])]

    def progress_of(self, rank: int) -> EpochProgress:
        """``rank``'s sums of the incomplete epoch (zeros when it has none)."""
        if not self.step or rank >= len(self.partial):
            return EpochProgress()
        return self.partial[rank]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (CUDA's with torch's)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy (keys as an int64 tensor), torch and CUDA generator states, plain data."""
    python, numpy, cpu = random.getstate(), plain(np.random.get_state()), torch.get_rng_state()
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}
    return {"python": python, "numpy": numpy, "torch": cpu, **cuda}


def _numpy_state(stored: Any) -> tuple[Any, ...]:
    """:func:`rng_state`'s NumPy entry for ``np.random.set_state``; a position past the key (read) refused."""
    algorithm, keys, position, *gauss = stored
    if not is_integer(position) or not 0 <= position <= 624:
        raise ValueError(f"position {position!r} outside the key's 624 words")
    return (algorithm, np.asarray(keys, dtype=np.uint32), position, *gauss)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` (checked by :func:`check_rng`)."""
    random.setstate(state["python"])
    np.random.set_state(_numpy_state(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class RunBounds:
    """What this run allows a resumed state to hold (None: unbounded but for :data:`COUNT_MAX`)."""

    epochs: int | None = None
    iters_per_epoch: int | None = None
    num_classes: int | None = None

    @property
    def total_iters(self) -> int:
        known = self.epochs is not None and self.iters_per_epoch is not None
        return self.epochs * self.iters_per_epoch if known else COUNT_MAX


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


def check_finite(value: torch.Tensor, field: str, low: float = -math.inf, unset: bool = False) -> None:
    """A floating ``value``'s elements finite and >= ``low`` (an infinite moment resumes without a word), or
    NaN where ``unset`` (an entry not estimated yet)."""
    wrong = (~torch.isfinite(value) | (value < low)) & ~(value.isnan() & unset)
    if value.dtype.is_floating_point and (bad := int(wrong.sum())):
        floor = "" if low == -math.inf else f" and at least {low:g}"
        expected = f"finite values{floor}" + (" (or NaN: not estimated yet)" if unset else "")
        raise CheckpointError(f"{field} holds {bad} values not finite{floor}; expected {expected}")


def check_like(stored: Any, live: Any, field: str, counters: dict[str, int], name: str = "") -> None:
    """``stored`` has ``live``'s structure (a state dict, a scheduler's state, a param group's settings):
    dicts of the same keys, an integer under a key of ``counters`` in [0, counters[key]], other integers,
    bools, strings and None equal to the live ones; floats finite; tensors of the live shape and dtype."""
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


def _state_keys(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> frozenset[str] | None:
    """The keys torch's SGD and Adam(W) keep per parameter with ``group``'s settings; None for another
    optimizer (its states then share one set of keys)."""
    if isinstance(optimizer, torch.optim.SGD):
        return frozenset({"momentum_buffer"} if group["momentum"] else ())
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return frozenset({"step", "exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if group["amsgrad"] else [])})
    return None


def check_optimizer(stored: Any, optimizer: torch.optim.Optimizer) -> None:
    """The groups' settings (:func:`check_like`: names and switches this run's, numbers finite); per parameter
    exactly the optimizer's keys (an empty state is refused: fused SGD fails on one beside filled ones),
    ``step`` >= 0, moments fitting their parameter."""
    live_groups = optimizer.param_groups
    if not isinstance(stored, dict) or not isinstance(stored.get("param_groups"), list):
        raise refuse("optimizer", stored, "a dict of state and param_groups")
    groups, per_param = stored["param_groups"], stored.get("state")
    if len(groups) != len(live_groups):  # build_optimizer's groups
        hint = "resume with the run's model and optim.*_weight_decay settings"
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
        settings = lambda g: {k: v for k, v in g.items() if k not in ("params", "param_names")}  # noqa: E731
        check_like(settings(group), settings(live), field, {})
    keys: dict[int, frozenset[str] | None] = {}  # per group
    for param_id, state in per_param.items():
        if param_id not in params:
            raise refuse("optimizer state key", param_id, "one of the parameter ids of param_groups")
        index, param = params[param_id]
        field = f"optimizer state[{param_id}]"
        if not isinstance(state, dict):
            raise refuse(field, state, "a dict")
        if index not in keys:
            expected = _state_keys(optimizer, groups[index])
            keys[index] = frozenset(state) if expected is None else expected
        if set(state) != keys[index]:
            raise refuse(field, state, f"a dict with keys {', '.join(sorted(keys[index])) or 'none'}")
        for key, value in state.items():
            where = f"{field}[{key!r}]"
            if key not in SCALAR_STATES:
                state[key] = _check_moment(value, param, where, key in SQUARED_STATES)
            elif isinstance(value, torch.Tensor) and (
                value.dim() != 0 or value.is_complex() or value.is_meta
            ):
                raise refuse(where, value, "a 0-d tensor or a number")
            else:
                check_number(value.item() if isinstance(value, torch.Tensor) else value, where, 0.0)


def _check_moment(value: Any, param: torch.Tensor, field: str, squared: bool) -> torch.Tensor:
    """``value`` as a moment of ``param``: dense, of its shape and dtype, on its device or the CPU (where
    checkpoints are read), finite (>= 0 when ``squared``), and in its memory order (copied into it)."""
    check_tensor(value, field, tuple(param.shape), param.dtype)
    if value.device.type not in ("cpu", param.device.type):
        raise refuse(field, value, f"a tensor on the CPU or {param.device.type}, not {value.device.type}")
    check_finite(value, field, 0.0 if squared else -math.inf)
    if _memory_order(value) != _memory_order(param):  # a fused kernel reads it in param's layout
        value = torch.empty_like(param, device=value.device).copy_(value)
    return value


def check_rng(states: Any) -> None:
    """Every rank's generator states, each tried on a private generator (CUDA's where this process has it)."""
    if not isinstance(states, list) or not 1 <= len(states) <= RANKS_MAX:
        raise refuse("rng", states, f"a list of 1 to {RANKS_MAX} ranks' generator states")
    for rank, state in enumerate(states):
        field = f"rng[{rank}]"
        if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= state.keys():
            raise refuse(field, state, "a dict with python, numpy and torch")
        _try_state(state["torch"], f"{field}['torch']", lambda s: torch.Generator().set_state(s))
        _try_state(state["python"], f"{field}['python']", lambda s: random.Random().setstate(s))
        numpy = lambda s: np.random.RandomState().set_state(_numpy_state(s))  # noqa: E731
        _try_state(state["numpy"], f"{field}['numpy']", numpy)
        cuda = state.get("cuda", [])
        devices = torch.cuda.device_count() if torch.cuda.is_available() else RANKS_MAX
        if not isinstance(cuda, list) or len(cuda) > devices:
            raise refuse(f"{field}['cuda']", cuda, f"a list of at most {devices} CUDA generator states")
        for index, value in enumerate(cuda if torch.cuda.is_available() else []):
            private = torch.Generator(device=f"cuda:{index}")
            _try_state(value, f"{field}['cuda'][{index}]", private.set_state)


def _try_state(value: Any, field: str, set_state: Callable[[Any], Any]) -> None:
    """``set_state(value)``, its refusal one line; a tensor dense first (torch copies numel bytes from it)."""
    if isinstance(value, torch.Tensor) and not _dense(value):
        raise refuse(field, value, "a generator state, a dense tensor")
    try:
        set_state(value)
    except Exception as exc:  # noqa: BLE001 - the generator's own refusal, whatever its type
        raise refuse(field, value, f"a generator state ({type(exc).__name__}: {first_line(exc)})") from None


def check_progress(checkpoint: dict[str, Any], bounds: RunBounds) -> None:
    """The :class:`TrainState` fields: epoch and step within this run's, counters >= 0 and bounded, records
    JSON-like, generator states :func:`check_rng`'s."""
    epochs = COUNT_MAX if bounds.epochs is None else bounds.epochs
    epoch = check_int(checkpoint.get("epoch", 0), "epoch", 0, epochs)
    steps = (bounds.iters_per_epoch or COUNT_MAX + 1) - 1 if epoch < epochs else 0  # complete: no more steps
    check_int(checkpoint.get("step", 0), "step", 0, steps)
    names = {f.name: f.type for f in fields(EpochProgress)}
    partial = checkpoint.get("partial", [])
    if not isinstance(partial, list) or len(partial) > RANKS_MAX:
        raise refuse("partial", partial, f"a list of at most {RANKS_MAX} ranks' progress")
    for index, progress in enumerate(partial):
        if not isinstance(progress, dict) or not progress.keys() <= names.keys():
            raise refuse(f"partial[{index}]", progress, f"a dict of {', '.join(names)}")
        for key, value in progress.items():
            check = check_int if names[key] == "int" else check_number
            check(value, f"partial[{index}][{key!r}]", -COUNT_MAX if key == "loss_sum" else 0, COUNT_MAX)
    history = checkpoint.get("history", [])
    if not isinstance(history, list) or len(history) > epoch:
        raise refuse("history", history, f"a list of at most {epoch} records (one per epoch done)")
    for index, record in enumerate(history):
        if not isinstance(record, dict):
            raise refuse(f"history[{index}]", record, "a dict")
        check_int(record.get("epoch"), f"history[{index}]['epoch']", 1, epoch)
        check_number(record.get("images_per_s"), f"history[{index}]['images_per_s']", 0.0)
    best = checkpoint.get("best")
    if best is not None:
        if not isinstance(best, dict) or best.get("weights") not in ("raw", "ema"):
            raise refuse("best", best, "None or a dict with weights 'raw' or 'ema'")
        check_int(best.get("epoch"), "best['epoch']", 1, max(epoch, 1))
        selection = best.get("selection", best)
        check_number(selection.get("mAP_class") if isinstance(selection, dict) else None, "best mAP_class")
    metrics = checkpoint.get("last_metrics")
    if metrics is not None and not isinstance(metrics, dict):
        raise refuse("last_metrics", metrics, "None or a dict of metrics")
    for name, records in (("history", history), ("best", best), ("last_metrics", metrics)):
        try:  # JSON-like, as results.json holds them (nesting is bounded by the checkpoint's reader)
            json.dumps(records)
        except (TypeError, ValueError) as exc:
            raise refuse(name, records, f"numbers, strings, lists and dicts ({first_line(exc)})") from None
    thresholds = checkpoint.get("thresholds")
    if thresholds is not None:  # one per class (any number for a run of unknown classes)
        length = len(thresholds) if isinstance(thresholds, torch.Tensor) and thresholds.dim() == 1 else -1
        check_tensor(
            thresholds, "thresholds", (length if bounds.num_classes is None else bounds.num_classes,)
        )
    counts = checkpoint.get("counts", {"skipped_steps": 0, "skipped_images": []})
    if not isinstance(counts, dict) or not isinstance(counts.get("skipped_images"), list):
        raise refuse("counts", counts, "a dict of skipped_steps and skipped_images")
    check_int(counts.get("skipped_steps"), "counts['skipped_steps']", 0, COUNT_MAX)
    if not all(isinstance(name, str) for name in counts["skipped_images"]):
        raise refuse("counts['skipped_images']", counts["skipped_images"], "a list of file names")
    check_number(checkpoint.get("wall_time_s", 0.0), "wall_time_s", 0.0)
    check_int(checkpoint.get("resumes", 0), "resumes", 0, COUNT_MAX)
    check_rng(checkpoint.get("rng"))


def check_part(name: str, stored: Any, part: Any, bounds: RunBounds) -> None:
    """Raise :class:`CheckpointError` unless ``stored`` fits the live ``part`` (model, optimizer, scheduler,
    loss or EMA) and ``bounds``: the one check of a part's state, its ``load_state_dict`` checks nothing."""
    total = bounds.total_iters
    if isinstance(part, torch.optim.Optimizer):
        check_optimizer(stored, part)
    elif isinstance(part, torch.optim.lr_scheduler.LRScheduler):
        counters = dict.fromkeys(SCHEDULER_COUNTERS, total if total == COUNT_MAX else total + 1)
        check_like(stored, part.state_dict(), name, counters)
    else:  # the model, the EMA (and its updates), the loss's state (and its epoch)
        check_like(stored, part.state_dict(), name, {"epoch": bounds.epochs or COUNT_MAX, "updates": total})
        if name == "loss":  # estimates the loss reads as numbers: ROLE's label table, pseudo-labels
            unset = getattr(part, "unset_as_nan", ())
            for key, value in stored.items():
                if isinstance(value, torch.Tensor):
                    check_finite(value, f"loss[{key!r}]", unset=key in unset)


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
        check_like(checkpoint["scaler"], live_scaler, "scaler", {"_growth_tracker": COUNT_MAX})
        check_number(checkpoint["scaler"]["scale"], "scaler['scale']", 2.0**-126, 2.0**127)
    check_progress(checkpoint, bounds)
