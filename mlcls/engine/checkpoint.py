"""Run state on disk: one object writes a run's checkpoints, chooses the one to resume, loads it once and
restores the run (:class:`Checkpointer`), and ``model.init_from`` starts a run from another's weights and
loss state. The state itself and its checks are :mod:`mlcls.engine.state`'s. In ``<run_dir>/checkpoints``:

    last.pt     the newest full training state (what ``trainer.resume=auto`` loads first)
    iter_*.pt   the newest ``trainer.keep_checkpoints`` full states (fallbacks)
    best.pt     the weights of the best mAP@class evaluation (on the held-out share of the training split
                under ``dataset.val_fraction``)

Checkpoints hold plain data only (tensors, containers, strings, numbers, None), read with
``torch.load(weights_only=True)`` (:func:`load_checkpoint`, the one reader, of :data:`mlcls.formats.FORMAT`
only): a pickle from someone else cannot run code. A file that needs more is refused, naming what it needs
(``torch.serialization.get_unsafe_globals_in_checkpoint``), unless trusted (``trust_checkpoint=true``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from mlcls import collectives
from mlcls.config_tree import nested_get
from mlcls.engine import distributed as dist_utils
from mlcls.engine.distributed import DistInfo
from mlcls.engine.state import (
    CheckpointError,
    EpochProgress,
    RunBounds,
    TrainState,
    check_resume_state,
    plain,
    rng_state,
    set_rng_state,
)
from mlcls.errors import ConfigError, first_line, plural
from mlcls.formats import FORMAT, check_format
from mlcls.io import atomic_link, atomic_write
from mlcls.models.factory import has_text_queries
from mlcls.models.heads import class_rows
from mlcls.text import build_encoder
from mlcls.torchfile import check_nesting, open_checkpoint

log = logging.getLogger("mlcls")

TRUST_HINT = (
    "if you wrote it yourself, load it as it is with trust_checkpoint=true "
    "(trainer.trust_checkpoint=true to resume)"
)


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint needs code run to be loaded (pickled objects beyond plain data) and was not trusted."""


