"""ROLE (mlcls/losses/role.py): its value and gradients against a float64 loop of Cole et al.'s equations,
against the released code's computation, its table's initialisation and optimisation, its size limit and
its place in a training run."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import TINY, compose_config
from test_losses_unknown_parity import RELEASED_EPS, neg_log, random_batch, to_spml

from mlcls.data.datasets.labels import LabelCounts
from mlcls.losses import RoleLoss
from mlcls.losses.role import OBSERVED_NEGATIVE_LOGIT, OBSERVED_POSITIVE_LOGIT, UNKNOWN_LOGIT_BOUND

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


def role(num_samples: int, num_classes: int, k: float = 2.0, **kwargs) -> RoleLoss:
    """A float64 ROLE loss set up for ``num_samples`` x ``num_classes``."""
    loss = RoleLoss(expected_positives=k, **kwargs)
    loss.setup(LabelCounts(num_samples, torch.zeros(num_classes), torch.zeros(num_classes)))
    return loss.double()


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def loop_reference(logits: torch.Tensor, estimates: torch.Tensor, targets: torch.Tensor, k: float):
    """Cole et al., Sec. 3.3, entry by entry in float64: the classifier's and the estimator's terms, each
    against the other's detached probability, plus half of each side's expected-positive regulariser.
    Returns a scalar tensor whose autograd gives the gradients in ``logits`` and ``estimates``."""
    rows, classes = targets.shape
    total = torch.zeros((), dtype=F64)
    for side, other in ((logits, estimates), (estimates, logits)):
        for i in range(rows):
            for c in range(classes):
                p = torch.sigmoid(side[i, c])
                t = sigmoid(other[i, c].item())  # the other side's probability, a constant
                y = targets[i, c].item()
                observed = -torch.log(p) if y == 1 else (-torch.log(1 - p) if y == 0 else 0.0)
                soft = -(t * torch.log(p) + (1 - t) * torch.log(1 - p))
                total = total + 0.5 * (observed + soft) / (rows * classes)
        expected = sum(torch.sigmoid(side[i, c]) for i in range(rows) for c in range(classes)) / rows
        total = total + 0.5 * (expected - k) ** 2 / classes**2
    return total


@pytest.mark.parametrize("regime", ["partial", "single_positive"])
def test_role_equals_the_equations(regime):
    """Value, classifier gradient and table gradient equal the float64 loop (the rows of the batch only
    get a table gradient)."""
    logits, targets = random_batch(regime, seed=3, rows=6, classes=5)
    loss = role(10, 5, k=1.7)
    indices = torch.tensor([7, 2, 9, 0, 4, 5])
    with torch.no_grad():  # estimates of every sign, observed entries written as the loss will write them
        loss.label_logits.uniform_(-3.0, 3.0)
    x = logits.clone().requires_grad_(True)
    value = loss(x, targets, indices)
    value.backward()
    start = loss.label_logits.detach().clone()  # after the first call wrote the observed entries
    z = start[indices].clone().requires_grad_(True)
    x_ref = logits.clone().requires_grad_(True)
    expected = loop_reference(x_ref, z, targets, 1.7)
    expected.backward()
    torch.testing.assert_close(value.detach(), expected.detach(), **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(loss.label_logits.grad[indices], z.grad, **TOL)
    others = torch.ones(10, dtype=torch.bool)
    others[indices] = False
    assert torch.equal(loss.label_logits.grad[others], torch.zeros(4, 5, dtype=F64))


def test_first_sight_writes_the_observed_labels_and_keeps_the_unknown_draw():
    loss = role(6, 4, init_seed=5)
    draw = loss.label_logits.detach().clone()
    assert draw.abs().max() <= UNKNOWN_LOGIT_BOUND and draw.std() > 0.1  # uniform in [-logit 0.6, logit 0.6]
    assert torch.equal(draw, role(6, 4, init_seed=5).label_logits.detach())  # the same on every rank
    targets = torch.tensor([[1.0, -1.0, 0.0, -1.0], [-1.0, -1.0, -1.0, 1.0]], dtype=F64)
    loss(torch.zeros(2, 4, dtype=F64), targets, torch.tensor([4, 1]))
    table = loss.label_logits.detach()
    row_4 = [OBSERVED_POSITIVE_LOGIT, draw[4, 1].item(), OBSERVED_NEGATIVE_LOGIT, draw[4, 3].item()]
    assert table[4].tolist() == row_4
    assert table[1].tolist() == [*draw[1, :3].tolist(), OBSERVED_POSITIVE_LOGIT]
    assert torch.equal(table[[0, 2, 3, 5]], draw[[0, 2, 3, 5]])
    assert math.isclose(OBSERVED_POSITIVE_LOGIT, math.log(0.995 / 0.005), rel_tol=1e-15)
    # a row seen before keeps what training made of it: its observed entries are not written again
    with torch.no_grad():
        loss.label_logits[4, 0] = -1.0
    loss(torch.zeros(2, 4, dtype=F64), targets, torch.tensor([4, 1]))
    assert loss.label_logits[4, 0].item() == -1.0


def test_writing_at_first_sight_is_the_authors_initialisation_under_adam():
    """The authors write every observed label into the table before training; here a row's are written
    when its sample first appears. Under Adam (no weight decay) a row not yet in a batch has had a zero
    gradient and zero moments, so it has not moved: the rows seen so far are equal after every step, bit
    for bit, and once every sample has been seen the whole tables are."""
    num_samples, classes = 12, 5
    generator = torch.Generator().manual_seed(0)
    all_targets = torch.full((num_samples, classes), -1.0, dtype=F64)
    all_targets[torch.arange(num_samples), torch.randint(classes, (num_samples,), generator=generator)] = 1.0
    lazy, eager = role(num_samples, classes), role(num_samples, classes)
    with torch.no_grad():
        eager.label_logits[all_targets == 1] = OBSERVED_POSITIVE_LOGIT
    model = torch.nn.Linear(3, classes).double()
    features = torch.randn(num_samples, 3, generator=generator, dtype=F64)
    optimizers = {
        name: torch.optim.Adam([{"params": [loss.label_logits], "lr": 0.5}])
        for name, loss in (("lazy", lazy), ("eager", eager))
    }
    for step in range(4):  # batches of 3: the last samples appear only in the last step
        batch = torch.arange(3 * step, 3 * step + 3)
        for name, loss in (("lazy", lazy), ("eager", eager)):
            optimizers[name].zero_grad()
            loss(model(features[batch]).detach(), all_targets[batch], batch).backward()
            optimizers[name].step()
        seen = lazy.seen
        assert torch.equal(lazy.label_logits[seen], eager.label_logits[seen]), step
    assert lazy.seen.all() and torch.equal(lazy.label_logits, eager.label_logits)


# ---------------------------------------------------------------------------------------------------------
# the released code: Cole et al., elijahcole/single-positive-multi-label, losses.py ``loss_role`` and
# ``compute_batch_loss``, models.py ``LabelEstimator``, commit 0ea84b0587ef802edec04b02926e12bd9461ccfd


def cole_role(logits: torch.Tensor, estimates: torch.Tensor, targets: torch.Tensor, k: float, eps):
    """The released computation on probabilities with ``-log(q + eps)``, labels 1 observed positive / 0
    unobserved (no observed negatives), ``loss_mtx`` summed / (B C) plus the halved regularisers."""
    labels = to_spml(targets)
    p, q = torch.sigmoid(logits), torch.sigmoid(estimates)
    rows, classes = p.shape

    def side(own, other):
        positive = torch.where(labels == 1, neg_log(own, eps), 0.0)
        cross = other.detach() * neg_log(own, eps) + (1 - other.detach()) * neg_log(1 - own, eps)
        regulariser = (own.sum(1).mean(0) - k) ** 2 / classes**2
        return positive, cross, regulariser

    pos_1, cross_1, reg_1 = side(p, q)
    pos_2, cross_2, reg_2 = side(q, p)
    matrix = 0.5 * (pos_1 + pos_2) + 0.5 * (cross_1 + cross_2)
    return (matrix / (rows * classes)).sum() + 0.5 * (reg_1 + reg_2)


@pytest.mark.parametrize("seed", range(4))
def test_role_equals_the_released_code(seed):
    """Single positives (the released code refuses observed negatives): equal without the released clamp
    (value, both gradients), and within the clamp's first-order bound with it."""
    logits, targets = random_batch("single_positive", seed, rows=8, classes=6)
    loss = role(8, 6, k=2.9, init_seed=seed)
    indices = torch.arange(8).flip(0)
    x = logits.clone().requires_grad_(True)
    value = loss(x, targets, indices)
    value.backward()
    z = loss.label_logits.detach()[indices].clone().requires_grad_(True)
    x_ref = logits.clone().requires_grad_(True)
    expected = cole_role(x_ref, z, targets, 2.9, torch.zeros((), dtype=F64))
    expected.backward()
    torch.testing.assert_close(value.detach(), expected.detach(), **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(loss.label_logits.grad[indices], z.grad, **TOL)
    per_entry = torch.zeros_like(logits, requires_grad=True)
    released = cole_role(logits, z.detach(), targets, 2.9, per_entry)
    (sensitivity,) = torch.autograd.grad(released, per_entry)
    bound = RELEASED_EPS * sensitivity.abs().sum().item()
    difference = cole_role(logits, z.detach(), targets, 2.9, RELEASED_EPS).item() - value.item()
    assert abs(difference) <= bound, (difference, bound)


# ---------------------------------------------------------------------------------------------------------
# settings and runs


def test_settings_are_checked_in_one_line():
    with pytest.raises(ValueError, match="role needs loss.expected_positives"):
        RoleLoss()
    with pytest.raises(ValueError, match=re.escape("table_lr_scale must be > 0, got 0")):
        RoleLoss(expected_positives=1.0, table_lr_scale=0)
    loss = RoleLoss(expected_positives=1.0)
    with pytest.raises(ValueError, match=re.escape("call it as loss(logits, targets, indices)")):
        loss(torch.zeros(2, 3), torch.ones(2, 3))
    loss.setup(LabelCounts(4, torch.zeros(3), torch.zeros(3)))
    with pytest.raises(
        ValueError, match=re.escape("an integer tensor of shape (2,); got torch.float32 (2,)")
    ):
        loss(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2))


