"""Shared helpers: compose the real configs with overrides, and the overrides of a tiny CPU run.

torch, Hydra and mlcls are imported where they are first used, not at the top: pytest-xdist's controller
process loads this file too, and it runs no test; importing them there took 10 s of ``make test``'s wall
time before the workers started.

The test files are named for the module they test, so that a module's tests are found by its name:
``mlcls/<module>.py`` -> ``test_<module>.py``, ``mlcls/<package>/__init__.py`` -> ``test_<package>.py``, and
``mlcls/<package>/[<folder>/]<module>.py`` -> ``test_<package>_<module>.py``, the folders between left out
(``mlcls/data/datasets/coco.py`` -> ``test_data_coco.py``, ``mlcls/engine/trainer.py`` ->
``test_engine_trainer.py``). A module whose tests fill several files adds an aspect:
``test_engine_checkpoint_fuzz.py``. A command's end-to-end tests are named for its module
(``mlcls/cli/train.py`` -> ``test_cli_train.py``). Helpers shared by several files carry no ``test_`` prefix
(data_fixtures.py, hostile.py, inference_fixtures.py, ranks.py). tests/test_package_layout.py holds every file
to this, and lists the few that test no module."""

from __future__ import annotations

import copy
import functools
import gc
import logging
import math
import multiprocessing.process
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from omegaconf import DictConfig

# One pytest-xdist worker per core: torch's threads in each worker share the cores with the other workers'
# (and their processes'), so each worker and what it starts takes its share. 2 workers of 2 threads on 2
# cores ran a training-heavy subset 1.4x slower than with 1 thread each.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    _SHARE = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)
    torch.set_num_threads(_SHARE)

# The host's processor name, which the benchmarks' results record: Python asks `uname -p` once per process and
# keeps the answer, so the worker asks it here rather than in whichever test first reads it (the guard below
# would count that test as starting a process).
platform.processor()

# A run of a few seconds on the CPU: small synthetic images, timm's smallest ResNet, two epochs.
TINY = [
    "dataset=synthetic",
    "dataset.train_size=192",
    "dataset.val_size=75",
    "dataset.image_size=32",
    "model.name=test_resnet",  # timm's model for tests: 0.4 M parameters, 5x faster than resnet10t
    "model.pretrained=false",
    "trainer.epochs=2",
    "trainer.batch_size=32",
    "trainer.workers=0",
    "trainer.log_every=1000",
    "trainer.report=false",  # no plots nor report.html, most of a tiny run (test_reporting_report.py: on)
    "optim.lr_head=0.005",
    "optim.lr_backbone=0.005",
]


# The tiny run on resnet10t, for the tests whose reference is built as that model (its layer shapes, the
# fields of its checkpoint, its report's thumbnails).
TINY_RESNET10T = ["model.name=resnet10t" if o.startswith("model.name=") else o for o in TINY]


_COMPOSED: dict[tuple[str, tuple[str, ...]], DictConfig] = {}


def compose_config(overrides: list[str], config_name: str = "train") -> DictConfig:
    """The config ``mlcls-train <overrides>`` would run, composed in-process; a copy of the worker's earlier
    composition of the same overrides (a composition takes 0.2-0.4 s; a copy 5 ms)."""
    from hydra import compose, initialize_config_dir

    from mlcls import config_dir
    from mlcls.cli.overrides import register_resolvers

    register_resolvers()
    key = (config_name, tuple(overrides))
    if key not in _COMPOSED:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            _COMPOSED[key] = compose(config_name=config_name, overrides=list(overrides))
    return copy.deepcopy(_COMPOSED[key])


def run_main(main, argv: list[str], monkeypatch, capsys) -> tuple[int, list[str], str]:
    """(exit status, stderr lines, stdout) of a CLI ``main`` run in this process on ``argv`` (``argv[0]`` the
    command's name), as its console script runs it: ``sys.exit(main())``."""
    monkeypatch.setattr(sys, "argv", argv)
    try:
        status = main()
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    return 0 if status is None else status, captured.err.strip().splitlines(), captured.out


def distinct_colours(pixels) -> int:
    """The number of distinct RGB colours of an (H, W, 3) uint8 image: each pixel packed into one integer,
    sorted once (``np.unique(..., axis=0)`` sorts rows as records: seconds for a screenshot)."""
    rgb = pixels.reshape(-1, 3).astype(np.uint32)
    packed = np.sort((rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2])
    return int(np.count_nonzero(np.diff(packed))) + 1 if packed.size else 0


