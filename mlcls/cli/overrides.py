"""Command-line overrides checked against the composed config before anything runs.

Hydra answers ``trainer.epoch=3`` (a typo of ``trainer.epochs``) with advice to append the key as
``+trainer.epoch=3``, which then trains 40 epochs with a key nothing reads. Here an override of a key that
is not in the config, with ``=`` or ``+``, stops the command with one line naming the closest options.
``++key=value`` (Hydra's explicit "add or replace") is left alone, as are deletions (``~key``), config
group choices (``loss=bce``, ``experiment=paper``) and ``hydra.*`` settings.
"""

from __future__ import annotations

import difflib
import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from mlcls import config_dir
from mlcls.cli.errors import user_errors
from mlcls.engine.validate import ConfigError

# Configs composed per command at most for swept config groups (e.g. experiment=a,b,c); beyond, no check.
MAX_COMPOSITIONS = 64
# Hydra's flags that choose another config than the command's own.
CONFIG_FLAGS = ("-cn", "--config-name", "-cd", "--config-dir", "-cp", "--config-path")


def compose_config(config_name: str, overrides: Sequence[str]) -> DictConfig:
    """The config ``config_name`` of ``mlcls/configs`` with ``overrides`` applied, after
    :func:`check_overrides`."""
    check_overrides(config_name, overrides)
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def command_line_overrides(argv: Sequence[str]) -> list[str] | None:
    """The overrides among a Hydra command line's arguments; ``None`` when it selects another config
    (``--config-name``, ``--config-dir``, ``--config-path``), which this module does not check."""
    if any(arg.split("=")[0] in CONFIG_FLAGS for arg in argv):
        return None
    return [arg for arg in argv if "=" in arg and not arg.startswith("-")]


def check_overrides(config_name: str, overrides: Sequence[str]) -> None:
    """Raise :class:`ConfigError` for an override of a key the composed config does not have.

    The config is composed with the config group choices of ``overrides`` (each value of a swept group in
    turn); a key counts as known if any of those configs has it. Overrides Hydra cannot parse, and choices
    it cannot compose, are left for Hydra to report.
    """
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return
    parsed = [o for o in parsed if not o.is_hydra_override() and o.type != OverrideType.DEL]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        groups = [o for o in parsed if _is_group(o.key_or_group)]
        keys = [o for o in parsed if o not in groups and o.type in (OverrideType.CHANGE, OverrideType.ADD)]
        if not keys:
            return
        choices = [[f"{o.get_key_element()}={value}" for value in _values(o)] for o in groups]
        if math.prod(len(values) for values in choices) > MAX_COMPOSITIONS:
            return
        try:
            trees = [
                OmegaConf.to_container(compose(config_name=config_name, overrides=list(combo)), resolve=False)
                for combo in itertools.product(*choices)
            ]
        except HydraException:
            return
    known = sorted({path for tree in trees for path in _paths(tree)})
    for override in keys:
        key = override.key_or_group
        if key not in known:
            raise ConfigError(_unknown_key_message(override, known))


def _is_group(name: str) -> bool:
    parent, _, leaf = name.rpartition("/")
    return leaf in GlobalHydra.instance().config_loader().list_groups(parent)


def _values(override: Override) -> list[str]:
    if override.is_sweep_override():
        return list(override.sweep_string_iterator())
    return [override.get_value_element_as_str()]


def _paths(node: Any, prefix: str = "") -> Iterator[str]:
    """Every key path of a config tree, inner nodes included: ``trainer``, ``trainer.epochs``, …"""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        path = f"{prefix}{key}"
        yield path
        yield from _paths(value, f"{path}.")


def _unknown_key_message(override: Override, known: list[str]) -> str:
    parent, _, leaf = override.key_or_group.rpartition(".")
    siblings = [path.rpartition(".")[2] for path in known if path.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)
    prefix = f"{parent}." if parent else ""
    if close:
        hint = f"did you mean {' or '.join(prefix + name for name in close)}?"
    elif siblings:
        hint = f"{parent or 'the config'} has {', '.join(siblings)}"
    else:
        hint = "run with --cfg job to list the options"
    added = ""
    if override.type == OverrideType.ADD:
        added = " (nothing reads an added key; ++ adds one all the same)"
    return f"unknown option {override.get_key_element()}: {hint}{added}"


def check_command_line(config_name: str, argv: Sequence[str] | None = None) -> None:
    """:func:`check_overrides` on this process's command line (``sys.argv``) as a ``mlcls-*`` command:
    an unknown key ends it with one line and exit status 2, before Hydra runs."""
    overrides = command_line_overrides(sys.argv[1:] if argv is None else argv)
    if overrides is not None:
        with user_errors():
            check_overrides(config_name, overrides)