class Checkpointer:
    """Writes (rank 0) and resumes the state of ``parts`` (name -> model, optimizer, scheduler, loss, ema),
    the ``scaler`` and the :class:`TrainState`, with the data's ``classes`` and ``preprocess``."""

    def __init__(
        self,
        cfg: DictConfig,
        run_dir: Path,
        parts: dict[str, Any],
        scaler: torch.amp.GradScaler,
        state: TrainState,
        dist: DistInfo,
        classes: list[str],
        preprocess: dict[str, Any],
        iters_per_epoch: int,
    ) -> None:
        self.cfg, self.directory, self.parts = cfg, run_dir / "checkpoints", parts
        self.scaler, self.state, self.dist = scaler, state, dist
        self.classes, self.preprocess, self.iters_per_epoch = classes, preprocess, iters_per_epoch
        self.text = text_record(cfg)

    def resume(self) -> bool:
        """Restore ``trainer.resume`` (a file, or ``auto``: :func:`choose_resume_checkpoint`); True if a
        checkpoint was loaded. Rank 0 chooses, the others load the path it chose (ranks choosing for
        themselves could load different files while one is written or a node's file system lags)."""
        resume = self.cfg.trainer.resume
        if not resume:
            return False
        trust = bool(self.cfg.trainer.get("trust_checkpoint", False))
        chosen = dist_utils.on_main(
            lambda: choose_resume_checkpoint(resume, self.directory, trust), self.dist.is_main
        )
        path = collectives.broadcast_object(chosen[0] if chosen is not None else None)
        if path is None:
            log.info(
                "trainer.resume=auto: no readable checkpoint in %s, starting from scratch", self.directory
            )
            return False
        with dist_utils.all_or_none():
            checkpoint = chosen[1] if chosen is not None else None
            if checkpoint is None:
                checkpoint = load_checkpoint(path, trust=trust)
            bounds = RunBounds(int(self.cfg.trainer.epochs), self.iters_per_epoch, len(self.classes))
            restore(
                checkpoint, Path(path), self.parts, self.scaler, self.state, self.cfg.trainer.amp,
                self.dist.rank, bounds,
            )  # fmt: skip
        return True

    def save(
        self,
        is_best: bool = False,
        progress: EpochProgress | None = None,
        best_thresholds: torch.Tensor | None = None,
        thresholds_split: str = "validation",
    ) -> None:
        """Checkpoint where training stands, after ``state.epoch`` epochs (``best.pt`` too when ``is_best``)
        or within an epoch (every rank's ``progress``); rank 0 writes, all return or raise together."""
        self.state.partial = [] if progress is None else collectives.all_gather_object(progress)
        self.state.rng = collectives.all_gather_object(rng_state())
        dist_utils.on_main(
            lambda: self._write_files(is_best, best_thresholds, thresholds_split), self.dist.is_main
        )

    def _write_files(
        self, is_best: bool, best_thresholds: torch.Tensor | None, thresholds_split: str
    ) -> None:
        """Write ``best.pt`` (when ``is_best``), then ``iter_<iteration>.pt``, link ``last.pt`` to it, keep
        the newest ``trainer.keep_checkpoints``: a kill at any point leaves the newest training checkpoint
        naming a best epoch whose ``best.pt`` exists."""
        parts = self.parts
        loss = parts["loss"]
        checkpoint = {
            **self.state.state_dict(),
            **{name: parts[name].state_dict() for name in ("model", "optimizer", "scheduler")},
            "loss": loss.state_dict() if isinstance(loss, nn.Module) else None,
            "ema": parts["ema"].state_dict() if "ema" in parts else None,
            "scaler": self.scaler.state_dict(),
            "classes": self.classes,
            "preprocess": self.preprocess,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "thresholds_split": thresholds_split,
            "text": self.text,
        }
        if is_best:
            best = self.state.best
            best_model = parts["model"] if best["weights"] == "raw" else parts["ema"].module
            best_weights = {
                "model": best_model.state_dict(),
                "weights": best["weights"],
                "thresholds": best_thresholds,
                "loss": checkpoint["loss"],  # the loss's state at this epoch (model.init_from carries it)
                **{
                    k: checkpoint[k]
                    for k in ("epoch", "classes", "preprocess", "config", "best", "thresholds_split", "text")
                },
            }
            save_checkpoint(best_weights, self.directory / "best.pt")
        iteration = self.state.epoch * self.iters_per_epoch + self.state.step
        path = self.directory / f"iter_{iteration:09d}.pt"
        save_checkpoint(checkpoint, path)
        atomic_link(path, self.directory / "last.pt")
        for old in sorted(self.directory.glob("iter_*.pt"))[: -self.cfg.trainer.keep_checkpoints]:
            old.unlink(missing_ok=True)


def choose_resume_checkpoint(
    resume: str, directory: str | Path, trust: bool = False
) -> tuple[str | None, dict[str, Any] | None]:
    """The checkpoint ``trainer.resume`` names and its contents: a file as given (contents None), or for
    ``auto`` the newest readable one of ``last.pt``, ``iter_*.pt`` (an unreadable one is reported and the
    previous tried; an untrusted one raises); ``(None, None)`` when none is."""
    if resume != "auto":
        return str(resume), None
    directory = Path(directory)
    last = [directory / "last.pt"] if (directory / "last.pt").is_file() else []
    for path in last + sorted(directory.glob("iter_*.pt"), reverse=True):
        try:
            return str(path), load_checkpoint(path, trust=trust)
        except UntrustedCheckpointError:
            raise
        except CheckpointError as exc:
            log.warning("%s; trying the previous checkpoint", exc)
    return None, None


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", trust: bool = False
) -> dict[str, Any]:
    """A checkpoint written by :func:`save_checkpoint`, of :data:`FORMAT` (else one line). More than plain
    data is an :class:`UntrustedCheckpointError` naming the type it needs unless ``trust`` (unpickled as it
    is); a missing or unreadable file a :class:`CheckpointError`."""
    path = Path(path)
    try:
        file = open_checkpoint(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except (OSError, ValueError) as exc:  # not a regular file, too large, not as torch.save writes
        raise CheckpointError(f"checkpoint {exc}" if str(exc).startswith(str(path)) else str(exc)) from None
    with file:
        try:
            state = torch.load(file, map_location=map_location, weights_only=not trust)
        except Exception as exc:  # truncated zip, wrong file type, pickling error
            needed = [] if trust else _unsafe_globals(file)
            if needed:
                raise UntrustedCheckpointError(
                    f"checkpoint {path} holds a {needed[0]} object, which loading would run code for "
                    f"(a crafted file, or one written before checkpoints held plain data); "
                    + TRUST_HINT.format(path=path)
                ) from None
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {first_line(exc)})"
            ) from exc
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not an mlcls checkpoint (no 'model' entry)")
    try:
        check_nesting(state, f"checkpoint {path}")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return check_format(state, "checkpoint", f"checkpoint {path}", CheckpointError)


