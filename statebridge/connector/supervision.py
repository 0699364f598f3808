"""Supervision of a coordinator's rank group: a group that was whole and loses a rank heals or
fails, it never lingers (``ConnectorConfig.on_rank_loss``)::

    rank lost --> requests in flight fail (peer_lost); peers dropped (Goodbye); not ready
      restart: every old rank told to stop, then stopped (terminate, kill) and joined
               -> only then: fresh pages, KV blocks, ledger; generation + 1
               -> new rendezvous store, new rank processes, all RankHello within
                  rank_start_timeout -> ready again; peers re-handshake
      exit, a failed restart, or too many restarts in rank_restart_window:
               -> fatal: the group stays broken, says why (:attr:`RankGroup.fatal`),
                  and the node's command exits non-zero for its supervisor

While a group is not whole, :meth:`RankGroup.whole` says which ranks are missing and why.

:class:`Supervision` is a part of :class:`~statebridge.connector.group.RankGroup` (its base
class): it uses the group's loop, config, ledger, handles and launcher.
"""

from __future__ import annotations

import logging
import threading
import time

from statebridge.connector import messages as m
from statebridge.connector.launch import RankHandle
from statebridge.connector.ledger import Ledger
from statebridge.errors import ClosedError, StartupError, StatebridgeError
from statebridge.state.cache import PagePool
from statebridge.state.kv import BlockPool

log = logging.getLogger("statebridge.connector.group")   # one logger for the group

__all__ = ["Supervision"]


class Supervision:
    """How a group that was whole heals or fails when it loses a rank (module docstring)."""

    def _supervise(self, cause: str) -> None:
        """Loop thread: the group was whole and lost a rank: restart it or fail it."""
        if self._closed or self.fatal or self.restarting:
            return
        if self.config.on_rank_loss == "exit":
            self._fail_group(f"{cause}; on_rank_loss is exit")
            return
        if self._launcher is None:
            self._fail_group(f"{cause}; no launcher to restart the ranks with")
            return
        now = time.monotonic()
        window, limit = self.config.rank_restart_window, self.config.max_rank_restarts
        self._restarts = [t for t in self._restarts if now - t < window]
        if len(self._restarts) >= limit:
            self._fail_group(f"{cause}; {len(self._restarts)} restarts within the last "
                             f"{window:g} s already (max_rank_restarts {limit})")
            return
        self._restarts.append(now)
        self.restarting = cause
        self.counters.add("rank_restarts")
        log.error("%s: %s; restarting the rank group (generation %d -> %d)", self.node_id,
                  cause, self.generation, self.generation + 1)
        self._on_group_down(f"{self.role} group {self.node_id} restarting after {cause}")
        self.to_ranks(m.RankShutdown(reason=f"group restarting after {cause}"))
        # The old ranks are the restarter's now: nothing here watches or counts them again.
        old, self.handles = self.handles, []
        for r, st in enumerate(self.ranks):
            st.lost = True
            self.rank_watch.forget(r)
        self._restarter = threading.Thread(target=self._restart, args=(cause, old),
                                           name=f"statebridge-{self.node_id}-restart",
                                           daemon=True)
        self._restarter.start()

    def _restart(self, cause: str, old: list[RankHandle]) -> None:
        """The restarter thread: stop the old ranks, reset, start a new group, wait for it."""
        started = time.monotonic()
        try:
            for h in old:
                h.stop(self.RANK_STOP_S)
            alive = [getattr(h, "pid", r) for r, h in enumerate(old) if h.is_alive()]
            if alive:
                raise StartupError(f"old rank processes {alive} did not exit")
            if self._closed:
                return
            store, self.dist_store = self.dist_store, None
            if store is not None:
                store.close()
            self.loop.call(self._reset_group)
            handles = self._launch()
            try:
                self.loop.call(self._adopt, handles)
            except StatebridgeError:
                for h in handles:
                    h.stop(0.5)
                raise
            self.wait_ready(self.config.rank_start_timeout)
            self.loop.call(self._restarted, time.monotonic() - started)
        except Exception as e:  # noqa: BLE001 -- any failure of a restart fails the group
            if self._closed:
                return
            log.exception("%s: restarting the rank group failed", self.node_id)
            try:
                self.loop.call_soon(self._fail_group,
                                    f"{cause}; restarting the rank group failed: "
                                    f"{type(e).__name__}: {e}")
            except ClosedError:
                pass

    def _reset_group(self) -> None:
        """Loop thread, once no old rank process is left that could write into a page or a
        block: fresh pools, ledger and rank slots for the next generation."""
        from statebridge.connector.group import _RankState   # (group imports this module)

        self.pool = PagePool(self.num_pages)
        if self.blocks is not None:
            self.blocks = BlockPool(self.num_blocks)
        self.ledger = Ledger(self.tp_size, self.pool, self.blocks)
        self.ranks = [_RankState() for _ in range(self.tp_size)]
        self._by_identity.clear()
        for r in range(self.tp_size):
            self.rank_watch.forget(r)
        self._ready.clear()
        self._started.clear()
        self._start_errors.clear()
        self._lost_why.clear()
        self.healthy = True
        self.handles = []
        self.generation += 1
        self._on_group_reset()

    def _adopt(self, handles: list[RankHandle]) -> None:
        if self._closed:
            raise ClosedError(f"{self.node_id} closed while its ranks restarted")
        self.handles = handles

    def _restarted(self, seconds: float) -> None:
        if self.fatal or self._closed:
            return
        cause, self.restarting = self.restarting, ""
        if not self.healthy:               # lost a rank of the new generation meanwhile
            lost = "; ".join(f"rank {r} lost ({why})" for r, why in sorted(self._lost_why.items()))
            self._supervise(lost)
            return
        log.warning("%s: rank group restarted in %.1f s (generation %d) after %s",
                    self.node_id, seconds, self.generation, cause)
        self._on_group_restarted()

    def _fail_group(self, why: str) -> None:
        """Loop thread: the group cannot serve any more: say why, drop peers, stop the ranks
        (the node's command exits non-zero on :attr:`fatal`)."""
        if self.fatal or self._closed:
            return
        self.fatal = why
        self.healthy = False
        self.restarting = ""
        self.counters.add("group_failures")
        log.critical("%s: rank group failed: %s", self.node_id, why)
        self._on_group_down(f"{self.role} group {self.node_id} failed: {why}")
        self.to_ranks(m.RankShutdown(reason=f"group failed: {why}"))
        for handler in self._fatal_handlers:
            try:
                handler(why)
            except Exception:  # noqa: BLE001
                log.exception("%s: fatal handler failed", self.node_id)

    def _on_group_down(self, why: str) -> None:
        """The group stopped serving (restarting or failed): requests in flight have failed;
        drop the peers (subclasses)."""

    def _on_group_reset(self) -> None:
        """Fresh state for a new generation (subclasses; loop thread)."""

    def _on_group_restarted(self) -> None:
        """The new generation is whole (subclasses; loop thread)."""
