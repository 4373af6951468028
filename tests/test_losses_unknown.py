"""Tests of the losses for unknown labels (an, an_ls, wan, epr, em, ll, hill, splc).

Each loss is compared, value and gradient, with a float64 reference written in this file as a plain loop
over the entries from the paper's equation, on labels holding positives, observed negatives and unknown
labels (-1). The papers' label convention (1 observed positive, 0 unobserved) maps to mlcls's 1 and -1.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, compose_config
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import Tensor

from mlcls import config_dir, losses
from mlcls.losses import (
    AssumeNegativeLoss,
    EntropyMaximisationLoss,
    ExpectedPositiveLoss,
    HillLoss,
    LabelSmoothedAssumeNegativeLoss,
    LargeLossLoss,
    SPLCLoss,
    WeakAssumeNegativeLoss,
)
from mlcls.losses.common import REDUCTIONS

UNKNOWN_CLASSES: dict[str, type[torch.nn.Module]] = {
    "an": AssumeNegativeLoss,
    "an_ls": LabelSmoothedAssumeNegativeLoss,
    "wan": WeakAssumeNegativeLoss,
    "epr": ExpectedPositiveLoss,
    "em": EntropyMaximisationLoss,
    "ll": LargeLossLoss,
    "hill": HillLoss,
    "splc": SPLCLoss,
}
# the arguments a loss needs besides its defaults (epr has no default k)
REQUIRED = {"epr": {"expected_positives": 2.9}}
F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def random_batch(rows: int = 6, classes: int = 7, seed: int = 0) -> tuple[Tensor, Tensor]:
    """float64 logits in about [-6, 6] and labels with positives, observed negatives and unknowns."""
    generator = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(rows, classes, generator=generator, dtype=F64)
    draw = torch.rand(rows, classes, generator=generator, dtype=F64)
    targets = torch.where(draw < 0.25, 1.0, torch.where(draw < 0.45, 0.0, -1.0)).to(F64)
    assert (targets == -1).any() and (targets == 0).any() and (targets == 1).any()
    return logits, targets


def value_and_grad(fn: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    leaf = x.detach().clone().requires_grad_(True)
    value = fn(leaf)
    (grad,) = torch.autograd.grad(value, leaf)
    return value.detach(), grad


def assert_matches(loss: Callable, reference: Callable, x: Tensor, y: Tensor) -> None:
    value, grad = value_and_grad(lambda a: loss(a, y), x)
    ref_value, ref_grad = value_and_grad(lambda a: reference(a, y), x)
    torch.testing.assert_close(value, ref_value, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)


# ---------------------------------------------------------------------------------------------------------
# float64 references, one entry at a time, p = 1 / (1 + e^-x)


def sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def log_p(x: Tensor) -> Tensor:
    return torch.log(sigmoid(x))


def log_not_p(x: Tensor) -> Tensor:
    return torch.log(1.0 - sigmoid(x))


def reduce(total: Tensor, rows: int, classes: int, reduction: str) -> Tensor:
    """The reductions of the docstrings: every entry counts (mean over B C, sum, sum / B)."""
    return {"mean": total / (rows * classes), "sum": total, "sum_per_sample": total / rows}[reduction]


def ref_entrywise(entry: Callable[[Tensor, float, int], Tensor], reduction: str = "mean") -> Callable:
    """The loss whose entry term is ``entry(x_ic, y_ic, C)``, reduced over all entries."""

    def loss(x: Tensor, y: Tensor) -> Tensor:
        rows, classes = x.shape
        total = torch.zeros((), dtype=F64)
        for i in range(rows):
            for c in range(classes):
                total = total + entry(x[i, c], float(y[i, c]), classes)
        return reduce(total, rows, classes, reduction)

    return loss


def an_entry(x: Tensor, y: float, classes: int) -> Tensor:
    return -log_p(x) if y == 1 else -log_not_p(x)  # Cole et al. eq. 4: unobserved -> negative


def an_ls_entry(eps: float) -> Callable:
    def entry(x: Tensor, y: float, classes: int) -> Tensor:
        if y == 1:
            return -(1 - eps) * log_p(x) - eps * log_not_p(x)
        return -(1 - eps) * log_not_p(x) - eps * log_p(x)

    return entry


def wan_entry(x: Tensor, y: float, classes: int) -> Tensor:
    if y == -1:
        return -log_not_p(x) / (classes - 1)  # Cole et al. eq. 5, gamma = 1 / (L - 1)
    return an_entry(x, y, classes)


def em_entry(alpha: float) -> Callable:
    def entry(x: Tensor, y: float, classes: int) -> Tensor:
        if y == -1:
            p = sigmoid(x)
            entropy = -p * torch.log(p) - (1 - p) * torch.log(1 - p)
            return -alpha * entropy  # Zhou et al. eq. 3: maximise the entropy of unknown labels
        return an_entry(x, y, classes)

    return entry


def focal_margin(x: Tensor, margin: float, gamma: float) -> Tensor:
    p_m = sigmoid(x - margin)
    return -((1 - p_m) ** gamma) * torch.log(p_m)


def hill_entry(lamb: float, margin: float, gamma: float) -> Callable:
    def entry(x: Tensor, y: float, classes: int) -> Tensor:
        if y == 1:
            return focal_margin(x, margin, gamma)
        p = sigmoid(x)
        return (lamb - p) * p**2  # Zhang et al. eq. 9, for every label not observed positive

    return entry


def splc_entry(tau: float, change_epoch: int, margin: float, gamma: float, epoch: int) -> Callable:
    def entry(x: Tensor, y: float, classes: int) -> Tensor:
        if y == 1:
            return focal_margin(x, margin, gamma)
        p = sigmoid(x)
        if y == -1 and epoch >= change_epoch and float(p.detach()) > tau:
            return -((1 - p) ** gamma) * torch.log(p)  # corrected to a positive, no margin
        return -(p**gamma) * torch.log(1 - p)

    return entry


def ref_epr(k: float) -> Callable:
    """Cole et al. eq. 6: observed labels' BCE over B C entries + (mean_i sum_c p_ic - k)^2 / C^2."""

    def loss(x: Tensor, y: Tensor) -> Tensor:
        rows, classes = x.shape
        total = torch.zeros((), dtype=F64)
        expected = torch.zeros((), dtype=F64)
        for i in range(rows):
            for c in range(classes):
                if y[i, c] != -1:
                    total = total + an_entry(x[i, c], float(y[i, c]), classes)
                expected = expected + sigmoid(x[i, c]) / rows
        return total / (rows * classes) + (expected - k) ** 2 / classes**2

    return loss


