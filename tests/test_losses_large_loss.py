"""LL-Cp, the large-loss permanent correction (Kim et al., CVPR 2022), and what every loss with a row per
training sample must do in training: resume bit-exactly mid-epoch (``ll`` in mode cp and ``role``), keep
its table identical on every DDP rank, and be refused in one line where its table or its indices cannot be
had.

The references run over a sequence of epochs, each a permutation of a small training set split into
batches, with a correction table that grows from call to call: a float64 loop over the entries from the
paper's equations (mlcls labels), and the released code's computation (written afresh on its labels:
1 observed positive, 0 unobserved, -1 observed negative, relabelled in place as its ``train.py`` does).
"""

from __future__ import annotations

import math
import signal
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import TINY, compose_config
from ranks import run_ranks
from test_losses_unknown_parity import TOL, to_spml, value_and_grad
from torch import Tensor

from mlcls.data import DatasetConfigError
from mlcls.engine.checkpoint import load_checkpoint
from mlcls.errors import ConfigError
from mlcls.losses import LargeLossLoss

F64 = torch.float64
SAMPLES, CLASSES, ROWS, EPOCHS = 12, 7, 4, 4  # 3 batches of 4 per epoch


def counts(samples: int = SAMPLES, classes: int = CLASSES) -> SimpleNamespace:
    """What ``setup`` reads of the training set's label counts."""
    return SimpleNamespace(num_samples=samples, num_classes=classes)


def observed_labels(regime: str, seed: int = 0) -> Tensor:
    """The training set's mlcls labels (SAMPLES, CLASSES): ``partial`` (positives, observed negatives,
    unknown) or ``single_positive`` (one positive per sample, the rest unknown)."""
    generator = torch.Generator().manual_seed(seed)
    if regime == "partial":
        draw = torch.rand(SAMPLES, CLASSES, generator=generator, dtype=F64)
        return torch.where(draw < 0.2, 1.0, torch.where(draw < 0.4, 0.0, -1.0)).to(F64)
    labels = torch.full((SAMPLES, CLASSES), -1.0, dtype=F64)
    labels[torch.arange(SAMPLES), torch.randint(CLASSES, (SAMPLES,), generator=generator)] = 1.0
    return labels