def cli(*args: str) -> list[str]:
    """Command line of an installed console script, falling back to ``python -m``."""
    name, rest = args[0], list(args[1:])
    exe = shutil.which(name, path=str(Path(sys.executable).parent))
    if exe:
        return [exe, *rest]
    module = {"mlcls-train": "mlcls.train", "mlcls-eval": "mlcls.eval"}[name]
    return [sys.executable, "-m", module, *rest]


def run_cli(args: list[str], cwd: Path, timeout: int = 300, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """Each test leaves logging as it found it: a console entry point run in-process (Hydra's job logging)
    adds handlers bound to that test's captured stream, which a later test of the same worker would write to
    after it is closed ("--- Logging error ---" on the later test's stderr)."""
    loggers = [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    saved = [(logger, list(logger.handlers), logger.level, logger.propagate) for logger in loggers]
    yield
    for logger, handlers, level, propagate in saved:
        logger.handlers[:] = handlers
        if logger.level != level:  # setLevel clears the cache of every logger: hundreds, for each of hundreds
            logger.setLevel(level)
        logger.propagate = propagate
    known = {id(logger) for logger in loggers}
    for logger in list(logging.Logger.manager.loggerDict.values()):  # loggers the test created
        if isinstance(logger, logging.Logger) and id(logger) not in known:
            logger.handlers.clear()


@pytest.fixture
def tiny() -> list[str]:
    return list(TINY)


# Tensor methods that read a value back to the host: on a GPU each one waits for the queued kernels.
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")
# Functions that copy a value from the host into a new tensor: on a GPU, a copy from pageable memory that
# waits for the queued kernels (what ``torch.cuda.set_sync_debug_mode`` reports); the Tensor method is
# counted with the reads.
HOST_COPIES = ("tensor", "as_tensor")


@pytest.fixture
def host_reads(monkeypatch) -> list[str]:
    """The names of the host-reading Tensor methods and host-copying functions called while the fixture
    is active, in call order."""
    import torch

    calls: list[str] = []

    def counted(owner, name: str) -> None:
        original = getattr(owner, name)

        def counting(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)

    for method in (*HOST_READS, "new_tensor"):
        counted(torch.Tensor, method)
    for name in HOST_COPIES:
        counted(torch, name)
    monkeypatch.setattr(torch, "nonzero", lambda *args, **kwargs: calls.append("torch.nonzero"))
    torch.ones(1).item()  # the counter itself works
    torch.ones(1).new_tensor(2.0)
    assert calls == ["item", "new_tensor"]
    calls.clear()
    return calls


def assert_dataset_setting_refused(override: str, message: str, capsys: pytest.CaptureFixture) -> None:
    """The synthetic dataset with ``override`` is refused in one line holding ``message``: by
    ``build_dataset`` on the validation split (so on every split, before training) and by
    ``mlcls-data stats`` (exit status 2, one line on stderr)."""
    from mlcls.cli.data import main as data_main
    from mlcls.data import DatasetConfigError, build_dataset

    cfg = compose_config(["dataset=synthetic", "dataset.train_size=8", "dataset.val_size=8", override])
    with pytest.raises(DatasetConfigError) as error:
        build_dataset(cfg.dataset, train=False)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert data_main(["stats", "dataset=synthetic", override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def error_on_a_full_disk(main, argv: list[str], monkeypatch, capsys) -> str:
    """The one stderr line of console entry point ``main`` run with ``argv`` (``argv[0]`` its name) while
    every ``fsync`` of mlcls's atomic writes fails as on a full disk; it must exit with status 2."""
    import errno

    import mlcls.io as io_module

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io_module.os, "fsync", full_disk)
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# An unmarked test (not ``slow``) may take at most this long, or the run fails naming it: the fast suite
# (``make test-fast``) stays fast as the project grows. Tests that train, spawn processes or start a
# subprocess are marked ``slow``. A test's time is its call's (a module's shared fixture is set up by
# whichever test asks first, so setup is not counted), the lesser of its wall time and its process's CPU
# time, so that waiting for a core (parallel workers on a loaded machine) does not count, nor do extra
# threads on an idle one.
UNMARKED_LIMIT_S = float(os.environ.get("MLCLS_UNMARKED_LIMIT_S", "5"))
_SPENT = pytest.StashKey[list]()  # [wall seconds, CPU seconds] of the test's call


def _spend(item: pytest.Item):
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    spent = item.stash.setdefault(_SPENT, [0.0, 0.0])
    spent[0] += time.perf_counter() - wall
    spent[1] += time.process_time() - cpu


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed or item.get_closest_marker("slow"):
        return
    took = min(item.stash.get(_SPENT, [0.0, 0.0]))
    started = item.stash.get(_STARTED, [])
    if took > UNMARKED_LIMIT_S:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {took:.1f} s without the slow marker; the limit for an "
            f"unmarked test is {UNMARKED_LIMIT_S:g} s: mark it @pytest.mark.slow or make it faster"
        )
    elif started and math.isfinite(UNMARKED_LIMIT_S):
        report.outcome = "failed"
        if TRAINING in started:
            report.longrepr = (
                f"{item.nodeid} trained a model ({TRAINING}) without the slow marker: "
                "tests that train are marked @pytest.mark.slow"
            )
        else:
            how = ", ".join(sorted(set(started)))
            report.longrepr = (
                f"{item.nodeid} started a process ({how}) without the slow marker: "
                "tests that spawn processes are marked @pytest.mark.slow"
            )


# An unmarked test may not start a process nor train (its setup and call, so a module's trained fixture
# counts too): a fork, a subprocess, a multiprocessing child (DataLoader workers) costs a new interpreter or a
# copy of the test process, a training run seconds, and their sum is what made the fast suite slow. Counted by
# wrapping the three ways a process starts and the trainer's ``fit``; ``git`` (what a run's provenance asks,
# a few milliseconds) is not counted. Both limits are off with MLCLS_UNMARKED_LIMIT_S=inf
# (scripts/gpu_check.sh: CUDA tests skipped here may compile or start workers).
TRAINING = "Trainer.fit"
_STARTED = pytest.StashKey[list]()  # how the running test started processes, or that it trained
_RUNNING: list[pytest.Item] = []  # the test whose setup or call runs now


def _starters() -> tuple[tuple[object, str, str], ...]:
    from mlcls.engine.trainer import Trainer

    return (
        (os, "fork", "os.fork"),
        (subprocess.Popen, "__init__", "subprocess"),
        (multiprocessing.process.BaseProcess, "start", "multiprocessing"),
        (Trainer, "fit", TRAINING),
    )


def _program(how: str, args: tuple, kwargs: dict) -> str:
    """The program a ``subprocess.Popen(self, args, ...)`` runs (its file name), else ``how``."""
    if how != "subprocess":
        return how
    command = kwargs.get("args", args[1] if len(args) > 1 else "")
    first = command.split()[0] if isinstance(command, str) and command else (list(command) or [""])[0]
    return Path(str(first)).name


def _counted(original, how: str):
    @functools.wraps(original)
    def start(*args, **kwargs):
        program = _program(how, args, kwargs)
        if _RUNNING and program != "git":
            _RUNNING[-1].stash.setdefault(_STARTED, []).append(program)
        return original(*args, **kwargs)

    start.__wrapped_starter__ = original
    return start


def _runs_tests(config: pytest.Config) -> bool:
    """False in pytest-xdist's controller, which hands the tests to its workers and runs none."""
    distributed = getattr(config.option, "dist", "no") != "no" and not config.option.collectonly
    return not distributed or "PYTEST_XDIST_WORKER" in os.environ


def pytest_configure(config: pytest.Config) -> None:
    if _runs_tests(config):
        for owner, name, how in _starters():
            setattr(owner, name, _counted(getattr(owner, name), how))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _runs_tests(config):
        for owner, name, _ in _starters():
            setattr(owner, name, getattr(owner, name).__wrapped_starter__)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    _RUNNING.append(item)
    yield
    _RUNNING.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    _RUNNING.append(item)
    yield from _spend(item)
    _RUNNING.pop()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What exists once the tests are collected (the imported modules: torch, timm, Hydra, mlcls and the
    tests) lives until the process ends: frozen out of the cyclic garbage collector, whose full collections
    walked it again each time (0.4 s each, a tenth of a worker's time in Python's collector)."""
    if _runs_tests(session.config):
        gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with the most ``slow`` tests first, then the others with the most tests first; each module's
    tests in their order. ``make test`` hands whole modules to its workers in this order
    (``--dist loadscope --no-loadscope-reorder``): the longest come first, and the run ends on short
    modules, not on one worker finishing a long one while the other waits."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def weight(tests: list[pytest.Item]) -> tuple[int, int]:
        return sum(test.get_closest_marker("slow") is not None for test in tests), len(tests)

    items[:] = [item for tests in sorted(modules.values(), key=weight, reverse=True) for item in tests]
