"""The one config flattener (:func:`mlcls.config_tree.flatten_config`): dotted leaves in the config's order,
a group's own value when asked for, and no recursion limit."""

from __future__ import annotations

from mlcls.config_tree import flatten_config
from mlcls.reporting.run_table import flat_settings


def test_leaves_under_dotted_keys_lists_whole() -> None:
    config = {"optim": {"lr": 0.1, "betas": [0.9, 0.99], "inner": {"a": None}}, "seed": 3, "empty": {}}
    flat = flatten_config(config)
    assert flat == {"optim.lr": 0.1, "optim.betas": [0.9, 0.99], "optim.inner.a": None, "seed": 3}
    assert list(flat) == ["optim.lr", "optim.betas", "optim.inner.a", "seed"]


def test_a_group_value_comes_before_its_leaves() -> None:
    config = {"sched": {"_target_": "x.Cosine", "t": 1}, "loss": {"gamma": 2}}
    flat = flatten_config(config, lambda key, group: key.upper() if "_target_" in group else None)
    assert list(flat.items()) == [("sched", "SCHED"), ("sched._target_", "x.Cosine"), ("sched.t", 1),
                                  ("loss.gamma", 2)]  # fmt: skip
    # the runs table's settings name what a group builds: torch.optim.SGD -> sgd
    settings = flat_settings({"optim": {"_target_": "torch.optim.SGD", "lr": 0.1}})
    assert list(settings.items()) == [
        ("optim", "sgd"),
        ("optim._target_", "torch.optim.SGD"),
        ("optim.lr", 0.1),
    ]


def test_deep_nesting_is_no_recursion_error() -> None:
    # old: flat_params / flat_settings recursed once per level, RecursionError past ~1,000 levels
    config: dict = {"leaf": 1}
    for _ in range(5000):
        config = {"k": config}
    assert flatten_config(config) == {"k." * 5000 + "leaf": 1}