def test_open_images_size_is_refused_in_one_line():
    """9 M samples x 9,605 classes: refused from the counts alone, before any memory is allocated."""
    loss = RoleLoss(expected_positives=8.0)
    counts = LabelCounts(
        9_000_000, torch.zeros(9605, dtype=torch.int64), torch.zeros(9605, dtype=torch.int64)
    )
    with pytest.raises(ValueError) as error:
        loss.setup(counts)
    message = str(error.value)
    assert (
        "\n" not in message
        and "9,000,000 training samples x 9,605 classes = 86,445,000,000 entries" in message
    )
    assert "(1,037.3 GB per process), over loss.max_table_entries=1,000,000,000" in message
    assert loss.label_logits.numel() == 0


@pytest.mark.slow
def test_a_run_over_the_limit_stops_before_training_in_one_line(tmp_path):
    from mlcls.engine.trainer import Trainer
    from mlcls.errors import ConfigError

    run_dir = tmp_path / "run"
    cfg = compose_config([*TINY, "loss=role", "loss.expected_positives=2", "loss.max_table_entries=100",
                          "dataset.observed=single_positive"])  # fmt: skip
    with pytest.raises(ConfigError) as error:
        Trainer(cfg, run_dir=run_dir)
    assert str(error.value).startswith("loss=role: role keeps a table of 192 training samples x 12 classes")
    assert "\n" not in str(error.value) and not (run_dir / "checkpoints").exists()