def _unsafe_globals(file: IO[bytes]) -> list[str]:
    """The classes and functions, beyond plain data, that loading the opened checkpoint ``file`` would call
    (torch's static scan of its pickle), sorted; none when it is not a ``torch.save`` archive."""
    try:
        file.seek(0)
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    except Exception:  # noqa: BLE001 - not an archive torch reads: the load's own error says what is wrong
        return []


def restore(
    checkpoint: dict[str, Any],
    path: Path,
    parts: dict[str, Any],
    scaler: torch.amp.GradScaler,
    state: TrainState,
    amp: str,
    rank: int,
    bounds: RunBounds | None = None,
) -> None:
    """Load a full training checkpoint into the run's objects once every field is checked against them
    and ``bounds`` (:func:`check_resume_state`: nothing is loaded on a mismatch). A checkpoint of another
    ``trainer.amp`` resumes with a warning and a fresh loss scale."""
    if "optimizer" not in checkpoint:
        raise CheckpointError(f"{path} holds weights only (best.pt?); resume needs last.pt or iter_*.pt")
    saved_amp = nested_get(checkpoint, "config", "trainer", "amp", default=amp)
    load_scaler = saved_amp == amp and bool(checkpoint.get("scaler"))
    try:
        check_resume_state(checkpoint, parts, scaler, load_scaler, bounds or RunBounds())
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc} (a damaged or crafted checkpoint; resume another)") from None
    for name, part in parts.items():
        if checkpoint.get(name) is not None:
            part.load_state_dict(checkpoint[name])
    if saved_amp != amp:
        log.warning(
            "%s was trained with trainer.amp=%s; continuing with trainer.amp=%s (fresh loss scale)",
            path,
            saved_amp,
            amp,
        )
    elif load_scaler:
        scaler.load_state_dict(checkpoint["scaler"])
    state.load_state_dict(checkpoint)
    state.resumes += 1
    world_size = torch.distributed.get_world_size() if collectives.initialized() else 1
    if len(state.rng) != world_size and rank == 0:
        log.warning(
            "%s was written by %d processes and resumes on %d: rank r continues the random streams of rank "
            "min(r, %d), and the rest of an epoch stopped midway is not what an uninterrupted run would read",
            path,
            len(state.rng),
            world_size,
            len(state.rng) - 1,
        )
    set_rng_state(state.rng[min(rank, len(state.rng) - 1)])
    where = f"epoch {state.epoch + 1}" + (f", step {state.step + 1}" if state.step else "")
    log.info("resumed from %s: continuing at %s", path, where)


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """``torch.save(state)`` to ``path`` atomically, with ``format`` :data:`FORMAT`."""
    atomic_write(Path(path), lambda f: torch.save({**state, "format": FORMAT}, f))


def text_record(cfg: DictConfig) -> dict[str, Any] | None:
    """A text-query head's encoder, ``{"source", "config"}``, with which ``mlcls-predict classes=...`` embeds
    new names the same way (:func:`mlcls.text.encoder_from_stored`); None for another head."""
    if not has_text_queries(cfg.model.head):
        return None
    return {"source": build_encoder(cfg.text).source, "config": plain(cfg.text)}


