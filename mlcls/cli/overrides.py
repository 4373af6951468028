"""Command lines of the ``mlcls-*`` commands: every mistake in one line on stderr, exit status 2.

Hydra's own reports span many lines and exit with 1 (an unknown option lists every choice and the search
path). :func:`run_command` runs a command with Hydra's errors raised and prints each as one line naming
the valid options; only a failed command line is composed again, to find the closest keys. Where Hydra
reports nothing -- ``+key=value`` for a key the config lacks (read by nothing), a nested group chosen with
dots (``model.head=csra``, which Hydra reads as a value replacing the head's config, for
``model/head=csra``) -- :func:`check_command_line` refuses it first; ``++key``, ``~key`` and ``hydra.*``
are left alone.

Hydra's override parser (``hydra.core.override_parser``) is not part of Hydra's documented API; it stays
because Hydra has no public way to parse an override (its key, group and swept values) before composing;
``GlobalHydra.instance().clear()`` is the reset Hydra's compose API documents after a failed run.
A config group and its options are read from the files of ``mlcls/configs`` (:func:`_group_options`).
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mlcls import config_dir
from mlcls.cli.errors import one_line, user_errors
from mlcls.errors import ConfigError

# Configs composed per command at most for swept config groups (e.g. experiment=a,b,c); beyond, no check.
MAX_COMPOSITIONS = 64
# @hydra.main's flags that take a value (``--hydra-help``), and those that select another config.
VALUE_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--cfg", "-c")
VALUE_FLAGS += ("--package", "-p", "--experimental-rerun")
CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
# --info takes an optional value, one of these
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def register_resolvers() -> None:
    """Register the resolvers mlcls's configs use, before one is composed (:func:`run_command`,
    :func:`compose_config`): ``${shards_source:KEY,FALLBACK}`` of ``configs/dataset/shards.yaml``, the
    packed source's setting (:func:`mlcls.data.shards.datasets.source_setting`, imported when such a config
    resolves)."""
    OmegaConf.register_new_resolver("shards_source", _shards_source, replace=True)


def _shards_source(key: str, fallback: Any, *, _parent_: DictConfig) -> Any:
    from mlcls.data.shards.datasets import source_setting

    return source_setting(key, fallback, _parent_)


def run_command(config_name: str, hydra_main: Callable[[], Any]) -> None:
    """Run ``hydra_main``, the ``@hydra.main`` function of config ``config_name``, on ``sys.argv`` (the
    resolvers registered first: :func:`register_resolvers`); a mistake ends it with one line
    (:func:`explain_error`) and exit status 2, unless the user set ``HYDRA_FULL_ERROR=1``."""
    register_resolvers()
    overrides = check_command_line(config_name)
    user_setting = os.environ.get("HYDRA_FULL_ERROR")
    if user_setting == "1":
        hydra_main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its report and exiting with 1
    try:
        hydra_main()
    except (HydraException, OmegaConfBaseException) as exc:
        # The commands turn their own errors into one line (mlcls.cli.errors.user_errors): what arrives here
        # comes from Hydra, before or between the jobs.
        with user_errors():
            raise ConfigError(explain_error(config_name, overrides, exc)) from exc
    finally:
        if user_setting is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = user_setting


def check_command_line(config_name: str, argv: Sequence[str] | None = None) -> list[str] | None:
    """Check a command line (default ``sys.argv[1:]``) before Hydra runs; return its ``key=value``
    overrides as Hydra writes them (None when a flag selects another config, which is not checked).

    A positional argument, a nested group chosen with dots or ``+key=…`` for a key the config lacks ends the
    process with one line and exit status 2; only a ``+key=…`` override costs a composition.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    arguments, other_config, index = [], False, 0  # without Hydra's flags (``--hydra-help``) and values
    while index < len(argv):
        flag, equals, _ = argv[index].partition("=")
        if flag.startswith("-"):
            other_config |= flag in CONFIG_FLAGS
            takes_next = flag in VALUE_FLAGS or (
                flag in ("--info", "-i") and index + 1 < len(argv) and argv[index + 1] in INFO_CHOICES
            )
            index += 1 if equals or not takes_next else 2
        else:
            arguments.append(argv[index])
            index += 1
    with user_errors():
        for arg in arguments:
            if "=" not in arg and not arg.startswith("~"):
                raise ConfigError(
                    f"unexpected argument {arg!r}: mlcls-{config_name} takes key=value overrides; "
                    f"mlcls-{config_name} --help lists the keys"
                )
        _check_group_paths(arguments)
        if other_config:
            return None
        overrides = [arg for arg in arguments if "=" in arg]
        _check_added_keys(config_name, overrides)
    return overrides


def _check_group_paths(overrides: Sequence[str]) -> None:
    """Raise :class:`ConfigError` for a nested config group chosen with dots (``model.head=csra``): Hydra
    would set the value, not choose the group's option."""
    for override in overrides:
        key, equals, value = override.partition("=")
        name = key.lstrip("+~")
        if equals and "." in name and (config_dir() / name.replace(".", "/")).is_dir():
            group = name.replace(".", "/")
            raise ConfigError(f"{name} is a config group: choose its option with {group}={value}")


def compose_config(config_name: str, overrides: Sequence[str]) -> DictConfig:
    """The config ``config_name`` with ``overrides`` applied, its resolvers registered
    (:func:`register_resolvers`); a mistake raises :class:`ConfigError` with the message of
    :func:`explain_error`."""
    register_resolvers()
    _check_group_paths(overrides)
    _check_added_keys(config_name, overrides)
    try:
        with _configs():
            return compose(config_name=config_name, overrides=list(overrides))
    except HydraException as exc:
        raise ConfigError(explain_error(config_name, overrides, exc)) from exc


