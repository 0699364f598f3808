"""How a group's rank processes are started: a :data:`Launcher` takes the ranks'
:class:`~statebridge.connector.rank.RankSetup`\\ s and returns a :class:`RankHandle` per rank.
Nodes use :func:`spawn_launcher` (one spawned process per rank); tests and benchmarks use
:class:`~statebridge.testing.hosts.RankHostPool`.
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Callable, Sequence

from statebridge.connector.rank import RankSetup, rank_main

__all__ = ["Launcher", "RankHandle", "spawn_launcher", "rank_log_level"]


class RankHandle:
    """What a launcher returns per rank: something that can tell if the rank is alive."""

    def is_alive(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def stop(self, timeout: float) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class _ProcessHandle(RankHandle):
    def __init__(self, proc: multiprocessing.Process) -> None:
        self.proc = proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def stop(self, timeout: float) -> None:
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)


Launcher = Callable[[Sequence[RankSetup]], list[RankHandle]]


def spawn_launcher(setups: Sequence[RankSetup]) -> list[RankHandle]:
    """One spawned process per rank (fork is unsafe with zmq/UCX threads)."""
    ctx = multiprocessing.get_context("spawn")
    handles = []
    for setup in setups:
        proc = ctx.Process(target=rank_main, args=(setup,), daemon=True,
                           name=f"statebridge-{setup.role}-rank{setup.tp_rank}")
        proc.start()
        handles.append(_ProcessHandle(proc))
    return handles



def rank_log_level() -> str:
    """The level rank processes log at: the application's, when it configured logging (the
    CLI does); else none, and the ranks leave logging alone like any library."""
    if not logging.getLogger().handlers:
        return ""
    return logging.getLevelName(logging.getLogger("statebridge").getEffectiveLevel())
