"""The decode side: the coordinator that connects to prefill servers, and its rank processes.

Runs in the decode node's main process (:class:`DecodeCoordinator`) and in each decode rank
process (:class:`~statebridge.connector.rank.RankWorker` with role ``"decode"``).

Per request (N-1 protocol)::

    submit(request_id, prompt[:-1])
      allocate one page id (same on every decode rank), next generation
      --RankRecv-->        every decode rank: post receives of its runs into the page
      --TransferRequest--> the prefill server (round robin over connected ones; with
                           prefix caches, the one holding most of the prompt:
                           connector/prefix_router.py)
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
are the thread-safe wrappers (one hand-off each) that return futures. Requests live in the
group's ledger (``coordinator.group.ledger``) keyed by ``RequestKey(prefill node id, request
id, generation)`` (``""`` for a local recompute).

The coordinator *has* its parts: ``group`` (its :class:`~statebridge.connector.group.RankGroup`:
the ranks, their loop thread, pools and ledger), ``links`` (its
:class:`~statebridge.connector.prefill_links.PrefillLinks` to prefill servers) and ``timing``
(its :class:`~statebridge.connector.request_timing.TimingJoin`).

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

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.group import RankGroup, delegate_to_group
from statebridge.connector.ledger import Phase, Record, RequestKey
from statebridge.connector.prefill_links import PeerState, PrefillLinks, _Prefill
from statebridge.connector.prefix_router import PrefixRouter
from statebridge.connector.request_timing import RequestTiming, TimingJoin, TransferResult
from statebridge.errors import (
    ClosedError,
    FailureKind,
    InvalidRequestError,
    NotReadyError,
    PeerLostError,
    TransferError,
    error_for,
)
from statebridge.state.kv import blocks_for

log = logging.getLogger(__name__)

__all__ = ["DecodeCoordinator", "DecodeGauges", "PeerState", "TransferResult", "RequestTiming",
           "OnDone"]

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


@delegate_to_group("node_id", "address", "supervisor.fatal", "wait_ready", "whole", "close")
class DecodeCoordinator:
    """The decode group's coordinator: the N-1 transfer of each request into its ranks.

    It *has* ``group`` (its :class:`~statebridge.connector.group.RankGroup`; it is that
    group's :class:`~statebridge.connector.group.GroupEvents`), ``links`` (to the prefill
    servers; it is their :class:`~statebridge.connector.prefill_links.LinkOwner`) and
    ``timing`` (:class:`~statebridge.connector.request_timing.TimingJoin`). The constructor
    takes the group's arguments (``spec, tp_size, layout, num_pages`` and the keywords of
    :class:`~statebridge.connector.group.RankGroup`: ``config``, ``node_id``, ``port``,
    ``launcher``, ``model``, ``probes``, the KV pool, ``device``, ...), builds the group, then
    its own parts, then starts the group. ``node_id``, ``address``, ``fatal``, ``wait_ready``,
    ``whole`` and ``close`` are the group's.

    It *has* ``router`` too (:class:`~statebridge.connector.prefix_router.PrefixRouter`):
    ``prefix_cache`` (default on) lets prefill nodes start requests from their prefix cache
    (False: ``TransferRequest.prefix_cache`` False, no routing by prefix); ``prefix_routing``
    (default on) sends a request to the prefill node that holds most of its prompt (False:
    round robin, the A/B switch of a benchmark).
    """

    role = "decode"

    def __init__(self, spec, tp_size: int, layout, num_pages: int, *,
                 prefix_cache: bool = True, prefix_routing: bool = True,
                 **group_options: Any) -> None:
        self.group = group = RankGroup(self, self.role, spec, tp_size, layout, num_pages,
                                       **group_options)
        self.links = PrefillLinks(group, self)
        self.router = PrefixRouter(enabled=prefix_cache, routing=prefix_routing)
        self.links.on_prefill_connected(self.router.connected)
        self.timing = TimingJoin(group.node_id,
                                 group.config.transfer_timeout + group.config.peer_timeout)
        #: request id -> its live attempt (ACTIVE, FAILED until its page is free, or DONE until
        #: released): a request id is in use exactly while it is here.
        self.current: dict[str, RequestKey] = {}
        self._callbacks: dict[RequestKey, OnDone] = {}
        self._last_generation = 0
        #: Transfer verification: request -> the prefill node's digests by decode rank
        #: (TransferDigest), until the request is DONE and compared, or freed.
        self._expected: dict[RequestKey, tuple[int, ...]] = {}
        group.start()

    # -- the parts' public faces (the group's: delegate_to_group above) -------------------------
    def connect(self, address: str, timeout: float | None = None, *,
                redial: bool = True, wait: bool = True) -> str | None:
        """Handshake with the prefill server at ``host:port`` (:meth:`PrefillLinks.connect
        <statebridge.connector.prefill_links.PrefillLinks.connect>`)."""
        return self.links.connect(address, timeout, redial=redial, wait=wait)

    def status(self) -> tuple[bool, str]:
        """Loop thread: (ready, why not) (:meth:`PrefillLinks.status
        <statebridge.connector.prefill_links.PrefillLinks.status>`)."""
        return self.links.status()

    def dialled(self) -> bool:
        """Loop thread: whether every kept prefill address has answered at least once."""
        return self.links.dialled()

    def on_prefill_connected(self, handler: "Callable[[m.GroupInfo], None]") -> None:
        """Call ``handler(info)`` on the loop thread after each handshake with a prefill node
        succeeded, with that node's group (its TP size, pages, KV pool)."""
        self.links.on_prefill_connected(handler)

    def prefill_nodes(self) -> list[str]:
        """The node ids of the prefill servers serving us (any thread)."""
        return self.links.prefill_nodes()

    def ready_prefills(self) -> list[str]:
        """Loop thread: the node ids of the prefill servers serving us, sorted."""
        return self.links.ready_prefills()

    def on_timing(self, callback: "Callable[[RequestTiming], None] | None") -> None:
        """Call ``callback`` with the :class:`RequestTiming` of every request whose state
        every decode rank holds (:meth:`TimingJoin.on_timing
        <statebridge.connector.request_timing.TimingJoin.on_timing>`)."""
        self.timing.on_timing(callback)

    @property
    def pending_callbacks(self) -> int:
        """Requests whose ``on_done`` has not run yet (loop thread)."""
        return len(self._callbacks)

    # -- the requests' messages from prefill servers (links.LinkOwner) ---------------------------
    def prefill_message(self, peer: _Prefill, msg: m.Message) -> None:
        if isinstance(msg, m.TransferTimes):
            self.timing.prefill_half(peer.node_id, msg)
        elif isinstance(msg, m.TransferFailed):
            record = self.group.ledger.get(RequestKey(peer.node_id, msg.request_id,
                                                      msg.generation))
            if record is None:
                self.group.counters.add("stale_messages")
                return
            # Only this request: the server still talks to us, so its endpoints stay. (Failing
            # them here -- lost_node -- would leave every later request of this connection
            # posting to a peer the ranks consider lost, with no RankConnect to revive it.)
            self._fail(record, FailureKind.parse(msg.kind),
                       f"prefill {peer.node_id}: {msg.message}", notify=False)
        elif isinstance(msg, m.TransferDigest):
            self._on_transfer_digest(peer, msg)
        elif isinstance(msg, m.PrefixAnnounce):
            self.router.announced(peer.node_id, msg)
        else:
            self.group.counters.add("unexpected_messages")

    def prefill_lost(self, peer: _Prefill, why: str) -> None:
        self.router.lost(peer.node_id)
        for record in self.group.ledger.of_peer(peer.node_id):
            self._fail(record, FailureKind.PEER_LOST, f"prefill {peer.node_id} lost ({why})",
                       notify=False, lost_node=peer.node_id)

    def gauges(self) -> DecodeGauges:
        """Loop thread: pages, KV blocks and prefill peers now."""
        group = self.group
        return DecodeGauges(
            pages_used=group.pool.num_used, pages_free=group.pool.num_free,
            blocks_used=group.blocks.num_used if group.blocks else 0,
            blocks_free=group.blocks.num_free if group.blocks else 0,
            prefill_nodes=tuple(self.ready_prefills()),
            refused_peers=int(group.counters.get("refused_peers")),
            transfers_verified=int(group.counters.get("transfer_digests_checked")),
            transfer_mismatches=int(group.counters.get("transfer_digest_mismatches")))

    def blocks_for(self, tokens: int) -> int:
        """KV blocks a request of ``tokens`` tokens holds (0 for a spec without attention)."""
        group = self.group
        return blocks_for(tokens, group.block_size) if group.spec.kv is not None else 0

    def free_blocks(self) -> int:
        """Loop thread: KV blocks free now (0 for a spec without attention)."""
        return self.group.blocks.num_free if self.group.blocks is not None else 0

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
        group = self.group
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got "
                                      f"{request_id!r}")
        if group.closed:
            raise ClosedError(f"{group.node_id} is closed")
        whole, why = group.whole()
        if not whole:
            if group.supervisor.restarting or not (group.supervisor.fatal or not group.healthy):
                raise NotReadyError(why, request_id=request_id)    # starting, restarting
            raise PeerLostError(why, request_id=request_id)
        live = self.current.get(request_id)
        if live is not None and group.ledger.get(live).phase is not Phase.FAILED:
            # (A FAILED attempt only waits for its page: a retry -- the recompute policy --
            # is a new attempt of the same id under a new generation.)
            raise InvalidRequestError(f"request id {request_id!r} is already in flight",
                                      request_id=request_id)
        peer = None
        if not local:
            ready = [p for p in self.links.prefills.values() if p.state is PeerState.READY]
            if prefill is not None:
                ready = [p for p in ready if p.node_id == prefill]
            if not ready:
                _, why = self.status()
                raise NotReadyError(f"{why}{f' named {prefill!r}' if prefill else ''}",
                                    request_id=request_id)
            peer = self.router.pick(ready, prompt, group.ledger)
        tokens = m.token_count(prompt)
        num_blocks = self.blocks_for(tokens)
        key = RequestKey(peer.node_id if peer else "", request_id,
                         (self._last_generation + 1) & 0xFFFFFFFF)
        # (CacheFullError for the page or the KV blocks: nothing is held, no generation used.)
        record = group.ledger.open(key, time.monotonic() + group.config.transfer_timeout, peer,
                                   num_blocks=num_blocks)
        generation = self._last_generation = key.generation
        record.arrived_at = arrived_at or time.time()
        blocks = tuple(record.blocks)
        self.current[request_id] = key
        self._callbacks[key] = on_done
        if peer is None:
            group.counters.add("local_prefills")
            group.to_ranks(m.RankLocalPrefill(request_id=request_id, generation=generation,
                                              prompt=prompt, page=record.page, blocks=blocks))
        else:
            group.counters.add("requests")
            group.to_ranks(m.RankRecv(request_id=request_id, generation=generation,
                                      page=record.page, peer_node=peer.node_id, blocks=blocks,
                                      kv_tokens=tokens if blocks else 0))
            self.router.sent(key, tokens)
            c.send_dealer(peer.sock, m.TransferRequest(request_id=request_id,
                                                       generation=generation, prompt=prompt,
                                                       kv_blocks=blocks,
                                                       prefix_cache=self.router.enabled))
        return key

    def grow(self, request_id: str, tokens: int) -> tuple[int, ...]:
        """Loop thread: make a DONE request's KV block table hold ``tokens`` tokens (decoding
        appends tokens); new blocks come right after its last one where free. Returns the
        whole table. :class:`CacheFullError` naming wanted / free / total blocks when short
        (nothing taken); InvalidRequestError for an id that is not a DONE request."""
        group = self.group
        key = self.current.get(request_id)
        record = group.ledger.get(key) if key is not None else None
        if record is None or record.phase is not Phase.DONE:
            raise InvalidRequestError(f"no completed request {request_id!r} to grow",
                                      request_id=request_id)
        if group.spec.kv is None:
            raise InvalidRequestError(f"{group.node_id} serves a spec without attention KV",
                                      request_id=request_id)
        group.ledger.grow(record, blocks_for(tokens, group.block_size))
        return tuple(record.blocks)

    def free(self, request_id: str) -> bool:
        """Loop thread: the caller is done with a DONE request's page (its id may be reused);
        False if ``request_id`` is not a DONE request."""
        key = self.current.get(request_id)
        record = self.group.ledger.get(key) if key is not None else None
        if record is None or record.phase is not Phase.DONE:
            return False
        self.group.ledger.free(record)
        del self.current[request_id]
        return True

    def cancel(self, request_id: str, reason: str = "aborted by caller") -> bool:
        """Loop thread: abort a request in flight (its callback gets AbortedError); False if it
        is not in flight."""
        key = self.current.get(request_id)
        record = self.group.ledger.get(key) if key is not None else None
        # (In flight: ACTIVE, or DONE while its transfer digests are still to come.)
        if record is None or record.phase is Phase.FAILED or record.result is not None:
            return False
        self._fail(record, FailureKind.ABORTED, reason, notify=True)
        return True

    def result(self, request_id: str) -> "TransferResult | None":
        """Loop thread: the result of a DONE request not yet freed."""
        key = self.current.get(request_id)
        record = self.group.ledger.get(key) if key is not None else None
        return record.result if record is not None and record.phase is Phase.DONE else None

    # -- requests: from any thread (one hand-off to the loop thread each) ----------------------
    def submit(self, request_id: str, prompt: Sequence[int], *,
               prefill: str | None = None) -> concurrent.futures.Future:
        """:meth:`start` from any thread; the future resolves to a :class:`TransferResult` or
        a typed error. Refusals raise here (one thread hand-off)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        prompt = _packed(request_id, prompt)
        self.group.loop.call(lambda: self._start(request_id, prompt, _resolver(future),
                                                 prefill=prefill))
        return future

    def submit_local(self, request_id: str, prompt: Sequence[int]) -> concurrent.futures.Future:
        """Compute the state of ``prompt`` on the decode ranks themselves (the ``recompute``
        policy when a transfer failed); resolves like :meth:`submit`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        prompt = _packed(request_id, prompt)
        self.group.loop.call(lambda: self._start(request_id, prompt, _resolver(future),
                                                 local=True))
        return future

    def abort(self, request_id: str, reason: str = "aborted by caller") -> None:
        """Abort a request in flight: its future fails with AbortedError."""
        self.group.loop.call(self.cancel, request_id, reason)

    def release(self, result: "TransferResult | str") -> None:
        """The caller is done with a completed request's page."""
        self.release_many([result])

    def release_many(self, results: Sequence["TransferResult | str"]) -> None:
        """:meth:`release` for many completed requests in one hop to the loop thread; raises
        InvalidRequestError naming the ids that were not completed requests (the others are
        freed)."""
        ids = [r if isinstance(r, str) else r.request_id for r in results]

        def run() -> None:
            unknown = [rid for rid in ids if not self.free(rid)]
            if unknown:
                raise InvalidRequestError(
                    f"no completed request {unknown[:5]!r}"
                    f"{f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else ''} to release")
        if ids:
            self.group.loop.call(run)

    # -- request lifecycle --------------------------------------------------------------------
    def rank_done(self, rank: int, msg: m.RankDone, record: Record,
                  failure: FailureKind | None) -> None:
        if failure is not None:
            self._fail(record, failure, f"decode rank {rank}: {msg.message}", notify=True)
        self._settle(record)

    def _on_transfer_digest(self, peer: _Prefill, msg: m.TransferDigest) -> None:
        group = self.group
        record = group.ledger.get(RequestKey(peer.node_id, msg.request_id, msg.generation))
        if record is None or record.failure is not None or not group.config.verify_transfers:
            group.counters.add("stale_messages")
            return
        if len(msg.digests) != group.tp_size:
            self._fail(record, FailureKind.TRANSFER_ERROR,
                       f"prefill {peer.node_id} sent {len(msg.digests)} transfer digests for "
                       f"{group.tp_size} decode ranks", notify=True)
            return
        self._expected[record.key] = msg.digests
        self._settle(record)

    def _verified(self, record: Record) -> bool:
        """A DONE request of a verified link: whether what every rank reports having landed
        matches what the prefill node sent (else the request fails with ``transfer_error``
        naming the request, the rank and both digests, and the mismatch is counted). False
        also while the prefill node's digests are still to come."""
        group = self.group
        expected = self._expected.get(record.key)
        if expected is None:
            return False
        del self._expected[record.key]
        bad = [(r, expected[r], record.done[r].digest) for r in range(group.tp_size)
               if record.done[r].digest != expected[r]]
        group.counters.add("transfer_digests_checked", group.tp_size)
        if not bad:
            return True
        group.counters.add("transfer_digest_mismatches", len(bad))
        what = "; ".join(f"decode rank {r}: expected {e:#018x}, got "
                         f"{g:#018x}" if g >= 0 else f"decode rank {r}: expected {e:#018x}, "
                         f"got none" for r, e, g in bad)
        message = (f"transfer checksum mismatch of request {record.request_id!r} from "
                   f"prefill {record.peer_node}: {what}")
        log.error("%s: %s", group.node_id, message)
        group.fail_on_ranks(record, FailureKind.TRANSFER_ERROR, message)   # (none to cancel)
        self._report(record, None, error_for(FailureKind.TRANSFER_ERROR, message,
                                             request_id=record.request_id,
                                             peer=record.peer_node or None))
        self._settle(record)                    # quiet: every rank answered; freed now
        return False

    def _fail(self, record: Record, kind: FailureKind, message: str, *, notify: bool,
              lost_node: str = "") -> None:
        # (A DONE request whose digests are still to come is not reported yet: it fails.)
        if record.phase is Phase.DONE and record.result is not None \
                or not self.group.fail_on_ranks(record, kind, message, lost_node):
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
        group = self.group
        if not group.ledger.quiet(record) or record.result is not None:
            return
        if record.phase is Phase.FAILED:
            self._expected.pop(record.key, None)
            if group.ledger.free(record) and self.current.get(record.request_id) == record.key:
                del self.current[record.request_id]
            return
        if record.phase is not Phase.DONE:
            return
        if record.peer is not None and group.config.verify_transfers \
                and not self._verified(record):
            return              # digests still to come (or it failed: reported and freed)
        done = [record.done[r] for r in range(group.tp_size)]
        result = record.result = TransferResult(
            request_id=record.request_id, generation=record.generation, page=record.page,
            prefill_node=record.peer_node, seconds=time.perf_counter() - record.started,
            nbytes=sum(d.nbytes for d in done), blocks=tuple(record.blocks),
            landed_at=max(d.landed_at for d in done))
        group.counters.add("transfers_ok")
        group.counters.add("bytes", result.nbytes)
        if self.timing.wanted:
            self.timing.decode_half(record, done, result)
        self._report(record, result, None)

    def _report(self, record: Record, result: "TransferResult | None",
                error: "TransferError | None") -> None:
        on_done = self._callbacks.pop(record.key, None)
        if on_done is None:
            return
        try:
            on_done(result, error)
        except Exception:  # noqa: BLE001 -- the caller's callback must not break the ledger
            log.exception("%s: on_done of %s failed", self.group.node_id, record.key)

    def _in_flight(self) -> int:
        return sum(1 for r in self.group.ledger if r.phase is not Phase.DONE)

    # -- what the group tells us (group.GroupEvents) ---------------------------------------------
    def peer_message(self, identity: bytes, msg: m.Message) -> None:
        """Nobody but our ranks talks to our ROUTER: counted."""
        self.group.counters.add("unexpected_messages")

    def tick(self) -> None:
        self.links.tick()
        now = time.monotonic()
        self.timing.expire(now)
        config = self.group.config
        for record in self.group.ledger:
            if record.phase is Phase.DONE and record.result is None \
                    and now > record.deadline + config.peer_timeout:
                # Every decode rank holds the state; the prefill node's digests never came.
                self._fail(record, FailureKind.TIMEOUT,
                           f"no transfer digests from prefill {record.peer_node} within "
                           f"{config.transfer_timeout} s", notify=True)
            elif record.phase is Phase.ACTIVE and now > record.deadline + config.peer_timeout:
                # The ranks enforce transfer_timeout themselves; this catches a rank that never
                # answers at all.
                self._fail(record, FailureKind.TIMEOUT,
                           f"no answer within {config.transfer_timeout} s", notify=True)

    def rank_lost(self, rank: int) -> None:
        for record in self.group.ledger:
            self._fail(record, FailureKind.PEER_LOST,
                       f"decode rank {rank} of {self.group.node_id} died", notify=True)
            self._settle(record)

    def group_down(self, why: str) -> None:
        """Every request has failed (and its prefill server heard Abort): the prefill
        connections end with a Goodbye; the kept addresses are re-dialed once the group is
        whole again."""
        self.links.hang_up(why, lost=True)
        self.router.reset()

    def group_reset(self) -> None:
        self._expected.clear()                 # of the old ledger's requests
        for key in list(self._callbacks):          # (none: every request failed already)
            on_done = self._callbacks.pop(key)
            on_done(None, PeerLostError(f"decode group {self.group.node_id} restarted",
                                        request_id=key.request_id))
        self.current.clear()

    def group_restarted(self) -> None:
        self.links.redial_now()

    def closing(self) -> None:
        for record in self.group.ledger:
            self._fail(record, FailureKind.ABORTED, f"{self.group.node_id} closing",
                       notify=True)
        self.links.close()

    # -- introspection, shutdown -----------------------------------------------------------------
    def stats(self) -> dict:
        group = self.group

        def collect():
            return {**group.page_stats(self._in_flight()),
                    "completed_unreleased": sum(1 for r in group.ledger
                                                if r.phase is Phase.DONE),
                    "prefills": self.ready_prefills(),
                    "prefill_nodes": {n: {"prefix": self.router.node_stats(n)}
                                      for n in self.ready_prefills()},
                    "prefix_routed": self.router.routed,
                    "prefix_routed_tokens": self.router.routed_tokens,
                    "healthy": group.healthy, "generation": group.generation,
                    **group.counters.snapshot()}
        return group.loop.call(collect)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _resolver(future: concurrent.futures.Future) -> OnDone:
    def on_done(result: "TransferResult | None", error: "TransferError | None") -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    return on_done


def _packed(request_id: str, prompt: Sequence[int]) -> bytes:
    """A caller's prompt as token bytes (:func:`~statebridge.connector.messages.pack_tokens`),
    or InvalidRequestError naming the request and the first bad id."""
    try:
        return m.pack_tokens(prompt)
    except ValueError as e:
        raise InvalidRequestError(f"prompt of {request_id!r}: {e}",
                                  request_id=str(request_id)) from None