def init_from_checkpoint(
    model: nn.Module, path: str, classes: list[str], trust: bool = False
) -> dict[str, Any]:
    """``model.init_from``: load the weights of the checkpoint ``path`` into ``model``; return the file's
    contents. With other classes (a new tag list) the head's class rows (:func:`class_rows`) of the classes
    both lists name are the file's, matched by name, the others keep their fresh initialisation, and the
    rest of the head is the file's (one log line: kept / new / dropped). A weight missing on either side or
    of another shape is a :class:`ConfigError` naming it and the file's network; so is a head whose weights
    are not one row per class (ML-Decoder with groups) when the lists share a class. Sharing none, such a
    head starts afresh whole."""
    state = load_checkpoint(path, trust=trust)
    weights = state["model"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(f"model.init_from={path}: 'model' is not a state dict (names to tensors)")
    stored = state.get("classes")
    stored = list(stored) if isinstance(stored, list) and all(isinstance(c, str) for c in stored) else []
    same_classes = stored == list(classes)
    classifier = model.get_classifier()
    head = next(name for name, module in model.named_modules() if module is classifier) + "."
    network = nested_get(state, "config", "model", "name", default="a model")
    head_name = nested_get(state, "config", "model", "head", "name", default="linear")
    fresh = model.state_dict()
    rows = None if same_classes else _class_rows(classifier, head, weights, fresh, stored, classes)
    shared = [name for name in classes if name in set(stored)]
    if rows is None and shared and not same_classes:
        raise ConfigError(
            f"model.init_from={path}: the file's {head_name} head shares {plural(len(shared), 'class')} with "
            "this run but its weights are not one row per class (ML-Decoder groups several classes per "
            "query): its rows cannot be matched by name; fine-tune a linear or csra head, or ML-Decoder with "
            "model.head.num_groups >= the number of classes"
        )
    if same_classes or rows is not None:  # the class rows are set below
        apart = set(rows or ())
    else:  # no class row to keep: the whole head starts afresh
        apart = {key for key in [*fresh, *weights] if key.startswith(head)}
    expected = {k: v for k, v in fresh.items() if k not in apart}
    loaded = {k: v for k, v in weights.items() if k not in apart}
    difference = weights_difference(expected, loaded, "this run's model")
    if difference is not None:
        raise ConfigError(
            f"model.init_from={path}: {difference}; the file holds {network} with a {head_name} head (set "
            "model.name, model.head and the head's options to it)"
        )
    if rows:
        position = {name: c for c, name in enumerate(stored)}
        new = torch.tensor([c for c, name in enumerate(classes) if name in position], dtype=torch.long)
        old = torch.tensor([position[classes[c]] for c in new.tolist()], dtype=torch.long)
        for key in rows:
            loaded[key] = fresh[key].clone()
            loaded[key][new] = weights[key][old].to(fresh[key].dtype)
    model.load_state_dict(loaded, strict=same_classes or rows is not None)
    if not same_classes:
        log.info(
            "model.init_from=%s: the file's classes (%d) are not this run's (%d): %d kept (their head rows, "
            "by name), %d new (initialised as a fresh head), %d dropped",
            path,
            len(stored),
            len(classes),
            len(shared),
            len(classes) - len(shared),
            len(set(stored) - set(classes)),
        )
    return state


def _class_rows(
    classifier: nn.Module,
    head: str,
    weights: Mapping[str, torch.Tensor],
    fresh: Mapping[str, torch.Tensor],
    stored: list[str],
    classes: list[str],
) -> list[str] | None:
    """The state-dict keys (under ``head``) of the classifier's class rows (:func:`class_rows`), when each
    is one row per class both in the file's ``weights`` (``stored`` classes) and in the model's ``fresh``
    state (``classes``), else None."""
    names = class_rows(classifier)
    if names is None or not stored:
        return None
    keys = [head + name for name in names]
    for key in keys:
        if key not in weights or key not in fresh:
            return None
        if weights[key].shape != (len(stored), *fresh[key].shape[1:]) or fresh[key].shape[0] != len(classes):
            return None
    return keys


def carry_loss_state(criterion: Any, state: dict[str, Any], path: str, loss_target: str) -> None:
    """``model.init_from`` for a loss with state (ROLE's, LL-Cp's, EM + APL's): it continues from the
    file's ``loss`` when trained with the same ``_target_`` and tensors of this run's names, shapes and
    dtypes (the same training set), else starts afresh (one log line): Cole et al.'s LinearInit."""
    current = criterion.state_dict() if isinstance(criterion, nn.Module) else {}
    if not current:
        return
    stored = state.get("loss")
    fits = (
        isinstance(stored, dict)
        and nested_get(state, "config", "loss", "_target_") == loss_target
        and stored.keys() == current.keys()
        and all(
            isinstance(stored[k], torch.Tensor) and stored[k].shape == v.shape and stored[k].dtype == v.dtype
            for k, v in current.items()
        )
    )
    if fits:
        criterion.load_state_dict(stored)
        log.info(
            "model.init_from=%s: the loss's state (%s) continues from the file", path, ", ".join(current)
        )
    else:
        log.info(
            "model.init_from=%s: the loss's state starts afresh (the file holds none of this loss for this "
            "training set)",
            path,
        )


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
