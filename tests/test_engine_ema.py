"""ModelEma against a float64 loop of its formula; counters exact; state round trip; other states refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from mlcls.engine.ema import ModelEma
from mlcls.engine.state import CheckpointError, RunBounds, check_part


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def training_steps(model: nn.Module, steps: int):
    """Move every parameter and the BatchNorm statistics as a training step would; yield after each."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator))
            model(torch.randn(8, 3, generator=generator) * 3 + 1)  # train mode: running stats move
        yield


def float_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.double().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


@pytest.mark.parametrize(("decay", "warmup"), [(0.5, True), (0.9, True), (0.9, False)])
def test_update_matches_a_float64_loop_of_the_formula(decay, warmup):
    # decay 0.5: the warm-up (1 + t) / (10 + t) passes it at t = 8; 0.9: not within the 25 steps
    applied = [True] * 10 + [False] * 3 + [True] * 12  # skipped steps leave everything as it was
    model = small_net()
    ema = ModelEma(model, decay, warmup=warmup)
    reference, t = float_state(model), 0
    for step_applied, _ in zip(applied, training_steps(model, len(applied)), strict=True):
        if step_applied:
            d = min(decay, (1.0 + t) / (10.0 + t)) if warmup else decay
            for key, x in float_state(model).items():
                reference[key] = d * reference[key] + (1.0 - d) * x
            t += 1
        ema.update(model, torch.tensor(step_applied))
    averaged = ema.module.state_dict()
    assert set(reference) == {k for k, v in averaged.items() if v.is_floating_point()}
    assert "1.running_mean" in reference and "1.running_var" in reference  # buffers averaged too
    for key, value in reference.items():
        torch.testing.assert_close(averaged[key].double(), value, rtol=1e-5, atol=1e-6, msg=key)
    assert ema.updates == t == 22


def test_integer_buffers_are_copied_exactly():
    model = small_net()
    ema = ModelEma(model, 0.9997)
    steps = training_steps(model, 9)
    for _ in range(7):
        next(steps)
        ema.update(model)
    for _ in steps:  # two steps the optimizer skipped: the model's BatchNorm still counted the batches
        ema.update(model, torch.tensor(False))
    counter = ema.module.state_dict()["1.num_batches_tracked"]
    assert counter.dtype == torch.int64 and counter.item() == 7
    assert model.state_dict()["1.num_batches_tracked"].item() == 9


def test_the_first_weights_fade_with_the_warm_up():
    # decay 0.9997 over 6,400 updates (40 epochs of COCO at batch 512): the copy of the initial weights
    # keeps 0.9997**6400 = 14.7 % of the average without warm-up, a negligible share with it.
    shares = {}
    for warmup in (False, True):
        model = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(model.weight)
        ema = ModelEma(model, 0.9997, warmup=warmup)
        nn.init.ones_(model.weight)
        for _ in range(6400):
            ema.update(model)
        shares[warmup] = 1.0 - ema.module.weight.item()
    assert shares[False] == pytest.approx(0.9997**6400, rel=1e-3)
    assert shares[True] < 1e-6  # 2e-29 in exact arithmetic, float32 rounding here


def test_state_dict_round_trip_continues_the_same_average():
    model = small_net()
    ema = ModelEma(model, 0.99)
    steps = training_steps(model, 6)
    for _ in range(3):
        next(steps)
        ema.update(model)
    resumed = ModelEma(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)), 0.99)
    resumed.load_state_dict(ema.state_dict())
    assert resumed.updates == 3
    for _ in steps:
        ema.update(model)
        resumed.update(model)
    for (key, a), b in zip(
        ema.module.state_dict().items(), resumed.module.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)


def test_an_averaged_model_state_is_not_an_ema_state():
    """ModelEma writes module and updates; torch AveragedModel's layout is no checkpoint's of mlcls."""
    model = small_net()
    old = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
    with pytest.raises(CheckpointError, match=r"^ema lacks module; expected this run's 2 entries$"):
        check_part("ema", old.state_dict(), ModelEma(small_net(), 0.99), RunBounds())


def test_something_else_is_refused_with_the_expected_keys():
    ema = ModelEma(small_net(), 0.99)
    with pytest.raises(CheckpointError, match=r"^ema lacks module; expected this run's 2 entries$"):
        check_part("ema", small_net().state_dict(), ema, RunBounds())
    with pytest.raises(ValueError, match=r"EMA decay 1\.0; expected a number in \(0, 1\)"):
        ModelEma(small_net(), 1.0)


def test_update_reads_no_tensor_on_the_host(monkeypatch):
    model = small_net()
    ema = ModelEma(model, 0.9997)

    def refuse(tensor, *args):
        raise AssertionError("the EMA update read a tensor on the host")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for applied in (None, torch.tensor(True), torch.tensor(False)):
        ema.update(model, applied)
    monkeypatch.undo()
    assert ema.updates == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host-sync check needs CUDA")
def test_update_does_not_synchronise_with_the_host():
    model = small_net().cuda()
    ema = ModelEma(model, 0.9997)
    ema.update(model)  # first call outside the check: lazy CUDA initialisation may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ema.update(model)
    finally:
        torch.cuda.set_sync_debug_mode("default")
