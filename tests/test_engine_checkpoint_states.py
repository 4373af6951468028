"""Resuming from a crafted ``last.pt``: every stored state is checked against the live objects before any
``load_state_dict`` (:mod:`mlcls.engine.state`), so a crafted state is one line and never reaches
a kernel. Each crafted checkpoint is resumed in a forked child under a memory cap and a time limit
(tests/hostile.py): a segmentation fault there shows as the error "Killed"."""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, compose_config
from hostile import bounded
from hydra.utils import instantiate

from mlcls.cli.train import run
from mlcls.data import build_dataset
from mlcls.engine.build import build_loss, build_model, build_optimization
from mlcls.engine.checkpoint import load_checkpoint, restore, save_checkpoint
from mlcls.engine.ema import ModelEma
from mlcls.engine.state import CheckpointError, RunBounds, TrainState, check_part
from mlcls.engine.trainer import Trainer

# One epoch of the tiny run (fused SGD) with a loss that has state (ROLE's label table, trained by the
# optimizer) and an EMA: every part a resume loads. trainer.epochs=2 when resumed.
RUN = [*TINY, "trainer.epochs=1", "loss=role", "loss.expected_positives=2.0", "trainer.ema_decay=0.9"]
EPOCHS = 2
ITERS_PER_EPOCH = 192 // 32  # dataset.train_size // trainer.batch_size, the last partial batch dropped
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A run directory after one real epoch, and its ``last.pt`` as loaded."""
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    run(compose_config([*RUN, "optim=sgd"]), run_dir=run_dir)
    checkpoint = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert checkpoint["scheduler"]["last_epoch"] == ITERS_PER_EPOCH  # the reference the bounds use
    return run_dir, checkpoint


def build_parts(optim: str) -> tuple[dict[str, Any], Any]:
    """This run's model, ROLE loss, EMA, optimizer (``optim``: sgd or adamw, both fused) and schedule,
    fresh, as :func:`mlcls.engine.build.build_run` makes them before it resumes; and the config."""
    cfg = compose_config([*RUN, f"trainer.epochs={EPOCHS}", f"optim={optim}", "optim.fused=true"])
    torch.manual_seed(0)
    train_set = build_dataset(cfg.dataset, train=True)
    model = build_model(cfg.model, len(train_set.classes), CPU, pretrained=False)
    criterion = build_loss(instantiate(cfg.loss), train_set, CPU)
    optimizer, scheduler = build_optimization(cfg, model, ITERS_PER_EPOCH, criterion)
    ema = ModelEma(model, cfg.trainer.ema_decay)
    parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loss": criterion, "ema": ema}
    return parts, cfg


@pytest.fixture(scope="module")
def fresh() -> dict[str, tuple[dict[str, Any], Any]]:
    """Fresh parts and config per optimizer, built once: each bounded child restores into its own copy."""
    return {optim: build_parts(optim) for optim in ("sgd", "adamw")}


@pytest.fixture(scope="module")
def checkpoints(genuine) -> dict[str, dict[str, Any]]:
    """The genuine ``last.pt`` per optimizer: for AdamW, its optimizer and schedule state replaced by
    those of one fused-AdamW step of parts built as the run builds them."""
    _, checkpoint = genuine
    parts, _ = build_parts("adamw")
    train_one_step(parts)
    adamw = {"optimizer": parts["optimizer"].state_dict(), "scheduler": parts["scheduler"].state_dict()}
    return {"sgd": checkpoint, "adamw": {**checkpoint, **adamw}}


def train_one_step(parts: dict[str, Any]) -> None:
    """One optimizer and schedule step with gradients of ones: what a resumed run does first."""
    for group in parts["optimizer"].param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    parts["optimizer"].step()
    parts["scheduler"].step()
    if "ema" in parts:
        parts["ema"].update(parts["model"])


def resume_and_train(checkpoint: dict[str, Any], parts: dict[str, Any], cfg: Any) -> str:
    """Restore ``checkpoint`` into the fresh ``parts`` as ``trainer.resume`` does, then train one step."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = TrainState()
    bounds = RunBounds(EPOCHS, ITERS_PER_EPOCH, len(checkpoint["classes"]))
    restore(checkpoint, Path("last.pt"), parts, scaler, state, cfg.trainer.amp, 0, bounds)
    train_one_step(parts)
    return f"resumed at epoch {state.epoch}, step {state.step}"


