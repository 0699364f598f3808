"""The GPU compile check (``test_compile.py``), started in the background at session start.

Compiling every kernel variant for sm_90 is minutes of CPU and needs nothing from the other
tests, so when that test is selected the session starts ``statebridge.kernels.compile_check``
right after collection (:func:`start`, from ``tests/conftest.py``), at idle priority
(``nice 19``: it takes the CPU the other tests leave), and the test, moved to the end of the
session, collects the result (:func:`result`). Run alone, the test still starts it itself.

Once per session, also under pytest-xdist: every worker collects every test, so each would
start it. The session's folder (:func:`configure`: chosen by the process that owns the
session -- the only one without xdist, xdist's controller with it -- and handed to the
workers) is created by the first process that starts the check (``os.mkdir`` is the claim);
the others find it taken. The check writes its output, its exit status and its report there,
so the test reads the result in whichever process runs it, and the owner ends the check if it
still runs and removes the folder when the session ends (:func:`stop`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from statebridge.testing.sockets import alive as _alive

ARCHS = (90,)
SAMPLED = (80,)

#: The session's folder (:func:`configure`); created by whoever starts the check.
_workdir: Path | None = None
#: The check, in the process that started it.
_proc: subprocess.Popen | None = None

#: Runs the check with its output in $1 and writes its exit status to $2 when it ends.
_WRAPPER = 'out=$1; rc=$2; shift 2; "$@" >"$out" 2>&1; echo $? >"$rc.tmp" && mv "$rc.tmp" "$rc"'


def configure(workdir: str | Path | None = None) -> Path:
    """Name the session's folder: a new name in the temporary directory for the process that
    owns the session, the owner's name (handed on by xdist) for a worker."""
    global _workdir
    _workdir = Path(workdir) if workdir else \
        Path(tempfile.gettempdir()) / f"statebridge-compile-check-{uuid.uuid4().hex}"
    return _workdir


def folder() -> Path:
    """The session's folder (named now if nothing named it)."""
    return _workdir if _workdir is not None else configure()


def start(nice: int = 19) -> bool:
    """Start the compile check unless a process of this session already did; whether this
    call started it."""
    global _proc
    workdir = folder()
    try:
        workdir.mkdir()
    except FileExistsError:
        return False
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(workdir / "triton-cache")   # empty: compile for real
    cmd = [sys.executable, "-m", "statebridge.kernels.compile_check",
           "--arch", *map(str, ARCHS), "--sample-arch", *map(str, SAMPLED),
           "--jobs", "2", "--json", str(workdir / "report.json")]
    _proc = subprocess.Popen(["sh", "-c", _WRAPPER, "sh", str(workdir / "output"),
                             str(workdir / "returncode"), *cmd],
                            env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    (workdir / "pid.tmp").write_text(str(_proc.pid))
    (workdir / "pid.tmp").rename(workdir / "pid")
    return True


def result(timeout: float) -> tuple[int, str, Path]:
    """Wait for the check (starting it now, at normal priority, if nothing started it):
    ``(exit status, output, report path)``. While the test waits, the idle-priority check
    has the CPU the waiting test leaves."""
    workdir = folder()
    start(nice=0)
    status, pid_file = workdir / "returncode", workdir / "pid"
    deadline = time.monotonic() + timeout
    while not status.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the compile check did not end in {timeout:.0f} s")
        if pid_file.exists() and not _alive(int(pid_file.read_text())) and not status.exists():
            raise AssertionError("the compile check ended without an exit status:\n"
                                 + (workdir / "output").read_text(errors="replace")[-3000:])
        time.sleep(0.5)
    return int(status.read_text()), (workdir / "output").read_text(errors="replace"), \
        workdir / "report.json"


def stop() -> None:
    """End the check if it still runs (a session that stopped early) and remove its files
    (the session's owner, at its end)."""
    global _workdir, _proc
    if _workdir is None:
        return
    pid_file = _workdir / "pid"
    if pid_file.exists() and not (_workdir / "returncode").exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if _proc is not None:
        _proc.wait()
    shutil.rmtree(_workdir, ignore_errors=True)
    _workdir, _proc = None, None
