"""The suite's own budget: an unmarked test over the limit fails the run with its name (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

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
