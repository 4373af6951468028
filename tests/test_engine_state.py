"""The checks of a stored state against the live objects (:mod:`mlcls.engine.state`), in process: the
optimizer's own ``state_dict()`` after real steps is the reference a stored state must fit."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mlcls.engine.state import CheckpointError, check_optimizer, check_rng, rng_state, set_rng_state


def stepped(optimizer_class: type[torch.optim.Optimizer], **settings) -> torch.optim.Optimizer:
    """``optimizer_class`` over a 3 x 2 weight and a bias, after two steps with gradients of ones."""
    layer = torch.nn.Linear(2, 3)
    optimizer = optimizer_class(layer.parameters(), lr=0.1, **settings)
    for _ in range(2):
        for param in layer.parameters():
            param.grad = torch.ones_like(param)
        optimizer.step()
    return optimizer


@pytest.mark.parametrize(
    ("optimizer_class", "settings"),
    [
        (torch.optim.SGD, {"momentum": 0.9, "fused": True}),
        (torch.optim.AdamW, {"fused": True}),
        (torch.optim.Adam, {"amsgrad": True}),
        (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),  # keys learned from its own states
    ],
)
def test_an_optimizers_own_state_fits_it(optimizer_class, settings) -> None:
    optimizer = stepped(optimizer_class, **settings)
    check_optimizer(optimizer.state_dict(), optimizer)


def test_a_moment_of_another_dtype_than_its_weight_is_one_line() -> None:
    optimizer = stepped(torch.optim.AdamW, fused=True)
    state = optimizer.state_dict()
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].double()
    with pytest.raises(
        CheckpointError,
        match=r"^optimizer state\[0\]\['exp_avg'\] holds a float64 tensor of shape \(3, 2\); expected a "
        r"dense float32 tensor of shape \(3, 2\)$",
    ):
        check_optimizer(state, optimizer)


def test_another_optimizers_states_of_other_keys_are_one_line() -> None:
    """RMSprop is in no table: its states must share one set of keys (the first's)."""
    optimizer = stepped(torch.optim.RMSprop, momentum=0.5)
    state = optimizer.state_dict()
    del state["state"][1]["momentum_buffer"]
    with pytest.raises(
        CheckpointError, match=r"^optimizer state\[1\] holds a dict of 2 items; expected a dict "
    ):
        check_optimizer(state, optimizer)


def test_an_empty_state_beside_filled_ones_is_one_line() -> None:
    """Fused SGD given one parameter without a momentum buffer beside others with one fails in its kernel
    call (a TypeError at the first resumed step): the state must hold the buffer."""
    optimizer = stepped(torch.optim.SGD, momentum=0.9, fused=True)
    state = optimizer.state_dict()
    state["state"][1] = {}
    with pytest.raises(
        CheckpointError,
        match=r"^optimizer state\[1\] holds a dict of 0 items; expected a dict with keys momentum_buffer$",
    ):
        check_optimizer(state, optimizer)


def test_a_switch_of_another_value_than_this_runs_is_one_line() -> None:
    """fused and differentiable together fail at the first step: a group's switches are this run's."""
    optimizer = stepped(torch.optim.SGD, momentum=0.9, fused=True)
    state = optimizer.state_dict()
    state["param_groups"][0]["differentiable"] = True
    with pytest.raises(
        CheckpointError, match=r"^optimizer param_groups\[0\]\['differentiable'\] holds True; expected False"
    ):
        check_optimizer(state, optimizer)


def test_generator_states_are_tried_on_private_generators() -> None:
    """A genuine state passes and restores exactly; torch's refusal of a short one and NumPy's of a short key
    become one line; a torch state sharing one byte across its elements is refused before torch copies
    5056 bytes from it."""
    state = rng_state()
    check_rng([state])
    expected = (torch.rand(3), np.random.random(3))
    set_rng_state(state)
    torch.testing.assert_close((torch.rand(3), np.random.random(3)), expected, rtol=0, atol=0)
    cases = {
        "torch": (torch.zeros(7, dtype=torch.uint8), r"\(7,\); expected a generator state \(RuntimeError: "),
        "numpy": (("MT19937", torch.zeros(3, dtype=torch.int64), 0, 0, 0.0), r"expected a generator state"),
        "python": ((3, (0,) * 10, None), r"expected a generator state \(ValueError: "),
    }
    for key, (value, words) in cases.items():
        with pytest.raises(CheckpointError, match=rf"^rng\[0\]\['{key}'\] holds .*{words}"):
            check_rng([{**state, key: value}])
    shared = torch.zeros(1, dtype=torch.uint8).expand(len(state["torch"]))
    with pytest.raises(
        CheckpointError, match=r"^rng\[0\]\['torch'\] holds .*; expected a generator state, a dense"
    ):
        check_rng([{**state, "torch": shared}])


def test_a_numpy_position_past_the_key_is_one_line() -> None:
    """NumPy's set_state takes any position; its next draw then reads past the 624-word key (a position of
    10**8 is a segmentation fault)."""
    state = copy.deepcopy(rng_state())
    algorithm, keys, _, *gauss = state["numpy"]
    for position in (625, -1, 10**8):
        state["numpy"] = (algorithm, keys, position, *gauss)
        with pytest.raises(
            CheckpointError, match=rf"^rng\[0\]\['numpy'\] holds .*position {position} outside"
        ):
            check_rng([state])


def test_a_loss_table_whose_nan_means_not_estimated_resumes_its_nans_and_refuses_an_infinity():
    """em with apl marks a pseudo-label not drawn yet with NaN: a resumed table keeps them; an infinity (no
    probability) is one line, as in ROLE's label table, which has no NaN to keep."""
    from mlcls.engine.state import RunBounds, check_part
    from mlcls.losses.unknown import EntropyMaximisationLoss

    loss = EntropyMaximisationLoss(apl=True, epochs=3, warmup_epochs=1)
    loss.pseudo_labels = torch.full((4, 3), float("nan"))
    loss.pseudo_labels[0, 0] = 0.25
    stored = copy.deepcopy(loss.state_dict())
    check_part("loss", stored, loss, RunBounds(epochs=3))
    stored["pseudo_labels"][1, 2] = float("inf")
    with pytest.raises(CheckpointError) as error:
        check_part("loss", stored, loss, RunBounds(epochs=3))
    assert str(error.value) == (
        "loss['pseudo_labels'] holds 1 values not finite; expected finite values (or NaN: not estimated yet)"
    )
