"""Losses under DDP, in two gloo processes on the CPU.

What is checked, on every rank:

* ``gather=True``: the loss value equals the single-process loss on the concatenated batch, and the
  gradient w.r.t. the rank's own logits is ``world_size`` times the single-process gradient of those
  rows. The factor comes from the gather's backward, which *sums* over ranks the
  gradients every rank's (identical) loss sends to this rank's rows. DDP averages parameter gradients
  over ranks, i.e. divides by ``world_size``, which restores the single-process gradient exactly; the
  second check asserts that end to end on the parameters of a DDP-wrapped model.
* ``gather=False`` with ``bucket_size=None`` is the paper's setting (one bucket per GPU): after DDP's
  averaging the parameter gradients equal those of one process with ``bucket_size`` = per-rank batch.
* ranks with different batch sizes get a clear error rather than a hang, from a check that reads the
  sizes back to the host on the first step only;
* ROLE (a table row per training sample) trained under DDP: the table is the same on both ranks, bit for
  bit, and model and table equal one process's training on the global batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mlcls.data.datasets.labels import LabelCounts
from mlcls.losses import RoleLoss, SoftmaxLoss, TwoWayLoss

WORLD = 2
ROWS = 6  # per rank
CLASSES = 5


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # torch.testing.assert_close would import DTensor (and torch._dynamo) in an initialised process group:
    # seconds per rank for a comparison that torch.allclose does as well here.
    assert torch.allclose(actual, expected, rtol=1e-12, atol=1e-12), f"{actual} != {expected}"


def _global_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same float64 batch of WORLD * ROWS rows on every rank, with unknown labels."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(WORLD * ROWS, CLASSES, generator=generator, dtype=torch.float64)
    u = torch.rand(WORLD * ROWS, CLASSES, generator=generator, dtype=torch.float64)
    targets = torch.where(u < 0.3, 1.0, torch.where(u < 0.45, -1.0, 0.0))
    return logits, targets


def _tagger_batch(seed: int, classes: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 batch of WORLD * ROWS rows shaped like a tagger's: 95 % of the columns without a positive
    in the batch (negatives and a few unknowns), the rest positive at 30 %."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(WORLD * ROWS, classes, generator=generator, dtype=torch.float64)
    u = torch.rand(WORLD * ROWS, classes, generator=generator, dtype=torch.float64)
    tagged = torch.rand(classes, generator=generator) < 0.05
    targets = torch.where(u < 0.05, -1.0, torch.where(tagged & (u < 0.35), 1.0, 0.0))
    return logits, targets


def _check_gathered_loss(rank: int) -> None:
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    batch, tagger = _global_batch(seed=0), _tagger_batch(seed=3)
    configs = [
        (TwoWayLoss, {}, batch),
        (TwoWayLoss, {"ways": "class", "bucket_size": 4, "margin": 0.5}, batch),  # buckets straddle ranks
        (SoftmaxLoss, {"ways": "both"}, batch),
        (TwoWayLoss, {"bucket_size": 4}, tagger),  # most columns of each bucket without a positive
    ]
    for cls, kwargs, (logits, targets) in configs:
        local = logits[rows].clone().requires_grad_(True)
        value = cls(gather=True, **kwargs)(local, targets[rows])
        value.backward()
        full = logits.clone().requires_grad_(True)
        expected = cls(**kwargs)(full, targets)
        expected.backward()
        assert_close(value, expected)
        assert_close(local.grad, WORLD * full.grad[rows])


def _check_ddp_parameter_grads(rank: int) -> None:
    """Parameter gradients of DDP(model) with a loss == one process with a reference loss on all rows."""
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(WORLD * ROWS, 4, generator=generator, dtype=torch.float64)
    _, targets = _global_batch(seed=2)
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Linear(4, CLASSES).double()
    single = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    cases = [
        (TwoWayLoss(gather=True), TwoWayLoss()),  # the global batch as one bucket (Table 5's M = 512)
        (TwoWayLoss(), TwoWayLoss(bucket_size=ROWS)),  # the paper's setting: one bucket per rank
    ]
    for loss, reference_loss in cases:
        model.zero_grad()
        single.zero_grad()
        loss(ddp(inputs[rows]), targets[rows]).backward()
        reference_loss(single(inputs), targets).backward()
        for param, expected in zip(model.parameters(), single.parameters(), strict=True):
            assert_close(param.grad, expected.grad)


def _check_unequal_batches(rank: int) -> None:
    logits, targets = _global_batch(seed=3)
    rows = 4 if rank == 0 else ROWS
    with pytest.raises(ValueError, match="same batch size on every rank"):
        TwoWayLoss(gather=True)(logits[:rows], targets[:rows])


def _check_sizes_compared_on_the_first_step_only(rank: int) -> None:
    """The size check reads the ranks' sizes back to the host: once, not on every training step."""
    logits, targets = _global_batch(seed=4)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    loss = TwoWayLoss(gather=True)
    reads: list[str] = []
    # Not __bool__: on the CPU the label check of every step reads one boolean (no device to wait for).
    originals = {method: getattr(torch.Tensor, method) for method in ("tolist", "item", "__int__")}

    def counting(method: str):
        def read(self, *args, **kwargs):
            reads.append(method)
            return originals[method](self, *args, **kwargs)

        return read

    try:
        for method in originals:
            setattr(torch.Tensor, method, counting(method))
        reads_per_step = []
        for _ in range(3):
            before = len(reads)
            local = logits[rows].clone().requires_grad_(True)
            loss(local, targets[rows]).backward()
            reads_per_step.append(len(reads) - before)
    finally:
        for method, original in originals.items():
            setattr(torch.Tensor, method, original)
    assert reads_per_step == [1, 0, 0], reads