def explain_error(config_name: str, overrides: Sequence[str] | None, exc: Exception) -> str:
    """One line for the error Hydra raised on ``overrides``: the unknown group option with the group's
    options, else the unknown key with the closest keys (:func:`check_overrides`), else Hydra's message."""
    if overrides is not None:
        GlobalHydra.instance().clear()  # left initialised by the failed run
        try:
            with _configs():
                _check_group_options(config_name, overrides)
            check_overrides(config_name, overrides)
        except ConfigError as error:
            return str(error)
        except HydraException:
            pass  # the config itself does not compose: Hydra's message says why
    if isinstance(exc, OverrideParseException):
        reason = [line for line in exc.message.splitlines() if not line.startswith(("Error parsing", "See "))]
        return f"cannot parse {exc.override!r} ({'; '.join(reason)}): expected key=value in Hydra's grammar"
    return one_line(exc)


def check_overrides(config_name: str, overrides: Sequence[str]) -> None:
    """Raise :class:`ConfigError` for an override of a key the composed config does not have.

    Composed with the first value of each swept group, then each other value of one group with the others'
    first (``experiment=a,b loss=c,d``: three configs, not four); a key is known if any of them has it.
    What Hydra cannot parse or compose is left for Hydra to report.
    """
    parsed = _parse(overrides)
    if parsed is None:
        return
    with _configs():
        groups = [o for o in parsed if _is_group(o.key_or_group)]
        keys = [o for o in parsed if o not in groups and o.type in (OverrideType.CHANGE, OverrideType.ADD)]
        if not keys:
            return
        choices = [[f"{o.get_key_element()}={value}" for value in _values(o)] for o in groups]
        first = [values[0] for values in choices]
        combos = [first] + [
            [*first[:i], value, *first[i + 1 :]] for i, values in enumerate(choices) for value in values[1:]
        ]
        if len(combos) > MAX_COMPOSITIONS:
            return
        try:
            trees = [
                OmegaConf.to_container(compose(config_name=config_name, overrides=combo), resolve=False)
                for combo in combos
            ]
        except HydraException:
            return
    known = sorted({path for tree in trees for path in _paths(tree)})
    for override in keys:
        key = override.key_or_group
        if key not in known:
            parent, _, leaf = key.rpartition(".")
            siblings = [path.rpartition(".")[2] for path in known if path.rpartition(".")[0] == parent]
            added = ""
            if override.type == OverrideType.ADD:
                added = " (nothing reads an added key; ++ adds one all the same)"
            raise ConfigError(
                f"unknown option {override.get_key_element()}: {closest_keys(leaf, siblings, parent)}{added}"
            )


def closest_keys(leaf: str, siblings: Sequence[str], parent: str = "") -> str:
    """``did you mean <parent>.<closest>?`` for an unknown ``leaf`` of ``parent``, else its keys."""
    close = difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)
    prefix = f"{parent}." if parent else ""
    if close:
        return f"did you mean {' or '.join(prefix + name for name in close)}?"
    if siblings:
        return f"{parent or 'the config'} has {', '.join(siblings)}"
    return "run with --cfg job to list the options"


def _check_added_keys(config_name: str, overrides: Sequence[str]) -> None:
    """:func:`check_overrides` when ``overrides`` add a key with a single ``+``, which Hydra accepts."""
    if any(o.startswith("+") and not o.startswith("++") for o in overrides):
        check_overrides(config_name, overrides)


def _check_group_options(config_name: str, overrides: Sequence[str]) -> None:
    """Raise :class:`ConfigError` for a group choice that is not one of its options (``loss=nope``), or of
    a group the command's config does not use (``mlcls-predict loss=bce``); Hydra initialised."""
    choices = [override for override in _parse(overrides) or [] if _is_group(override.key_or_group)]
    if not choices:
        return  # no composition: an unknown key is the usual mistake
    base = compose(config_name=config_name, return_hydra_config=True)
    used = set(base.hydra.runtime.choices)
    for override in choices:
        group = override.key_or_group
        if group not in used and override.type != OverrideType.ADD:
            keys = [str(key) for key in base if key != "hydra"]
            raise ConfigError(f"unknown option {group}: {closest_keys(group, keys)}")
        options = _group_options(group)
        for value in _values(override):
            if value not in options:
                raise ConfigError(
                    f"Could not find '{group}/{value}'. Available options in '{group}': {', '.join(options)}"
                )


def _parse(overrides: Sequence[str]) -> list[Override] | None:
    """The parsed overrides, ``hydra.*`` settings and deletions left out; None if Hydra cannot parse them."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return None
    return [o for o in parsed if not o.is_hydra_override() and o.type != OverrideType.DEL]


def _configs() -> Any:
    """Hydra initialised on ``mlcls/configs``, as a context."""
    return initialize_config_dir(config_dir=str(config_dir()), version_base="1.3")


def _is_group(name: str) -> bool:
    return bool(name) and (config_dir() / name).is_dir()


def _group_options(group: str) -> list[str]:
    """The options of config group ``group``: the names of its ``.yaml`` files in ``mlcls/configs``."""
    return sorted(path.stem for path in (config_dir() / group).glob("*.yaml"))


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
