"""OS-thread placement and names for the connector's data-plane threads inside a vLLM worker."""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger("vllm." + __name__)

__all__ = ["name_os_thread", "on_every_cpu"]


@contextlib.contextmanager
def on_every_cpu():
    """Threads started inside (this agent's, zmq's I/O thread, UCX's async thread) may run on
    every CPU. vLLM's CPU worker pins the calling thread to its ``VLLM_CPU_OMP_THREADS_BIND``
    cores, and a thread inherits its parent's mask: pinned there, the side channel waits behind
    whatever spins on those cores (another instance's worker polling with ``sched_yield``)."""
    try:
        pinned = os.sched_getaffinity(0)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError) as e:
        log.debug("statebridge connector: agent threads keep the worker's CPUs (%s)", e)
        pinned = None
    try:
        yield
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)


def name_os_thread(name: str) -> None:
    """Name the calling OS thread, as `top -H`, `ps -L` and `py-spy` show it."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)     # PR_SET_NAME
    except (OSError, AttributeError):
        pass