def ref_ll(mode: str, delta_rel: float, epoch: int, reduction: str = "mean") -> Callable:
    """Kim et al.: at epoch t (1-based) the unobserved labels with the ceil(B C (t - 1) delta_rel) largest
    assumed-negative losses of the batch are rejected (loss 0) or corrected (BCE against 1)."""

    def loss(x: Tensor, y: Tensor) -> Tensor:
        rows, classes = x.shape
        count = math.ceil(rows * classes * min(epoch * delta_rel, 1.0))
        entries = [(i, c) for i in range(rows) for c in range(classes)]
        unknown_losses = sorted(
            (float(-log_not_p(x[i, c]).detach()) for i, c in entries if y[i, c] == -1), reverse=True
        )
        threshold = unknown_losses[count - 1] if 0 < count <= len(unknown_losses) else -math.inf
        total = torch.zeros((), dtype=F64)
        for i in range(rows):
            for c in range(classes):
                large = count > 0 and y[i, c] == -1 and float(-log_not_p(x[i, c]).detach()) >= threshold
                if not large:
                    total = total + an_entry(x[i, c], float(y[i, c]), classes)
                elif mode == "ct":
                    total = total - log_p(x[i, c])
        return reduce(total, rows, classes, reduction)

    return loss


# ---------------------------------------------------------------------------------------------------------
# each loss against its reference


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    ("name", "kwargs", "entry"),
    [
        ("an", {}, an_entry),
        ("an_ls", {"ls_coef": 0.1}, an_ls_entry(0.1)),
        ("an_ls", {"ls_coef": 0.3}, an_ls_entry(0.3)),
        ("wan", {}, wan_entry),
        ("em", {"alpha": 0.1}, em_entry(0.1)),
        ("em", {"alpha": 0.2}, em_entry(0.2)),
        ("hill", {}, hill_entry(1.5, 1.0, 2.0)),
        ("hill", {"lamb": 1.2, "margin": 0.5, "gamma": 1.0}, hill_entry(1.2, 0.5, 1.0)),
    ],
    ids=["an", "an_ls", "an_ls-0.3", "wan", "em", "em-0.2", "hill", "hill-other"],
)
def test_entrywise_losses_equal_their_equations(name, kwargs, entry, reduction):
    x, y = random_batch(seed=1)
    loss = UNKNOWN_CLASSES[name](**kwargs, reduction=reduction)
    assert_matches(loss, ref_entrywise(entry, reduction), x, y)


