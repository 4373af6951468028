"""The suite's own budget: an unmarked test over the limit fails the run with its name (tests/conftest.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def test_an_unmarked_slow_test_fails_with_its_name_and_a_marked_one_passes(pytester, monkeypatch):
    monkeypatch.setenv("MLCLS_UNMARKED_LIMIT_S", "0.2")
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers = slow: marked\n")
    pytester.makepyfile(
        test_inner="""
import time
import pytest

def busy(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_quick():
    time.sleep(0.4)  # waiting is not working: wall time alone does not count

def test_sleepy():
    busy(0.4)

@pytest.mark.slow
def test_sleepy_but_marked():
    busy(0.4)

@pytest.fixture
def slow_setup():
    busy(0.4)

def test_slow_setup(slow_setup):
    pass
"""
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)  # a shared fixture's setup is not the test's own time
    text = result.stdout.str()
    assert "test_inner.py::test_sleepy took" in text and "without the slow marker" in text
    assert "test_slow_setup took" not in text


@pytest.mark.slow  # its inner tests start processes, which the outer run counts too
def test_an_unmarked_test_that_starts_a_process_or_trains_fails_with_its_name(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers = slow: marked\n")
    pytester.makepyfile(
        test_inner="""
import multiprocessing
import os
import subprocess
import sys

import pytest

def test_forks():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

def test_runs_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_starts_a_worker():
    worker = multiprocessing.get_context("spawn").Process(target=print)
    worker.start()
    worker.join()

def test_asks_git():
    subprocess.run(["git", "--version"], capture_output=True)

@pytest.mark.slow
def test_runs_python_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.fixture
def a_child():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_whose_setup_starts_one(a_child):
    pass

def test_trains(tmp_path):
    from mlcls.cli.overrides import compose_config
    from mlcls.cli.train import run

    tiny = [
        "dataset=synthetic", "dataset.train_size=8", "dataset.val_size=4", "dataset.image_size=16",
        "model.name=test_resnet", "model.pretrained=false", "trainer.epochs=1", "trainer.batch_size=8",
        "trainer.workers=0", "trainer.report=false",
    ]
    run(compose_config("train", tiny), run_dir=tmp_path)
"""
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=5)
    text = result.stdout.str()
    assert "test_inner.py::test_trains trained a model (Trainer.fit) without the slow marker" in text
    for name, how in [
        ("test_forks", "os.fork"),
        ("test_runs_python", Path(sys.executable).name),
        ("test_starts_a_worker", "multiprocessing"),
        ("test_whose_setup_starts_one", Path(sys.executable).name),
    ]:
        assert f"test_inner.py::{name} started a process ({how}) without the slow marker" in text
