"""EM with asymmetric pseudo-labelling (``loss=em loss.apl=true``, Zhou et al., ECCV 2022): the loss with
pseudo-labels against a float64 loop, the APL selection against a numpy loop, both against the released
code's computation (Correr-Zhou/SPML-AckTheUnknown, written afresh here on its label convention), a
tiny training run that pseudo-labels and resumes bit-exactly mid-run, two gloo processes, refusals."""

from __future__ import annotations

import math
import os
import re
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import TINY, compose_config
from ranks import run_ranks
from test_losses_unknown_parity import RELEASED_EPS, TOL, clamp_terms, neg_log, random_batch, value_and_grad
from torch import nn
from torch.utils.data import TensorDataset

from mlcls.data.datasets.labels import LabelCounts
from mlcls.losses import EntropyMaximisationLoss

F64 = torch.float64
NAN = float("nan")


def apl_loss(alpha=0.2, beta=0.3, warmup=2, epochs=6, neg_proportion=0.9, labels=None, **kwargs):
    """An EM loss with APL, set up for the training labels ``labels`` (N, C)."""
    loss = EntropyMaximisationLoss(
        alpha=alpha,
        apl=True,
        beta=beta,
        warmup_epochs=warmup,
        epochs=epochs,
        neg_proportion=neg_proportion,
        **kwargs,
    )
    loss.setup(LabelCounts.of(labels))
    return loss


def training_labels(seed: int, samples: int = 40, classes: int = 6) -> torch.Tensor:
    """Labels 1 / 0 / -1, every class with many unknown entries."""
    generator = torch.Generator().manual_seed(seed)
    draw = torch.rand(samples, classes, generator=generator)
    return torch.where(draw < 0.15, 1.0, torch.where(draw < 0.25, 0.0, -1.0))


# ---------------------------------------------------------------------------------------------------------
# the loss: a float64 loop


def loop_loss(logits, targets, soft, alpha, beta):
    """Sum over the entries of EM's term, or ``beta`` BCE against ``s`` for an unknown entry with a
    pseudo-label ``s`` (not NaN), divided by B C; one entry at a time."""
    rows, classes = logits.shape
    total = torch.zeros((), dtype=F64)
    for i in range(rows):
        for c in range(classes):
            x, y, s = logits[i, c], float(targets[i, c]), float(soft[i, c])
            p = 1.0 / (1.0 + torch.exp(-x))
            if y == 1:
                total = total - torch.log(p)
            elif y == 0:
                total = total - torch.log(1 - p)
            elif math.isnan(s):
                total = total + alpha * (p * torch.log(p) + (1 - p) * torch.log(1 - p))
            else:
                total = total + beta * (-s * torch.log(p) - (1 - s) * torch.log(1 - p))
    return total / (rows * classes)


