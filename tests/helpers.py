"""Shared helpers for the tests: run the CLIs in a subprocess and check their one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(script: str, *args: str, cwd: str | None = None, env: dict | None = None, timeout: float = 300):
    """Run `python <script> args...` from the repo root scripts; return the CompletedProcess."""
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_user_error(proc, *fragments: str) -> str:
    """A user mistake: exit code 2, no traceback, one 'error:' line that names the problem."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]
