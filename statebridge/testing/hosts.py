"""Long-lived rank host processes: start many TP groups without paying a process start each.

Starting a rank process costs seconds of CPU (torch, UCX imports). Tests and benchmarks that
build many groups (every TP pair x layout x model) instead start a :class:`RankHostPool` once:
host ``i`` runs rank ``i`` of every group it is given, each :class:`RankWorker` in its own thread
with its own UCX worker and page buffer. Ranks of one group are still separate processes.
Production nodes use :func:`~statebridge.connector.launch.spawn_launcher` (one process per rank).
"""

from __future__ import annotations

import logging
import multiprocessing
import itertools
import os
import threading
import time
from typing import Any, Callable, Sequence

from statebridge.connector.launch import Launcher, RankHandle, _ProcessHandle, start_process
from statebridge.connector.rank import RankSetup, RankWorker
from statebridge.errors import ConfigError

__all__ = ["RankHostPool"]

log = logging.getLogger(__name__)


def _host_main(conn, initializer: Callable[..., Any] | None, initargs: tuple) -> None:
    """Serve ``(seq, what)`` requests: a :class:`RankSetup` to start, ``"ops"``, or
    ``None`` to exit. Every answer is ``(seq, status, value)``, so a launcher that gave up on
    an answer (a slow rank start) can tell it from the answer to its next request."""
    if initializer is not None:
        initializer(*initargs)
    threads: list[threading.Thread] = []
    while True:
        try:
            seq, setup = conn.recv()
        except EOFError:
            seq, setup = 0, None
        if setup is None:
            # Workers were shut down by their coordinators; do not wait on UCX/zmq teardown.
            logging.shutdown()
            os._exit(0)
        if setup == "ops":
            from statebridge.connector.stats import ops

            conn.send((seq, "ops", ops.snapshot()))
            continue
        try:
            worker = RankWorker(setup)
        except Exception as e:  # reported to the launcher; the host keeps serving
            conn.send((seq, "error", f"{type(e).__name__}: {e}"))
            continue
        t = threading.Thread(target=worker.run, daemon=True,
                             name=f"{setup.role}-rank{setup.tp_rank}-{setup.node_id}")
        t.start()
        threads.append(t)
        conn.send((seq, "ok", os.getpid()))


def _answer(conn, seq: int, timeout: float, what: str) -> tuple[str, Any]:
    """The host's answer to request ``seq`` within ``timeout`` s; older answers (to requests
    a caller stopped waiting for) are dropped."""
    deadline = time.monotonic() + timeout
    while True:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise ConfigError(f"{what}: no answer in {timeout:g} s")
        got, status, value = conn.recv()
        if got == seq:
            return status, value
        log.warning("%s: dropping a late answer to request %d (%s)", what, got, status)


class _HostHandle(_ProcessHandle):
    """A rank inside a host process: alive while the host is."""

    def stop(self, timeout: float) -> None:
        # The worker thread ends on RankShutdown; the host process stays for the next group.
        pass


class RankHostPool:
    """``size`` host processes (forked by the fork server, as nodes' ranks are:
    :func:`~statebridge.connector.launch.start_process`); :meth:`launcher` places rank r of a
    group on host r.
    With ``lazy=True`` host r starts with the first group that has a rank r (a pool shared by
    tests that need different group sizes starts only the hosts they use).

    ``initializer(*initargs)`` runs first in every host process, as in
    :class:`multiprocessing.pool.Pool`: the place for the caller to configure logging there (the
    pool never does; without one, the hosts log nothing). It is pickled to the host process,
    so it must be picklable: a module-level function or a :func:`functools.partial` of one.
    """

    def __init__(self, size: int, *, initializer: Callable[..., Any] | None = None,
                 initargs: tuple = (), lazy: bool = False) -> None:
        if size < 1:
            raise ConfigError(f"pool size must be >= 1, got {size}")
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        #: Seconds a host may take to start a rank (model load, TP rendezvous) before the
        #: launch fails; a late answer is then dropped, never taken for the next launch's.
        self.start_timeout = 120.0
        #: (process, pipe) of host r at index r; ``None`` for a host of a ``lazy`` pool that no
        #: group has needed yet (it starts with the first group that has a rank r).
        self.hosts: list[tuple[Any, Any] | None] = [None] * size
        if not lazy:
            for i in range(size):
                self._host(i)

    def _host(self, i: int) -> tuple[Any, Any]:
        """Host ``i``, started now if it was not."""
        if self.hosts[i] is None:
            parent, child = multiprocessing.Pipe()
            proc = start_process(_host_main, (child, self._initializer, self._initargs),
                                 title=f"sb-host{i}", name=f"statebridge-host{i}")
            self.hosts[i] = (proc, parent)
        return self.hosts[i]

    @property
    def pids(self) -> list[int | None]:
        """Process ids of the hosts, host r first for rank r (``None``: not started yet)."""
        return [h[0].pid if h is not None else None for h in self.hosts]

    def launcher(self) -> Launcher:
        def launch(setups: Sequence[RankSetup]) -> list[RankHandle]:
            if len(setups) > len(self.hosts):
                raise ConfigError(f"group of {len(setups)} ranks needs more than the "
                                  f"{len(self.hosts)} hosts of this pool")
            handles = []
            with self._lock:
                seqs = {}
                for setup in setups:
                    proc, conn = self._host(setup.tp_rank)
                    seqs[setup.tp_rank] = next(self._seq)
                    conn.send((seqs[setup.tp_rank], setup))
                for setup in setups:
                    proc, conn = self.hosts[setup.tp_rank]
                    status, detail = _answer(conn, seqs[setup.tp_rank], self.start_timeout,
                                             f"host {setup.tp_rank} starting a rank")
                    if status != "ok":
                        raise ConfigError(f"host {setup.tp_rank} could not start rank: {detail}")
                    handles.append(_HostHandle(proc))
            return handles
        return launch

    def ops(self, hosts: int | None = None) -> list[dict[str, int]]:
        """Each host's operation counts (:data:`statebridge.connector.stats.ops`: control
        messages, UCX operations, ... of every rank it ran, since it started), for the first
        ``hosts`` (a host not started yet has counted nothing: ``{}``)."""
        out = []
        with self._lock:
            for i, host in enumerate(self.hosts[:hosts]):
                if host is None:
                    out.append({})
                    continue
                proc, conn = host
                seq = next(self._seq)
                conn.send((seq, "ops"))
                status, value = _answer(conn, seq, 30.0, f"host {i} ops")
                if status != "ops":
                    raise ConfigError(f"host answered ops with {status!r}")
                out.append(value)
        return out

    def close(self) -> None:
        started = [h for h in self.hosts if h is not None]
        for proc, conn in started:
            try:
                conn.send((0, None))
            except (BrokenPipeError, OSError):
                pass
        for proc, conn in started:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self.hosts = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