def test_an_is_bce_with_unknown_labels_as_negatives():
    """AN is torch's BCE on the labels with -1 replaced by 0, averaged over every entry."""
    x, y = random_batch(seed=2)
    expected = F.binary_cross_entropy_with_logits(x, y.clamp(min=0))
    torch.testing.assert_close(AssumeNegativeLoss()(x, y), expected, **TOL)


@pytest.mark.parametrize("k", [1.5, 2.9, 31.4])
def test_epr_equals_its_equation(k):
    x, y = random_batch(seed=3)
    assert_matches(ExpectedPositiveLoss(expected_positives=k), ref_epr(k), x, y)


@pytest.mark.parametrize("epoch", [0, 1, 4])
@pytest.mark.parametrize(
    "kwargs", [{}, {"tau": 0.7, "change_epoch": 2, "margin": 0.5, "gamma": 1.0, "reduction": "sum"}]
)
def test_splc_equals_its_equation(kwargs, epoch):
    x, y = random_batch(seed=4)
    settings = {"tau": 0.6, "change_epoch": 1, "margin": 1.0, "gamma": 2.0, "reduction": "mean", **kwargs}
    loss = SPLCLoss(**settings)
    loss.set_epoch(epoch)
    reduction = settings.pop("reduction")
    assert_matches(loss, ref_entrywise(splc_entry(**settings, epoch=epoch), reduction), x, y)
    corrected = (y == -1) & (torch.sigmoid(x) > settings["tau"])
    assert corrected.any()  # the batch exercises the correction once it is on


@pytest.mark.parametrize("mode", ["r", "ct"])
@pytest.mark.parametrize(
    ("delta_rel", "epoch"), [(0.05, 0), (0.05, 1), (0.05, 2), (0.1, 3), (0.5, 3), (0.002, 5)]
)
def test_ll_equals_its_equation(mode, delta_rel, epoch):
    """k = ceil(B C R) of the 42 entries: 0, 3, 5, 13, all the unknown ones (R = 1), 1."""
    x, y = random_batch(seed=5)
    loss = LargeLossLoss(mode=mode, delta_rel=delta_rel)
    loss.set_epoch(epoch)
    assert_matches(loss, ref_ll(mode, delta_rel, epoch), x, y)
    assert loss.rejection_rate == min(epoch * delta_rel, 1.0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ll_reductions(reduction):
    x, y = random_batch(seed=6)
    loss = LargeLossLoss(mode="ct", delta_rel=0.1, reduction=reduction)
    loss.set_epoch(2)
    assert_matches(loss, ref_ll("ct", 0.1, 2, reduction), x, y)


def test_ll_first_epoch_is_assume_negative_and_rejection_changes_the_loss():
    x, y = random_batch(seed=7)
    loss = LargeLossLoss(delta_rel=0.1)
    torch.testing.assert_close(loss(x, y), AssumeNegativeLoss()(x, y), **TOL)
    loss.set_epoch(1)
    assert loss(x, y) < AssumeNegativeLoss()(x, y)  # the largest assumed-negative losses are gone


# ---------------------------------------------------------------------------------------------------------
# what each loss does with -1


@pytest.mark.parametrize("name", sorted(UNKNOWN_CLASSES))
def test_unknown_labels_get_a_term(name):
    """Every new loss uses the unknown labels: moving their logits changes the loss (the zoo's other
    losses exclude them, tests/test_losses.py::test_unknown_entries_are_excluded)."""
    x, y = random_batch(seed=8)
    kwargs = {"mode": "ct"} if name == "ll" else REQUIRED.get(name, {})  # LL-R's rejected ones get 0
    loss = UNKNOWN_CLASSES[name](**kwargs)
    if hasattr(loss, "set_epoch"):
        loss.set_epoch(3)
    _, grad = value_and_grad(lambda a: loss(a, y), x)
    assert (grad[y == -1] != 0).all()


@pytest.mark.parametrize("name", sorted(UNKNOWN_CLASSES))
def test_finite_for_extreme_logits_and_all_unknown_rows(name):
    x, y = random_batch(seed=9)
    x[0, :3] = torch.tensor([1e4, -1e4, 80.0], dtype=F64)
    y[1] = -1.0
    loss = UNKNOWN_CLASSES[name](**REQUIRED.get(name, {}))
    if hasattr(loss, "set_epoch"):
        loss.set_epoch(3)
    for dtype in (F64, torch.float32):
        value, grad = value_and_grad(lambda a, d=dtype: loss(a, y.to(d)), x.to(dtype))
        assert torch.isfinite(value) and torch.isfinite(grad).all(), (name, dtype)


def test_docs_table_states_what_every_loss_does_with_unknown_labels():
    text = (config_dir().parent.parent / "docs" / "losses.md").read_text()
    section = text.split("## Unknown labels (-1)", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.M))
    assert rows == {getattr(losses, cls).name for cls in losses.__all__}