@pytest.mark.parametrize("seed", range(4))
def test_loss_with_pseudo_labels_equals_a_float64_loop(seed):
    labels = training_labels(seed)
    loss = apl_loss(labels=labels)
    generator = torch.Generator().manual_seed(100 + seed)
    # pseudo-labels on about half the entries, known ones included (where they must be ignored)
    soft = torch.rand(labels.shape, generator=generator)
    loss.pseudo_labels.copy_(torch.where(torch.rand(labels.shape, generator=generator) < 0.5, soft, NAN))
    indices = torch.randperm(len(labels), generator=generator)[:16]
    logits = 10.0 * torch.rand(16, labels.shape[1], generator=generator, dtype=F64) - 5.0
    targets = labels[indices].to(F64)
    table = loss.pseudo_labels[indices].to(F64)
    assert (~table.isnan() & (targets == -1)).any() and (table.isnan() & (targets == -1)).any()
    value, grad = value_and_grad(lambda x: loss(x, targets, indices), logits)
    ref_value, ref_grad = value_and_grad(lambda x: loop_loss(x, targets, table, 0.2, 0.3), logits)
    torch.testing.assert_close(value, ref_value, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    # without pseudo-labels it is plain EM
    loss.pseudo_labels.fill_(NAN)
    plain = EntropyMaximisationLoss(alpha=0.2)(logits, targets)
    torch.testing.assert_close(loss(logits, targets, indices), plain, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------
# the selection: a numpy loop


def numpy_apl(table, labels, indices, probabilities, unknown, proportion, steps):
    """One APL step, one class and one candidate at a time: among the scored entries that are unknown
    and without a pseudo-label, the int(proportion U_c / steps) lowest predictions (ties: lower index)."""
    table = table.copy()
    scored = {}
    for row, index in enumerate(indices):
        scored.setdefault(int(index), row)  # a sample scored twice counts once
    for c in range(table.shape[1]):
        quota = int(proportion * unknown[c] / steps)
        candidates = [
            (float(probabilities[row, c]), index)
            for index, row in scored.items()
            if labels[index, c] == -1 and np.isnan(table[index, c])
        ]
        for prediction, index in sorted(candidates)[:quota]:
            table[index, c] = prediction
    return table


@pytest.mark.parametrize("seed", range(3))
def test_selection_over_several_epochs_equals_a_numpy_loop(seed):
    labels = training_labels(seed)
    warmup, epochs, proportion = 2, 6, 0.9
    loss = apl_loss(labels=labels, warmup=warmup, epochs=epochs, neg_proportion=proportion)
    assert [loss.wants_train_predictions(e) for e in range(1, epochs + 1)] == [
        False,
        True,
        True,
        True,
        True,
        False,
    ]
    unknown = (labels == -1).sum(0).numpy()
    table = np.full(labels.shape, np.nan, dtype=np.float32)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(warmup, epochs):
        # a shuffled pass with a few samples twice (DDP's padding) and a few not at all (a dropped batch)
        order = torch.randperm(len(labels), generator=generator)[:36]
        indices = torch.cat([order, order[:3]])
        probabilities = torch.rand(len(order), labels.shape[1], generator=generator)
        probabilities = torch.cat([probabilities, probabilities[:3]])
        added = loss.pseudo_label(indices, probabilities, labels[indices])
        before = np.isnan(table).sum()
        table = numpy_apl(
            table,
            labels.numpy(),
            indices.numpy(),
            probabilities.numpy(),
            unknown,
            proportion,
            epochs - warmup,
        )
        assert int(added) == before - np.isnan(table).sum() > 0
        np.testing.assert_array_equal(loss.pseudo_labels.numpy(), table)
    labelled = (~loss.pseudo_labels.isnan()).sum(0)
    quota = torch.tensor([int(proportion * u / (epochs - warmup)) for u in unknown])
    assert bool((labelled <= 4 * quota).all()) and bool((labelled > 0).all())
    assert bool((labels[~loss.pseudo_labels.isnan()] == -1).all())


# ---------------------------------------------------------------------------------------------------------
# parity with the released code (labels 1 / 0 unobserved / -s pseudo-negative)


def zhou_labels(targets, soft):
    """mlcls labels and pseudo-labels -> the released code's: 1 positive, 0 unobserved, -s a pseudo-negative
    of soft target s (single-positive labels: no observed negative)."""
    return torch.where(targets == 1, 1.0, torch.where(soft.isnan(), 0.0, -soft)).to(targets.dtype)


def zhou_em_apl(alpha, beta, logits, labels, eps):
    """losses.py ``loss_EM_APL`` at c09c1149: per entry by the label, sum / (B C)."""
    p = torch.sigmoid(logits)
    s = (-labels).clamp(min=0)
    terms = torch.where(
        labels == 1,
        neg_log(p, eps),
        torch.where(
            labels == 0,
            -alpha * (p * neg_log(p, eps) + (1 - p) * neg_log(1 - p, eps)),
            beta * (s * neg_log(p, eps) + (1 - s) * neg_log(1 - p, eps)),
        ),
    )
    return terms.sum() / labels.numel()


def zhou_apl(labels, unknown, idx, preds, proportion, num_epochs, warmup_epoch):
    """train.py ``aysmmetric_pseudo_labeling`` at c09c1149: per class, the entries of the pass whose label
    is 0, sorted by prediction, the first int(proportion U_c / (num_epochs - warmup_epoch)) set to -pred."""
    labels = labels.copy()
    for c in range(labels.shape[1]):
        unobserved = np.where(labels[idx, c] == 0)[0]
        lowest = unobserved[np.argsort(preds[unobserved, c])][
            : int(proportion * unknown[c] / (num_epochs - warmup_epoch))
        ]
        labels[idx[lowest], c] = -preds[lowest, c]
    return labels


def single_positive_state(seed, rows=16, classes=20):
    """single-positive logits/labels (test_losses_unknown_parity's) and a table pseudo-labelling half the
    unknowns."""
    logits, targets = random_batch("single_positive", seed, rows, classes)
    generator = torch.Generator().manual_seed(seed)
    soft = torch.rand(targets.shape, generator=generator, dtype=F64) * 0.5
    soft = torch.where((torch.rand(targets.shape, generator=generator) < 0.5) & (targets == -1), soft, NAN)
    loss = apl_loss(alpha=0.1, beta=0.9, labels=targets.float())
    loss.pseudo_labels.copy_(soft)
    return loss, logits, targets, soft.float().to(F64)


@pytest.mark.parametrize("seed", range(5))
def test_loss_equals_the_released_code_without_its_clamp_and_within_its_bound(seed):
    loss, logits, targets, soft = single_positive_state(seed)
    indices = torch.arange(len(targets))
    labels = zhou_labels(targets, soft)
    value, grad = value_and_grad(lambda x: loss(x, targets, indices), logits)
    ref_value, ref_grad = value_and_grad(
        lambda x: zhou_em_apl(0.1, 0.9, x, labels, torch.zeros((), dtype=F64)), logits
    )
    torch.testing.assert_close(value, ref_value, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    reference = lambda x, y, eps: zhou_em_apl(0.1, 0.9, x, zhou_labels(y, soft), eps)  # noqa: E731
    released = torch.tensor(RELEASED_EPS, dtype=F64)
    difference = (reference(logits, targets, released) - loss(logits, targets, indices)).item()
    first_order, bound = clamp_terms(reference, logits, targets, RELEASED_EPS)
    q_min = torch.sigmoid(-logits.abs().max()).item()
    assert abs(difference) <= bound, (difference, bound)
    assert abs(difference - first_order) <= RELEASED_EPS / (2 * q_min) * bound


@pytest.mark.parametrize("seed", range(3))
def test_selection_equals_the_released_code(seed):
    """Every sample scored once per pass, in a shuffled order; float32 predictions, as theirs."""
    generator = torch.Generator().manual_seed(seed)
    samples, classes, warmup, epochs = 50, 8, 5, 10
    positive = torch.randint(classes, (samples,), generator=generator)
    targets = torch.full((samples, classes), -1.0)
    targets[torch.arange(samples), positive] = 1.0
    loss = apl_loss(labels=targets, warmup=warmup, epochs=epochs)
    theirs = zhou_labels(targets, torch.full(targets.shape, NAN)).numpy()
    unknown = (theirs == 0).sum(0)  # from the original observed labels, fixed
    for _ in range(warmup, epochs):
        order = torch.randperm(samples, generator=generator)
        preds = torch.rand(samples, classes, generator=generator)
        loss.pseudo_label(order, preds, targets[order])
        theirs = zhou_apl(theirs, unknown, order.numpy(), preds.numpy(), 0.9, epochs, warmup)
        mapped = np.where(theirs < 0, -theirs, np.nan).astype(np.float32)
        np.testing.assert_array_equal(loss.pseudo_labels.numpy(), mapped)
    assert int((~loss.pseudo_labels.isnan()).sum()) == 5 * sum(int(0.9 * u / 5) for u in unknown)


# ---------------------------------------------------------------------------------------------------------
# training: the trainer's pass, the count, a mid-epoch resume


APL_RUN = [
    *TINY,
    "dataset.train_size=64",
    "dataset.val_size=16",
    "dataset.observed=single_positive",
    "model.name=test_resnet",
    "trainer.epochs=3",
    "loss=em",
    "loss.apl=true",
    "loss.warmup_epochs=1",
    "loss.epochs=3",
]


@pytest.mark.slow
def test_training_pseudo_labels_and_resumes_bit_exactly_mid_run(tmp_path):
    from mlcls.engine.checkpoint import load_checkpoint
    from mlcls.engine.trainer import Preempted, Trainer

    straight = Trainer(compose_config([*APL_RUN]), run_dir=tmp_path / "straight")
    assert straight.criterion.needs_sample_index
    labels = torch.stack([straight.data.train_set[i][1] for i in range(64)])
    straight.fit()
    table = straight.criterion.pseudo_labels.cpu()
    # APL after epochs 1 and 2 (not 3), each int(0.9 U_c / 2) per class: every sample is scored (64 / 32)
    unknown = (labels == -1).sum(0)
    expected = torch.tensor([2 * int(0.9 * u / 2) for u in unknown.tolist()])
    assert torch.equal((~table.isnan()).sum(0), expected) and int(expected.sum()) > 0
    assert bool((labels[~table.isnan()] == -1).all()) and bool(
        ((table > 0) & (table < 1)).sum() == expected.sum()
    )

    class StopInEpoch2(Trainer):
        def train_step(self, images, targets, *indices):
            self.steps = getattr(self, "steps", 0) + 1
            if self.steps == 3:  # epoch 2, step 1: after the first APL step
                os.kill(os.getpid(), signal.SIGINT)
            return super().train_step(images, targets, *indices)

    resumed_dir = tmp_path / "resumed"
    with pytest.raises(Preempted):
        StopInEpoch2(compose_config([*APL_RUN]), run_dir=resumed_dir).fit()
    stopped = load_checkpoint(resumed_dir / "checkpoints" / "last.pt")
    assert (stopped["epoch"], stopped["step"]) == (1, 1)
    after_first = stopped["loss"]["pseudo_labels"]
    assert int((~after_first.isnan()).sum()) == int(expected.sum()) // 2
    resumed = Trainer(compose_config([*APL_RUN, "trainer.resume=auto"]), run_dir=resumed_dir)
    resumed.fit()
    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "last.pt")
    b = load_checkpoint(resumed_dir / "checkpoints" / "last.pt")
    assert all(torch.equal(a["model"][key], b["model"][key]) for key in a["model"])
    torch.testing.assert_close(b["loss"]["pseudo_labels"], table, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(a["loss"]["pseudo_labels"], table, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------------------
# two gloo processes


WORLD, SAMPLES, CLASSES, BATCH = 2, 24, 5, 4


def _ddp_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, CLASSES), nn.BatchNorm1d(CLASSES))
    inputs = torch.randn(SAMPLES, 7)
    labels = training_labels(3, SAMPLES, CLASSES)
    return model, inputs, labels


def _apl_on_rank(rank: int, init_file: str, out: str) -> None:
    from mlcls.engine.evaluate import predict_training_set

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model, inputs, labels = _ddp_data()
        if rank == 1:  # BatchNorm statistics that drifted on this rank: rank 0's are used
            model[1].running_mean.add_(1.0)
        loss = apl_loss(labels=labels, warmup=1, epochs=3)
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(5))
        mine = order[rank::WORLD]
        batches = [(inputs[rows], labels[rows], rows) for rows in mine.split(BATCH)]
        predictions = predict_training_set(model, batches, len(batches))
        loss.pseudo_label(*predictions)
        torch.save({"table": loss.pseudo_labels, "indices": predictions[0]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_give_the_table_of_one(tmp_path):
    from mlcls.engine.evaluate import predict_training_set

    out = str(tmp_path / "table")
    run_ranks(_apl_on_rank, (str(tmp_path / "store"), out), WORLD, what="APL under DDP")
    ranks = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    assert sorted(ranks[0]["indices"].tolist()) == list(range(SAMPLES))
    # one process scoring every sample with rank 0's model
    model, inputs, labels = _ddp_data()
    loss = apl_loss(labels=labels, warmup=1, epochs=3)
    rows = torch.arange(SAMPLES)
    loss.pseudo_label(*predict_training_set(model, [(inputs, labels, rows)], 1))
    assert int((~loss.pseudo_labels.isnan()).sum()) > 0
    for rank in ranks:
        torch.testing.assert_close(rank["table"], loss.pseudo_labels, rtol=0, atol=1e-6, equal_nan=True)
        assert torch.equal(rank["table"].isnan(), loss.pseudo_labels.isnan())
    torch.testing.assert_close(ranks[0]["table"], ranks[1]["table"], rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.beta=-1"], "loss=em: beta must be >= 0, got -1"),
        (["loss.neg_proportion=0"], "loss=em: neg_proportion must be in (0, 1], got 0"),
        (["loss.neg_proportion=1.5"], "loss=em: neg_proportion must be in (0, 1], got 1.5"),
        (["loss.warmup_epochs=0"], "loss=em: warmup_epochs must be an integer >= 1, got 0"),
        (["loss.warmup_epochs=1.5"], "loss=em: warmup_epochs must be an integer >= 1, got 1.5"),
        (["loss.epochs=null"], "loss=em: apl needs loss.epochs, the run's trainer.epochs"),
        (
            ["loss.epochs=3", "loss.warmup_epochs=3"],
            "loss=em: apl pseudo-labels after epochs warmup_epochs..",
        ),
    ],
)
def test_bad_apl_settings_stop_before_training_in_one_line(overrides, message):
    from mlcls.engine.config_checks import check_config
    from mlcls.errors import ConfigError

    cfg = compose_config(
        ["trainer.device=cpu", "trainer.amp=none", "loss=em", "loss.apl=true", "loss.epochs=10", *overrides]
    )
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        check_config(cfg, world_size=1)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_a_table_over_its_limit_stops_before_training_in_one_line(tmp_path):
    from mlcls.engine.trainer import Trainer
    from mlcls.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        Trainer(compose_config([*APL_RUN, "loss.max_table_entries=100"]), run_dir=tmp_path)
    assert str(error.value).startswith(
        "loss=em: em with apl=true keeps a table of 64 training samples x 12 classes = 768 entries "
        "(0.0 GB per process), over loss.max_table_entries=100"
    )
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("where", ["shards", "dali"])
def test_apl_needs_the_index_that_shards_and_dali_do_not_give(where):
    from mlcls.data.datasets.base import DatasetConfigError
    from mlcls.data.loader import build_train_loader
    from mlcls.data.shards.datasets import ShardTrainSet

    needs = EntropyMaximisationLoss(apl=True, epochs=3, warmup_epochs=1).needs_sample_index
    assert needs and not EntropyMaximisationLoss().needs_sample_index
    if where == "shards":  # a packed set as the loader knows one: by its shards' sizes
        dataset = ShardTrainSet.__new__(ShardTrainSet)
        dataset.shard_sizes = [8]
    else:
        dataset = TensorDataset(torch.zeros(8, 1))
    backend = "dali" if where == "dali" else "fast"
    with pytest.raises(DatasetConfigError, match="needs each sample's index in the batch, which") as error:
        build_train_loader(dataset, 4, 0, 0, 1, 0, torch.device("cpu"), backend, with_index=needs)
    assert ("dataset=shards" if where == "shards" else "data.backend=dali") in str(error.value)
    assert "\n" not in str(error.value)
