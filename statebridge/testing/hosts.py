"""Long-lived rank host processes: start many TP groups without paying a process start each.

Starting a rank process costs ~3 s of CPU here (torch, UCX imports). Tests and benchmarks that
build many groups (every TP pair x layout x model) instead start a :class:`RankHostPool` once:
host ``i`` runs rank ``i`` of every group it is given, each :class:`RankWorker` in its own thread
with its own UCX worker and page buffer. Ranks of one group are still separate processes.
Production nodes use :func:`~statebridge.connector.group.spawn_launcher` (one process per rank).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from typing import Any, Callable, Sequence

from statebridge.connector.group import Launcher, RankHandle, _ProcessHandle
from statebridge.connector.rank import RankSetup, RankWorker
from statebridge.errors import ConfigError

__all__ = ["RankHostPool"]

log = logging.getLogger(__name__)


def _host_main(conn, initializer: Callable[..., Any] | None, initargs: tuple) -> None:
    if initializer is not None:
        initializer(*initargs)
    threads: list[threading.Thread] = []
    while True:
        try:
            setup = conn.recv()
        except EOFError:
            setup = None
        if setup is None:
            # Workers were shut down by their coordinators; do not wait on UCX/zmq teardown.
            logging.shutdown()
            os._exit(0)
        if setup == "opcounts":
            from statebridge.connector.opcounts import snapshot

            conn.send(("opcounts", snapshot()))
            continue
        try:
            worker = RankWorker(setup)
        except Exception as e:  # reported to the launcher; the host keeps serving
            conn.send(("error", f"{type(e).__name__}: {e}"))
            continue
        t = threading.Thread(target=worker.run, daemon=True,
                             name=f"{setup.role}-rank{setup.tp_rank}-{setup.node_id}")
        t.start()
        threads.append(t)
        conn.send(("ok", os.getpid()))


class _HostHandle(_ProcessHandle):
    """A rank inside a host process: alive while the host is."""

    def stop(self, timeout: float) -> None:
        # The worker thread ends on RankShutdown; the host process stays for the next group.
        pass


class RankHostPool:
    """``size`` spawned host processes; :meth:`launcher` places rank r of a group on host r.

    ``initializer(*initargs)`` runs first in every host process, as in
    :class:`multiprocessing.pool.Pool`: the place for the caller to configure logging there (the
    pool never does; without one, the hosts log nothing). It crosses a process
    spawn, so it must be picklable: a module-level function or a :func:`functools.partial` of one.
    """

    def __init__(self, size: int, *, initializer: Callable[..., Any] | None = None,
                 initargs: tuple = ()) -> None:
        if size < 1:
            raise ConfigError(f"pool size must be >= 1, got {size}")
        ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self.hosts = []
        for i in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_host_main, args=(child, initializer, tuple(initargs)),
                               daemon=True, name=f"statebridge-host{i}")
            proc.start()
            self.hosts.append((proc, parent))

    @property
    def pids(self) -> list[int]:
        """Process ids of the hosts, host r first for rank r."""
        return [proc.pid for proc, _ in self.hosts]

    def launcher(self) -> Launcher:
        def launch(setups: Sequence[RankSetup]) -> list[RankHandle]:
            if len(setups) > len(self.hosts):
                raise ConfigError(f"group of {len(setups)} ranks needs more than the "
                                  f"{len(self.hosts)} hosts of this pool")
            handles = []
            with self._lock:
                for setup in setups:
                    proc, conn = self.hosts[setup.tp_rank]
                    conn.send(setup)
                for setup in setups:
                    proc, conn = self.hosts[setup.tp_rank]
                    if not conn.poll(120):
                        raise ConfigError(f"host {setup.tp_rank} did not start a rank in 120 s")
                    status, detail = conn.recv()
                    if status != "ok":
                        raise ConfigError(f"host {setup.tp_rank} could not start rank: {detail}")
                    handles.append(_HostHandle(proc))
            return handles
        return launch

    def opcounts(self, hosts: int | None = None) -> list[dict[str, int]]:
        """Each host's :func:`~statebridge.connector.opcounts.snapshot` (control messages and
        UCX operations of every rank it ran, since it started), for the first ``hosts``."""
        out = []
        with self._lock:
            for proc, conn in self.hosts[:hosts]:
                conn.send("opcounts")
                if not conn.poll(30):
                    raise ConfigError("host did not answer opcounts in 30 s")
                status, value = conn.recv()
                if status != "opcounts":
                    raise ConfigError(f"host answered opcounts with {status!r}")
                out.append(value)
        return out

    def close(self) -> None:
        for proc, conn in self.hosts:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, conn in self.hosts:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self.hosts = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
