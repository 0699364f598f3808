"""Supervision of a coordinator's rank group: a group that was whole and loses a rank heals or
fails, it never lingers (``ConnectorConfig.on_rank_loss``)::

    rank lost --> requests in flight fail (peer_lost); peers dropped (Goodbye); not ready
      restart: every old rank told to stop, then stopped (terminate, kill) and joined
               -> only then: fresh pages, KV blocks, ledger; generation + 1
               -> new rendezvous store, new rank processes, all RankHello within
                  rank_start_timeout -> ready again; peers re-handshake
      exit, a failed restart, or too many restarts in rank_restart_window:
               -> fatal: the group stays broken, says why (:attr:`Supervisor.fatal`, also
                  a coordinator's ``fatal``),
                  and the node's command exits non-zero for its supervisor

While a group is not whole, :meth:`RankGroup.whole
<statebridge.connector.group.RankGroup.whole>` says which ranks are missing and why.

A :class:`Supervisor` holds the restart policy and its state (the cause of a restart under
way, the fatal reason, recent restarts, the restarter thread); the group it supervises is a
:class:`Supervised` (the :class:`~statebridge.connector.group.RankGroup`), which it calls for
everything that touches the ranks, the pools and the group's owner.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Protocol

from statebridge.config import ConnectorConfig
from statebridge.connector.launch import RankHandle
from statebridge.connector.stats import Counters
from statebridge.errors import ClosedError, StartupError, StatebridgeError

if TYPE_CHECKING:
    from statebridge.connector.control import EventLoop

log = logging.getLogger("statebridge.connector.group")   # one logger for the group

__all__ = ["Supervisor", "Supervised"]


class Supervised(Protocol):
    """What a :class:`Supervisor` needs of the group it supervises. The loop-thread calls run
    on ``loop``; :meth:`launch_ranks` and :meth:`wait_ready` on the restarter thread."""

    node_id: str
    role: str
    loop: EventLoop
    #: Rank groups started so far (1, then + 1 per restart: :meth:`reset_generation`).
    generation: int
    #: No rank of this generation was lost.
    healthy: bool

    @property
    def closed(self) -> bool:
        """The group was closed: nothing is restarted or failed any more."""

    @property
    def can_restart(self) -> bool:
        """Whether the group has a launcher to start new ranks with."""

    def stop_serving(self, why: str, shutdown: str) -> None:
        """Loop thread: the group stops serving (``why``: its owner drops its peers); every
        rank is told to stop with ``shutdown`` as the reason."""

    def retire_ranks(self) -> list[RankHandle]:
        """Loop thread: the current ranks are the restarter's: none is watched or counted
        again; returns their handles."""

    def close_dist_store(self) -> None:
        """The old generation's rendezvous store closes (none left to use it)."""

    def reset_generation(self) -> None:
        """Loop thread, once no old rank process is left: fresh state, generation + 1."""

    def launch_ranks(self) -> list[RankHandle]:
        """Start a new generation's rank processes."""

    def adopt_ranks(self, handles: list[RankHandle]) -> None:
        """Loop thread: the new ranks are the group's (ClosedError when it closed)."""

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every rank announced itself (StartupError or ClosedError if not)."""

    def lost_ranks(self) -> dict[int, str]:
        """Loop thread: the ranks of this generation lost so far, and why."""

    def group_restarted(self) -> None:
        """Loop thread: the new generation is whole (the owner re-dials its peers)."""


class Supervisor:
    """How a group that was whole heals or fails when it loses a rank (module docstring)."""

    #: Seconds an old rank gets to exit after RankShutdown before a restart terminates it.
    RANK_STOP_S = 2.0

    def __init__(self, group: Supervised, config: ConnectorConfig, counters: Counters) -> None:
        self.group = group
        self.config = config
        self.counters = counters
        #: Why the group is restarting ("" when it is not).
        self.restarting = ""
        #: Why the group failed for good ("" while it serves or heals); see the module doc.
        self.fatal = ""
        self._restarts: list[float] = []          # monotonic times of recent restarts
        self._restarter: threading.Thread | None = None
        self._fatal_handlers: list[Callable[[str], None]] = []

    def on_fatal(self, handler: Callable[[str], None]) -> None:
        """Call ``handler(why)`` on the loop thread when the group fails for good."""
        self._fatal_handlers.append(handler)

    def join(self, timeout: float) -> None:
        """Wait for a restart under way (it sees the group closed; bounded by its steps)."""
        if self._restarter is not None:
            self._restarter.join(timeout)

    def supervise(self, cause: str) -> None:
        """Loop thread: the group was whole and lost a rank: restart it or fail it."""
        group = self.group
        if group.closed or self.fatal or self.restarting:
            return
        if self.config.on_rank_loss == "exit":
            self.fail(f"{cause}; on_rank_loss is exit")
            return
        if not group.can_restart:
            self.fail(f"{cause}; no launcher to restart the ranks with")
            return
        now = time.monotonic()
        window, limit = self.config.rank_restart_window, self.config.max_rank_restarts
        self._restarts = [t for t in self._restarts if now - t < window]
        if len(self._restarts) >= limit:
            self.fail(f"{cause}; {len(self._restarts)} restarts within the last "
                      f"{window:g} s already (max_rank_restarts {limit})")
            return
        self._restarts.append(now)
        self.restarting = cause
        self.counters.add("rank_restarts")
        log.error("%s: %s; restarting the rank group (generation %d -> %d)", group.node_id,
                  cause, group.generation, group.generation + 1)
        group.stop_serving(f"{group.role} group {group.node_id} restarting after {cause}",
                           f"group restarting after {cause}")
        old = group.retire_ranks()
        restarter = threading.Thread(target=self._restart, args=(cause, old),
                                     name=f"statebridge-{group.node_id}-restart", daemon=True)
        restarter.start()
        self._restarter = restarter        # (close() on another thread joins a started one)

    def _restart(self, cause: str, old: list[RankHandle]) -> None:
        """The restarter thread: stop the old ranks, reset, start a new group, wait for it."""
        group = self.group
        started = time.monotonic()
        try:
            for h in old:
                h.stop(self.RANK_STOP_S)
            alive = [getattr(h, "pid", r) for r, h in enumerate(old) if h.is_alive()]
            if alive:
                raise StartupError(f"old rank processes {alive} did not exit")
            if group.closed:
                return
            group.close_dist_store()
            group.loop.call(group.reset_generation)
            handles = group.launch_ranks()
            try:
                group.loop.call(group.adopt_ranks, handles)
            except StatebridgeError:
                for h in handles:
                    h.stop(0.5)
                raise
            group.wait_ready(self.config.rank_start_timeout)
            group.loop.call(self._restarted, time.monotonic() - started)
        except Exception as e:  # noqa: BLE001 -- any failure of a restart fails the group
            if group.closed:
                return
            log.exception("%s: restarting the rank group failed", group.node_id)
            try:
                group.loop.call_soon(self.fail,
                                     f"{cause}; restarting the rank group failed: "
                                     f"{type(e).__name__}: {e}")
            except ClosedError:
                pass

    def _restarted(self, seconds: float) -> None:
        group = self.group
        if self.fatal or group.closed:
            return
        cause, self.restarting = self.restarting, ""
        if not group.healthy:               # lost a rank of the new generation meanwhile
            lost = "; ".join(f"rank {r} lost ({why})"
                             for r, why in sorted(group.lost_ranks().items()))
            self.supervise(lost)
            return
        log.warning("%s: rank group restarted in %.1f s (generation %d) after %s",
                    group.node_id, seconds, group.generation, cause)
        group.group_restarted()

    def fail(self, why: str) -> None:
        """Loop thread: the group cannot serve any more: say why, drop peers, stop the ranks
        (the node's command exits non-zero on :attr:`fatal`)."""
        group = self.group
        if self.fatal or group.closed:
            return
        self.fatal = why
        self.restarting = ""
        self.counters.add("group_failures")
        log.critical("%s: rank group failed: %s", group.node_id, why)
        group.stop_serving(f"{group.role} group {group.node_id} failed: {why}",
                           f"group failed: {why}")
        for handler in self._fatal_handlers:
            try:
                handler(why)
            except Exception:  # noqa: BLE001
                log.exception("%s: fatal handler failed", group.node_id)