@pytest.mark.slow
def test_a_run_trains_the_table_and_checkpoints_it(tmp_path):
    """Through the trainer: batches carry their indices, the table has its optimizer group and moves, and
    last.pt holds the table, its flags and its Adam moments."""
    from mlcls.engine.trainer import Trainer

    cfg = compose_config([*TINY, "loss=role", "loss.expected_positives=2", "trainer.epochs=1", "optim=adamw",
                          "dataset.train_size=64", "dataset.observed=single_positive"])  # fmt: skip
    trainer = Trainer(cfg, run_dir=tmp_path)
    before = trainer.criterion.label_logits.detach().clone()
    trainer.fit()
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    table = checkpoint["loss"]["label_logits"]
    assert table.shape == (64, 12) and checkpoint["loss"]["seen"].all()
    assert torch.equal(table, trainer.criterion.label_logits.detach()) and not torch.equal(table, before)
    group = [g for g in checkpoint["optimizer"]["param_groups"] if g["name"] == "table"]
    assert len(group) == 1 and group[0]["weight_decay"] == 0.0
    assert group[0]["initial_lr"] == pytest.approx(10 * cfg.optim.lr_head)
    moments = checkpoint["optimizer"]["state"][group[0]["params"][0]]
    assert moments["exp_avg"].shape == (64, 12) and moments["exp_avg_sq"].abs().sum() > 0


def test_config_lists_every_argument_with_its_default():
    import inspect

    from omegaconf import OmegaConf

    from mlcls import config_dir

    cfg = OmegaConf.load(config_dir() / "loss" / "role.yaml")
    assert cfg._target_ == "mlcls.losses.RoleLoss"
    params = inspect.signature(RoleLoss).parameters
    assert {k: v for k, v in cfg.items() if k != "_target_"} == {k: p.default for k, p in params.items()}