def assert_one_line(outcome, *words: str) -> None:
    assert not outcome.escaped, (outcome.error, outcome.message, outcome.trace[-1500:])
    assert outcome.error == "CheckpointError", (outcome.error, outcome.message, outcome.trace[-1500:])
    assert "\n" not in outcome.message and "last.pt" in outcome.message
    for word in words:
        assert word in outcome.message, outcome.message


def _moments(change):
    """Each optimizer state tensor (not ``step``) replaced by ``change(tensor, key)``."""

    def mutate(checkpoint: dict[str, Any]) -> None:
        for state in checkpoint["optimizer"]["state"].values():
            for key in state:
                if key != "step":
                    state[key] = change(state[key], key)

    return mutate


def _optimizer_tensors(shape: tuple[int, ...]):
    return _moments(lambda tensor, key: torch.zeros(shape))


def _permuted(tensor: torch.Tensor, key: str) -> torch.Tensor:
    """The same values in another layout: channels_last for a 4-d weight, transposed for a 2-d one."""
    if tensor.dim() == 4:
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor.t().contiguous().t() if tensor.dim() == 2 else tensor


def _poisoned(value: float, only: str | None = None):
    return _moments(lambda tensor, key: tensor if only not in (None, key) else torch.full_like(tensor, value))


def _set(**values: Any):
    return lambda checkpoint: checkpoint.update(values)


def _rng(**values: Any):
    return lambda checkpoint: checkpoint["rng"][0].update(values)


def _numpy_position(checkpoint: dict[str, Any]) -> None:
    """NumPy's generator state with its position far past the 624-word key: NumPy's set_state takes it, and
    its next draw reads past the key (a segmentation fault)."""
    algorithm, keys, _, *gauss = checkpoint["rng"][0]["numpy"]
    checkpoint["rng"][0]["numpy"] = (algorithm, keys, 10**8, *gauss)


def _without(key: str):
    def mutate(checkpoint: dict[str, Any]) -> None:
        for state in checkpoint["optimizer"]["state"].values():
            del state[key]

    return mutate


def _loss_state(checkpoint: dict[str, Any]) -> None:
    checkpoint["loss"]["label_logits"] = torch.zeros(3, 3)


def _scheduler(checkpoint: dict[str, Any]) -> None:
    checkpoint["scheduler"].update(last_epoch=-7, _step_count=-1)


