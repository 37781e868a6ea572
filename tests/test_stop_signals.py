"""How the commands other than train.py (which checkpoints: tests/test_train.py) end on SIGTERM, SIGHUP and Ctrl-C:
one line, 128 + the signal, their clean-up run, no temporary directory left behind."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import python_path

COMMAND = """
import sys, time
from lm import storage
from lm.errors import cli, when_stopped

@cli
def main(argv):
    when_stopped("nothing was written")
    print(storage.temp_dir("lm-read-"), flush=True)
    time.sleep(60)

sys.exit(main())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_ends_a_command_in_one_line_with_its_clean_up(tmp_path, sig):
    """SIGTERM (kill, timeout, docker stop) and SIGHUP killed sample.py, lm.eval, lm.export and prepare outright
    (-15, no line, no clean-up: prepare's workers left the resource tracker's "leaked semaphore objects" warning, a
    bucket run's copy stayed in /tmp as lm-read-*, which a Ctrl-C's os._exit left too)."""
    env = {**os.environ, "PYTHONPATH": python_path(), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", COMMAND], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    made = proc.stdout.readline().strip()
    assert os.path.isdir(made)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    said = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
    assert (proc.returncode, err) == (128 + sig, f"{said}; nothing was written\n")
    assert os.listdir(tmp_path) == []


def test_what_a_killed_process_left_in_tmp_goes_with_the_next_temporary_directory(tmp_path, monkeypatch):
    """A process killed outright (SIGKILL) left its lm-read-* copy in /tmp for good; one whose process still runs
    (its lock held) stays."""
    from lm import storage

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    killed = subprocess.run([sys.executable, "-c", "from lm import storage; print(storage.temp_dir('lm-read-'))"
                             "; import os; os.kill(os.getpid(), 9)"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": python_path(), "TMPDIR": str(tmp_path)})  # fmt: skip
    left = killed.stdout.strip()
    assert killed.returncode == -9 and os.path.isdir(left)
    old = time.time() - 2 * storage.ABANDONED_AFTER_S
    os.utime(f"{left}.lock", (old, old))
    other = tmp_path / "lm-read-not-ours"  # (another program's, named alike: never lm's to remove)
    other.mkdir()
    (tmp_path / "lm-read-not-ours.lock").write_text("")
    os.utime(tmp_path / "lm-read-not-ours.lock", (old, old))
    running = storage.temp_dir("lm-read-")
    os.utime(f"{running}.lock", (old, old))
    mine = storage.temp_dir("lm-read-")
    kept = sorted(os.path.basename(p) + s for p in (running, mine) for s in ("", ".lock"))
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "lm-read-not-ours", "lm-read-not-ours.lock"])
