"""The decode side: the coordinator that connects to prefill servers, and its rank processes.

Runs in the decode node's main process (:class:`DecodeCoordinator`) and in each decode rank
process (:class:`~statebridge.connector.rank.RankWorker` with role ``"decode"``).

Per request (N-1 protocol)::

    submit(request_id, prompt[:-1])
      allocate one page id (same on every decode rank), next generation
      --RankRecv-->        every decode rank: post receives of its runs into the page
      --TransferRequest--> the prefill server (round robin over connected ones)
      <--RankDone--        every decode rank (all receives complete, or failed/cancelled)
      future resolves to a TransferResult (the prefill side freed its page when its own
      ranks' sends completed: nothing to tell it)
    release(result)        the caller is done with the page (decoding finished)

With attention KV (``spec.kv``) the request also takes ``blocks_for(len(prompt), block_size)``
KV blocks (ids the same on every decode rank) with its page; ``TransferRequest`` carries that
block table and ``RankRecv`` too: the prefill side takes one range of consecutive blocks, so
the ranks post the recurrent AND the KV receives at once (the runs' sizes and order follow
from the decode table and a contiguous source range alone). A rank answers when all
completed. :meth:`DecodeCoordinator.grow`
extends a completed request's table while it decodes; the blocks are freed with the page.

Two ways in: :meth:`DecodeCoordinator.start` / :meth:`~DecodeCoordinator.free` /
:meth:`~DecodeCoordinator.cancel` run ON the coordinator's loop thread and report through a
callback (the decode node, whose front door and scheduler live on this loop, uses them: no thread
hand-off per request or token); :meth:`~DecodeCoordinator.submit`, :meth:`release` and friends
are the thread-safe wrappers (one hand-off each) that return futures. Requests live in
``self.ledger`` keyed by ``RequestKey(prefill node id, request id, generation)`` (``""`` for a
local recompute).

Failures become typed errors (``PeerLostError``, ``NotReadyError``, ``TransferTimeoutError``,
``AbortedError``, ``TransferError``) as soon as they are known; the page is freed only after
every decode rank confirmed that none of its receives can still write into it. A prefill server that goes silent for ``peer_timeout`` seconds (or says Goodbye) fails every
request it touched; other prefill servers keep serving. When the decode group itself loses a
rank (see :mod:`~statebridge.connector.group`), every request fails, every prefill connection is
dropped with a Goodbye, and once the group is whole again every kept address is re-dialed.

Reconnect: kept prefill addresses are re-dialed with backoff when their server is lost
(:mod:`~statebridge.connector.prefill_links`, the coordinator's links to prefill servers).
Nothing of the old connection can land after a reconnect: its requests already failed (and
their pages were freed only once every decode rank confirmed its receives were cancelled), and
new requests carry new generations, hence new tags.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import zmq

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.group import RankGroup
from statebridge.connector.ledger import Phase, Record, RequestKey
from statebridge.connector.prefill_links import (
    REDIAL_MIN_S,
    PeerState,
    PrefillLinks,
    _Dial,
    _Prefill,
)
from statebridge.connector.request_timing import RequestTiming, TimingJoin
from statebridge.connector.decode_api import ThreadSafeRequests, _packed
from statebridge.errors import (
    ClosedError,
    ConfigError,
    FailureKind,
    IncompatiblePeerError,
    InvalidRequestError,
    NotReadyError,
    PeerLostError,
    TransferError,
    error_for,
)
from statebridge.state.kv import blocks_for
from statebridge.state.plan import TransferPlan

log = logging.getLogger(__name__)

__all__ = ["DecodeCoordinator", "DecodeGauges", "PeerState", "TransferResult", "RequestTiming",
           "OnDone"]

@dataclass(frozen=True)
class TransferResult:
    """A request whose state every decode rank holds in ``page``."""

    request_id: str
    generation: int
    page: int
    prefill_node: str
    seconds: float                  # submit -> every decode rank holds the state
    nbytes: int                     # payload bytes received by all decode ranks
    blocks: tuple[int, ...] = ()    # the request's KV block table (spec with KV)
    landed_at: float = 0.0          # wall clock: the last decode rank held all of it


#: ``on_done(result, error)`` of :meth:`DecodeCoordinator.start`: exactly one is not None.
OnDone = Callable[["TransferResult | None", "TransferError | None"], None]


@dataclass(frozen=True)
class DecodeGauges:
    """What the decode coordinator holds now (:meth:`DecodeCoordinator.gauges`): pages and KV
    blocks (per rank, the same on every rank) used and free, the prefill nodes serving it,
    and the prefill peers whose handshake failed since it started."""

    pages_used: int
    pages_free: int
    blocks_used: int
    blocks_free: int
    prefill_nodes: tuple[str, ...]
    refused_peers: int
    transfers_verified: int = 0
    transfer_mismatches: int = 0


class DecodeCoordinator(PrefillLinks, TimingJoin, ThreadSafeRequests, RankGroup):
    """The decode group's coordinator: the N-1 transfer of each request into its ranks."""

    role = "decode"

    def _init_state(self) -> None:
        self.prefills: dict[str, _Prefill] = {}      # node id (or address before Hello) -> peer
        self._by_sock: dict[zmq.Socket, _Prefill] = {}
        #: request id -> its live attempt (ACTIVE, FAILED until its page is free, or DONE until
        #: released): a request id is in use exactly while it is here.
        self.current: dict[str, RequestKey] = {}
        self._callbacks: dict[RequestKey, OnDone] = {}
        self._last_generation = 0
        self._rr = itertools.count()
        self.prefill_watch = c.PeerWatch(self.config.peer_timeout, self.loop)
        self._dials: dict[str, _Dial] = {}           # address -> kept connection
        self._prefill_handlers: list[Callable[[m.GroupInfo], None]] = []
        #: on_timing's callback, and the halves of request timings waiting for the other:
        #: key -> (monotonic when kept, the prefill side's TransferTimes) or (monotonic,
        #: arrived_at, the TransferResult)
        self._on_timing: Callable | None = None
        self._halves: dict[RequestKey, tuple] = {}
        #: Transfer verification: request -> the prefill node's digests by decode rank
        #: (TransferDigest), until the request is DONE and compared, or freed.
        self._expected: dict[RequestKey, tuple[int, ...]] = {}

    @property
    def pending_callbacks(self) -> int:
        """Requests whose ``on_done`` has not run yet (loop thread)."""
        return len(self._callbacks)

    def _on_prefill_message(self, peer: _Prefill, msg: m.Message) -> None:
        if isinstance(msg, m.Reject):
            self.counters.add("rejected_handshakes")
            if msg.code == "not_ready":          # its group is not whole: dial again later
                self.counters.add("prefill_not_ready")
                peer.state = PeerState.FAILED
                peer.error = NotReadyError(f"prefill server {peer.address} is not ready: "
                                           f"{msg.reason}", peer=peer.address)
                self._drop_prefill(peer, f"not ready: {msg.reason}")
                peer.event.set()
                return
            self._handshake_failed(peer, IncompatiblePeerError(
                f"prefill server {peer.address} rejected us: {msg.reason}"))
        elif isinstance(msg, m.Hello) and peer.state is PeerState.HELLO:
            if msg.compat_hash != m.compat_hash(self.spec.to_json()) or msg.role != "prefill":
                self._handshake_failed(peer, IncompatiblePeerError(
                    f"prefill server {peer.address} is incompatible: hash {msg.compat_hash!r}, "
                    f"role {msg.role!r}"))
                return
            peer.state = PeerState.INFO
            c.send_dealer(peer.sock, self.group_info())
        elif isinstance(msg, m.GroupInfo) and peer.state is PeerState.INFO:
            try:
                peer.geometry = self.check_peer_info(msg)
                peer.plan = TransferPlan(peer.geometry, self.geometry)
            except (IncompatiblePeerError, ConfigError) as e:
                self._handshake_failed(peer, e)
                return
            if msg.node_id in self.prefills:
                self._handshake_failed(peer, IncompatiblePeerError(
                    f"prefill node id {msg.node_id!r} is already connected"))
                return
            peer.node_id = msg.node_id
            self.prefills[msg.node_id] = peer
            self.prefill_watch.heard(msg.node_id)
            self.to_ranks(self.rank_connect(msg))
            peer.state = PeerState.READY
            peer.info = msg
            log.info("%s: handshake with prefill group %s done in %.1f s (TP %d, %s): %d "
                     "messages, %d bytes per request", self.node_id, msg.node_id,
                     time.monotonic() - peer.opened_at, msg.tp_size, msg.layout,
                     peer.plan.messages_per_request, peer.plan.bytes_per_request)
            self._redialed(peer)
            peer.event.set()
            for handler in self._prefill_handlers:
                try:
                    handler(msg)
                except Exception:  # noqa: BLE001 -- a report must not break the handshake
                    log.exception("%s: prefill-connected handler failed", self.node_id)
        elif isinstance(msg, m.TransferTimes):
            self._on_times(peer, msg)
        elif isinstance(msg, m.TransferFailed):
            record = self.ledger.get(RequestKey(peer.node_id, msg.request_id, msg.generation))
            if record is None:
                self.counters.add("stale_messages")
                return
            # Only this request: the server still talks to us, so its endpoints stay. (Failing
            # them here -- lost_node -- would leave every later request of this connection
            # posting to a peer the ranks consider lost, with no RankConnect to revive it.)
            self._fail(record, FailureKind.parse(msg.kind),
                       f"prefill {peer.node_id}: {msg.message}", notify=False)
        elif isinstance(msg, m.TransferDigest):
            self._on_transfer_digest(peer, msg)
        elif isinstance(msg, m.Goodbye):
            self._prefill_lost(peer, "said goodbye")
        elif isinstance(msg, m.Error):
            self.counters.add("peer_errors")
            log.warning("%s: prefill %s reported: %s %s", self.node_id, peer.address, msg.kind,
                        msg.message)
        elif isinstance(msg, m.Heartbeat):
            pass
        else:
            self.counters.add("unexpected_messages")

    def gauges(self) -> DecodeGauges:
        """Loop thread: pages, KV blocks and prefill peers now."""
        return DecodeGauges(
            pages_used=self.pool.num_used, pages_free=self.pool.num_free,
            blocks_used=self.blocks.num_used if self.blocks else 0,
            blocks_free=self.blocks.num_free if self.blocks else 0,
            prefill_nodes=tuple(self.ready_prefills()),
            refused_peers=int(self.counters.get("refused_peers")),
            transfers_verified=int(self.counters.get("transfer_digests_checked")),
            transfer_mismatches=int(self.counters.get("transfer_digest_mismatches")))

    def blocks_for(self, tokens: int) -> int:
        """KV blocks a request of ``tokens`` tokens holds (0 for a spec without attention)."""
        return blocks_for(tokens, self.block_size) if self.spec.kv is not None else 0

    def free_blocks(self) -> int:
        """Loop thread: KV blocks free now (0 for a spec without attention)."""
        return self.blocks.num_free if self.blocks is not None else 0

    # -- requests: on the loop thread ---------------------------------------------------------
    def start(self, request_id: str, prompt: Sequence[int], on_done: OnDone, *,
              prefill: str | None = None, local: bool = False,
              arrived_at: float = 0.0) -> RequestKey:
        """Start moving the state of ``prompt`` (the N-1 prefix) into a page of every decode
        rank (``local``: compute it on the decode ranks themselves, the ``recompute`` policy).
        Loop thread only. ``on_done(result, error)`` runs once, on the loop thread, when every
        decode rank holds the state or when the request failed; a DONE request keeps its page
        (and its id) until :meth:`free`.

        Refusals raise and hold nothing: :class:`CacheFullError` (no free page: back-pressure),
        :class:`NotReadyError` (no prefill server connected), :class:`InvalidRequestError`
        (the id is in use), :class:`PeerLostError` (a decode rank is lost),
        :class:`ClosedError`.

        ``arrived_at``: when the caller got the request (wall-clock seconds; 0.0: now), the
        start of its queue time in :class:`RequestTiming`.
        """
        return self._start(request_id, _packed(request_id, prompt), on_done, prefill=prefill,
                           local=local, arrived_at=arrived_at)

    def _start(self, request_id: str, prompt: bytes, on_done: OnDone, *,
               prefill: str | None = None, local: bool = False,
               arrived_at: float = 0.0) -> RequestKey:
        """:meth:`start` for a prompt already packed as token bytes (:func:`_packed`; the
        submit methods do that on the caller's thread, once; it travels as is)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got "
                                      f"{request_id!r}")
        if self._closed:
            raise ClosedError(f"{self.node_id} is closed")
        whole, why = self.whole()
        if not whole:
            if self.restarting or not (self.fatal or not self.healthy):
                raise NotReadyError(why, request_id=request_id)    # starting, restarting
            raise PeerLostError(why, request_id=request_id)
        live = self.current.get(request_id)
        if live is not None and self.ledger.get(live).phase is not Phase.FAILED:
            # (A FAILED attempt only waits for its page: a retry -- the recompute policy --
            # is a new attempt of the same id under a new generation.)
            raise InvalidRequestError(f"request id {request_id!r} is already in flight",
                                      request_id=request_id)
        peer = None
        if not local:
            ready = [p for p in self.prefills.values() if p.state is PeerState.READY]
            if prefill is not None:
                ready = [p for p in ready if p.node_id == prefill]
            if not ready:
                _, why = self.status()
                raise NotReadyError(f"{why}{f' named {prefill!r}' if prefill else ''}",
                                    request_id=request_id)
            peer = ready[next(self._rr) % len(ready)]
        tokens = m.token_count(prompt)
        num_blocks = self.blocks_for(tokens)
        key = RequestKey(peer.node_id if peer else "", request_id,
                         (self._last_generation + 1) & 0xFFFFFFFF)
        # (CacheFullError for the page or the KV blocks: nothing is held, no generation used.)
        record = self.ledger.open(key, time.monotonic() + self.config.transfer_timeout, peer,
                                  num_blocks=num_blocks)
        generation = self._last_generation = key.generation
        record.arrived_at = arrived_at or time.time()
        blocks = tuple(record.blocks)
        self.current[request_id] = key
        self._callbacks[key] = on_done
        if peer is None:
            self.counters.add("local_prefills")
            self.to_ranks(m.RankLocalPrefill(request_id=request_id, generation=generation,
                                             prompt=prompt, page=record.page, blocks=blocks))
        else:
            self.counters.add("requests")
            self.to_ranks(m.RankRecv(request_id=request_id, generation=generation,
                                     page=record.page, peer_node=peer.node_id, blocks=blocks,
                                     kv_tokens=tokens if blocks else 0))
            c.send_dealer(peer.sock, m.TransferRequest(request_id=request_id,
                                                       generation=generation, prompt=prompt,
                                                       kv_blocks=blocks))
        return key

    def grow(self, request_id: str, tokens: int) -> tuple[int, ...]:
        """Loop thread: make a DONE request's KV block table hold ``tokens`` tokens (decoding
        appends tokens); new blocks come right after its last one where free. Returns the
        whole table. :class:`CacheFullError` naming wanted / free / total blocks when short
        (nothing taken); InvalidRequestError for an id that is not a DONE request."""
        key = self.current.get(request_id)
        record = self.ledger.get(key) if key is not None else None
        if record is None or record.phase is not Phase.DONE:
            raise InvalidRequestError(f"no completed request {request_id!r} to grow",
                                      request_id=request_id)
        if self.spec.kv is None:
            raise InvalidRequestError(f"{self.node_id} serves a spec without attention KV",
                                      request_id=request_id)
        self.ledger.grow(record, blocks_for(tokens, self.block_size))
        return tuple(record.blocks)

    def free(self, request_id: str) -> bool:
        """Loop thread: the caller is done with a DONE request's page (its id may be reused);
        False if ``request_id`` is not a DONE request."""
        key = self.current.get(request_id)
        record = self.ledger.get(key) if key is not None else None
        if record is None or record.phase is not Phase.DONE:
            return False
        self.ledger.free(record)
        del self.current[request_id]
        return True

    def cancel(self, request_id: str, reason: str = "aborted by caller") -> bool:
        """Loop thread: abort a request in flight (its callback gets AbortedError); False if it
        is not in flight."""
        key = self.current.get(request_id)
        record = self.ledger.get(key) if key is not None else None
        # (In flight: ACTIVE, or DONE while its transfer digests are still to come.)
        if record is None or record.phase is Phase.FAILED or record.result is not None:
            return False
        self._fail(record, FailureKind.ABORTED, reason, notify=True)
        return True

    def result(self, request_id: str) -> "TransferResult | None":
        """Loop thread: the result of a DONE request not yet freed."""
        key = self.current.get(request_id)
        record = self.ledger.get(key) if key is not None else None
        return record.result if record is not None and record.phase is Phase.DONE else None

    # -- request lifecycle --------------------------------------------------------------------
    def _on_rank_done(self, rank: int, msg: m.RankDone) -> None:
        record = self.ledger.answer(rank, msg)
        if record is None:
            self.counters.add("stale_rank_done")
            return
        if msg.kind and record.failure is None:
            self._fail(record, FailureKind.parse(msg.kind), f"decode rank {rank}: {msg.message}",
                       notify=True)
        self._settle(record)

    def _on_transfer_digest(self, peer: _Prefill, msg: m.TransferDigest) -> None:
        record = self.ledger.get(RequestKey(peer.node_id, msg.request_id, msg.generation))
        if record is None or record.failure is not None or not self.config.verify_transfers:
            self.counters.add("stale_messages")
            return
        if len(msg.digests) != self.tp_size:
            self._fail(record, FailureKind.TRANSFER_ERROR,
                       f"prefill {peer.node_id} sent {len(msg.digests)} transfer digests for "
                       f"{self.tp_size} decode ranks", notify=True)
            return
        self._expected[record.key] = msg.digests
        self._settle(record)

    def _verified(self, record: Record) -> bool:
        """A DONE request of a verified link: whether what every rank reports having landed
        matches what the prefill node sent (else the request fails with ``transfer_error``
        naming the request, the rank and both digests, and the mismatch is counted). False
        also while the prefill node's digests are still to come."""
        expected = self._expected.get(record.key)
        if expected is None:
            return False
        del self._expected[record.key]
        bad = [(r, expected[r], record.done[r].digest) for r in range(self.tp_size)
               if record.done[r].digest != expected[r]]
        self.counters.add("transfer_digests_checked", self.tp_size)
        if not bad:
            return True
        self.counters.add("transfer_digest_mismatches", len(bad))
        what = "; ".join(f"decode rank {r}: expected {e:#018x}, got "
                         f"{g:#018x}" if g >= 0 else f"decode rank {r}: expected {e:#018x}, "
                         f"got none" for r, e, g in bad)
        message = (f"transfer checksum mismatch of request {record.request_id!r} from "
                   f"prefill {record.peer_node}: {what}")
        log.error("%s: %s", self.node_id, message)
        self.fail_on_ranks(record, FailureKind.TRANSFER_ERROR, message)   # (none to cancel)
        self._report(record, None, error_for(FailureKind.TRANSFER_ERROR, message,
                                             request_id=record.request_id,
                                             peer=record.peer_node or None))
        self._settle(record)                    # quiet: every rank answered; freed now
        return False

    def _fail(self, record: Record, kind: FailureKind, message: str, *, notify: bool,
              lost_node: str = "") -> None:
        # (A DONE request whose digests are still to come is not reported yet: it fails.)
        if record.phase is Phase.DONE and record.result is not None \
                or not self.fail_on_ranks(record, kind, message, lost_node):
            return
        peer = record.peer
        if notify and peer is not None and peer.state is PeerState.READY:
            c.send_dealer(peer.sock, m.Abort(request_id=record.request_id,
                                             generation=record.generation, reason=message))
        self._report(record, None, error_for(kind, message, request_id=record.request_id,
                                             peer=record.peer_node or None))
        self._settle(record)

    def _settle(self, record: Record) -> None:
        """A failed request's page is freed once no decode rank can still write into it; a
        request every rank received becomes DONE (its page is the caller's until freed)."""
        if not self.ledger.quiet(record) or record.result is not None:
            return
        if record.phase is Phase.FAILED:
            self._expected.pop(record.key, None)
            if self.ledger.free(record) and self.current.get(record.request_id) == record.key:
                del self.current[record.request_id]
            return
        if record.phase is not Phase.DONE:
            return
        if record.peer is not None and self.config.verify_transfers \
                and not self._verified(record):
            return              # digests still to come (or it failed: reported and freed)
        done = [record.done[r] for r in range(self.tp_size)]
        result = record.result = TransferResult(
            request_id=record.request_id, generation=record.generation, page=record.page,
            prefill_node=record.peer_node, seconds=time.perf_counter() - record.started,
            nbytes=sum(d.nbytes for d in done), blocks=tuple(record.blocks),
            landed_at=max(d.landed_at for d in done))
        self.counters.add("transfers_ok")
        self.counters.add("bytes", result.nbytes)
        if self._on_timing is not None:
            self._timing_half(record, done, result)
        self._report(record, result, None)

    def _report(self, record: Record, result: "TransferResult | None",
                error: "TransferError | None") -> None:
        on_done = self._callbacks.pop(record.key, None)
        if on_done is None:
            return
        try:
            on_done(result, error)
        except Exception:  # noqa: BLE001 -- the caller's callback must not break the ledger
            log.exception("%s: on_done of %s failed", self.node_id, record.key)

    def _in_flight(self) -> int:
        return sum(1 for r in self.ledger if r.phase is not Phase.DONE)

    # -- liveness ------------------------------------------------------------------------------
    def _on_tick(self) -> None:
        hb = m.Heartbeat(node_id=self.node_id, seq=self._heartbeats)
        for peer in list(self.prefills.values()):
            if peer.state is PeerState.READY:
                c.send_dealer(peer.sock, hb)
        for node in self.prefill_watch.expired():
            peer = self.prefills.get(node)
            if peer is not None:
                self._prefill_lost(peer, f"silent for {self.config.peer_timeout} s")
        self._redial()
        now = time.monotonic()
        if self._halves:
            self._expire_halves(now)
        for record in self.ledger:
            if record.phase is Phase.DONE and record.result is None \
                    and now > record.deadline + self.config.peer_timeout:
                # Every decode rank holds the state; the prefill node's digests never came.
                self._fail(record, FailureKind.TIMEOUT,
                           f"no transfer digests from prefill {record.peer_node} within "
                           f"{self.config.transfer_timeout} s", notify=True)
            elif record.phase is Phase.ACTIVE and now > record.deadline + self.config.peer_timeout:
                # The ranks enforce transfer_timeout themselves; this catches a rank that never
                # answers at all.
                self._fail(record, FailureKind.TIMEOUT,
                           f"no answer within {self.config.transfer_timeout} s", notify=True)

    def _on_rank_lost(self, rank: int) -> None:
        for record in self.ledger:
            self._fail(record, FailureKind.PEER_LOST,
                       f"decode rank {rank} of {self.node_id} died", notify=True)
            self._settle(record)

    def _on_group_down(self, why: str) -> None:
        """Every request has failed (and its prefill server heard Abort): the prefill
        connections end with a Goodbye; the kept addresses are re-dialed once the group is
        whole again."""
        for peer in list(self.prefills.values()):
            if peer.state is PeerState.READY:
                c.send_dealer(peer.sock, m.Goodbye(node_id=self.node_id))
        for peer in list(self._by_sock.values()):
            peer.state = PeerState.LOST
            self._drop_prefill(peer, why)

    def _on_group_reset(self) -> None:
        self._expected.clear()                 # of the old ledger's requests
        for key in list(self._callbacks):          # (none: every request failed already)
            on_done = self._callbacks.pop(key)
            on_done(None, PeerLostError(f"decode group {self.node_id} restarted",
                                        request_id=key.request_id))
        self.current.clear()

    def _on_group_restarted(self) -> None:
        for dial in self._dials.values():
            if dial.peer is None:
                dial.next_at, dial.wait = 0.0, REDIAL_MIN_S

    def _on_close(self) -> None:
        for record in self.ledger:
            self._fail(record, FailureKind.ABORTED, f"{self.node_id} closing", notify=True)
        for peer in list(self.prefills.values()):
            if peer.state is PeerState.READY:
                c.send_dealer(peer.sock, m.Goodbye(node_id=self.node_id))
        for peer in list(self._by_sock.values()):
            self._drop_prefill(peer, "closing")
        self._dials.clear()

    def stats(self) -> dict:
        def collect():
            return {**self._page_stats(),
                    "completed_unreleased": sum(1 for r in self.ledger
                                                if r.phase is Phase.DONE),
                    "prefills": self.ready_prefills(),
                    "healthy": self.healthy, "generation": self.generation,
                    **self.counters.snapshot()}
        return self.loop.call(collect)
