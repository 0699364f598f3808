"""The GPU compile check (``test_compile.py``), started in the background at session start.

Compiling every kernel variant for sm_90 is minutes of CPU and needs nothing from the other
tests, so when that test is selected the session starts ``statebridge.kernels.compile_check``
right after collection (:func:`start`, from ``tests/conftest.py``), at idle priority
(``nice 19``: it takes the CPU the other tests leave), and the test, moved to the end of the
session, collects the result (:func:`result`). Run alone, the test still starts it itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ARCHS = (90,)
SAMPLED = (80,)


@dataclass
class Run:
    proc: subprocess.Popen
    workdir: Path
    report: Path


_run: Run | None = None


def start(nice: int = 19) -> Run:
    """Start the compile check (once per session) and return it."""
    global _run
    if _run is None:
        workdir = Path(tempfile.mkdtemp(prefix="statebridge-compile-check-"))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(workdir / "triton-cache")   # empty: compile for real
        report = workdir / "report.json"
        cmd = [sys.executable, "-m", "statebridge.kernels.compile_check",
               "--arch", *map(str, ARCHS), "--sample-arch", *map(str, SAMPLED),
               "--jobs", "2", "--json", str(report)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        _run = Run(proc, workdir, report)
    return _run


def result(timeout: float) -> tuple[int, str, Path]:
    """Wait for the check (starting it now, at normal priority, if nothing started it):
    ``(exit status, output, report path)``. While the test waits, the idle-priority check
    has the CPU the waiting test leaves."""
    run = _run or start(nice=0)
    out, _ = run.proc.communicate(timeout=timeout)
    return run.proc.returncode, out, run.report


def stop() -> None:
    """End the check if it still runs (a session that stopped early) and remove its files."""
    global _run
    if _run is None:
        return
    if _run.proc.poll() is None:
        _run.proc.kill()
        _run.proc.communicate()
    shutil.rmtree(_run.workdir, ignore_errors=True)
    _run = None
