"""A rank's worker: the loop serving its coordinator (see the package docstring)."""

from __future__ import annotations

import functools
import logging
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from statebridge.connector import control as c
from statebridge.connector.local import LocalDealer
from statebridge.connector import messages as m
from statebridge.connector.data import RunTemplate, shared
from statebridge.connector.data.shared import (
    NOTICE_BYTES,
    MapSide,
    NoticeSlots,
    map_threshold,
    next_serial,
)
from statebridge.connector.data.tags import READY_INDEX
from statebridge.connector.ledger import RequestKey
from statebridge.connector.rank import KVBlocks, RankModel, RankSetup, kv_checksum, load_callable
from statebridge.connector.opcounts import counter as _op_counter
from statebridge.errors import FailureKind, ProtocolError, StatebridgeError, kind_of
from statebridge.net import same_host
from statebridge.security import CurveKeys
from statebridge.state.cache import StateCache, page_checksum
from statebridge.state.kv import BlockGeometry, KVPairPlan, KVPlan, blocks_for, range_start
from statebridge.state.layout import PageGeometry
from statebridge.state.plan import PairPlan, TransferPlan
from statebridge.state.spec import StateSpec

log = logging.getLogger(__name__)

__all__ = ["RankWorker"]


@dataclass(frozen=True)
class _Route:
    """One rank pair of this rank with a peer node, fixed per peer: the pair's plan, the other
    rank, its UCX peer id, and the zero-copy runs as a template (None for a staged pair, whose
    single message is ``staged_bytes`` long)."""

    pair: PairPlan
    peer_rank: int
    peer: str
    template: "RunTemplate | None"
    staged_bytes: int
    shm: bool = False                  # read out of the prefill rank's shared map (zero-copy)


@dataclass(frozen=True)
class _KVRoute:
    """One KV rank pair of this rank with a peer node: the pair's plan (runs per request from
    both block tables), the other rank, its UCX peer id, and the tag index of its first run
    (after the recurrent pair's zero-copy runs, so the two posts never share a tag)."""

    pair: KVPairPlan
    peer_rank: int
    peer: str
    index0: int
    shm: bool = False                  # read out of the prefill rank's shared map
    #: (block count, column) -> the checked runs of blocks [0, count) (see template())
    _templates: dict = field(default_factory=dict, repr=False, compare=False)

    def template(self, blocks: int, col: int) -> RunTemplate:
        """The pair's runs for ``blocks`` consecutive blocks on both sides, relative to the
        first block, checked once per block count (a request posts them at its block base)."""
        key = (blocks, col)
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= _KV_TEMPLATES:
                self._templates.clear()
            template = self._templates[key] = RunTemplate(self.pair.contiguous_runs(blocks),
                                                          col, "KV runs")
        return template


@dataclass
class _Read:
    """A decode rank's shared-map read of one request from one prefill rank: its "ready"
    receive, then the copy of the pair's recurrent runs and KV runs out of the mapping."""

    pending: "_Pending"
    peer_rank: int
    peer: str
    handle: object                     # the "ready" notice's TransferHandle
    slot: "shared.NoticeSlot"          # where the notice lands in this rank's buffer


@dataclass
class _Pending:
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
    attended: bool = True              # needs this rank's progress to finish (see _before_sleep)
    unread: int = 0                    # decode rank: shared-map reads not yet copied
    first_block: int | None = None     # decode rank: its table's first id when one range
    #: prefill rank: the notice slots its shared-map readers answer in (slot, peer), and the
    #: request's serial they write there
    answers: list = field(default_factory=list)
    serial: int = 0


