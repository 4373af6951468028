"""A loss's reduction under DDP, in two gloo processes on the CPU: the criterion the trainer builds
(:func:`mlcls.engine.build.build_loss`) gives a DDP-wrapped model, with half the batch on each process, the
parameter gradient one process takes on the whole batch, for ASL summed over the batch (ML-Decoder's
recipe) and for a mean. ``trainer.loss_sum_scope=process`` keeps each process's own sum (the paper's 4
GPUs): half that gradient here. Also pinned: torch's SyncBatchNorm refuses CPU tensors under gloo, the
reason ``trainer.sync_bn`` converts on CUDA only."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mlcls.engine.build import build_loss
from mlcls.losses import AsymmetricLoss

WORLD = 2
ROWS = 4  # per process
CLASSES = 5
ASL = {"_target_": "mlcls.losses.AsymmetricLoss", "gamma_pos": 0.0, "gamma_neg": 4.0, "clip": 0.05}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same float64 inputs and fully known labels of WORLD * ROWS samples on every process."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(WORLD * ROWS, 3, generator=generator, dtype=torch.float64)
    targets = (torch.rand(WORLD * ROWS, CLASSES, generator=generator) < 0.4).to(torch.float64)
    return inputs, targets


def _gradients(model: nn.Module, loss: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> list:
    model.zero_grad()
    loss(model(inputs), targets).backward()
    return [param.grad.clone() for param in model.parameters()]


def _check_gradients(rank: int) -> None:
    inputs, targets = _batch()
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    torch.manual_seed(0)  # the same initial model on every process
    single = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, CLASSES)).double()
    ddp = DistributedDataParallel(copy.deepcopy(single))
    for reduction, process_factor in (("sum", WORLD), ("mean", 1)):
        options = {**ASL, "reduction": reduction}
        one_process = AsymmetricLoss(**{k: v for k, v in options.items() if k != "_target_"})
        reference = _gradients(single, one_process, inputs, targets)
        cfg = OmegaConf.create(options)
        criterion = build_loss(cfg, None, torch.device("cpu"), WORLD)  # trainer.loss_sum_scope=global
        scaled = _gradients(ddp, criterion, inputs[rows], targets[rows])
        for actual, expected in zip(scaled, reference, strict=True):
            assert torch.allclose(actual, expected, rtol=1e-12, atol=1e-15), (reduction, actual, expected)
        # trainer.loss_sum_scope=process: each process's own sum, which DDP averages
        own = _gradients(ddp, build_loss(cfg, None, torch.device("cpu"), 1), inputs[rows], targets[rows])
        for actual, expected in zip(own, reference, strict=True):
            assert torch.allclose(actual * process_factor, expected, rtol=1e-12, atol=1e-15), reduction


def _check_sync_batchnorm_refuses_the_cpu() -> None:
    norm = nn.SyncBatchNorm(3).train()
    with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
        norm(torch.randn(4, 3, 2, 2))


def _worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        _check_gradients(rank)
        _check_sync_batchnorm_refuses_the_cpu()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_summed_and_mean_losses_give_the_one_process_gradient_in_two_gloo_processes(tmp_path):
    # fork: the ranks share this process's imports, torch._dynamo's (which DDP imports, seconds of CPU)
    # included, instead of two spawned interpreters importing them side by side.
    import torch._dynamo  # noqa: F401

    run_ranks(_worker, (str(tmp_path / "store"),), WORLD, what="DDP loss-scale test")
