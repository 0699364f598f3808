"""A rank's pending transfers: the requests whose transfers are posted and not yet settled,
how a loop pass finds the finished ones (scan), times out the stuck ones (expire), fails one
(:func:`fail_pending`), and how the loop sleeps meanwhile (:meth:`PendingTransfers.before_sleep`).

A request is settled -- answered with one ``RankDone`` -- only once none of its handles is in
flight, none of its shared-map reads is still to copy, and every shared-map reader of it
answered (or it failed): then nothing of it can still touch its page.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from statebridge.connector.ledger import RequestKey
from statebridge.connector.stats import ops
from statebridge.errors import FailureKind, kind_of

if TYPE_CHECKING:
    from statebridge.config import ConnectorConfig
    from statebridge.connector.control import EventLoop
    from statebridge.connector.data import Transport

__all__ = ["Pending", "PendingTransfers", "fail_pending"]

#: Seconds between scans of the pending transfers for timeouts (transfer timeouts are tens
#: of seconds; scanning on every loop pass costs O(pending) per pass).
_TIMEOUT_SCAN_S = 0.1
#: How many unfinished requests a loop pass looks past (oldest first) before it stops, and
#: how often it looks at all of them (see PendingTransfers.scan).
_SCAN_AHEAD = 4
_FULL_SCAN_S = 0.002
#: How often a prefill rank looks at its answer words when ``send_reap_interval`` is 0.
_ANSWER_POLL_S = 0.001
#: Window over which a rank measures how often its unattended sends finish.
_SEND_RATE_WINDOW_S = 0.25


@dataclass
class Pending:
    key: RequestKey
    page: int
    handles: list
    started: float
    nbytes: int = 0
    messages: int = 0
    failure: tuple[str, str] | None = None
    blocks: tuple[int, ...] = ()       # the request's KV blocks on this rank's side
    kv_tokens: int = 0
    final_at: float = 0.0              # prefill rank: time.monotonic() when the state was final
    lease: bool = False                # prefill rank: sends of a final state, under the lease
    computed_from: float = 0.0         # prefill rank: time.monotonic() when its compute began
    posted_at: float = 0.0             # time.monotonic() when its transfers were posted
    attended: bool = True              # needs this rank's progress to finish (see before_sleep)
    unread: int = 0                    # decode rank: shared-map reads not yet copied
    first_block: int | None = None     # decode rank: its table's first id when one range
    #: prefill rank: the notice slots its shared-map readers answer in (slot, peer), and the
    #: request's serial they write there
    answers: list = field(default_factory=list)
    serial: int = 0


def fail_pending(p: Pending, kind: "FailureKind | str", reason: str) -> None:
    """``p`` fails with ``kind``: its live handles are cancelled (a receive UCX already matched
    may still finish writing: the request settles once every handle is out of flight)."""
    p.failure = (str(kind), reason)
    for h in p.handles:
        if not h.done():
            h.cancel()


class PendingTransfers:
    """The pending requests of a rank, oldest first, and what the loop needs of them. Loop
    thread only (``len()`` may be read anywhere: a moment stale).

    ``answered(p)`` says whether every shared-map reader of ``p`` answered
    (:meth:`~statebridge.connector.rank.shared_map.SharedMaps.answered`).
    """

    def __init__(self, config: "ConnectorConfig", transport: "Transport", loop: "EventLoop",
                 answered: Callable[[Pending], bool]) -> None:
        self.config = config
        self.transport = transport
        self.loop = loop
        self._answered = answered
        self._by_key: dict[RequestKey, Pending] = {}
        self._next_timeout_scan = 0.0
        self._next_full_scan = 0.0
        #: Peer nodes whose receivers read this rank's sends by themselves (same host, shared
        #: memory: Transport.sends_complete_unattended), how many pending requests still need
        #: this rank's own progress, and whether the loop polls the UCX fd.
        self.unattended_nodes: set[str] = set()
        self._attended = 0
        self._awaiting = 0                 # prefill: pending requests with answers to come
        self._ucx_watched = True
        #: Unattended sends settled since ``_rate_since``, and their rate over the last window.
        self._sends_settled = 0
        self._sends_per_s = 0.0
        self._rate_since = time.monotonic()

    def __len__(self) -> int:
        return len(self._by_key)

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def __contains__(self, key: RequestKey) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[RequestKey]:
        return iter(self._by_key)

    def get(self, key: RequestKey) -> Pending | None:
        return self._by_key.get(key)

    def add(self, p: Pending, direction: str) -> None:
        """``p``'s transfers are posted: pending until :meth:`scan` finds them finished."""
        p.attended = direction != "send" or p.key.peer_node not in self.unattended_nodes
        self._attended += p.attended
        self._awaiting += bool(p.answers)
        self._by_key[p.key] = p

    def pop(self, key: RequestKey) -> Pending:
        """Take a finished request out (it is being settled)."""
        p = self._by_key.pop(key)
        self._attended -= p.attended
        self._awaiting -= bool(p.answers)
        self._sends_settled += not p.attended
        return p

    @staticmethod
    def outcome(p: Pending) -> tuple[str, str]:
        """``(kind, message)`` of a finished request: its failure, the first failed handle's
        error, or ``("", "")``."""
        kind, message = p.failure or ("", "")
        if not kind:
            for h in p.handles:
                error = h.error                 # every handle is finished here
                if error is not None:
                    return kind_of(error).value, str(error)
        return kind, message

    def fail_peer(self, peer: str, reason: str) -> None:
        """``peer`` is gone: the requests waiting for its shared-map answers fail now (no
        handle stands for an answer), not at their transfer timeout."""
        for p in self._by_key.values():
            if p.failure is None and any(q == peer for _, q in p.answers):
                p.failure = (FailureKind.PEER_LOST.value, reason)

    def scan(self) -> list[RequestKey]:
        """After one UCX progress: the requests whose transfers all finished.

        Transfers finish about in the order they were posted (the prefill side serves
        requests in arrival order), so a pass looks at the pending requests oldest first and
        stops after :data:`_SCAN_AHEAD` unfinished ones; every :data:`_FULL_SCAN_S` it looks
        at all of them (a transfer that finished out of order waits at most that long).
        Transfer timeouts are checked every :data:`_TIMEOUT_SCAN_S`.
        """
        now = time.perf_counter()
        ready = []
        misses = 0
        full = now >= self._next_full_scan
        if full:
            self._next_full_scan = now + _FULL_SCAN_S
        answered = self._answered
        for key, p in self._by_key.items():
            handles = p.handles
            if not p.unread and (not handles or handles[-1].finished()
                                 and all(h.finished() for h in handles)) \
                    and (not p.answers or answered(p)):
                ready.append(key)
            else:
                misses += 1
                if misses >= _SCAN_AHEAD and not full:
                    break
        if now >= self._next_timeout_scan:
            self._next_timeout_scan = now + _TIMEOUT_SCAN_S
            self._expire(now)
        return ready

    def _expire(self, now: float) -> None:
        """A prefill rank's sends wait ``lease_timeout`` for their receivers, counted from when
        they were posted (the state was final: prefill queueing and compute are not the decode
        side's delay); a decode rank's receives wait ``transfer_timeout``."""
        lease, limit = self.config.lease_timeout, self.config.transfer_timeout
        for p in self._by_key.values():
            if p.failure is not None:
                continue
            if p.lease:
                if now - p.started > lease:
                    fail_pending(p, FailureKind.TIMEOUT, f"lease of {lease} s expired before "
                                                         f"the sends completed")
            elif now - p.started > limit:
                fail_pending(p, FailureKind.TIMEOUT, f"transfer not done after {limit} s")

    def before_sleep(self) -> "bool | float":
        """Before the loop sleeps: arm UCX and sleep on its fd as well, or -- when every pending
        request is a send its receiver reads by itself and sends finish often -- sleep through
        UCX's events and reap the send completions at the next wake-up, within
        ``config.send_reap_interval``.

        An armed sender wakes for every acknowledgement, though nothing is urgent then (its
        page is freed a little later), and UCX's receiver pays a signal to wake it. When sends
        finish at least once per reap interval on average, a wake-up by the clock reaps
        one or more of them at the cost of one acknowledgement's wake-up, and the receiver
        sends no signal (less CPU per request on hybrid cells: docs/measurements.md, "Prefill
        ranks sleep through their sends"). Fewer completions (long transfers, low load) keep
        the loop armed: the clock would only add wake-ups.
        Receives (decode ranks), and sends that need this side's progress (TCP: UCX endpoint
        error handling, another host), keep it armed too. Where UCX needs the sender after all
        (the wire-up of a new endpoint's first transfer), the transfer waits at most the
        interval. Shared-map readers answer in this rank's memory, which no fd signals: while
        any request waits for answers, an armed sleep lasts at most the interval too.
        """
        now = time.monotonic()
        if now - self._rate_since >= _SEND_RATE_WINDOW_S:
            self._sends_per_s = self._sends_settled / (now - self._rate_since)
            self._sends_settled, self._rate_since = 0, now
        reap = self.config.send_reap_interval
        unattended = bool(self._by_key) and not self._attended \
            and self._sends_per_s * reap >= 1.0 and reap > 0
        if unattended == self._ucx_watched:
            self.loop.watch_fd(self.transport.fileno(), not unattended)
            self._ucx_watched = not unattended
        if unattended:
            ops.add("unattended_sleeps")
            return reap
        armed = self.transport.arm()
        if armed and self._awaiting:
            # Shared-map readers answer in memory, which wakes nobody: look again by the clock.
            return reap or _ANSWER_POLL_S
        return armed

    def cancel_all(self) -> None:
        """The rank is closing: cancel every handle, forget every request."""
        for p in self._by_key.values():
            for h in p.handles:
                h.cancel()
        self._by_key.clear()
        self._attended = self._awaiting = 0