ROLE_STEPS = 3
ROLE_SAMPLES = ROLE_STEPS * WORLD * ROWS


def _role_setup() -> tuple[nn.Module, RoleLoss, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same model, ROLE loss (float64 table), inputs, single-positive labels and sample order on
    every rank and in the parent process."""
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(ROLE_SAMPLES, 4, generator=generator, dtype=torch.float64)
    targets = torch.full((ROLE_SAMPLES, CLASSES), -1.0, dtype=torch.float64)
    targets[torch.arange(ROLE_SAMPLES), torch.randint(CLASSES, (ROLE_SAMPLES,), generator=generator)] = 1.0
    order = torch.randperm(ROLE_SAMPLES, generator=generator)
    torch.manual_seed(0)
    model = nn.Linear(4, CLASSES).double()
    loss = RoleLoss(expected_positives=1.5)
    loss.setup(LabelCounts(ROLE_SAMPLES, torch.zeros(CLASSES), torch.zeros(CLASSES)))
    return model, loss.double(), inputs, targets, order


def _train_role(model: nn.Module, loss: RoleLoss, inputs, targets, order, rows: slice) -> None:
    """ROLE_STEPS Adam steps on the global batches of ``order``, each process on its ``rows`` of them."""
    optimizer = torch.optim.Adam(
        [{"params": list(model.parameters()), "lr": 0.05}, {"params": [loss.label_logits], "lr": 0.5}]
    )
    for step in range(ROLE_STEPS):
        batch = order[step * WORLD * ROWS : (step + 1) * WORLD * ROWS][rows]
        optimizer.zero_grad()
        loss(model(inputs[batch]), targets[batch], batch).backward()
        optimizer.step()


def _role_reference(path: str) -> None:
    model, loss, *data = _role_setup()
    _train_role(model, loss, *data, rows=slice(None))
    torch.save({"model": model.state_dict(), "table": loss.label_logits.detach()}, path)


def _check_role_under_ddp(rank: int, reference_path: str) -> None:
    model, loss, *data = _role_setup()
    _train_role(DistributedDataParallel(model), loss, *data, rows=slice(rank * ROWS, (rank + 1) * ROWS))
    table = loss.label_logits.detach()
    tables = [torch.empty_like(table) for _ in range(WORLD)]
    dist.all_gather(tables, table)
    assert all(torch.equal(other, table) for other in tables)
    reference = torch.load(reference_path, weights_only=True)
    assert not torch.equal(table, _role_setup()[1].label_logits.detach())  # it trained
    assert torch.allclose(table, reference["table"], rtol=1e-10, atol=1e-12)
    for name, value in model.state_dict().items():
        assert torch.allclose(value, reference["model"][name], rtol=1e-10, atol=1e-12), name


def _worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        _check_gathered_loss(rank)
        _check_ddp_parameter_grads(rank)
        _check_unequal_batches(rank)
        _check_sizes_compared_on_the_first_step_only(rank)
        _check_role_under_ddp(rank, init_file + ".role.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gather_in_two_gloo_processes(tmp_path):
    _role_reference(str(tmp_path / "store.role.pt"))  # one process, before the group exists
    # fork: the ranks share this process's imports, torch._dynamo's (which DDP imports, seconds of CPU)
    # included, instead of two spawned interpreters importing them side by side.
    import torch._dynamo  # noqa: F401

    run_ranks(_worker, (str(tmp_path / "store"),), WORLD, what="DDP loss test")