CRAFTED = [
    # (optimizer, what is crafted, mutation, words the one line must hold)
    ("sgd", "optimizer tensors of 1 element", _optimizer_tensors((1,)), ["momentum_buffer", "of shape (1,)"]),
    ("sgd", "optimizer tensors of 3x3", _optimizer_tensors((3, 3)), ["momentum_buffer", "of shape (3, 3)"]),
    ("adamw", "optimizer tensors of 1 element", _optimizer_tensors((1,)), ["exp_avg", "of shape (1,)"]),
    ("adamw", "optimizer tensors of 3x3", _optimizer_tensors((3, 3)), ["exp_avg", "of shape (3, 3)"]),
    ("sgd", "epoch -5", _set(epoch=-5), ["epoch holds -5", "from 0 to 2"]),
    ("sgd", "epoch -10**12", _set(epoch=-(10**12)), ["epoch holds -1000000000000", "from 0 to 2"]),
    ("sgd", "epoch past trainer.epochs", _set(epoch=3), ["epoch holds 3", "from 0 to 2"]),
    ("sgd", "step past the epoch", _set(step=ITERS_PER_EPOCH), ["step holds 6", "from 0 to 5"]),
    ("sgd", "step negative", _set(step=-1), ["step holds -1"]),
    (
        "sgd",
        "torch rng of 7 bytes",
        _rng(torch=torch.zeros(7, dtype=torch.uint8)),
        ["rng[0]['torch']", "(7,)"],
    ),
    ("sgd", "torch rng as floats", _rng(torch=torch.zeros(5056)), ["rng[0]['torch']", "float32"]),
    (
        "sgd",
        "numpy rng short",
        _rng(numpy=("MT19937", torch.zeros(3, dtype=torch.int64), 0, 0, 0.0)),
        ["numpy"],
    ),
    # old: resumed, and the first draw of NumPy's generator read past its key
    ("sgd", "numpy position past the key", _numpy_position, ["rng[0]['numpy']", "position 100000000"]),
    ("adamw", "exp_avg_sq missing", _without("exp_avg_sq"), ["a dict with keys exp_avg, exp_avg_sq, step"]),
    ("sgd", "python rng a string", _rng(python="x"), ["rng[0]['python'] holds 'x'"]),
    ("sgd", "no rng", _set(rng=[]), ["rng holds a list of 0 items"]),
    (
        "sgd",
        "partial progress of other keys",
        _set(step=2, partial=[{"loss_sum": "x", "bogus": 1}]),
        ["partial[0]"],
    ),
    (
        "sgd",
        "partial progress negative",
        _set(step=2, partial=[{"seen": -3}]),
        ["partial[0]['seen'] holds -3"],
    ),
    ("sgd", "ROLE's label table 3x3", _loss_state, ["loss['label_logits']", "(3, 3)", "(192, "]),
    # old: these resumed and trained on, changing every later step
    ("sgd", "momentum NaN", _poisoned(math.nan), ["momentum_buffer']", "not finite; expected finite"]),
    ("adamw", "exp_avg +inf", _poisoned(math.inf, "exp_avg"), ["exp_avg']", "not finite"]),
    ("adamw", "exp_avg_sq negative", _poisoned(-1.0, "exp_avg_sq"), ["exp_avg_sq']", "and at least 0"]),
    (
        "sgd",
        "ROLE's label table +inf",
        lambda c: c["loss"]["label_logits"].fill_(math.inf),
        ["loss['label_logits'] holds", "not finite"],
    ),
    # old: a NotImplementedError traceback
    ("adamw", "exp_avg on the meta device", _moments(lambda t, k: t.to("meta")), ["on the meta device"]),
    ("sgd", "scheduler counters negative", _scheduler, ["scheduler['last_epoch'] holds -7"]),
    ("sgd", "EMA updates negative", lambda c: c["ema"].update(updates=-1), ["ema['updates'] holds -1"]),
    ("sgd", "history of strings", _set(history=["x"]), ["history[0] holds 'x'"]),
    ("sgd", "resumes a float", _set(resumes=1.5), ["resumes holds 1.5"]),
    ("sgd", "thresholds of 2 classes", _set(thresholds=torch.zeros(2)), ["thresholds", "(2,)"]),
    (  # the old code loaded the model, then the optimizer's load-state hook raised a ValueError
        "sgd",
        "optimizer group renamed",
        lambda c: c["optimizer"]["param_groups"][0].update(name="head_norm"),
        ["optimizer param_groups[0]['name'] holds 'head_norm'", "expected 'head'"],
    ),
]


@pytest.mark.slow
def test_the_genuine_checkpoint_resumes_and_trains(checkpoints, fresh) -> None:
    for optim, stored in checkpoints.items():
        outcome = bounded(resume_and_train, stored, *fresh[optim])
        assert outcome.error is None, (optim, outcome.error, outcome.message, outcome.trace[-1500:])
        assert outcome.value == "resumed at epoch 1, step 0"


@pytest.mark.slow
@pytest.mark.parametrize(("optim", "what", "mutate", "words"), CRAFTED, ids=[c[1] for c in CRAFTED])
def test_a_crafted_state_is_one_line_and_never_reaches_a_kernel(
    checkpoints, fresh, optim, what, mutate, words
) -> None:
    stored = copy.deepcopy(checkpoints[optim])
    mutate(stored)
    assert_one_line(bounded(resume_and_train, stored, *fresh[optim]), *words)


