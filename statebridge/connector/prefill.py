"""The prefill side: a server that decode groups connect to, and its TP rank processes.

Runs in the prefill node's main process (:class:`PrefillServer`) and in each prefill rank
process (:class:`~statebridge.connector.rank.RankWorker` with role ``"prefill"``).

Per request (N-1 protocol)::

    decode --TransferRequest--> server: allocate one page id (same on every rank)
                                server --RankPrefill--> every rank: compute state, send runs
                                every rank --RankDone--> server (sends complete or failed):
                                page freed (the decode side took every byte or failed)
    decode <--TransferTimes--   server: when it happened on the ranks (the decode side's
                                metrics; nothing waits for it)

With attention KV (``spec.kv``) the request also carries the decode side's block table
(``TransferRequest.kv_blocks``); the server allocates as many blocks of its own with the page
(a request waits for pages AND blocks), always ONE range of consecutive ids, so the decode
ranks know the runs from their own table alone (the runs' sizes and order depend on where
either table breaks, not on where the source range starts) and post their KV receives with
the recurrent ones, without a round trip. Its ranks send the KV runs after the recurrent ones.
The blocks are freed with the page.

With its prefix cache on (``prefix_cache``; :mod:`~statebridge.connector.prefill_cache`), a
request may start from a cached checkpoint (``RankPrefill.cached_tokens``: the ranks copy its
state and KV into the request's own page and range, so the transfer is unchanged) and leaves
checkpoints of its own; its full blocks the cache adopts are not freed with the page.
``TransferTimes.cached_tokens`` says how many tokens were not computed, and the decode peers
hear what the cache holds (``PrefixAnnounce``: in full after the handshake, then the changes
with the heartbeats).

The page is held under a lease of ``lease_timeout`` seconds from when its state is final (the
ranks posted the sends; queueing and compute do not count): if the sends do not complete in
time (the decode side vanished before posting its receives), each rank cancels its own and
reports the timeout, and the page is freed once every rank confirmed. A decode peer that goes silent for ``peer_timeout``
seconds (or says Goodbye) has all its requests cancelled; a prefill rank that dies fails every
request in flight with ``peer_lost``, and the server says Goodbye to its decode peers while its
group restarts (or failed: see :mod:`~statebridge.connector.group`). A server whose group is
not whole refuses handshakes (``Reject`` code ``not_ready``, naming the missing ranks): decode
nodes re-dial until it is whole again. A Heartbeat from a connection the server does not know
(it dropped that peer, e.g. after the peer was silent) is answered with Goodbye, so the peer
learns at once that it must handshake again.
"""

from __future__ import annotations

import collections
import math
import logging
from typing import Any, Callable

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.group import RankGroup, delegate_to_group
from statebridge.connector.ledger import Phase, Record, RequestKey
from statebridge.connector.prefill_cache import PrefillPrefix
from statebridge.errors import CacheFullError, FailureKind, IncompatiblePeerError
from statebridge.state.prefix import DEFAULT_CHECKPOINT_TOKENS
from statebridge.state.kv import blocks_for

log = logging.getLogger(__name__)

__all__ = ["PrefillServer"]


class _Peer:
    """One decode node's connection (a ROUTER identity)."""

    def __init__(self, identity: bytes, node_id: str) -> None:
        self.identity = identity
        self.node_id = node_id
        self.hello = False
        self.connected = False
        self.inflight = 0
        self.heartbeats = 0


