"""The test suite's own settings (tests/conftest.py) do what .ci/run counts on. (pytest refuses a conftest function
named pytest_* that is no hook of its own: these are called as pytest calls them.)"""

import time

import conftest
import pytest


def test_a_test_not_started_by_lm_tests_until_is_skipped_saying_why(monkeypatch):
    """.ci/run gives the slow tier a time to end by: a test not started by then is skipped, with the reason, and the
    run passes; CI's hard timeout, which fails CI, is only for a test still running long after it."""
    monkeypatch.setenv("LM_TESTS_UNTIL", str(int(time.time()) - 1))
    with pytest.raises(pytest.skip.Exception, match="not started: the time LM_TESTS_UNTIL gives the run was spent"):
        conftest.pytest_runtest_setup(None)
    monkeypatch.setenv("LM_TESTS_UNTIL", str(int(time.time()) + 600))
    conftest.pytest_runtest_setup(None)  # (time left: the test runs)
    monkeypatch.delenv("LM_TESTS_UNTIL")
    conftest.pytest_runtest_setup(None)


def test_lm_tests_until_that_is_not_a_time_is_refused(monkeypatch):
    monkeypatch.setenv("LM_TESTS_UNTIL", "tomorrow")
    with pytest.raises(pytest.UsageError, match=r"LM_TESTS_UNTIL=tomorrow is not a Unix time \(seconds\)"):
        conftest.pytest_configure(None)
