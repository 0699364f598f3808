"""Run a command in a process group of its own and collect its output (tests and benchmarks
that start vLLM: its engine and worker processes inherit the output and may outlive the
command, so the output goes to a file, not a pipe, and the whole group is killed after)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from typing import Mapping, Sequence

__all__ = ["run_group"]


def run_group(cmd: Sequence[str], env: Mapping[str, str], timeout: float) -> tuple[int, str]:
    """``(exit status, stdout + stderr)`` of ``cmd``; its process group is SIGKILLed once it
    exits or after ``timeout`` seconds (then the status is -9)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(list(cmd), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = -9
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        log.seek(0)
        return rc, log.read()
