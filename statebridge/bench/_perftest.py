"""UCX's line rate: ``ucx_perftest -t tag_bw`` between a server and a client process on 127.0.0.1.

``ucx_perftest`` ships in the ``libucx`` wheel (``bin/``) that ucxx depends on, so this works from
an installed statebridge, not only a checkout. Used by ``statebridge bench`` (the line rate of a
cell) and ``benchmarks/bench_transport.py``.

Settings, so the line rate moves bytes the way statebridge's transport does:

- ucxx's UCX settings (:data:`UCXX_ENV`: ``UCX_RNDV_THRESH=8192``, ``UCX_MAX_RNDV_RAILS=1``);
- buffers from transparent huge pages (:data:`PERFTEST_ENV`), like
  :func:`~statebridge.connector.data.alloc_buffer`'s;
- ``UCX_TLS`` and endpoint error handling (``-e``) as the caller says: error handling makes UCX
  drop shared memory, so error-handling cells compare with ``tcp -e`` and the others with ``sm``.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from statebridge.net import free_port

__all__ = ["PERFTEST_ENV", "UCXX_ENV", "WAIT_MODES", "perftest", "perftest_path"]

MIB = 1024 * 1024
WAIT_MODES = ("poll", "sleep")
UCXX_ENV = {"UCX_RNDV_THRESH": "8192", "UCX_MAX_RNDV_RAILS": "1",
            "UCX_WARN_UNUSED_ENV_VARS": "n"}
# perftest allocates its buffers through UCX; by default from SysV segments without
# transparent huge pages. Put THP first so it moves bytes out of the same kind of memory as
# alloc_buffer() (docs/measurements.md, "Transport choices", on huge pages).
PERFTEST_ENV = {"UCX_ALLOC_PRIO": "thp,md:sysv,md:posix,huge,mmap,heap"}

# -f prints one line: iterations, latency p50/avg/overall (us), bandwidth avg/overall (MiB/s),
# message rate avg/overall.
_RESULT = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                     r"\s+\d+\s+\d+\s*$", re.MULTILINE)


def _libucx() -> Path:
    import libucx

    return Path(libucx.__file__).parent


def perftest_path() -> Path:
    """The ``ucx_perftest`` executable of the installed ``libucx`` wheel."""
    exe = _libucx() / "bin" / "ucx_perftest"
    if not exe.exists():
        raise FileNotFoundError(f"ucx_perftest not found at {exe}")
    return exe


def perftest(size: int, tls: str, error_handling: bool, iters: int, timeout: float,
             wait_mode: str = "poll") -> dict:
    """``ucx_perftest -t tag_bw`` of ``iters`` messages of ``size`` bytes over ``UCX_TLS=tls``.

    ``wait_mode``: ``poll`` (both spin) or ``sleep`` (both sleep on the worker's event fd
    between completions, like ``progress_mode="blocking"``; on 2 cores two spinning processes
    take each other's CPU). Returns ``gbps`` (1e9 B/s) and the per-message overheads;
    raises RuntimeError when perftest prints no result.
    """
    if size < 1 or iters < 1:
        raise ValueError(f"size and iters must be >= 1, got size={size} iters={iters}")
    if wait_mode not in WAIT_MODES:
        raise ValueError(f"wait_mode must be one of {WAIT_MODES}, got {wait_mode!r}")
    exe = str(perftest_path())
    env = dict(os.environ, LD_LIBRARY_PATH=str(_libucx() / "lib"), UCX_TLS=tls, **UCXX_ENV,
               **PERFTEST_ENV)
    port = free_port()
    warmup = max(2, iters // 10)
    server = subprocess.Popen([exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        cmd = [exe, "127.0.0.1", "-p", str(port), "-t", "tag_bw", "-s", str(size),
               "-n", str(iters), "-w", str(warmup), "-E", wait_mode, "-f"] \
            + (["-e"] if error_handling else [])
        out = ""
        for _ in range(50):                           # until the server listens
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            out = proc.stdout + proc.stderr
            if "connect() failed" not in out:
                break
            time.sleep(0.1)
        m = _RESULT.search(out)
        if m is None:
            raise RuntimeError(f"ucx_perftest (size {size}, UCX_TLS={tls}, error handling "
                               f"{error_handling}) gave no result:\n{out[-2000:]}")
        mib_s = float(m.group(6))                    # overall bandwidth, "MB/s" = MiB/s
        return {"tls": tls, "error_handling": error_handling, "wait_mode": wait_mode,
                "size": size, "iters": iters, "gbps": mib_s * MIB / 1e9,
                "overhead_us": float(m.group(4)), "overhead_p50_us": float(m.group(2))}
    finally:
        server.kill()
        server.wait(5)