@delegate_to_group("node_id", "address", "supervisor.fatal", "wait_ready", "whole", "close")
class PrefillServer:
    """The prefill group's coordinator: handshake, requests, leases, liveness.

    It *has* ``group``, its :class:`~statebridge.connector.group.RankGroup` (it is that
    group's :class:`~statebridge.connector.group.GroupEvents`); the constructor takes the
    group's arguments (``spec, tp_size, layout, num_pages`` and the keywords of
    :class:`~statebridge.connector.group.RankGroup`), builds the group, then its own state,
    then starts the group. Requests live in the group's ledger (``server.group.ledger``) keyed
    by ``RequestKey(decode node id, request id, generation)``; a record's ``peer`` is the
    :class:`_Peer` connection it came from. ``node_id``, ``address`` (where decode nodes
    connect), ``fatal``, ``wait_ready``, ``whole`` and ``close`` are the group's.

    It *has* ``prefix`` (:class:`~statebridge.connector.prefill_cache.PrefillPrefix`), its
    prefix cache: ``prefix_cache`` turns it on (off by default; the node turns it on),
    ``prefix_stride`` tokens between checkpoints, ``prefix_cache_bytes`` per rank (None: half
    of the pages and blocks).
    """

    role = "prefill"

    def __init__(self, spec, tp_size: int, layout, num_pages: int, *,
                 prefix_cache: bool = False, prefix_stride: int = DEFAULT_CHECKPOINT_TOKENS,
                 prefix_cache_bytes: int | None = None, **group_options: Any) -> None:
        self.group = group = RankGroup(self, self.role, spec, tp_size, layout, num_pages,
                                       **group_options)
        model = group_options.get("model_dir") or group_options.get("model") or ""
        self.prefix = PrefillPrefix(group, enabled=prefix_cache, stride=prefix_stride,
                                    cache_bytes=prefix_cache_bytes, model=str(model))
        self.peers: dict[bytes, _Peer] = {}
        self.waiting: collections.deque[tuple[_Peer, m.TransferRequest]] = collections.deque()
        self._announcing = False                 # an announcement is due this loop iteration
        self.peer_watch = c.PeerWatch(group.config.peer_timeout, group.loop)
        self._queries: dict[type, Callable[[m.Message], m.Message]] = {}
        #: Transfer verification: request -> rank -> the digests it sends each decode rank
        #: (until every rank reported; then their sums go to the decode node).
        self._digests: dict[RequestKey, dict[int, tuple[int, ...]]] = {}
        group.on_rank_message(m.RankDigest, self._on_rank_digest)
        group.start()

    def on_query(self, msg_type: type, handler: "Callable[[m.Message], m.Message]") -> None:
        """Answer ``msg_type`` from any connection (no handshake needed) with
        ``handler(msg)``, on the loop thread: a layer above the connector (the prefill node)
        answers its status and stats queries this way. Call before the server is used."""
        self._queries[msg_type] = handler

    # -- decode peers (on the group's ROUTER: group.GroupEvents) ---------------------------------
    def peer_message(self, identity: bytes, msg: m.Message) -> None:
        peer = self.peers.get(identity)
        if self.group.closed and isinstance(msg, (m.Hello, m.GroupInfo)):
            # Goodbye is sent: a decode node re-dialing now must not be connected anew.
            c.send_router(self.group.router, identity, m.Reject(
                code="closing", reason=f"prefill server {self.group.node_id} is closing"))
            return
        if isinstance(msg, (m.Hello, m.GroupInfo)):
            whole, why = self.whole()
            if not whole:
                # Not whole (starting, restarting, failed): the decode node re-dials.
                self.group.counters.add("refused_not_ready")
                c.send_router(self.group.router, identity, m.Reject(code="not_ready", reason=why))
                return
        if isinstance(msg, m.Hello):
            self._on_hello(identity, msg)
            return
        query = self._queries.get(type(msg))
        if query is not None:
            c.send_router(self.group.router, identity, query(msg))
            return
        if peer is None and isinstance(msg, m.Heartbeat):
            # A connection we dropped (or never knew) still heartbeats: tell it to handshake.
            self.group.counters.add("unknown_peers")
            c.send_router(self.group.router, identity, m.Goodbye(node_id=self.group.node_id))
            return
        if peer is None or not peer.hello:
            self.group.counters.add("protocol_errors")
            c.send_router(self.group.router, identity, m.Error(
                kind="ProtocolError", message=f"{type(msg).__name__} before Hello"))
            return
        self.peer_watch.heard(identity)
        if isinstance(msg, m.GroupInfo):
            self._on_group_info(identity, msg)
        elif isinstance(msg, m.TransferRequest):
            self._on_transfer_request(peer, msg)
        elif isinstance(msg, m.Abort):
            record = self._record(peer, msg.request_id, msg.generation)
            if record is not None:
                self.group.counters.add("aborted_by_peer")
                self._fail(record, FailureKind.ABORTED, f"aborted by decode: {msg.reason}",
                           notify=False)
            elif not self._drop_waiting(peer, msg.request_id, msg.generation):
                self.group.counters.add("stale_aborts")        # finished (or failed) already
        elif isinstance(msg, m.Goodbye):
            self._peer_lost(identity, "said goodbye")
        elif isinstance(msg, m.Heartbeat):
            pass
        else:
            self.group.counters.add("unexpected_messages")

    def _on_hello(self, identity: bytes, msg: m.Hello) -> None:
        expected = m.compat_hash(self.group.spec.to_json())
        if msg.compat_hash != expected or msg.role != "decode":
            self.group.counters.add("incompatible_peers")
            reason = (f"compat hash {msg.compat_hash!r} != {expected!r}"
                      if msg.compat_hash != expected else f"role {msg.role!r} is not 'decode'")
            log.warning("%s: rejected %s: %s", self.group.node_id, msg.node_id, reason)
            c.send_router(self.group.router, identity, m.Reject(code="incompatible", reason=reason))
            return
        peer = self.peers.get(identity) or _Peer(identity, msg.node_id)
        peer.hello = True
        self.peers[identity] = peer
        self.peer_watch.heard(identity)
        c.send_router(self.group.router, identity,
                      m.Hello(compat_hash=expected, node_id=self.group.node_id, role=self.role))

    def _on_group_info(self, identity: bytes, info: m.GroupInfo) -> None:
        try:
            self.group.handshake.check_peer_info(info)
        except IncompatiblePeerError as e:
            self.group.counters.add("incompatible_peers")
            c.send_router(self.group.router, identity, m.Reject(code="incompatible", reason=str(e)))
            return
        self._connect_peer(identity, info)

    def _connect_peer(self, identity: bytes, info: m.GroupInfo) -> None:
        peer = self.peers[identity]
        # A decode node that re-dials (it lost us, e.g. a cut link) comes back on a new socket
        # with the same node id. Its old connection is dead: drop it first, so the ranks fail
        # its endpoints (RankCancel with lost_node) BEFORE the GroupInfo below makes new ones.
        for old in [p for i, p in self.peers.items()
                    if i != identity and p.node_id == info.node_id]:
            self._peer_lost(old.identity, "superseded by a new connection")
        peer.node_id = info.node_id
        self.group.to_ranks(self.group.handshake.rank_connect(info))
        peer.connected = True
        log.info("%s: decode group %s connected (TP %d, %s)", self.group.node_id, info.node_id,
                 info.tp_size, info.layout)
        c.send_router(self.group.router, identity,
                      self.prefix.group_info(self.group.group_info()))
        snapshot = self.prefix.snapshot()         # what its router starts from
        if snapshot is not None:
            c.send_router(self.group.router, identity, snapshot)

    # -- requests ----------------------------------------------------------------------------------
    def _record(self, peer: _Peer, request_id: str, generation: int) -> Record | None:
        record = self.group.ledger.get(RequestKey(peer.node_id, request_id, generation))
        return record if record is not None and record.peer is peer else None

    def _on_transfer_request(self, peer: _Peer, msg: m.TransferRequest) -> None:
        if not peer.connected:
            self._reject(peer, msg, FailureKind.TRANSFER_ERROR, "TransferRequest before GroupInfo")
            return
        whole, why = self.group.whole()
        if not whole:
            self._reject(peer, msg, FailureKind.PEER_LOST, why)
            return
        if RequestKey(peer.node_id, msg.request_id, msg.generation) in self.group.ledger:
            self.group.counters.add("duplicate_requests")
            return
        if self.group.spec.kv is None and msg.kv_blocks:
            self._reject(peer, msg, FailureKind.INVALID_REQUEST,
                         f"{len(msg.kv_blocks)} KV blocks for a spec without attention KV")
            return
        if self.group.spec.kv is not None:
            tokens = m.token_count(msg.prompt)
            need = blocks_for(tokens, self.group.block_size)
            if len(msg.kv_blocks) != need:
                self._reject(peer, msg, FailureKind.INVALID_REQUEST,
                             f"{len(msg.kv_blocks)} KV blocks for a prompt of {tokens} tokens "
                             f"(needs {need} of {self.group.block_size})")
                return
            if need > self.group.num_blocks:
                self._reject(peer, msg, FailureKind.BUSY,
                             f"{need} KV blocks wanted, {self.group.blocks.num_free} free of "
                             f"{self.group.num_blocks}: the prompt never fits")
                return
        limit = self.group.config.max_inflight_per_peer
        if peer.inflight >= limit:
            self._reject(peer, msg, FailureKind.BUSY, f"{peer.inflight} requests in flight from "
                                                      f"{peer.node_id} (limit {limit})")
            return
        if not self._fits(msg) or self.waiting:
            # Queued requests count against the peer's limit too: the queue stays bounded.
            # (FIFO: behind a waiting request; for specs without KV the queue is non-empty
            # only while no page is free.)
            queued = sum(1 for p, _ in self.waiting if p is peer)
            if peer.inflight + queued >= limit:
                self._reject(peer, msg, FailureKind.BUSY,
                             f"{peer.inflight} requests in flight and {queued} queued from "
                             f"{peer.node_id} (limit {limit})")
                return
            self.group.counters.add("waiting_for_pages" if not self.group.pool.num_free
                              else "waiting_for_blocks")
            self.waiting.append((peer, msg))               # back-pressure, not a failure
            return
        self._start(peer, msg)

    def _start(self, peer: _Peer, msg: m.TransferRequest) -> None:
        key = RequestKey(peer.node_id, msg.request_id, msg.generation)
        try:
            record = self.group.ledger.open(key, math.inf, peer,        # the ranks hold the lease
                                      num_blocks=len(msg.kv_blocks), contiguous=True)
        except CacheFullError:                    # callers checked; never lose the request
            self.waiting.appendleft((peer, msg))
            return
        peer.inflight += 1
        self.group.counters.add("requests")
        src_blocks = tuple(record.blocks)
        self.group.to_ranks(m.RankPrefill(request_id=msg.request_id, generation=msg.generation,
                                    prompt=msg.prompt, src_page=record.page,
                                    peer_node=peer.node_id, src_blocks=src_blocks,
                                    dst_blocks=msg.kv_blocks, kv_tokens=m.token_count(msg.prompt)
                                    if self.group.spec.kv is not None else 0,
                                    **self.prefix.plan(msg, record)))

    def _fits(self, msg: m.TransferRequest) -> bool:
        """Whether a page and the request's KV blocks (one range) are free now (the prefix
        cache gives up unpinned units for them)."""
        return self.prefix.admit(len(msg.kv_blocks))

    def _reject(self, peer: _Peer, msg: m.TransferRequest, kind: FailureKind,
                reason: str) -> None:
        self.group.counters.add(f"rejected_{kind}")
        c.send_router(self.group.router, peer.identity, m.TransferFailed(
            request_id=msg.request_id, generation=msg.generation, kind=kind.value,
            message=reason))

    def _drop_waiting(self, peer: _Peer, request_id: str, generation: int) -> bool:
        """Drop a queued request; False if it was not queued."""
        before = len(self.waiting)
        self.waiting = collections.deque(
            (p, w) for p, w in self.waiting
            if not (p is peer and w.request_id == request_id and w.generation == generation))
        return len(self.waiting) < before

    def rank_done(self, rank: int, msg: m.RankDone, record: Record,
                  failure: FailureKind | None) -> None:
        if failure is not None:
            if failure is FailureKind.TIMEOUT:    # a rank's lease on its sends ended
                self.group.counters.add("leases_expired")
            self._fail(record, failure, f"prefill rank {rank}: {msg.message}", notify=True)
        self._maybe_free(record)

    def _on_rank_digest(self, rank: int, msg: m.RankDigest) -> None:
        """A rank's digests of what it sends for a request (a decode group that verifies):
        once every rank's are in, their sums by decode rank go to the decode node."""
        key = RequestKey(msg.peer_node, msg.request_id, msg.generation)
        record = self.group.ledger.get(key)
        if record is None or record.failure is not None:
            self.group.counters.add("stale_digests")
            return
        self.group.counters.add("transfer_digests")
        by_rank = self._digests.setdefault(key, {})
        by_rank[rank] = msg.digests
        if len(by_rank) < self.group.tp_size:
            return
        del self._digests[key]
        sizes = {len(d) for d in by_rank.values()}
        if len(sizes) != 1:
            self._fail(record, FailureKind.TRANSFER_ERROR,
                       f"prefill ranks sent digests for {sorted(sizes)} decode ranks",
                       notify=True)
            return
        sums = tuple(sum(col) & ((1 << 64) - 1) for col in zip(*by_rank.values()))
        peer = record.peer
        if self.peers.get(peer.identity) is peer:
            c.send_router(self.group.router, peer.identity, m.TransferDigest(
                request_id=msg.request_id, generation=msg.generation, digests=sums))

    def _fail(self, record: Record, kind: FailureKind, message: str, *, notify: bool,
              lost_node: str = "") -> None:
        """Cancel ``record`` on every rank still working on it; tell the decode peer."""
        if not self.group.fail_on_ranks(record, kind, message, lost_node):
            return
        peer = record.peer
        if notify and self.peers.get(peer.identity) is peer:
            c.send_router(self.group.router, peer.identity, m.TransferFailed(
                request_id=record.request_id, generation=record.generation, kind=kind.value,
                message=message))
        self._maybe_free(record)

    def _maybe_free(self, record: Record) -> None:
        """Free the page once no rank can still send from it: every rank's sends completed
        (the request is DONE) or the request failed and every live rank confirmed."""
        if not self.group.ledger.quiet(record) or record.phase is Phase.ACTIVE:
            return
        if self.group.ledger.get(record.key) is not record:
            return                                   # freed already (callers may re-check)
        if self.prefix.settle(record, record.phase is Phase.DONE) and not self._announcing:
            self._announcing = True                  # new checkpoints: routers hear them at the
            self.group.loop.call_later(0.0, self._announce_now)  # end of this loop iteration
        self.group.ledger.free(record)
        cached_tokens = self.prefix.release(record)
        self._digests.pop(record.key, None)
        record.peer.inflight -= 1
        if record.phase is Phase.DONE and self.peers.get(record.peer.identity) is record.peer:
            self._send_times(record, cached_tokens)
        self._start_waiting()

    def _send_times(self, record: Record, cached_tokens: int = 0) -> None:
        """Tell the decode peer when its request's events happened on our ranks (its
        metrics; one row per request, coalesced with the others of this loop iteration)."""
        done = record.done.values()
        c.send_router(self.group.router, record.peer.identity, m.TransferTimes(
            request_id=record.request_id, generation=record.generation,
            computed_from=min((d.computed_from for d in done if d.computed_from), default=0.0),
            state_final_at=max((d.state_final_at for d in done), default=0.0),
            posted_at=min((d.posted_at for d in done if d.posted_at), default=0.0),
            cached_tokens=cached_tokens))

    def _start_waiting(self) -> None:
        while self.group.healthy and self.waiting and self._fits(self.waiting[0][1]):
            peer, msg = self.waiting.popleft()                  # broken: rejected instead
            if self.peers.get(peer.identity) is peer:
                self._start(peer, msg)

    # -- liveness (group.GroupEvents) ------------------------------------------------------------
    def tick(self) -> None:
        for identity, peer in list(self.peers.items()):
            if peer.hello:
                peer.heartbeats += 1
                c.send_router(self.group.router, identity,
                              m.Heartbeat(node_id=self.group.node_id, seq=peer.heartbeats))
        self._announce(self.prefix.changes())        # evictions since the last
        for identity in self.peer_watch.expired():
            self._peer_lost(identity, f"silent for {self.group.config.peer_timeout} s")

    def _announce_now(self) -> None:
        """The checkpoints that requests ended with since the last (one message for those of
        a loop iteration), not at the next heartbeat: a chat's next turn is routed by them."""
        self._announcing = False
        self._announce(self.prefix.changes())

    def _announce(self, announce: m.PrefixAnnounce | None) -> None:
        """``announce`` (drained once) to every decode peer past its handshake."""
        if announce is None:
            return
        for identity, peer in list(self.peers.items()):
            if peer.hello and peer.connected:
                c.send_router(self.group.router, identity, announce)

    def _peer_lost(self, identity: bytes, why: str) -> None:
        peer = self.peers.pop(identity, None)
        self.peer_watch.forget(identity)
        if peer is None:
            return
        self.group.counters.add("peers_lost")
        log.warning("%s: decode peer %s lost (%s)", self.group.node_id, peer.node_id, why)
        self.waiting = collections.deque((p, w) for p, w in self.waiting if p is not peer)
        for record in self.group.ledger:
            if record.peer is peer:
                self._fail(record, FailureKind.PEER_LOST,
                           f"decode peer {peer.node_id} lost ({why})", notify=False,
                           lost_node=peer.node_id)
                # The peer cannot complete it any more; free once the ranks confirmed.
                self._maybe_free(record)

    def rank_lost(self, rank: int) -> None:
        for record in self.group.ledger:
            self._fail(record, FailureKind.PEER_LOST,
                       f"prefill rank {rank} of {self.group.node_id} died", notify=True)
            self._maybe_free(record)
        for peer, msg in list(self.waiting):
            if self.peers.get(peer.identity) is peer:
                self._reject(peer, msg, FailureKind.PEER_LOST,
                             f"prefill group {self.group.node_id} lost a rank")
        self.waiting.clear()

    def group_down(self, why: str) -> None:
        """Every request has failed; the decode peers hear Goodbye and re-dial (refused while
        the group is not whole)."""
        for identity in list(self.peers):
            c.send_router(self.group.router, identity, m.Goodbye(node_id=self.group.node_id))
            self._peer_lost(identity, why)

    def group_reset(self) -> None:
        self._digests.clear()                  # of the old ledger's requests
        self.prefix.reset()                    # fresh pools: the cache starts empty

    def group_restarted(self) -> None:
        """Nothing to do: decode nodes re-dial us (refused while the group was not whole)."""

    def closing(self) -> None:
        for identity in list(self.peers):
            c.send_router(self.group.router, identity, m.Goodbye(node_id=self.group.node_id))

    # -- introspection (thread-safe) -----------------------------------------------------------
    def stats(self) -> dict:
        group = self.group

        def collect():
            pages = group.page_stats()
            prefix = self.prefix.stats()
            # pages and blocks the cache holds are not in use by requests
            pages["pages_used"] -= prefix["pages_cached"]
            pages["blocks_used"] -= prefix["blocks_cached"]
            return {**pages,
                    "waiting": len(self.waiting), "peers": len(self.peers),
                    "healthy": group.healthy, "generation": group.generation,
                    "ready": group.whole()[0], "reason": group.whole()[1],
                    **group.counters.snapshot(), **prefix}
        return group.loop.call(collect)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
