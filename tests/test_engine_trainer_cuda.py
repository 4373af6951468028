"""The trainer's CUDA paths, where CUDA exists (scripts/gpu_check.sh selects these tests by their skip
reason, "needs CUDA"): AMP with the real GradScaler, the epoch loop's host synchronisations, and a
single-process NCCL group through the trainer's collectives and evaluation."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import TINY, compose_config
from ranks import free_port

from mlcls import collectives
from mlcls.engine.trainer import Trainer


def _trainer(tmp_path, *overrides: str) -> Trainer:
    return Trainer(compose_config([*TINY, "trainer.device=cuda", *overrides]), run_dir=tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="AMP with a GradScaler needs CUDA")
@pytest.mark.parametrize("amp, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_amp_steps_run_in_half_precision_with_the_real_grad_scaler(tmp_path, amp, dtype):
    trainer = _trainer(tmp_path, f"trainer.amp={amp}", "trainer.limit_train_batches=4")
    initial_scale = 2.0**16 if amp == "fp16" else 1.0
    # bf16 has float32's exponent range: no loss scaling, the scaler is built disabled (its scale is 1)
    assert trainer.scaler.is_enabled() == (amp == "fp16") and trainer.scaler.get_scale() == initial_scale
    logits_dtypes: list[torch.dtype] = []
    hook = trainer.model.register_forward_hook(lambda _, inputs, logits: logits_dtypes.append(logits.dtype))
    before = [parameter.detach().clone() for parameter in trainer.model.parameters()]
    try:
        result = trainer.train_one_epoch(0)
    finally:
        hook.remove()
    assert logits_dtypes == [dtype] * 4 and math.isfinite(result["loss"])
    skipped = trainer.state.counts["skipped_steps"]
    assert skipped < 4
    # fp16: every skipped step halves the scale (no growth within 2,000 steps); bf16 keeps it at 1
    assert trainer.scaler.get_scale() == (initial_scale / 2**skipped if amp == "fp16" else 1.0)
    after = list(trainer.model.parameters())
    assert any(not torch.equal(old, new) for old, new in zip(before, after, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sync debug mode needs CUDA")
def test_the_cuda_epoch_loop_synchronises_as_often_for_8_steps_as_for_2(tmp_path):
    def synchronisations(steps: int) -> list[str]:
        trainer = _trainer(
            tmp_path / str(steps), "dataset.train_size=320", "trainer.log_every=1000",
            f"trainer.limit_train_batches={steps}",
        )  # fmt: skip
        trainer.train_one_epoch(0)  # warm-up: cuDNN autotuning, allocator, first optimizer state
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_one_epoch(1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # one warning per synchronising call; the first call of set_sync_debug_mode in a process also warns
        # that the mode is a prototype (not a synchronisation)
        return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]

    two, eight = synchronisations(2), synchronisations(8)
    assert len(eight) == len(two), "\n".join(eight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a NCCL group needs CUDA")
def test_a_single_process_nccl_group_evaluates_as_without_a_group(tmp_path):
    trainer = _trainer(tmp_path, "trainer.amp=none")
    alone = trainer.measure()
    address = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=address, rank=0, world_size=1)
    try:
        grouped = trainer.measure()
        total = collectives.all_reduce_sum(torch.arange(3.0, device="cuda"))
        gathered = collectives.all_gather_object({"rank": 0})
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(grouped.scores, alone.scores, rtol=1e-3, atol=1e-3)
    assert torch.equal(grouped.labels, alone.labels)
    assert total.tolist() == [0.0, 1.0, 2.0] and gathered == [{"rank": 0}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.slow
def test_apl_pass_over_the_training_set_on_cuda(tmp_path):
    """EM's APL on CUDA: the pass after each epoch scores every training sample (the prefetched batches,
    their indices on the device) and pseudo-labels as many entries per class as the schedule says."""
    from test_losses_unknown_apl import APL_RUN

    trainer = _trainer(tmp_path, *APL_RUN[len(TINY) :])
    labels = torch.stack([trainer.data.train_set[i][1] for i in range(len(trainer.data.train_set))])
    trainer.fit()
    table = trainer.criterion.pseudo_labels
    assert table.device.type == "cuda"
    unknown = (labels == -1).sum(0)
    expected = torch.tensor([2 * int(0.9 * u / 2) for u in unknown.tolist()])
    assert torch.equal((~table.isnan()).sum(0).cpu(), expected) and int(expected.sum()) > 0