# ---------------------------------------------------------------------------------------------------------
# the epoch: set by the trainer, resumed exactly


def test_ll_epoch_state_round_trips_mid_run():
    """A loss restored from ``state_dict()`` mid-run gives bit-identical losses to the one that went on."""
    batches = [random_batch(seed=20 + s) for s in range(4)]
    running = LargeLossLoss(mode="ct", delta_rel=0.05)
    running.set_epoch(2)
    values = [running(x, y) for x, y in batches[:2]]
    state = running.state_dict()
    restored = LargeLossLoss(mode="ct", delta_rel=0.05)
    assert restored(*batches[2]) != running(*batches[2])  # a fresh loss (epoch 0) differs
    restored.load_state_dict(state)
    for x, y in batches[2:]:
        value = running(x, y)
        assert torch.equal(restored(x, y), value)
        values.append(value)
    assert state == {"_extra_state": {"epoch": 2}} and restored.epoch == 2
    splc = SPLCLoss()
    splc.set_epoch(3)
    fresh = SPLCLoss()
    fresh.load_state_dict(splc.state_dict())
    assert fresh.epoch == 3 and torch.equal(fresh(*batches[0]), splc(*batches[0]))


@pytest.mark.slow
def test_trainer_tells_the_loss_the_epoch_and_a_resumed_run_matches(tmp_path, monkeypatch):
    """``set_epoch`` is called before every epoch, the resumed one included; resuming after the first
    epoch gives the uninterrupted run's weights."""
    from mlcls.cli.train import run
    from mlcls.engine.trainer import Trainer

    seen: list[int] = []
    original = LargeLossLoss.set_epoch
    monkeypatch.setattr(
        LargeLossLoss, "set_epoch", lambda self, epoch: (seen.append(epoch), original(self, epoch))
    )
    tiny = [
        *TINY,
        "dataset.train_size=64",
        "dataset.val_size=16",
        "model.name=test_resnet",
        "loss=ll",
        "loss.delta_rel=0.5",
    ]
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight = run(compose_config([*tiny]), run_dir=straight_dir)
    assert seen == [0, 1]

    class StopAfterFirstEpoch(Trainer):
        def save(self, is_best: bool) -> None:
            super().save(is_best)
            if self.state.epoch == 1:
                raise KeyboardInterrupt

    seen.clear()
    with pytest.raises(KeyboardInterrupt):
        StopAfterFirstEpoch(compose_config([*tiny]), run_dir=resumed_dir).fit()
    resumed = run(compose_config([*tiny, "trainer.resume=auto"]), run_dir=resumed_dir)
    assert seen == [0, 1]
    a = torch.load(straight_dir / "checkpoints" / "last.pt", weights_only=False)["model"]
    b = torch.load(resumed_dir / "checkpoints" / "last.pt", weights_only=False)["model"]
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in straight["history"]]


