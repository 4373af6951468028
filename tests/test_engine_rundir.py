"""The run directory: one live run at a time, a run that fails before its first checkpoint leaving nothing,
resume=auto in an explicit hydra.run.dir (a full disk that keeps the last good checkpoint: test_io.py)."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_RESNET10T as TINY
from conftest import compose_config
from data_fixtures import truncate, write_csv
from hostile import bounded
from hydra.core.hydra_config import HydraConfig

import mlcls.engine.rundir as rundir_module
from mlcls.data import BadImageError
from mlcls.engine.config_checks import check_config
from mlcls.engine.rundir import (
    LOCK_NAME,
    RunDirLocked,
    acquire_run_lock,
    process_identity,
    release_run_lock,
)
from mlcls.engine.trainer import Trainer
from mlcls.errors import ConfigError

QUICK = ["dataset.train_size=64", "dataset.val_size=20"]


def _lock_of(pid: int) -> str:
    return json.dumps({"host": socket.gethostname(), "pid": pid, "started": "2026-01-01 00:00:00"})


def _finished_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.slow
def test_a_live_runs_lock_refuses_a_second_run_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).write_text(_lock_of(os.getppid()))  # a live process other than this one
    with pytest.raises(RunDirLocked) as caught:
        Trainer(compose_config([*TINY, *QUICK]), run_dir=run_dir)
    message = str(caught.value)
    assert "\n" not in message and f"pid {os.getppid()} on {socket.gethostname()}" in message
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "checkpoints").exists()


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_and_released(tmp_path, caplog):
    dead = _finished_pid()
    (tmp_path / LOCK_NAME).write_text(_lock_of(dead))
    with caplog.at_level(logging.WARNING, logger="mlcls"):
        acquire_run_lock(tmp_path)
    assert "taking over the stale lock" in caplog.text and str(dead) in caplog.text
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no draft left
    release_run_lock(tmp_path)
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_whose_pid_is_now_another_process_is_stale(tmp_path, caplog):
    """A container restarted or a host rebooted reuses process ids: the lock names the process that wrote
    it (boot id and start time), so a live process that took its id over does not hold the directory."""
    other = os.getppid()  # alive, and not this process
    identity = process_identity(other)
    assert identity is not None and identity == process_identity(other)  # read twice, the same
    boot_id, start = identity.rsplit(":", 1)
    reused = {**json.loads(_lock_of(other)), "process": f"{boot_id}:{int(start) + 1}"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(reused))
    with caplog.at_level(logging.WARNING, logger="mlcls"):
        acquire_run_lock(tmp_path)
    assert "taking over the stale lock" in caplog.text
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert (holder["pid"], holder["process"]) == (os.getpid(), process_identity(os.getpid()))
    release_run_lock(tmp_path)

    # The same live process under the identity it has: the directory stays its.
    (tmp_path / LOCK_NAME).write_text(json.dumps({**reused, "process": identity}))
    with pytest.raises(RunDirLocked, match=f"in use by another run \\(pid {other} on "):
        acquire_run_lock(tmp_path)


@pytest.mark.slow
def test_an_unreadable_lock_is_one_line(tmp_path, monkeypatch):
    """Another user's lock (mode 0600): simulated, as the suite may run as root, who reads any file."""
    (tmp_path / LOCK_NAME).write_text(_lock_of(_finished_pid()))

    opened = rundir_module.open_regular

    def refused(path, *args, **kwargs):
        if Path(path).name == LOCK_NAME:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(rundir_module, "open_regular", refused)
    with pytest.raises(RunDirLocked) as caught:
        acquire_run_lock(tmp_path)
    assert str(caught.value) == (
        f"cannot read the lock {tmp_path / LOCK_NAME} (Permission denied); another run may hold the "
        "directory: choose another one, or delete the lock if its run is gone"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no draft left


@pytest.mark.slow
def test_a_lock_held_by_a_process_that_never_lets_go_is_one_line_in_bounded_time(tmp_path, monkeypatch):
    """The lock is judged under filelock, waited for at most JUDGE_TIMEOUT_S. Old: fcntl.flock waited
    without end (the bounded call ran past its 5 s)."""
    (tmp_path / LOCK_NAME).write_text(_lock_of(_finished_pid()))
    monkeypatch.setattr(rundir_module, "JUDGE_TIMEOUT_S", 0.3)
    with (tmp_path / LOCK_NAME).open("rb") as held:  # another open file: flock refuses this process too
        fcntl.flock(held, fcntl.LOCK_EX)
        outcome = bounded(acquire_run_lock, tmp_path, memory_mb=256, seconds=5)
    assert not outcome.escaped and outcome.error == "RunDirLocked", (outcome.error, outcome.message)
    assert "\n" not in outcome.message and f"the lock {tmp_path / LOCK_NAME} stayed held" in outcome.message
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no draft left


class _SlowHandler(logging.Handler):
    """A log handler that takes its time, as one writing to a busy file system does."""

    def emit(self, record: logging.LogRecord) -> None:
        time.sleep(0.005)


def _contend(run_dirs: list[str], barrier, results) -> None:
    """Try each run directory's lock at the moment the other contenders try it; report who got it."""
    logging.getLogger("mlcls").addHandler(_SlowHandler())
    for run_dir in run_dirs:
        barrier.wait()
        try:
            acquire_run_lock(Path(run_dir))
            held = True
        except RunDirLocked:
            held = False
        barrier.wait()  # every contender has tried before the trial's results are read
        results.put((run_dir, os.getpid(), held))


@pytest.mark.slow
def test_processes_taking_over_one_stale_lock_leave_exactly_one_holder(tmp_path):
    contenders, trials = 4, 40
    run_dirs = [tmp_path / f"run{trial}" for trial in range(trials)]
    dead = _finished_pid()
    for run_dir in run_dirs:
        run_dir.mkdir()
        (run_dir / LOCK_NAME).write_text(_lock_of(dead))
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(contenders, timeout=20), context.Queue()
    processes = [
        context.Process(target=_contend, args=([str(d) for d in run_dirs], barrier, results))
        for _ in range(contenders)
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=30) for _ in range(contenders * trials)]
    for process in processes:
        process.join(timeout=10)
        assert process.exitcode == 0
    for run_dir in run_dirs:
        holders = [pid for directory, pid, held in outcomes if directory == str(run_dir) and held]
        assert len(holders) == 1, f"{run_dir.name}: held by {holders}"
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == holders[0]
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # no draft left