def resume_and_weights(checkpoint: dict[str, Any], parts: dict[str, Any], cfg: Any) -> dict[str, Any]:
    resume_and_train(checkpoint, parts, cfg)
    return parts["model"].state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_moments_laid_out_otherwise_resume_as_in_the_weights_layout(checkpoints, fresh, optim) -> None:
    """The moments (momentum; exp_avg, exp_avg_sq: one step's are constant, so scaled along their elements)
    channels_last for 4-d weights, transposed for 2-d ones: the weights after one resumed step equal those of
    the same values in the weights' layout. Old: the fused kernels read them in the weights' order, rc 0 and
    weights off."""
    varied = copy.deepcopy(checkpoints[optim])
    _moments(lambda tensor, key: tensor * torch.linspace(1, 2, tensor.numel()).view(tensor.shape))(varied)
    permuted = copy.deepcopy(varied)
    _moments(_permuted)(permuted)
    states = permuted["optimizer"]["state"].values()
    assert any(not value.is_contiguous() for state in states for value in state.values())
    reference = bounded(resume_and_weights, varied, *fresh[optim])
    outcome = bounded(resume_and_weights, permuted, *fresh[optim])
    assert reference.error is None and outcome.error is None, (outcome.error, outcome.message)
    differing = [key for key, value in reference.value.items() if not torch.equal(outcome.value[key], value)]
    assert not differing, differing


@pytest.mark.slow
def test_trainer_resume_refuses_a_negative_epoch_in_one_line(genuine, tmp_path) -> None:
    """Through the real door (``trainer.resume=auto`` in :func:`build_run`): the old code trained 7 epochs
    from epoch -5; ``step`` is bounded by this run's iterations per epoch, which build_run passes on."""
    run_dir, checkpoint = genuine
    for crafted in ({**checkpoint, "epoch": -5}, {**checkpoint, "step": ITERS_PER_EPOCH}):
        (tmp_path / "checkpoints").mkdir(exist_ok=True)
        save_checkpoint(crafted, tmp_path / "checkpoints" / "last.pt")
        cfg = compose_config(
            [
                *RUN,
                "optim=sgd",
                f"trainer.epochs={EPOCHS}",
                "trainer.resume=auto",
            ]
        )
        outcome = bounded(lambda c=cfg: Trainer(c, run_dir=tmp_path).state.epoch, seconds=60)
        assert_one_line(outcome, "epoch holds -5" if crafted["epoch"] == -5 else "step holds 6")


# ----------------------------------------------------------------------------- fuzz
MUTATIONS = 48
BATCH = 16  # mutations per forked child
VALUES: list[Any] = [
    0,
    -1,
    1,
    7,
    -(10**12),
    2**63,
    10**30,
    1.5,
    -0.5,
    math.nan,
    math.inf,
    "x",
    "",
    None,
    True,
    [],
    {},
    [1, 2],
]


