"""The test suite's own settings (tests/conftest.py) do what .ci/run counts on."""

import os
import subprocess
import sys
import time

import conftest
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A_TEST = "tests/test_imports.py::test_a_circle_is_found"  # (a test of a second, importing no JAX)


def _pytest(until: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", A_TEST],
        cwd=ROOT, env={**os.environ, "LM_TESTS_UNTIL": until}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_test_not_started_by_lm_tests_until_is_skipped_saying_why(monkeypatch):
    """.ci/run gives the slow tier a time to end by: a test not started by then is skipped, with the reason, and the
    run passes; CI's hard timeout, which fails CI, is only for a test still running long after it."""
    spent = _pytest(str(int(time.time()) - 1))
    assert spent.returncode == 0 and "1 skipped" in spent.stdout, spent.stdout[-2000:]
    assert "not started: the time LM_TESTS_UNTIL gives the run was spent" in spent.stdout, spent.stdout[-2000:]
    monkeypatch.setenv("LM_TESTS_UNTIL", str(int(time.time()) + 600))
    conftest.pytest_runtest_setup(None)  # (time left: the test runs)


def test_lm_tests_until_that_is_not_a_time_is_refused(monkeypatch):
    monkeypatch.setenv("LM_TESTS_UNTIL", "tomorrow")
    with pytest.raises(pytest.UsageError, match=r"LM_TESTS_UNTIL=tomorrow is not a Unix time \(seconds\)"):
        conftest.pytest_configure(None)
