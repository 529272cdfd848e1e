"""A test's script run in a fresh interpreter: what a process does before anything else in it has run (no CUDA
initialised, no backend registered, nothing imported by earlier tests)."""

from __future__ import annotations

import os
import subprocess
import sys


def assert_fresh_process_ok(script: str, unset: tuple[str, ...] = ()) -> None:
    """Runs ``script`` with this interpreter and import path, the environment variables ``unset`` removed, and
    requires it to exit 0 and print "fresh process ok"."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and "fresh process ok" in result.stdout, result.stdout + result.stderr[-4000:]