@pytest.mark.slow
def test_a_finished_run_releases_its_lock(tmp_path):
    trainer = Trainer(compose_config([*TINY, *QUICK, "trainer.epochs=1"]), run_dir=tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    trainer.fit()
    assert not (tmp_path / LOCK_NAME).exists() and (tmp_path / "checkpoints" / "last.pt").is_file()


@pytest.mark.slow
def test_a_bad_image_in_the_first_epoch_leaves_no_run_directory(tmp_path):
    images = [f"{i}.jpg" for i in range(8)]
    rows = "".join(f"{name},{'a' if i % 2 else 'b'}\n" for i, name in enumerate(images))
    root = write_csv(tmp_path / "data", "image,labels\n" + rows, images=images)
    (root / "val.csv").write_text("image,labels\n" + rows)
    truncate(root / "3.jpg")
    run_dir = tmp_path / "outputs" / "run"
    cfg = compose_config(
        [
            *(override for override in TINY if not override.startswith("dataset")),
            "dataset=csv",
            f"dataset.root={root}",
            "dataset.val_file=val.csv",
            "dataset.image_size=32",
            "dataset.on_bad_image=error",
            "trainer.batch_size=4",
        ]
    )
    trainer = Trainer(cfg, run_dir=run_dir)
    assert (run_dir / "config.yaml").is_file()
    with pytest.raises(BadImageError, match="3.jpg"):
        trainer.fit()
    assert not run_dir.exists()


def test_resume_auto_accepts_an_explicit_hydra_run_dir(tmp_path):
    cfg = compose_config([*TINY, "trainer.resume=auto"])
    with pytest.raises(ConfigError, match="needs hydra.run.dir=<run dir> \\(hydra.sweep.dir"):
        check_config(cfg, world_size=1)
    check_config(cfg, world_size=1, run_dir=tmp_path)  # given in Python
    from hydra import compose, initialize_config_dir

    from mlcls import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        with_hydra = compose("train", [*TINY, "trainer.resume=auto", f"hydra.run.dir={tmp_path}"], True)
    HydraConfig.instance().set_config(with_hydra)
    try:
        check_config(cfg, world_size=1)
    finally:
        HydraConfig.instance().cfg = None
    # a multirun's job directory is hydra.sweep.dir/<job number>: the sweep directory must be named
    for sweep, accepted in (("hydra.sweep.dir", True), ("hydra.run.dir", False)):
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            overrides = [*TINY, "trainer.resume=auto", "hydra.mode=MULTIRUN", f"{sweep}={tmp_path}"]
            with_hydra = compose("train", overrides, True)
        HydraConfig.instance().set_config(with_hydra)
        try:
            if accepted:
                check_config(cfg, world_size=1)
            else:
                with pytest.raises(ConfigError, match="needs hydra.run.dir"):
                    check_config(cfg, world_size=1)
        finally:
            HydraConfig.instance().cfg = None


@pytest.mark.slow
def test_resume_auto_in_hydra_run_dir_through_the_cli(tmp_path, monkeypatch, capsys):
    """``mlcls-train``'s entry point in-process (its console script and exit status are proven by a
    subprocess in test_cli_train.py): Hydra's own run directory is where resume=auto finds the run."""
    from mlcls.cli.train import main

    monkeypatch.chdir(tmp_path)
    common = ["mlcls-train", *TINY, *QUICK, f"hydra.run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", [*common, "trainer.epochs=1"])
    main()
    assert json.loads((tmp_path / "run" / "results.json").read_text())["epochs_completed"] == 1
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", [*common, "trainer.epochs=2", "trainer.resume=auto"])
    main()
    captured = capsys.readouterr()
    assert "resumed from" in captured.out + captured.err
    assert json.loads((tmp_path / "run" / "results.json").read_text())["epochs_completed"] == 2