def _tensor_variants(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [
        torch.zeros(1),
        torch.zeros(3, 3),
        torch.zeros(0),
        torch.zeros(()),
        torch.zeros(tensor.shape, dtype=torch.int64),
        torch.zeros(tensor.shape, dtype=torch.float16),
        torch.zeros((*tensor.shape, 2)),
        torch.zeros(tensor.shape).as_strided(tuple(tensor.shape), (0,) * tensor.dim())
        if tensor.dim()
        else tensor,
    ]


def _paths(data: Any, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Every key path in the checkpoint's resumed fields, containers and leaves."""
    found = [prefix] if prefix else []
    if depth > 5:
        return found
    if isinstance(data, dict):
        for key, value in data.items():
            if prefix or key not in ("config", "classes", "preprocess", "thresholds_split"):  # not resumed
                found += _paths(value, (*prefix, key), depth + 1)
    elif isinstance(data, (list, tuple)) and len(data) < 50:  # not into Python's 625-entry rng state
        for index, value in enumerate(data):
            found += _paths(value, (*prefix, index), depth + 1)
    return found


def _replaced(data: Any, path: tuple, new: Any) -> Any:
    """``data`` with the value at ``path`` replaced by ``new``: the containers on the path copied, the rest
    shared (a restore never changes the checkpoint it reads)."""
    key, *rest = path
    value = _replaced(data[key], tuple(rest), new) if rest else new
    if isinstance(data, dict):
        return {**data, key: value}
    items = list(data)
    items[key] = value
    return type(data)(items)


def _mutated(checkpoint: dict[str, Any], path: tuple, rng: random.Random) -> dict[str, Any]:
    old = checkpoint
    for key in path:
        old = old[key]
    return _replaced(
        checkpoint, path, rng.choice(_tensor_variants(old) if isinstance(old, torch.Tensor) else VALUES)
    )


def resume_each(crafted: list[dict[str, Any]], parts: dict[str, Any], cfg: Any) -> list[tuple[str, str]]:
    """:func:`resume_and_train` of each checkpoint into its own copy of ``parts``: ("resumed", where) or
    ("CheckpointError", its line); any other exception escapes (and fails the test)."""
    outcomes = []
    for checkpoint in crafted:
        try:
            outcomes.append(("resumed", resume_and_train(checkpoint, copy.deepcopy(parts), cfg)))
        except CheckpointError as exc:
            outcomes.append(("CheckpointError", str(exc)))
    return outcomes


@pytest.mark.slow
def test_fuzzed_resume_states_resume_or_stop_in_one_line(checkpoints, fresh) -> None:
    """Seeded mutations of a genuine last.pt's fields (shapes, dtypes, counters, types, huge values), each
    resumed through :func:`restore` and a training step: each resumes and trains, or stops in one line.
    Each mutation picks a resumed field (model, optimizer, ..., epoch, rng) uniformly, then a place in it;
    a forked child under the caps resumes a batch of them (a crash there fails the whole batch)."""
    rng = random.Random(35)
    by_field: dict[Any, list[tuple]] = {}
    for optim, checkpoint in checkpoints.items():
        for path in _paths(checkpoint):
            by_field.setdefault((optim, path[0]), []).append(path)
    fields = sorted(by_field, key=str)
    batches: dict[str, list[tuple[tuple, dict[str, Any]]]] = {"sgd": [], "adamw": []}
    for _ in range(MUTATIONS):
        optim, field = rng.choice(fields)
        path = rng.choice(by_field[optim, field])
        batches[optim].append((path, _mutated(checkpoints[optim], path, rng)))
    counts = {"resumed": 0, "CheckpointError": 0}
    for optim, mutations in batches.items():
        for start in range(0, len(mutations), BATCH):
            batch = mutations[start : start + BATCH]
            paths = [path for path, _ in batch]
            outcome = bounded(resume_each, [c for _, c in batch], *fresh[optim], seconds=60)
            assert not outcome.escaped and outcome.error is None, (
                paths,
                outcome.error,
                outcome.trace[-2000:],
            )
            for path, (kind, line) in zip(paths, outcome.value, strict=True):
                assert "\n" not in line, (path, line)
                counts[kind] += 1
    assert counts["CheckpointError"] > MUTATIONS // 2 and sum(counts.values()) == MUTATIONS, counts


def test_a_state_dict_of_other_keys_names_the_first_one_in_one_line() -> None:
    """Model, loss, EMA and scheduler states go through one check (check_like): the first key missing or
    extra, never a list of every key of the model."""
    linear = torch.nn.Linear(2, 3)
    state = linear.state_dict()
    with pytest.raises(CheckpointError, match=r"^model lacks bias; expected this run's 2 entries$"):
        check_part("model", {"weight": state["weight"]}, linear, RunBounds())
    with pytest.raises(CheckpointError, match=r"^ema\['module'\] holds 'extra', which this run lacks$"):
        check_part("ema", {"module": {**state, "extra": 1}, "updates": 0}, ModelEma(linear, 0.9), RunBounds())
    with pytest.raises(CheckpointError, match=r"^model\['bias'\] holds a float32 tensor of shape \(2,\)"):
        check_part("model", {**state, "bias": torch.zeros(2)}, linear, RunBounds())