class RankWorker:
    """One rank's connector: cache + transport + a loop serving its coordinator."""

    def __init__(self, setup: RankSetup) -> None:
        from statebridge.connector.data import Transport, alloc_buffer  # imports ucxx

        self.setup = setup
        self.config = setup.config
        self.spec = StateSpec.from_json(setup.spec_json)
        self.geometry = PageGeometry(self.spec, setup.tp_size, setup.layout,
                                     region_align=setup.region_align)
        # ONE buffer: the pages, then (spec with KV) the KV block pool from ``kv_base`` (the
        # pages' bytes rounded up to 64). The transport is bound to all of it, so KV runs are
        # plain absolute offsets. Huge-page backed: shared-memory transfers run ~1.5-2x
        # faster from it.
        pages_bytes = self.geometry.page_size * setup.num_pages
        self.kv_geometry: BlockGeometry | None = None
        if self.spec.kv is not None and setup.num_blocks:
            self.kv_geometry = BlockGeometry(self.spec.kv, setup.tp_size, setup.kv_layout,
                                             setup.block_size, setup.num_blocks)
        self.kv_base = -(-pages_bytes // 64) * 64 if self.kv_geometry else pages_bytes
        kv_bytes = self.kv_geometry.nbytes if self.kv_geometry else 0
        # Last, a slot per (page, peer rank) for the notices of shared-map reads, from a page
        # boundary: decode ranks map these words (and nothing before them) writable to answer.
        self.ctl_base = -(-(self.kv_base + kv_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        nbytes = self.ctl_base + NoticeSlots.nbytes(setup.num_pages)
        #: A prefill rank's buffer is a memfd that same-host decode ranks map and read when
        #: some decode group could (the shared-map rule); otherwise huge-page-backed
        #: anonymous memory.
        self.shared_buffer: shared.SharedBuffer | None = None
        if setup.role == "prefill" and map_threshold(self._map_side()) is not None:
            self.shared_buffer = shared.SharedBuffer(
                nbytes, f"statebridge-prefill-rank{setup.tp_rank}")
            self.buffer = self.shared_buffer.tensor
        else:
            self.buffer = alloc_buffer(nbytes)
        self._buf = self.buffer.numpy()
        self.notices = NoticeSlots(self._buf[self.ctl_base:].view(np.int64), self.ctl_base,
                                   setup.num_pages)
        self.cache = StateCache(self.geometry, setup.num_pages,
                                buffer=self.buffer[:pages_bytes])
        self.kv: KVBlocks | None = None
        if self.kv_geometry is not None:
            self.kv = KVBlocks(self.kv_geometry,
                               self.buffer[self.kv_base:self.kv_base + kv_bytes], self.kv_base)
        self.transport = Transport(self.buffer, error_handling=self.config.ucx_error_handling)
        self.model: RankModel = load_callable(setup.model)(setup, self.cache, self.kv)
        self.model.worker = self
        self.loop = c.EventLoop(f"{setup.role}-rank{setup.tp_rank}")
        if setup.local_coordinator:
            self.sock = LocalDealer(setup.local_coordinator,
                                    name=f"{setup.role}-rank{setup.tp_rank}",
                                    max_frame=c.frame_cap(self.config.max_message_bytes))
            self.loop.add_fd(self.sock.fileno(), self._on_message)
        else:
            self.sock = c.connect_dealer(self.loop.context, setup.coordinator,
                                         keys=CurveKeys.from_config(self.config))
            self.loop.add_reader(self.sock, self._on_message)
        self.routes: dict[str, list[_Route]] = {}        # peer node -> this rank's pairs
        self.kv_routes: dict[str, list[_KVRoute]] = {}   # peer node -> this rank's KV pairs
        #: Peer node -> the peer ranks this rank reads from (decode) or notifies (prefill)
        #: through shared maps, in order; decode: UCX peer id -> the mapping (or why not).
        self.shm_peers: dict[str, list[tuple[int, str]]] = {}
        self.peer_maps: dict[str, "shared.PeerMap | StatebridgeError"] = {}
        self.shm_runs: dict[str, np.ndarray] = {}       # UCX peer id -> its pairs' runs
        self.shm_kv: dict[str, list[_KVRoute]] = {}     # UCX peer id -> its shared-map KV pairs
        self._reads: list[_Read] = []          # decode: reads whose notice is awaited
        self._awaiting = 0                     # prefill: pending requests with answers to come
        self._serial = 0                       # prefill: numbers its requests' answers
        #: Requests queued for or on the compute thread -> None, or why they were cancelled.
        self.computing: dict[RequestKey, tuple[str, str] | None] = {}
        self._model_handlers = self.model.handlers()
        self._compute_q: queue.Queue = queue.Queue()
        self._compute = threading.Thread(target=self._compute_main, daemon=True,
                                         name=f"{setup.role}-rank{setup.tp_rank}-compute")
        self._compute.start()
        self.pending: dict[RequestKey, _Pending] = {}
        self._next_timeout_scan = 0.0
        self._next_full_scan = 0.0
        #: Newest generation the coordinator announced to this rank (RankRecv /
        #: RankLocalPrefill); with ``pending`` it says which data-plane messages may still be
        #: received (see :meth:`_may_arrive`).
        self.announced_generation = 0
        self.coordinator_watch = c.PeerWatch(self.config.peer_timeout)
        self._heartbeats = 0
        self.coordinator_watch.heard("coordinator")
        self.counters = c.Counters()
        # UCX progress is driven by this loop: it sleeps in poll() on the zmq socket AND the
        # UCX worker's epoll fd, after arming the worker (blocking progress mode).
        # (The fd only wakes the loop: on_idle below runs after every wake-up anyway, so the
        # fd's own handler does nothing -- one progress and one scan per iteration, not two.)
        self.loop.add_fd(self.transport.fileno(), lambda: None)
        self.loop.before_sleep = self._before_sleep
        #: Peer nodes whose receivers read this rank's sends by themselves (same host, shared
        #: memory: Transport.sends_complete_unattended), how many pending requests still need
        #: this rank's own progress, and whether the loop polls the UCX fd.
        self.unattended_nodes: set[str] = set()
        self._attended = 0
        self._ucx_watched = True
        #: Unattended sends settled since ``_rate_since``, and their rate over the last window.
        self._sends_settled = 0
        self._sends_per_s = 0.0
        self._rate_since = time.monotonic()
        self.loop.on_idle = self._poll_transfers
        self.loop.call_every(self.config.heartbeat_interval, self._heartbeat)
        self._send(m.RankHello(tp_rank=setup.tp_rank, address=self.transport.address,
                               pid=os.getpid(), shm_fd=self.shared_buffer.fd
                               if self.shared_buffer is not None else -1))

    def _before_sleep(self) -> "bool | float":
        """Before the loop sleeps: arm UCX and sleep on its fd as well, or -- when every pending
        request is a send its receiver reads by itself and sends finish often -- sleep through
        UCX's events and reap the send completions at the next wake-up, within
        ``config.send_reap_interval``.

        An armed sender wakes for every acknowledgement, though nothing is urgent then (its
        page is freed a little later), and UCX's receiver pays a signal to wake it. When sends
        finish at least once per reap interval on average, a wake-up by the clock reaps
        one or more of them at the cost of one acknowledgement's wake-up, and the receiver
        sends no signal: on this 2-core machine a hybrid 4x1 cell spent 20% less CPU per
        request (README, "Prefill ranks sleep through their sends"). Fewer completions (long
        transfers, low load) keep the loop armed: the clock would only add wake-ups. Receives
        (decode ranks), and sends that need this side's progress (TCP: UCX endpoint error
        handling, another host), keep it armed too. Where UCX needs the sender after all (the
        wire-up of a new endpoint's first transfer), the transfer waits at most the interval.
        Shared-map readers answer in this rank's memory, which no fd signals: while any
        request waits for answers, an armed sleep lasts at most the interval too.
        """
        now = time.monotonic()
        if now - self._rate_since >= _SEND_RATE_WINDOW_S:
            self._sends_per_s = self._sends_settled / (now - self._rate_since)
            self._sends_settled, self._rate_since = 0, now
        reap = self.config.send_reap_interval
        unattended = bool(self.pending) and not self._attended \
            and self._sends_per_s * reap >= 1.0 and reap > 0
        if unattended == self._ucx_watched:
            self.loop.watch_fd(self.transport.fileno(), not unattended)
            self._ucx_watched = not unattended
        if unattended:
            _op_counter()["unattended_sleeps"] += 1
            return reap
        armed = self.transport.arm()
        if armed and self._awaiting:
            # Shared-map readers answer in memory, which wakes nobody: look again by the clock.
            return reap or _ANSWER_POLL_S
        return armed

    # -- lifecycle --------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until told to shut down or the coordinator goes silent."""
        try:
            self.loop.run()
        finally:
            self.close()

    def close(self) -> None:
        self._compute_q.put(None)
        for p in list(self.pending.values()):
            for h in p.handles:
                h.cancel()
        self.pending.clear()
        self._reads.clear()
        self._attended = self._awaiting = 0
        self.peer_maps.clear()
        self.transport.close()
        if self.shared_buffer is not None:
            self.shared_buffer.close()
        self.loop.stop()
        self.sock.close(0)

    def _send(self, message: m.Message) -> None:
        c.send_dealer(self.sock, message)

    def _heartbeat(self) -> None:
        self._drop_dead_maps()
        self._heartbeats += 1
        self._send(m.Heartbeat(node_id=f"{self.setup.node_id}/{self.setup.tp_rank}",
                               seq=self._heartbeats))
        try:
            self.transport.reject_unannounced(self._may_arrive, grace=self.config.peer_timeout)
        except StatebridgeError as e:
            log.warning("rank %d: sweeping unannounced messages failed: %s",
                        self.setup.tp_rank, e)
        if self.coordinator_watch.expired():
            log.error("%s rank %d: coordinator silent for %.1f s, shutting down",
                      self.setup.role, self.setup.tp_rank, self.config.peer_timeout)
            self.loop.request_stop()

    # -- messages from the coordinator -------------------------------------------------------
    def _on_message(self) -> None:
        handlers, heard = self._handlers, False
        while True:
            msg = c.recv_dealer(self.sock, self.config.max_message_bytes)
            if msg is None:
                break
            heard = True
            if isinstance(msg, ProtocolError):
                self.counters.add("protocol_errors")
                log.warning("rank %d: bad message from coordinator: %s", self.setup.tp_rank, msg)
                continue
            handler = handlers.get(type(msg))
            if handler is not None:
                handler(msg)
            elif type(msg) in self._model_handlers:
                self._compute_q.put(msg)              # the model's own work, in order
            else:
                self.counters.add("unexpected_messages")
        if heard:
            self.coordinator_watch.heard("coordinator")

    @functools.cached_property
    def _handlers(self) -> dict:
        return {
            m.Heartbeat: lambda msg: None,
            m.GroupInfo: self._on_connect,
            m.RankPrefill: self._on_prefill,
            m.RankRecv: self._on_recv,
            m.RankCancel: self._on_cancel,
            m.RankLocalPrefill: self._on_local_prefill,
            m.RankShutdown: lambda msg: self.loop.request_stop(),
        }

    def _on_connect(self, info: m.GroupInfo) -> None:
        """The coordinator forwarded the checked GroupInfo of a peer group: plan the pairs with
        it and open endpoints to its ranks."""
        peer_geo = PageGeometry(self.spec, info.tp_size, info.layout,
                                region_align=info.region_align, page_size=info.page_size)
        if info.node_id in self.routes:
            # The same node connected again (it re-dialed after a cut link or a restart): its
            # old endpoints may be broken; fresh ones for the new connection.
            for peer in self._peers_of(info.node_id):
                self._fail_peer(peer, f"{info.node_id} connected again",
                                transport=peer in self.transport.peers)
        # The shared-map rule, as both sides of the link see it: which pairs read out of the
        # prefill rank's map (on a hybrid link, every KV pair and zero-copy recurrent pair).
        own, peer_side = self._map_side(), MapSide.of_info(info)
        shm = map_threshold(own, peer_side) if self.setup.role == "prefill" \
            else map_threshold(peer_side, own)
        routes = self.routes[info.node_id] = self._routes(info.node_id, peer_geo, shm)
        if self.transport.sends_complete_unattended(same_host(info.host_id)):
            self.unattended_nodes.add(info.node_id)
        else:
            self.unattended_nodes.discard(info.node_id)
        kv_routes = self.kv_routes[info.node_id] = self._kv_routes(info, routes, shm is not None)
        peers = sorted({(r.peer_rank, r.peer) for r in [*routes, *kv_routes] if r.shm})
        self.shm_peers[info.node_id] = peers
        # Per peer rank, its shared-map pairs' runs relative to the two pages (fixed per peer).
        self.shm_runs.update({peer: np.concatenate(
            [r.pair.runs for r in routes if r.shm and r.peer == peer]
            or [np.zeros((0, 3), dtype=np.int64)]) for _, peer in peers})
        self.shm_kv.update({peer: [r for r in kv_routes if r.shm and r.peer == peer]
                            for _, peer in peers})
        if self.setup.role == "decode":
            for peer_rank, peer in peers:
                try:
                    self.peer_maps[peer] = shared.PeerMap(info.rank_pids[peer_rank],
                                                          info.rank_shm_fds[peer_rank])
                except StatebridgeError as e:     # its requests fail, naming it
                    log.error("decode rank %d: %s", self.setup.tp_rank, e)
                    self.peer_maps[peer] = e
        connected = set()
        for route in [*routes, *kv_routes]:
            if route.peer not in connected:
                connected.add(route.peer)
                self.transport.connect(route.peer, info.rank_addresses[route.peer_rank])
        log.info("%s rank %d: connected to %s (%d ranks, %s)", self.setup.role,
                 self.setup.tp_rank, info.node_id, info.tp_size, info.layout)

    def _drop_dead_maps(self) -> None:
        """Unmap the buffers of prefill ranks whose process has exited: a mapping keeps the
        memfd's memory alive, and a restarted prefill node comes back under a new node id (its
        old maps would never be replaced). A read of a dropped peer fails, naming it."""
        for peer, mapped in list(self.peer_maps.items()):
            if isinstance(mapped, shared.PeerMap) and not shared.process_alive(mapped.pid):
                log.info("decode rank %d: %s exited, unmapping its buffer", self.setup.tp_rank,
                         peer)
                del self.peer_maps[peer]

    def _map_side(self) -> MapSide:
        """This rank's group, for the shared-map rule (:func:`map_threshold`)."""
        return MapSide.of_config(self.setup.role, self.config, tp_size=self.setup.tp_size,
                                 page_size=self.geometry.page_size,
                                 has_kv=self.kv_geometry is not None)

    def _routes(self, node: str, peer_geo: PageGeometry,
                shm: int | None = None) -> list["_Route"]:
        """This rank's pairs with ``node`` (whose ranks have ``peer_geo``), each with its UCX
        peer and, for zero-copy pairs, the runs checked once as a
        :class:`~statebridge.connector.data.RunTemplate`. With ``shm`` (a byte threshold)
        zero-copy pairs moving at least that much per request read out of the shared map."""
        routes = []
        if self.setup.role == "prefill":
            plan = TransferPlan(self.geometry, peer_geo)
            pairs, direction = plan.for_source(self.setup.tp_rank), "send"
        else:
            plan = TransferPlan(peer_geo, self.geometry)
            pairs, direction = plan.for_destination(self.setup.tp_rank), "recv"
        for pair in pairs:
            peer_rank = pair.dst_rank if direction == "send" else pair.src_rank
            template = None if pair.staged else self.transport.template(pair.runs, direction)
            staged_bytes = int(pair.pack[:, 2].sum()) if pair.staged else 0
            routes.append(_Route(pair, peer_rank, f"{node}/{peer_rank}", template, staged_bytes,
                                 shm=shm is not None and template is not None
                                 and pair.nbytes >= shm))
        return routes

    def _kv_routes(self, info: m.GroupInfo, routes: list["_Route"],
                   shm: bool = False) -> list["_KVRoute"]:
        """This rank's KV pairs with the peer group ``info`` (none without KV on both sides);
        ``shm``: read out of the shared map."""
        if self.kv_geometry is None or not info.num_blocks:
            return []
        peer_geo = BlockGeometry(self.spec.kv, info.tp_size, info.kv_layout,
                                 info.block_size, info.num_blocks)
        if self.setup.role == "prefill":
            plan = KVPlan(self.kv_geometry, peer_geo)
            pairs = plan.for_source(self.setup.tp_rank)
        else:
            plan = KVPlan(peer_geo, self.kv_geometry)
            pairs = plan.for_destination(self.setup.tp_rank)
        recurrent = {r.peer_rank: len(r.template) if r.template is not None else 0
                     for r in routes}
        out = []
        for pair in pairs:
            peer_rank = pair.dst_rank if self.setup.role == "prefill" else pair.src_rank
            out.append(_KVRoute(pair, peer_rank, f"{info.node_id}/{peer_rank}",
                                recurrent.get(peer_rank, 0), shm))
        return out

    def _post_kv(self, pending: "_Pending", node: str, direction: str,
                 src_blocks, dst_blocks, *, dst_start: int | None) -> None:
        """Post this rank's KV runs of the request (absolute offsets: the pool's base added on
        this rank's side); raises StatebridgeError when a post fails (the handles posted so
        far are in ``pending``).

        Block tables that are ranges of consecutive ids on both sides (the prefill side's
        always is; the decode side's allocator prefers them) post the pair's template for that
        many blocks at this side's first block: per request only the base is added and
        checked. Other tables build and check their runs for the request. ``dst_start``: the
        destination table's :func:`range_start` (None: not one range, or empty)."""
        col = 0 if direction == "send" else 1
        routes = self.kv_routes.get(node, ())
        if not routes:
            return
        n = len(dst_blocks)
        start = None
        if n and len(src_blocks) == n:
            start = range_start(src_blocks) if col == 0 else dst_start
        contiguous = start is not None \
            and (dst_start if col == 0 else range_start(src_blocks)) is not None
        generation = pending.key.generation
        for route in routes:
            pair = route.pair
            if contiguous:
                template = route.template(n, col)
                base = self.kv_base + start * (pair.src_block_stride if col == 0
                                               else pair.dst_block_stride)
            else:
                shift = np.zeros(3, dtype=np.int64)
                shift[col] = self.kv_base
                template, base = RunTemplate(pair.runs(src_blocks, dst_blocks) + shift, col,
                                             "KV runs"), 0
            if route.shm:                        # read out of the shared map: counted only
                pending.nbytes += template.nbytes
                pending.messages += len(template)
                continue
            if not len(template):
                continue
            handle = self.transport.post_runs(direction, route.peer, generation,
                                              pair.src_rank, base, template,
                                              index0=route.index0)
            pending.handles.append(handle)
            pending.nbytes += template.nbytes
            pending.messages += len(template)

    def _on_prefill(self, msg: m.RankPrefill) -> None:
        key = RequestKey(msg.peer_node, msg.request_id, msg.generation)
        if msg.peer_node not in self.routes:
            self._done(key, FailureKind.TRANSFER_ERROR, f"no connection to {msg.peer_node!r}")
            return
        # The model runs on the compute thread, in arrival order (every rank of the group sees
        # the same order, which collective ops across ranks need); this loop keeps serving
        # heartbeats and other transfers meanwhile.
        self.computing[key] = None
        self._compute_q.put(msg)

    def _on_local_prefill(self, msg: m.RankLocalPrefill) -> None:
        self._announce(msg.generation)
        self.computing[RequestKey("", msg.request_id, msg.generation)] = None
        self._compute_q.put(msg)

    def _compute_main(self) -> None:
        """The compute thread: model work in arrival order; results go back to the loop.

        Results go back in batches (one loop wake-up each), so a backlog of cheap work (a
        stand-in model) costs one hand-off. Held results go to the loop before the thread
        blocks on an empty queue, before a model message (:meth:`RankModel.handlers`: a decode
        step is latency-bound), after work that took
        :data:`_RESULT_HOLD_S` or more (the next is likely as slow: a real model), and once the
        first held result is that old -- a result waits at most about one cheap item.
        """
        results: list = []
        first_at = took = 0.0

        def hand_over() -> bool:
            nonlocal results
            try:
                self.loop.call_soon(_run_all, results)
            except StatebridgeError:                      # loop closed
                return False
            results = []
            return True

        while True:
            if results and self._compute_q.empty() and not hand_over():
                return
            msg = self._compute_q.get()
            model_handler = None if msg is None else self._model_handlers.get(type(msg))
            if results and (msg is None or model_handler is not None or took >= _RESULT_HOLD_S
                            or time.perf_counter() - first_at >= _RESULT_HOLD_S) \
                    and not hand_over():
                return
            if msg is None:
                self.model.close()
                return
            started = time.perf_counter()
            if model_handler is not None:
                reply = None
                try:
                    reply = model_handler(msg)
                except Exception:  # noqa: BLE001 -- the handler's own failure: logged
                    log.exception("rank %d: %s failed", self.setup.tp_rank, type(msg).__name__)
                    self.counters.add("model_handler_errors")
                callback, args = (self._send, (reply,)) if reply is not None else (None, ())
            else:
                key = _key_of(msg)
                error = None
                if self.computing.get(key) is None:       # not cancelled while queued
                    page = msg.src_page if isinstance(msg, m.RankPrefill) else msg.page
                    if isinstance(msg, m.RankPrefill):
                        blocks, tokens = msg.src_blocks, msg.kv_tokens
                    else:
                        blocks, tokens = msg.blocks, m.token_count(msg.prompt)
                    try:
                        if blocks:
                            self._check_blocks(blocks, tokens)
                        self.model.prefill(page, m.unpack_tokens(msg.prompt),
                                           msg.request_id, tuple(blocks))
                    except Exception as e:  # the model failed: the request fails, rank serves on
                        log.exception("rank %d: computing %s failed", self.setup.tp_rank,
                                      msg.request_id)
                        error = f"prefill failed: {type(e).__name__}: {e}"
                # CLOCK_MONOTONIC is one clock for every process of the machine: the moment
                # the state is final, compared with the decode ranks' held_at (low-load latency).
                callback, args = self._after_compute, (msg, error, time.monotonic())
            took = time.perf_counter() - started
            self.counters.add("compute_seconds", took)
            if callback is not None:
                if not results:
                    first_at = time.perf_counter()
                results.append((callback, args))

    def _after_compute(self, msg: "m.RankPrefill | m.RankLocalPrefill",
                       error: str | None, final_at: float = 0.0) -> None:
        key = _key_of(msg)
        cancelled = self.computing.pop(key, None)
        if cancelled is not None:
            self._done(key, *cancelled)
            return
        if error is not None:
            self._done(key, FailureKind.TRANSFER_ERROR, error)
            return
        if isinstance(msg, m.RankLocalPrefill):
            self._done(key, "", "")
            return
        pending = _Pending(key, msg.src_page, [], time.perf_counter(),
                           blocks=msg.src_blocks, kv_tokens=msg.kv_tokens, final_at=final_at)
        kv = (msg.peer_node, msg.src_blocks, msg.dst_blocks) if msg.src_blocks else None
        self._post_routes(pending, self.routes[msg.peer_node], "send",
                          self.cache.page_offset(msg.src_page), kv)

    def _check_blocks(self, blocks, tokens: int) -> None:
        from statebridge.errors import ConfigError

        if self.kv is None:
            raise ConfigError(f"KV blocks {list(blocks)[:4]} for a rank without a KV pool")
        need = blocks_for(tokens, self.kv.geometry.block_size)
        if len(blocks) < need or min(blocks) < 0 or max(blocks) >= self.kv.geometry.num_blocks:
            raise ConfigError(f"block table {list(blocks)[:8]} ({len(blocks)} blocks) does not "
                              f"hold {tokens} tokens in a pool of "
                              f"{self.kv.geometry.num_blocks} blocks")

    def _post_routes(self, pending: "_Pending", routes: list["_Route"], direction: str,
                     base: int, kv: tuple | None = None) -> None:
        """Post every route of this rank for the request at page offset ``base`` (zero-copy
        routes from their templates, staged ones packed from / unpacked into the page); the
        request is pending once all are posted, or fails at once when one post raises."""
        transport = self.transport
        generation = pending.key.generation
        try:
            for route in routes:
                pair = route.pair
                if route.shm:                    # read out of the shared map: no post
                    pending.nbytes += pair.nbytes
                    pending.messages += pair.messages
                    continue
                if route.template is None and direction == "send":
                    handle = transport.post_send_staged(
                        route.peer, generation, pair.src_rank,
                        pair.pack + np.array([base, 0, 0], dtype=np.int64))
                elif route.template is None:
                    handle = transport.post_recv_staged(
                        route.peer, generation, pair.src_rank, route.staged_bytes,
                        pair.unpack + np.array([0, base, 0], dtype=np.int64))
                else:
                    handle = transport.post_runs(direction, route.peer, generation,
                                                 pair.src_rank, base, route.template)
                pending.handles.append(handle)
                pending.nbytes += pair.nbytes
                pending.messages += pair.messages
            if kv is not None:
                node, src_blocks, dst_blocks = kv
                self._post_kv(pending, node, direction, src_blocks, dst_blocks,
                              dst_start=range_start(dst_blocks) if dst_blocks else None)
            shm_peers = self.shm_peers.get(pending.key.peer_node)
            if shm_peers:
                self._post_notices(pending, shm_peers, direction, base)
        except StatebridgeError as e:
            self._post_failed(pending, e)
            return
        pending.attended = direction != "send" \
            or pending.key.peer_node not in self.unattended_nodes
        self._attended += pending.attended
        self._awaiting += bool(pending.answers)
        self.pending[pending.key] = pending

    def _post_notices(self, pending: "_Pending", peers: list[tuple[int, str]], direction: str,
                      base: int) -> None:
        """Shared-map reads of the request: a prefill rank writes the "ready" notice of each
        peer rank into its slot (the page's offset, its own serial for the request, its KV
        pool's base, the request's first block, and where to answer), marks the slot's answer
        word pending, then sends the notice; a decode rank posts the receive of the notice
        (the copy and the answer follow in :meth:`_do_reads`)."""
        transport, key = self.transport, pending.key
        if direction == "send":
            self._serial = serial = next_serial(self._serial)
            pending.serial = serial
            first_block = pending.blocks[0] if pending.blocks else 0
            for peer_rank, peer in peers:
                slot = self.notices.slot(pending.page, peer_rank)
                slot.write(base, serial, self.kv_base, first_block)
                pending.answers.append((slot, peer))
                pending.handles.append(transport.post_notice(
                    "send", peer, key.generation, self.setup.tp_rank, READY_INDEX, slot.offset,
                    NOTICE_BYTES))
            return
        for peer_rank, peer in peers:
            slot = self.notices.slot(pending.page, peer_rank)
            handle = transport.post_notice("recv", peer, key.generation, peer_rank, READY_INDEX,
                                           slot.offset, NOTICE_BYTES)
            pending.handles.append(handle)
            pending.unread += 1
            self._reads.append(_Read(pending, peer_rank, peer, handle, slot))

    def _answered(self, p: "_Pending") -> bool:
        """Prefill rank: whether every shared-map reader of ``p`` answered (or ``p`` failed:
        then nothing waits for them; a reader still copying reads, it writes nothing here)."""
        if p.failure is not None:
            return True
        serial = p.serial
        for slot, _ in p.answers:
            if not slot.answered(serial):
                return False
        return True

    def _fail_peer(self, peer: str, reason: str, *, transport: bool = True) -> None:
        """``peer`` is gone (declared lost, or its node connected again): its UCX handles fail
        (``transport``: the transport declares it lost), and so do the requests waiting for its
        shared-map answers, which no handle stands for -- now, not at their transfer
        timeout."""
        if transport:
            self.transport.fail_peer(peer, reason)
        for p in self.pending.values():
            if p.failure is None and any(q == peer for _, q in p.answers):
                p.failure = (FailureKind.PEER_LOST.value, reason)

    def _do_reads(self) -> None:
        """Decode rank: for each shared-map read whose notice came, copy the pair's runs out
        of the prefill rank's mapping into this rank's page, then answer "done" (the prefill
        rank frees its page once every reader answered). A read whose notice was cancelled
        copies nothing; a request that failed meanwhile copies nothing and answers. At most
        :data:`_READ_BUDGET` bytes per loop pass (the loop comes straight back for the rest):
        heartbeats and cancels are never held up by a backlog of copies."""
        waiting, copied = [], 0
        for read in self._reads:
            handle = read.handle
            if copied >= _READ_BUDGET or not handle.finished():
                waiting.append(read)
                continue
            p = read.pending
            p.unread -= 1
            if handle.error is not None:
                continue
            notice = read.slot.read()
            if p.failure is None:
                try:
                    copied += self._copy_read(read, notice)
                except StatebridgeError as e:
                    p.failure = (kind_of(e).value, f"shared-map read failed: {e}")
                    for h in p.handles:
                        if not h.done():
                            h.cancel()
            self._answer(read, notice)
        self._reads = waiting
        if copied >= _READ_BUDGET and waiting:
            self.loop.call_soon(lambda: None)    # no sleep before the next pass

    def _peer_map(self, peer: str) -> shared.PeerMap:
        """The mapping of ``peer``'s buffer; the error that kept it from being mapped (or that
        it was dropped) otherwise."""
        src = self.peer_maps.get(peer)
        if not isinstance(src, shared.PeerMap):
            raise src if isinstance(src, StatebridgeError) else StatebridgeError(
                f"no shared map of {peer!r}")
        return src

    def _answer(self, read: _Read, notice: shared.Notice) -> None:
        """Tell the prefill rank of ``read`` that this rank is done with its page (the
        notice's answer, :meth:`~statebridge.connector.data.shared.Notice.answer`)."""
        try:
            if not notice.answer(self._peer_map(read.peer)):
                log.info("decode rank %d: %s no longer waits for serial %d (answer word at "
                         "%d)", self.setup.tp_rank, read.peer, notice.serial,
                         notice.answer_offset)
        except StatebridgeError as e:             # the prefill side's timeout covers it
            log.warning("decode rank %d: answering %s failed: %s", self.setup.tp_rank,
                        read.peer, e)

    def _copy_read(self, read: _Read, notice: shared.Notice) -> int:
        """Copy the runs of the pair (this rank, ``read.peer_rank``) of the request out of the
        peer's mapping into this rank's page and KV blocks; the ``notice`` gave the source
        page's offset, the source KV pool's base and the source table's first block (the
        prefill side's table is always one range of consecutive blocks)."""
        src = self._peer_map(read.peer)
        p = read.pending
        # The cached run tables go to the copy as they are, with the request's bases (the C
        # copy shifts and checks every row): no per-request arrays.
        groups = [(self.shm_runs[read.peer], notice.page_offset, self.cache.page_offset(p.page))]
        kv = self.shm_kv.get(read.peer)
        if kv and p.blocks:
            first, n = notice.first_block, len(p.blocks)
            src_pool, d0 = notice.kv_base, p.first_block
            for route in kv:
                pair = route.pair
                if d0 is None:                  # a scattered decode table: its own runs
                    groups.append((pair.runs(range(first, first + n), p.blocks), src_pool,
                                   self.kv_base))
                else:
                    groups.append((pair.contiguous_runs(n),
                                   src_pool + first * pair.src_block_stride,
                                   self.kv_base + d0 * pair.dst_block_stride))
        copied = shared.copy_groups(self._buf, src, groups)
        _op_counter()["shared_map_reads"] += 1
        return copied

    def _post_failed(self, pending: "_Pending", error: StatebridgeError) -> None:
        """A post raised (peer declared lost, transport closed, bad runs): the request fails
        now, its posted handles are cancelled, and the coordinator hears it at once."""
        for h in pending.handles:
            h.cancel()
        kind = kind_of(error)
        self.counters.add(f"failed_{kind}")
        self._done(pending.key, kind, f"posting failed: {error}")

    def _announce(self, generation: int) -> None:
        if _generation_after(generation, self.announced_generation):
            self.announced_generation = generation

    def _may_arrive(self, generation: int, src_rank: int) -> bool:
        """Whether a data-plane message of ``generation`` sitting in UCX's unexpected queue
        may still be taken by a receive of this rank (the sweep in :meth:`_heartbeat` rejects
        it otherwise, and also once it waited longer than ``peer_timeout``).

        The decode coordinator numbers attempts in increasing order and announces them to
        every rank in that order (RankRecv, RankLocalPrefill) before the prefill side can send
        anything; receives are posted when the announcement is handled, and UCX matches
        messages that came first at that moment. So a message in the unexpected queue is
        legitimate only while its announcement is still on its way: its generation is newer
        than the newest announced. Of an announced generation it is either stale (the attempt
        finished or was cancelled: no receive left) or matches none of the attempt's tags
        (rogue or corrupt) -- with the attempt still pending it is left for the grace period
        (receives posted with delayed submission match a little later), else rejected at once.
        A prefill rank posts no receives: nothing may arrive.

        Attention KV (specs with KV) keeps this true: RankRecv posts the KV receives with the
        recurrent ones (the prefill side's block table is one contiguous range, so the runs
        follow from the decode table alone).
        """
        if self.setup.role != "decode":
            return False
        if _generation_after(generation, self.announced_generation):
            return True
        return any(key.generation == generation for key in self.pending)

    def _on_recv(self, msg: m.RankRecv) -> None:
        self._announce(msg.generation)
        key = RequestKey(msg.peer_node, msg.request_id, msg.generation)
        routes = self.routes.get(msg.peer_node)
        if routes is None:
            self._done(key, FailureKind.TRANSFER_ERROR, f"no connection to {msg.peer_node!r}")
            return
        if msg.blocks:
            try:
                self._check_blocks(msg.blocks, msg.kv_tokens)
            except StatebridgeError as e:
                self._done(key, FailureKind.TRANSFER_ERROR, str(e))
                return
        pending = _Pending(key, msg.page, [], time.perf_counter(), blocks=msg.blocks,
                           kv_tokens=msg.kv_tokens,
                           first_block=range_start(msg.blocks) if msg.blocks else None)
        self._post_routes(pending, routes, "recv", self.cache.page_offset(msg.page))
        if msg.blocks and pending.key in self.pending:
            try:
                # The source range's start does not change the runs' sizes or order.
                self._post_kv(pending, msg.peer_node, "recv", range(len(msg.blocks)),
                              msg.blocks, dst_start=pending.first_block)
            except StatebridgeError as e:                 # settled by the next poll
                pending.failure = (kind_of(e).value, f"posting KV receives failed: {e}")
                for h in pending.handles:
                    if not h.done():
                        h.cancel()

    def _on_cancel(self, msg: m.RankCancel) -> None:
        if msg.lost_node:
            for peer in self._peers_of(msg.lost_node):
                self._fail_peer(peer, f"peer node {msg.lost_node} lost")
        key = RequestKey(msg.peer_node, msg.request_id, msg.generation)
        kind = msg.kind or FailureKind.ABORTED.value
        if key in self.computing:
            # Still queued or computing: answered when the compute thread hands it back.
            self.computing[key] = (kind, msg.reason)
            return
        pending = self.pending.get(key)
        if pending is None:
            # Nothing in flight here (never started or already done): confirm at once.
            self._done(key, kind, msg.reason)
            return
        pending.failure = (kind, msg.reason)
        for h in pending.handles:
            if not h.done():
                h.cancel()

    def _peers_of(self, node: str) -> list[str]:
        peers = [route.peer for route in self.routes.get(node, ())]
        return peers + [r.peer for r in self.kv_routes.get(node, ()) if r.peer not in peers]

    # -- transfers ------------------------------------------------------------------------------
    def _poll_transfers(self) -> None:
        """After one UCX progress: settle the requests whose transfers all finished.

        Runs on every loop pass. Transfers finish about in the order they were posted (the
        prefill side serves requests in arrival order), so a pass looks at the pending
        requests oldest first and stops after :data:`_SCAN_AHEAD` unfinished ones; every
        :data:`_FULL_SCAN_S` it looks at all of them (a transfer that finished out of order
        waits at most that long). Transfer timeouts are checked every :data:`_TIMEOUT_SCAN_S`.
        """
        if not self.pending:
            return
        self.transport.progress()
        if self._reads:
            self._do_reads()
        now = time.perf_counter()
        ready = []
        misses = 0
        full = now >= self._next_full_scan
        if full:
            self._next_full_scan = now + _FULL_SCAN_S
        for key, p in self.pending.items():
            handles = p.handles
            if not p.unread and (not handles or handles[-1].finished()
                                 and all(h.finished() for h in handles)) \
                    and (not p.answers or self._answered(p)):
                ready.append(key)
            else:
                misses += 1
                if misses >= _SCAN_AHEAD and not full:
                    break
        if now >= self._next_timeout_scan:
            self._next_timeout_scan = now + _TIMEOUT_SCAN_S
            self._expire_transfers(now)
        for key in ready:
            self._settle(key)

    def _expire_transfers(self, now: float) -> None:
        limit = self.config.transfer_timeout
        for p in self.pending.values():
            if p.failure is None and now - p.started > limit:
                p.failure = (FailureKind.TIMEOUT.value, f"transfer not done after {limit} s")
                for h in p.handles:
                    if not h.done():
                        h.cancel()

    def _settle(self, key: RequestKey) -> None:
        """A request whose handles are all finished: answer the coordinator with its outcome."""
        p = self.pending.pop(key)
        self._attended -= p.attended
        self._awaiting -= bool(p.answers)
        self._sends_settled += not p.attended
        kind, message = p.failure or ("", "")
        if not kind:
            for h in p.handles:
                error = h.error                 # every handle is finished here
                if error is not None:
                    kind, message = kind_of(error).value, str(error)
                    break
        checksum = kv_sum = ""
        if not kind and self.setup.checksums and self.setup.role == "decode":
            checksum = page_checksum(self.geometry, self.cache.page_bytes(p.page))
            if p.blocks and self.kv is not None:
                kv_sum = kv_checksum(self.kv, p.blocks, p.kv_tokens)
        self.counters.add("transfers_ok" if not kind else f"failed_{kind}")
        self.counters.add("bytes", p.nbytes)
        prefill = self.setup.role == "prefill"
        self._done(key, kind, message, checksum, seconds=time.perf_counter() - p.started,
                   nbytes=p.nbytes, messages=p.messages, kv_checksum=kv_sum,
                   state_final_at=p.final_at if prefill and not kind else 0.0,
                   held_at=time.monotonic() if not prefill and not kind else 0.0)

    def _done(self, key: RequestKey, kind: "FailureKind | str", message: str,
              checksum: str = "", *, seconds: float = 0.0, nbytes: int = 0,
              messages: int = 0, kv_checksum: str = "", state_final_at: float = 0.0,
              held_at: float = 0.0) -> None:
        self._send(m.RankDone(tp_rank=self.setup.tp_rank, peer_node=key.peer_node,
                              request_id=key.request_id, generation=key.generation,
                              kind=str(kind), message=message,
                              checksum=checksum, seconds=seconds, nbytes=nbytes,
                              messages=messages, staging_bytes=self.transport.staging_bytes,
                              kv_checksum=kv_checksum, state_final_at=state_final_at,
                              held_at=held_at))


#: Block counts whose KV templates a KV route keeps (cleared when full).
_KV_TEMPLATES = 256

#: Seconds between scans of the pending transfers for timeouts (transfer timeouts are tens
#: of seconds; scanning on every loop pass cost O(pending) per pass).
_TIMEOUT_SCAN_S = 0.1
#: How many unfinished requests a loop pass looks past (oldest first) before it stops, and
#: how often it looks at all of them (see RankWorker._poll_transfers).
_SCAN_AHEAD = 4
_FULL_SCAN_S = 0.002


#: How often a prefill rank looks at its answer words when ``send_reap_interval`` is 0.
_ANSWER_POLL_S = 0.001
#: Most bytes a decode rank copies out of shared maps in one loop pass (see _do_reads).
_READ_BUDGET = 64 << 20

#: Window over which a rank measures how often its unattended sends finish.
_SEND_RATE_WINDOW_S = 0.25

#: Longest a compute result waits for later ones before the batch goes to the loop.
_RESULT_HOLD_S = 0.0005


def _run_all(calls: list) -> None:
    """Run a compute thread's batch of results on the loop, in order; one failing result does
    not drop the others."""
    for fn, args in calls:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 -- logged like the loop's own handlers
            log.exception("handling the result of %r failed", fn)


def _key_of(msg: "m.RankPrefill | m.RankLocalPrefill") -> RequestKey:
    peer = msg.peer_node if isinstance(msg, m.RankPrefill) else ""
    return RequestKey(peer, msg.request_id, msg.generation)


def _generation_after(a: int, b: int) -> bool:
    """``a`` is newer than ``b`` in the 32-bit generation sequence (serial number arithmetic,
    so the order survives the wrap-around after 2**32 attempts)."""
    return 0 < (a - b) % (1 << 32) < 1 << 31