@pytest.mark.parametrize("name", sorted(UNKNOWN_CLASSES))
@pytest.mark.slow
def test_every_new_loss_config_trains_a_step_through_the_trainer(name, tmp_path):
    from mlcls.engine.trainer import Trainer

    extra = [f"loss.{key}={value}" for key, value in REQUIRED.get(name, {}).items()]
    cfg = compose_config([*TINY, f"loss={name}", *extra])
    trainer = Trainer(cfg, run_dir=tmp_path)
    if hasattr(trainer.criterion, "set_epoch"):
        trainer.criterion.set_epoch(2)
    assert type(trainer.criterion) is UNKNOWN_CLASSES[name]
    torch.manual_seed(0)
    images = torch.randn(8, 3, 32, 32)
    targets = torch.full((8, 12), -1.0)
    targets[torch.arange(8), torch.arange(8)] = 1.0  # single positive labels
    targets[0, 9] = 0.0
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.ddp_model.train()
    loss, applied = trainer.train_step(images, targets)
    assert torch.isfinite(loss) and bool(applied)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))


# ---------------------------------------------------------------------------------------------------------
# configs, errors, benchmark


@pytest.mark.parametrize("name", sorted(UNKNOWN_CLASSES))
def test_config_lists_every_argument_with_its_default(name):
    cfg = OmegaConf.load(config_dir() / "loss" / f"{name}.yaml")
    cls = UNKNOWN_CLASSES[name]
    assert cfg._target_ == f"mlcls.losses.{cls.__name__}" and cls.name == name
    params = inspect.signature(cls).parameters
    assert {k: v for k, v in cfg.items() if k != "_target_"} == {k: p.default for k, p in params.items()}
    cfg.update(REQUIRED.get(name, {}))
    assert type(instantiate(cfg)) is cls
    assert "Reduction:" in cls.__doc__


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss=epr"], "loss=epr: epr needs loss.expected_positives, the expected number of positives"),
        (["loss=epr", "loss.expected_positives=0"], "loss=epr: expected_positives must be > 0, got 0"),
        (["loss=ll", "loss.mode=c"], "loss=ll: mode must be one of 'r', 'ct', 'cp'; got 'c'"),
        (["loss=ll", "loss.delta_rel=2"], "loss=ll: delta_rel must be in [0, 1], got 2"),
        (["loss=splc", "loss.tau=1.0"], "loss=splc: tau must be in (0, 1), got 1.0"),
        (["loss=an_ls", "loss.ls_coef=0.5"], "loss=an_ls: ls_coef must be in [0, 0.5), got 0.5"),
        (["loss=em", "loss.alpha=-1"], "loss=em: alpha must be >= 0, got -1"),
        (["loss=hill", "loss.gamma=-1"], "loss=hill: gamma must be >= 0, got -1"),
    ],
)
def test_bad_settings_stop_before_training_in_one_line(overrides, message):
    from mlcls.engine.config_checks import check_config
    from mlcls.errors import ConfigError

    cfg = compose_config(["trainer.device=cpu", "trainer.amp=none", *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        check_config(cfg, world_size=1)
    assert "\n" not in str(error.value)


def test_wan_needs_two_classes_and_epochs_are_non_negative():
    x, y = torch.zeros(3, 1, dtype=F64), torch.tensor([[1.0], [-1.0], [0.0]], dtype=F64)
    with pytest.raises(ValueError, match=re.escape("wan weighs assumed negatives by 1 / (C - 1)")):
        WeakAssumeNegativeLoss()(x, y)
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1"):
        LargeLossLoss().set_epoch(-1)


def test_training_step_reads_nothing_back_from_the_device(host_reads):
    """Forward + backward on the meta device (a stand-in for a GPU holding no data), with the epoch
    terms on: no ``.item()``, ``bool()``, ``.tolist()`` or ``nonzero`` on a tensor, no copy from the host."""
    x, y = random_batch(seed=11)
    host_reads.clear()  # making the batch reads values
    for name, cls in UNKNOWN_CLASSES.items():
        loss = cls(**REQUIRED.get(name, {})).to("meta")
        if hasattr(loss, "set_epoch"):
            loss.set_epoch(3)
        logits = x.float().to("meta").requires_grad_(True)
        loss(logits, y.float().to("meta")).backward()
        assert host_reads == [] and logits.grad.shape == x.shape, name


def test_loss_benchmark_builds_every_loss():
    from mlcls.bench import loss_bench

    criteria = loss_bench._criteria()
    assert set(UNKNOWN_CLASSES) <= set(criteria)
    assert criteria["epr"].expected_positives == loss_bench.SCALE_POSITIVES
