"""The test suite's own settings (tests/conftest.py) do what .ci/run counts on. (pytest refuses a conftest function
named pytest_* that is no hook of its own: these are called as pytest calls them.)"""

import os
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


def test_the_tests_programs_are_kept_in_their_compilation_cache(tmp_path):
    """A second run compiles little: this process's programs go to the tests' cache, however quick to compile."""
    import jax
    import jax.numpy as jnp

    if not conftest._TESTS_CACHE:
        pytest.skip("LM_TESTS_COMPILE_CACHE is empty: the run keeps no compiled programs")
    cache = conftest._TESTS_CACHE["dir"]
    assert jax.config.jax_compilation_cache_dir == cache and jax.config.jax_persistent_cache_min_compile_time_secs == 0
    before = set(os.listdir(cache)) if os.path.isdir(cache) else set()
    new = float(time.time_ns() % 2**20)
    jax.jit(lambda x: x * new)(jnp.ones(3))  # (a program no run compiled before: its constant is new)
    assert set(os.listdir(cache)) - before


def test_the_compilation_cache_is_trimmed_oldest_first_beyond_its_bound(tmp_path):
    for i in range(4):
        (tmp_path / f"entry{i}").write_bytes(b"x" * 100)
        os.utime(tmp_path / f"entry{i}", (1000 + i, 1000 + i))
    conftest._pruned(str(tmp_path), 1000)  # (within its bound: kept)
    assert len(os.listdir(tmp_path)) == 4
    conftest._pruned(str(tmp_path), 250)  # (beyond: the oldest go until it holds half the bound)
    assert os.listdir(tmp_path) == ["entry3"]
    conftest._pruned(str(tmp_path / "none"), 250)  # (no directory yet)


def test_a_compilation_cache_that_cannot_be_written_is_one_warning_and_none(tmp_path, monkeypatch):
    """JAX warned at every compile, in the tests and in the commands they run (whose lines tests count)."""
    import jax

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LM_TESTS_COMPILE_CACHE", str(tmp_path / "file" / "cache"))
    warned = []
    config = type("Config", (), {"issue_config_time_warning": lambda self, w, stacklevel: warned.append(str(w))})()
    kept = dict(conftest._TESTS_CACHE), jax.config.jax_compilation_cache_dir
    conftest.pytest_configure(config)
    assert (dict(conftest._TESTS_CACHE), jax.config.jax_compilation_cache_dir) == kept
    assert warned == [f"LM_TESTS_COMPILE_CACHE={tmp_path / 'file' / 'cache'} cannot be written ({tmp_path / 'file'} "
                      "is a file, not a directory): compiling without it"]
