"""How a group's rank processes are started: a :data:`Launcher` takes the ranks'
:class:`~statebridge.connector.rank.RankSetup`\\ s and returns a :class:`RankHandle` per rank.
Nodes use :func:`spawn_launcher` (one process per rank); tests and benchmarks use
:class:`~statebridge.testing.hosts.RankHostPool`.

Rank processes come from a fork server (:func:`rank_context`): a fresh single-threaded process,
started with the first rank, that imports :data:`PRELOAD` once and forks each rank from itself.
A rank then starts without importing torch and the package again (about 1.3 CPU-seconds each:
a restarted rank serves sooner), and nothing is forked from a process that runs zmq or UCX
threads. Each rank is named ``sb-<role><rank>`` (``ps``, ``top``, ``/proc/PID/comm``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import Callable, Sequence

from statebridge.connector.rank import RankSetup, rank_main

__all__ = ["Launcher", "RankHandle", "spawn_launcher", "rank_log_level", "rank_context",
           "start_process", "rank_title", "RANK_TITLES", "PRELOAD"]

#: What the fork server imports before it forks any rank (torch, numpy, zmq and the rank's
#: modules come with it). Importing is not initialising: no CUDA context, UCX worker or zmq
#: context exists in the server.
PRELOAD = ("statebridge.connector.rank",)

#: How a rank process's name (:func:`rank_title`) begins, by role.
RANK_TITLES = ("sb-prefill", "sb-decode")


def rank_title(role: str, tp_rank: int) -> str:
    """A rank process's name (what ``ps`` and ``/proc/PID/comm`` show): ``sb-decode3``."""
    return f"sb-{role}{tp_rank}"


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


def rank_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context rank processes start in: the fork server, preloading
    :data:`PRELOAD` (the preload takes effect when the server starts: with this process's
    first rank)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _entry(title: str, environ: dict[str, str], target: Callable[..., None],
           args: tuple) -> None:
    """A forked process's start: this process's name, the environment its starter had when it
    started it (the fork server holds the one it had itself when it started), then
    ``target(*args)``."""
    os.environ.clear()
    os.environ.update(environ)
    try:        # Linux: prctl(PR_SET_NAME), what ps and /proc/PID/comm show (15 bytes)
        import ctypes

        ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
    target(*args)


def start_process(target: Callable[..., None], args: tuple, *, title: str,
                  name: str) -> multiprocessing.Process:
    """Start ``target(*args)`` in a daemon process of :func:`rank_context` named ``title``
    (``name``: the :class:`multiprocessing.Process` name) with this process's environment
    as it is now, as a spawned process would have it."""
    proc = rank_context().Process(target=_entry, args=(title, dict(os.environ), target, args),
                                  daemon=True, name=name)
    proc.start()
    return proc


def spawn_launcher(setups: Sequence[RankSetup]) -> list[RankHandle]:
    """One process per rank, forked by the fork server (:func:`rank_context`)."""
    return [_ProcessHandle(start_process(rank_main, (setup,),
                                         title=rank_title(setup.role, setup.tp_rank),
                                         name=f"statebridge-{setup.role}-rank{setup.tp_rank}"))
            for setup in setups]



def rank_log_level() -> str:
    """The level rank processes log at: the application's, when it configured logging (the
    CLI does); else none, and the ranks leave logging alone like any library."""
    if not logging.getLogger().handlers:
        return ""
    return logging.getLevelName(logging.getLogger("statebridge").getEffectiveLevel())