def schedule(seed: int = 1) -> list[tuple[int, Tensor, Tensor]]:
    """(0-based epoch, sample indices, float64 logits in (-5, 5)) of every step: each epoch a permutation
    of the training set in batches of ROWS, new logits at every step (a model that moves)."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for epoch in range(EPOCHS):
        order = torch.randperm(SAMPLES, generator=generator)
        for batch in order.split(ROWS):
            steps.append(
                (epoch, batch, 10.0 * torch.rand(ROWS, CLASSES, generator=generator, dtype=F64) - 5.0)
            )
    return steps


def cp_loss(delta_rel: float) -> LargeLossLoss:
    loss = LargeLossLoss(mode="cp", delta_rel=delta_rel)
    loss.setup(counts())
    return loss


# ---------------------------------------------------------------------------------------------------------
# float64 reference from the paper's equations


def ref_cp_step(
    x: Tensor, y: Tensor, samples: Tensor, epoch: int, delta_rel: float, corrected: set[tuple[int, int]]
) -> Tensor:
    """LL-Cp on one batch, one entry at a time; adds the batch's new corrections to ``corrected``.

    A corrected unknown label is a positive. From epoch 1 on, k = ceil(B C delta_rel) (exact); the unknown
    labels whose assumed-negative loss -log(1 - p) is at least the k-th largest unknown one's are taken as
    positives (-log p), those strictly above it are corrected from now on. Mean over the B C entries.
    """
    rows, classes = x.shape
    p = [[1.0 / (1.0 + torch.exp(-x[i, c])) for c in range(classes)] for i in range(rows)]
    label = [
        [
            1.0 if (int(samples[i]), c) in corrected and y[i, c] == -1 else float(y[i, c])
            for c in range(classes)
        ]
        for i in range(rows)
    ]
    negative = [[-torch.log(1.0 - p[i][c]) for c in range(classes)] for i in range(rows)]
    k = math.ceil(rows * classes * Fraction(str(delta_rel))) if epoch >= 1 else 0
    unknown = sorted(
        (negative[i][c].item() for i in range(rows) for c in range(classes) if label[i][c] == -1),
        reverse=True,
    )
    threshold = (unknown[k - 1] if k <= len(unknown) else -math.inf) if k else math.inf
    total = torch.zeros((), dtype=F64)
    new = set()
    for i in range(rows):
        for c in range(classes):
            if label[i][c] == 1 or (label[i][c] == -1 and negative[i][c].item() >= threshold):
                total = total - torch.log(p[i][c])
                if label[i][c] == -1 and negative[i][c].item() > threshold:
                    new.add((int(samples[i]), c))
            else:
                total = total + negative[i][c]
    corrected |= new
    return total / (rows * classes)


@pytest.mark.parametrize("regime", ["partial", "single_positive"])
@pytest.mark.parametrize("delta_rel", [0.1, 0.5])  # k = 3 of 28 entries; 14, more than some batches' unknowns
def test_cp_equals_its_equations_over_epochs(regime, delta_rel):
    labels = observed_labels(regime)
    loss, corrected = cp_loss(delta_rel), set()
    sizes = []
    for epoch, samples, x in schedule():
        loss.set_epoch(epoch)
        y = labels[samples]
        value, grad = value_and_grad(lambda a, y=y, s=samples: loss(a, y, s), x)
        ref_value, ref_grad = value_and_grad(
            lambda a, y=y, s=samples, e=epoch: ref_cp_step(a, y, s, e, delta_rel, corrected), x
        )
        torch.testing.assert_close(value, ref_value, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)
        assert set(map(tuple, loss.corrected.nonzero().tolist())) == corrected
        sizes.append(len(corrected))
    per_epoch = sizes[ROWS - 2 :: SAMPLES // ROWS]
    assert per_epoch[0] == 0 < per_epoch[1] < per_epoch[2]  # none in epoch 0, then the table grows
    assert not loss.corrected[labels >= 0].any()  # only unknown labels are ever corrected


def test_cp_corrections_are_positives_of_later_calls_and_the_rest_is_ct():
    """A corrected label is a positive from the next call on (no longer a candidate); within the call
    that finds it, LL-Cp's loss is LL-Ct's with the constant rate."""
    labels = observed_labels("single_positive")
    x = schedule()[0][2]
    samples = torch.arange(ROWS)
    loss, ct = cp_loss(0.1), LargeLossLoss(mode="ct", delta_rel=0.1)
    loss.set_epoch(3), ct.set_epoch(1)  # cp's rate stays delta_rel; ct's grows to it in epoch 1
    y = labels[samples]
    torch.testing.assert_close(loss(x, y, samples), ct(x, y), **TOL)
    relabelled = torch.where(loss.corrected[samples], 1.0, y)
    assert (relabelled != y).any()
    torch.testing.assert_close(loss(x, y, samples), ct(x, relabelled), **TOL)


# ---------------------------------------------------------------------------------------------------------
# parity with the released code


def kim_cp_step(
    logits: Tensor, label_matrix: Tensor, samples: Tensor, llr_rel: float, delta_rel: float
) -> Tensor:
    """Kim et al., snucml/LargeLossMatters at ac475fec0ba2dcc8b7a691873b18cb57f11f7052: losses.py
    ``compute_batch_loss`` with ``perm_mod = 1``, ``llr_rel_mod = 1`` on the batch's rows of the training
    labels ``label_matrix`` (1 / 0 unobserved / -1), then train.py's permanent correction
    ``label_matrix_obs[idx[correction_idx[0]], correction_idx[1]] = 1.0`` (in place)."""
    labels = label_matrix[samples]
    rows, classes = logits.shape
    clipped = labels.clip(0)
    loss = F.binary_cross_entropy_with_logits(logits, clipped, reduction="none")
    flipped = F.binary_cross_entropy_with_logits(logits, torch.logical_not(clipped).to(F64), reduction="none")
    final = loss
    k = math.ceil(rows * classes * (1 - llr_rel))
    if k != 0:
        k = math.ceil(rows * classes * delta_rel)
        unobserved_loss = (labels == 0) * loss
        threshold = torch.topk(unobserved_loss.flatten(), k).values[-1]
        final = torch.where(unobserved_loss < threshold, loss, flipped)
        where = torch.where(unobserved_loss.detach() > threshold.detach())
        label_matrix[samples[where[0]], where[1]] = 1.0
    return (final / (rows * classes)).sum()


# k = 1, 3, 6 of 28 entries; partial labels at 6 run out of unknown ones (where the released code turns to
# observed labels; mlcls never does, see test_cp_equals_its_equations_over_epochs)
@pytest.mark.parametrize(
    ("regime", "delta_rel"),
    [
        ("partial", 0.002),
        ("partial", 0.1),
        ("single_positive", 0.002),
        ("single_positive", 0.1),
        ("single_positive", 0.2),
    ],
)
def test_cp_equals_the_released_code_with_its_relabelling(regime, delta_rel):
    """Value and gradient at every step to float64 precision, and the released relabelled training labels
    equal mlcls's labels with its table applied after every step (the k-th entry is not relabelled: with
    k = 1, as at the authors' 0.2 % on 28 entries, or on VOC's 16 x 20, nothing is)."""
    labels = observed_labels(regime)
    released = to_spml(labels)
    loss, llr_rel = cp_loss(delta_rel), 1.0
    for step, (epoch, samples, x) in enumerate(schedule()):
        if step and epoch != schedule()[step - 1][0]:
            llr_rel -= delta_rel  # train.py, after every epoch
        loss.set_epoch(epoch)
        y = labels[samples]
        k = math.ceil(ROWS * CLASSES * delta_rel)
        assert k == math.ceil(ROWS * CLASSES * Fraction(str(delta_rel)))  # the released float k is exact
        assert k <= int((released[samples] == 0).sum())  # the released code would touch observed labels
        value, grad = value_and_grad(lambda a, y=y, s=samples: loss(a, y, s), x)
        ref_value, ref_grad = value_and_grad(
            lambda a, s=samples, r=llr_rel: kim_cp_step(a, released, s, r, delta_rel), x
        )
        torch.testing.assert_close(value, ref_value, **TOL)
        torch.testing.assert_close(grad, ref_grad, **TOL)
        assert torch.equal(to_spml(torch.where(loss.corrected & (labels == -1), 1.0, labels)), released)
    # k = 1 (28 entries at 0.2 %) corrects the largest loss for the step but relabels none of them
    assert bool(loss.corrected.any()) == (k > 1)


# ---------------------------------------------------------------------------------------------------------
# exact resume mid-epoch, through the trainer

# 64 single-positive training images in batches of 32: 2 steps per epoch, 2 epochs; stopped after the
# first step of the second epoch (LL-Cp corrects from the second epoch on)
RESUME = [
    *TINY,
    "dataset.train_size=64",
    "dataset.val_size=16",
    "model.name=test_resnet",
    "dataset.observed=single_positive",
]
STOP_AT_STEP = 3


def _stopped_then_resumed(overrides: list[str], out: Path) -> tuple[dict, dict]:
    from mlcls.cli.train import run
    from mlcls.engine.trainer import Preempted, Trainer

    class StopAtStep(Trainer):
        def train_step(self, images, targets, *indices):
            self.steps = getattr(self, "steps", 0) + 1
            if self.steps == STOP_AT_STEP:
                self.signals.received = signal.SIGTERM  # as a scheduler's signal, polled after the step
            return super().train_step(images, targets, *indices)

    run(compose_config([*RESUME, *overrides]), run_dir=out / "straight")
    with pytest.raises(Preempted, match="at epoch 2, step 1"):
        StopAtStep(compose_config([*RESUME, *overrides]), run_dir=out / "stopped").fit()
    assert load_checkpoint(out / "stopped" / "checkpoints" / "last.pt")["step"] == 1
    run(compose_config([*RESUME, *overrides, "trainer.resume=auto"]), run_dir=out / "stopped")
    return tuple(load_checkpoint(out / name / "checkpoints" / "last.pt") for name in ("straight", "stopped"))


def _assert_equal_states(a, b) -> None:
    if isinstance(a, Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_equal_states(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal_states(x, y)
    else:
        assert a == b


@pytest.mark.slow  # three short trainings each: 15-20 s
@pytest.mark.parametrize(
    ("overrides", "table"),
    [
        (["loss=ll", "loss.mode=cp", "loss.delta_rel=0.05"], "corrected"),
        (["loss=role", "loss.expected_positives=2"], "label_logits"),
    ],
    ids=["ll_cp", "role"],
)
def test_resumed_mid_epoch_the_run_and_its_loss_state_are_bit_identical(overrides, table, tmp_path):
    """The model, the optimizer (ROLE's table's Adam moments included) and the loss's state (LL-Cp's
    corrections, ROLE's label table) of a run stopped mid-epoch and resumed equal the uninterrupted run's."""
    straight, resumed = _stopped_then_resumed(overrides, tmp_path)
    assert straight["loss"][table].shape[0] == 64 and straight["loss"][table].any()
    for part in ("model", "loss", "optimizer"):
        _assert_equal_states(straight[part], resumed[part])
    if table == "label_logits":  # the table is trained by Adam: its moments are in the optimizer's state
        shape = straight["loss"][table].shape
        moments = [s for s in straight["optimizer"]["state"].values() if s["exp_avg"].shape == shape]
        assert len(moments) == 1 and moments[0]["exp_avg"].any()


# ---------------------------------------------------------------------------------------------------------
# DDP: the same corrections on every rank, those of one process with the global batch

WORLD = 2


def _ddp_worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        labels, loss = observed_labels("partial"), cp_loss(0.1)
        rows = slice(rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD)
        values, grads = [], []
        for epoch, samples, x in _ddp_schedule():
            loss.set_epoch(epoch)
            value, grad = value_and_grad(lambda a, s=samples: loss(a, labels[s[rows]], s[rows]), x[rows])
            values.append(value)
            grads.append(grad)
        torch.save({"table": loss.corrected, "values": values, "grads": grads}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _ddp_schedule() -> list[tuple[int, Tensor, Tensor]]:
    """The schedule's global batches; in the last, rank 1's last sample is rank 0's first, as DDP's
    padding repeats a sample."""
    steps = schedule(seed=2)
    epoch, samples, x = steps[-1]
    steps[-1] = (epoch, torch.cat([samples[:-1], samples[:1]]), x)
    return steps


@pytest.mark.slow
def test_cp_under_ddp_keeps_the_same_table_on_every_rank(tmp_path):
    run_ranks(_ddp_worker, (str(tmp_path / "store"), str(tmp_path)), WORLD, what="DDP LL-Cp test")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    labels, single = observed_labels("partial"), cp_loss(0.1)
    for step, (epoch, samples, x) in enumerate(_ddp_schedule()):
        single.set_epoch(epoch)
        value, grad = value_and_grad(lambda a, s=samples: single(a, labels[s], s), x)
        for rank, result in enumerate(ranks):
            torch.testing.assert_close(result["values"][step], value, **TOL)
            rows = slice(rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD)
            # the gather's backward sums every rank's (identical) loss: DDP's average divides it back
            torch.testing.assert_close(result["grads"][step], WORLD * grad[rows], **TOL)
    assert single.corrected.any()
    assert all(torch.equal(result["table"], single.corrected) for result in ranks)


# ---------------------------------------------------------------------------------------------------------
# refusals, before training, in one line


@pytest.mark.slow  # Hydra's composition and the trainer's setup: seconds
def test_cp_table_over_its_limit_stops_the_cli_before_training_in_one_line(tmp_path, monkeypatch, capsys):
    """mlcls-train's ``main``, run in this process (the installed entry point's process and exit status are
    test_engine_trainer_cluster.py's and test_engine_rundir.py's)."""
    import sys

    from mlcls.cli.train import main

    args = [*TINY, "trainer.device=cpu", "trainer.amp=none", f"hydra.run.dir={tmp_path / 'run'}"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.setattr(
        sys, "argv", ["mlcls-train", *args, "loss=ll", "loss.mode=cp", "loss.max_table_entries=10"]
    )
    with pytest.raises(SystemExit) as exit_status:
        main()
    assert exit_status.value.code not in (0, None)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "mlcls: error: loss=ll: ll keeps a table of 192 training samples x 12 classes = 2,304 entries "
        "(0.0 GB per process), over loss.max_table_entries=10; train on fewer samples or classes, or raise "
        "the limit if every process has the memory"
    ]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_cp_keeps_no_table_in_the_other_modes():
    loss = LargeLossLoss(mode="ct", max_table_entries=1)
    loss.setup(None)  # nothing to size or refuse
    assert not loss.needs_sample_index and set(loss.state_dict()) == {"_extra_state"}
    with pytest.raises(ValueError, match=r"ll keeps a table of 12 training samples x 7 classes = 84 entries"):
        LargeLossLoss(mode="cp", max_table_entries=83).setup(counts())


@pytest.mark.parametrize("loader", ["dali", "shards"])
def test_cp_without_sample_indices_is_refused_in_one_line(loader, tmp_path):
    from mlcls.cli.train import run

    if loader == "dali":
        data = ["data.backend=dali", "dataset.transform=paper"]
        where = "data.backend=dali"
    else:
        pytest.importorskip("webdataset")
        from mlcls.cli.data import main as data_main

        packed = tmp_path / "packed"
        pack = ["dataset.train_size=20", "dataset.val_size=8", f"out={packed}", "max_side=32"]
        assert data_main(["pack", *pack]) == 0
        data = ["dataset=shards", f'dataset.urls="{packed}/train-000000.tar"', "dataset.image_size=32"]
        where = "dataset=shards"
    base = [o for o in TINY if not o.startswith("dataset")] if loader == "shards" else list(TINY)
    cfg = compose_config([*base, *data, "loss=ll", "loss.mode=cp"])
    with pytest.raises((DatasetConfigError, ConfigError)) as error:
        run(cfg, run_dir=tmp_path / "run")
    message = str(error.value)
    assert f"needs each sample's index in the batch, which {where} does not give" in message
    assert "\n" not in message


def test_cp_step_reads_nothing_back_from_the_device(host_reads):
    """Forward (the table applied, the corrections written) and backward on the meta device, a stand-in
    for a GPU holding no data: no ``.item()``, ``bool()``, ``.tolist()`` or ``nonzero``, no host copy."""
    labels = observed_labels("partial").float().to("meta")
    steps = schedule()
    host_reads.clear()  # making the batches reads values
    loss = cp_loss(0.1).to("meta")
    loss.set_epoch(1)
    for _, samples, x in steps[:2]:
        samples = samples.to("meta")
        logits = x.float().to("meta").requires_grad_(True)
        loss(logits, labels[samples], samples).backward()
        assert logits.grad.shape == x.shape
    assert host_reads == []
