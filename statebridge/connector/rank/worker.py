"""A rank's worker: the loop serving its coordinator, its message handlers, connecting to peer
groups, and its lifecycle (see the package docstring).

What a rank holds lives beside it, one concern per module: its memory (``memory``), its
routes and the one posting path (``routes``), its pending transfers and how its loop sleeps
(``pending``), its side of the shared-map protocol (``shared_map``) and its compute thread
(``compute``). The worker wires them and answers the coordinator.
"""

from __future__ import annotations

import functools
import logging
import os
import time

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.data import shared
from statebridge.connector.data.env import quiet_unused_env_warnings, ucx_options
from statebridge.connector.ledger import RequestKey
from statebridge.connector.local import LocalDealer
from statebridge.connector.rank import digest
from statebridge.connector.rank.compute import ComputeThread, check_blocks, key_of
from statebridge.connector.rank.memory import RankMemory
from statebridge.connector.rank.model import (
    KVBlocks,
    RankModel,
    RankSetup,
    kv_checksum,
    load_callable,
)
from statebridge.connector.rank.pending import Pending, PendingTransfers, fail_pending
from statebridge.connector.rank.routes import Routes
from statebridge.connector.rank.shared_map import SharedMaps
from statebridge.connector.rank.startup import fmt_bytes, phase
from statebridge.connector.stats import Counters, ops
from statebridge.connector.data.device import memory_of
from statebridge.devices import rank_device
from statebridge.errors import FailureKind, ProtocolError, StatebridgeError, kind_of
from statebridge.net import same_host
from statebridge.security import CurveKeys
from statebridge.state.cache import StateCache, page_checksum
from statebridge.state.kv import BlockGeometry, range_start
from statebridge.state.layout import PageGeometry
from statebridge.state.spec import StateSpec

log = logging.getLogger(__name__)

__all__ = ["RankWorker"]


class RankWorker:
    """One rank's connector: memory + transport + a loop serving its coordinator."""

    def __init__(self, setup: RankSetup) -> None:
        from statebridge.connector.data import Transport  # imports ucxx

        self.setup = setup
        self.config = setup.config
        self.name = f"{setup.role}-rank{setup.tp_rank}"
        self.spec = StateSpec.from_json(setup.spec_json)
        self.geometry = PageGeometry(self.spec, setup.tp_size, setup.layout,
                                     region_align=setup.region_align)
        self.kv_geometry: BlockGeometry | None = None
        if self.spec.kv is not None and setup.num_blocks:
            self.kv_geometry = BlockGeometry(self.spec.kv, setup.tp_size, setup.kv_layout,
                                             setup.block_size, setup.num_blocks)
        device = rank_device(setup.device, setup.tp_rank)
        side = shared.MapSide.of_config(setup.role, self.config, tp_size=setup.tp_size,
                                        page_size=self.geometry.page_size,
                                        has_kv=self.kv_geometry is not None,
                                        memory=memory_of(device))
        who = f"{setup.role} rank {setup.tp_rank}"
        with phase(who, "pools") as p:
            self.memory = RankMemory.for_rank(setup.role, setup.tp_rank, self.geometry,
                                              setup.num_pages, self.kv_geometry, side, device)
            p.detail = fmt_bytes(self.memory.nbytes)
        self.cache = StateCache(self.geometry, setup.num_pages, buffer=self.memory.pages)
        self.kv: KVBlocks | None = None
        if self.kv_geometry is not None:
            self.kv = KVBlocks(self.kv_geometry, self.memory.kv_pool, self.memory.kv_base)
        quiet_unused_env_warnings()
        with phase(who, "UCX worker"):
            self.transport = Transport(self.memory.registered,
                                       error_handling=self.config.ucx_error_handling,
                                       ucx_options=ucx_options(setup.ucx_net_devices,
                                                               self.config.bind_host))
        self.counters = Counters()
        if self.config.verify_transfers:
            # The digest passes run on this loop thread: torch's default of one thread per
            # core in every rank process makes the ranks fight over the CPUs (the real model
            # sets the same for its own work; docs/measurements.md, "Transfer verification").
            import torch

            torch.set_num_threads(self.config.torch_threads)
        model = load_callable(setup.model) if setup.model else RankModel
        self.model: RankModel = model(setup, self.cache, self.kv)
        weights_private, weights_mapped = self.model.weight_memory()
        self.model.rank_stats = self.stats
        self.loop = c.EventLoop(self.name)
        if setup.local_coordinator:
            self.sock = LocalDealer(setup.local_coordinator, name=self.name,
                                    max_frame=c.frame_cap(self.config.max_message_bytes))
            self.loop.add_fd(self.sock.fileno(), self._on_message)
        else:
            self.sock = c.connect_dealer(self.loop.context, setup.coordinator,
                                         keys=CurveKeys.from_config(self.config))
            self.loop.add_reader(self.sock, self._on_message)
        self.maps = SharedMaps(setup.role, setup.tp_rank, side, self.memory, self.cache,
                               self.transport, self.loop)
        self.routes = Routes(setup.role, setup.tp_rank, self.spec, self.geometry,
                             self.kv_geometry, self.memory.kv_base, self.transport, self.maps)
        self.pending = PendingTransfers(self.config, self.transport, self.loop,
                                        self.maps.answered)
        self.compute = ComputeThread(self.name, self.model, self.loop, self.counters,
                                     on_computed=self._after_compute,
                                     on_reply=lambda reply: self._send(reply),
                                     max_prefill_tokens=self.config.max_prefill_tokens
                                     if self.config.batched_prefill else None)
        #: Newest generation the coordinator announced to this rank (RankRecv /
        #: RankLocalPrefill); with ``pending`` it says which data-plane messages may still be
        #: received (see :meth:`_may_arrive`).
        self.announced_generation = 0
        # The coordinator: gone when its process is (see _coordinator_gone); merely silent
        # (stopped, busy) is logged and waited for.
        self.coordinator_pid = setup.coordinator_pid or os.getppid()
        #: This process's parent at start: the coordinator, or the fork server that the
        #: coordinator started (it exits with the coordinator), or a rank host.
        self._parent = os.getppid()
        self.coordinator_watch = c.PeerWatch(self.config.peer_timeout, self.loop)
        self._coordinator_silent = False
        self._stopping = False
        self._heartbeats = 0
        self.coordinator_watch.heard("coordinator")
        # UCX progress is driven by this loop: it sleeps in poll() on the coordinator's socket
        # AND the UCX worker's epoll fd, after arming the worker (blocking progress mode).
        # (The fd only wakes the loop: on_idle below runs after every wake-up anyway, so the
        # fd's own handler does nothing -- one progress and one scan per iteration, not two.)
        self.loop.add_fd(self.transport.fileno(), lambda: None)
        self.loop.before_sleep = self.pending.before_sleep
        self.loop.on_idle = self._poll_transfers
        self.loop.call_every(self.config.heartbeat_interval, self._heartbeat)
        self._send(m.RankHello(tp_rank=setup.tp_rank, address=self.transport.address,
                               pid=self.memory.pid, shm_fd=self.memory.peer_fd,
                               weights_private=weights_private,
                               weights_mapped=weights_mapped,
                               chunked_prefill=self.compute.chunked))

    def stats(self) -> dict:
        """The rank's transfer counters (:meth:`Transport.stats
        <statebridge.connector.data.Transport.stats>`) with ``pending`` and ``computing``, the
        requests it moves and computes: what its model may read of it (any thread; a moment
        stale)."""
        return {**self.transport.stats(), "pending": len(self.pending),
                "computing": len(self.compute)}

    # -- lifecycle --------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until told to shut down or the coordinator is gone."""
        try:
            self.loop.run()
        finally:
            self.close()

    def close(self) -> None:
        self.compute.close()
        self.pending.cancel_all()
        self.maps.close()
        self.transport.close()
        self.memory.close()
        self.loop.stop()
        self.sock.close(0)

    def _send(self, message: m.Message) -> None:
        c.send_dealer(self.sock, message)

    def _heartbeat(self) -> None:
        self.maps.drop_dead_maps()
        self._heartbeats += 1
        self._send(m.Heartbeat(node_id=f"{self.setup.node_id}/{self.setup.tp_rank}",
                               seq=self._heartbeats))
        try:
            self.transport.reject_unannounced(self._may_arrive, grace=self.config.peer_timeout)
        except StatebridgeError as e:
            log.warning("rank %d: sweeping unannounced messages failed: %s",
                        self.setup.tp_rank, e)
        gone = self._coordinator_gone()
        if gone:
            self._stop_for(gone)
        elif self.coordinator_watch.expired():
            self._coordinator_silent = True
            log.warning("%s rank %d: coordinator silent for %.1f s, its process %d alive "
                        "(stopped or busy): waiting for it", self.setup.role,
                        self.setup.tp_rank, self.config.peer_timeout, self.coordinator_pid)

    def _coordinator_gone(self) -> str:
        """Why the coordinator is gone for good ("" while it is not): its local channel closed,
        or its process exited (this process's parent changed; else its pid is gone)."""
        if isinstance(self.sock, LocalDealer) and not self.sock.connected:
            return "its local channel closed"
        pid = self.coordinator_pid
        if os.getppid() != self._parent:
            # The parent died: the coordinator, or the fork server it took with it. (A dead
            # coordinator whose own parent has not reaped it yet still answers kill(pid, 0).)
            return f"its process {pid} exited"
        if self._parent == pid:
            return ""
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"its process {pid} exited"
        except PermissionError:
            pass
        return ""

    def _stop_for(self, why: str) -> None:
        if not self._stopping:
            self._stopping = True
            log.error("%s rank %d: coordinator gone (%s), shutting down", self.setup.role,
                      self.setup.tp_rank, why)
        self.loop.request_stop()

    # -- messages from the coordinator -------------------------------------------------------
    def _on_message(self) -> None:
        handlers, heard = self._handlers, False
        model_handlers = self.compute.model_handlers
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
            elif type(msg) in model_handlers:
                self.compute.submit_model(msg)          # the model's own work, in order
            else:
                self.counters.add("unexpected_messages")
        if heard:
            self.coordinator_watch.heard("coordinator")
            if self._coordinator_silent:
                self._coordinator_silent = False
                log.warning("%s rank %d: coordinator heard again", self.setup.role,
                            self.setup.tp_rank)
        if isinstance(self.sock, LocalDealer) and not self.sock.connected:
            self._stop_for("its local channel closed")      # no more wake-ups from it

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
        if info.node_id in self.routes:
            # The same node connected again (it re-dialed after a cut link or a restart): its
            # old endpoints may be broken; fresh ones for the new connection.
            for peer in self.routes.peers_of(info.node_id):
                self._fail_peer(peer, f"{info.node_id} connected again",
                                transport=peer in self.transport.peers)
        # Transfer verification: a decode rank digests what lands from a prefill group that
        # sends digests (its coordinator refused any other); a prefill rank digests what it
        # sends to a decode group that verifies.
        verify = self.config.verify_transfers and info.verify_transfers
        routes, kv_routes = self.routes.plan(info, self.maps.threshold(info), verify)
        self.maps.connect(info, routes, kv_routes)
        if self.transport.sends_complete_unattended(same_host(info.host_id)):
            self.pending.unattended_nodes.add(info.node_id)
        else:
            self.pending.unattended_nodes.discard(info.node_id)
        connected = {}
        for route in [*routes, *kv_routes]:
            if route.peer not in connected:
                connected[route.peer] = route.peer_rank
                self.transport.connect(route.peer, info.rank_addresses[route.peer_rank])
        self._send(m.RankTransports(
            tp_rank=self.setup.tp_rank, peer_node=info.node_id,
            peer_ranks=tuple(connected.values()),
            lanes=tuple(",".join(self.transport.lanes(peer)) for peer in connected),
            host_staging=self.transport.host_staging))
        log.info("%s rank %d: connected to %s (%d ranks, %s)", self.setup.role,
                 self.setup.tp_rank, info.node_id, info.tp_size, info.layout)

    def _on_prefill(self, msg: m.RankPrefill) -> None:
        if msg.peer_node not in self.routes:
            key = RequestKey(msg.peer_node, msg.request_id, msg.generation)
            self._done(key, FailureKind.TRANSFER_ERROR, f"no connection to {msg.peer_node!r}")
            return
        # The model runs on the compute thread, in arrival order; this loop keeps serving
        # heartbeats and other transfers meanwhile.
        self.compute.submit(msg)

    def _on_local_prefill(self, msg: m.RankLocalPrefill) -> None:
        self._announce(msg.generation)
        self.compute.submit(msg)

    def _after_compute(self, msg: "m.RankPrefill | m.RankLocalPrefill",
                       error: str | None, final_at: float = 0.0,
                       started_at: float = 0.0) -> None:
        """The compute thread is done with ``msg`` (``error``: why the model failed; its
        compute began at ``started_at`` and the state was final at ``final_at``,
        ``time.monotonic()``)."""
        key = key_of(msg)
        cancelled = self.compute.finish(key)
        if cancelled is not None:
            self._done(key, *cancelled)
            return
        if error is not None:
            self._done(key, FailureKind.TRANSFER_ERROR, error)
            return
        if isinstance(msg, m.RankLocalPrefill):
            self._done(key, "", "", computed=(started_at, final_at))
            return
        pending = Pending(key, msg.src_page, [], time.perf_counter(),
                          blocks=msg.src_blocks, kv_tokens=msg.kv_tokens, final_at=final_at,
                          lease=True, computed_from=started_at)
        if self._post(pending, "send", msg.src_blocks, msg.dst_blocks) \
                and key.peer_node in self.routes.verified:
            # After posting: the digest pass overlaps the transfer (the page is held until
            # every send completed, so it cannot change meanwhile).
            try:
                self._send_digests(pending, msg)
            except Exception as e:  # noqa: BLE001 -- fails this request, not the rank
                log.exception("rank %d: transfer digest of %s failed", self.setup.tp_rank, key)
                fail_pending(pending, FailureKind.TRANSFER_ERROR, f"transfer digest failed: {e}")

    def _on_recv(self, msg: m.RankRecv) -> None:
        self._announce(msg.generation)
        key = RequestKey(msg.peer_node, msg.request_id, msg.generation)
        if msg.peer_node not in self.routes:
            self._done(key, FailureKind.TRANSFER_ERROR, f"no connection to {msg.peer_node!r}")
            return
        if msg.blocks:
            try:
                check_blocks(self.kv, msg.blocks, msg.kv_tokens)
            except StatebridgeError as e:
                self._done(key, FailureKind.TRANSFER_ERROR, str(e))
                return
        pending = Pending(key, msg.page, [], time.perf_counter(), blocks=msg.blocks,
                          kv_tokens=msg.kv_tokens,
                          first_block=range_start(msg.blocks) if msg.blocks else None)
        # The source table is one range of the same length: its start is the prefill side's.
        self._post(pending, "recv", None, msg.blocks)

    def _post(self, pending: Pending, direction: str, src_blocks, dst_blocks) -> bool:
        """Post the request's transfers (:meth:`Routes.post
        <statebridge.connector.rank.routes.Routes.post>`): pending once all are posted
        (True). When a post raises (peer declared lost, transport closed, bad runs) the request
        fails now: its posted handles are cancelled and the coordinator hears it at once."""
        pending.posted_at = time.monotonic()
        try:
            self.routes.post(pending, direction, self.cache.page_offset(pending.page),
                             src_blocks, dst_blocks)
        except StatebridgeError as e:
            kind = kind_of(e)
            fail_pending(pending, kind, f"posting failed: {e}")
            self.counters.add(f"failed_{kind}")
            self._done(pending.key, *pending.failure)
            return False
        self.pending.add(pending, direction)
        return True

    # -- transfer verification ----------------------------------------------------------------
    def _send_digests(self, pending: Pending, msg: m.RankPrefill) -> None:
        """Prefill rank: the digest of what it sends each decode rank, to the coordinator."""
        by_rank = self.routes.digests(self.memory.registered, msg.peer_node, "send",
                                      self.cache.page_offset(msg.src_page), msg.src_blocks,
                                      msg.dst_blocks)
        size = self.routes.peer_size(msg.peer_node)
        ops.add("transfer_digests")
        self._send(m.RankDigest(tp_rank=self.setup.tp_rank, peer_node=msg.peer_node,
                                request_id=msg.request_id, generation=msg.generation,
                                digests=tuple(digest.total(by_rank.get(r, []))
                                              for r in range(size))))

    def _landed_digest(self, p: Pending) -> int:
        """Decode rank: the digest of what landed in ``p``'s page and KV blocks (every pair of
        its prefill node together), computed before the rank reports the request done."""
        by_rank = self.routes.digests(self.memory.registered, p.key.peer_node, "recv",
                                      self.cache.page_offset(p.page), None, p.blocks)
        ops.add("transfer_digests")
        return digest.total([d for ds in by_rank.values() for d in ds])

    def _on_cancel(self, msg: m.RankCancel) -> None:
        if msg.lost_node:
            for peer in self.routes.peers_of(msg.lost_node):
                self._fail_peer(peer, f"peer node {msg.lost_node} lost")
        key = RequestKey(msg.peer_node, msg.request_id, msg.generation)
        kind = msg.kind or FailureKind.ABORTED.value
        if self.compute.cancel(key, kind, msg.reason):
            return              # still queued or computing: answered when it comes back
        pending = self.pending.get(key)
        if pending is None:
            # Nothing in flight here (never started or already done): confirm at once.
            self._done(key, kind, msg.reason)
            return
        fail_pending(pending, kind, msg.reason)

    def _fail_peer(self, peer: str, reason: str, *, transport: bool = True) -> None:
        """``peer`` is gone (declared lost, or its node connected again): its UCX handles fail
        (``transport``: the transport declares it lost), and so do the requests waiting for its
        shared-map answers, which no handle stands for -- now, not at their transfer
        timeout."""
        if transport:
            self.transport.fail_peer(peer, reason)
        self.pending.fail_peer(peer, reason)

    def _announce(self, generation: int) -> None:
        if generation_after(generation, self.announced_generation):
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
        if generation_after(generation, self.announced_generation):
            return True
        return any(key.generation == generation for key in self.pending)

    # -- transfers ------------------------------------------------------------------------------
    def _poll_transfers(self) -> None:
        """After every loop pass: progress UCX once, copy the shared-map reads whose notice
        came, and settle the requests whose transfers all finished."""
        if not self.pending:
            return
        self.transport.progress()
        if self.maps.reads:
            self.maps.read()
        ready = self.pending.scan()
        if ready and self.setup.probes:
            self._probe(ready)
        for key in ready:
            self._settle(key)

    def _settle(self, key: RequestKey) -> None:
        """A request whose handles are all finished: answer the coordinator with its outcome."""
        p = self.pending.pop(key)
        kind, message = self.pending.outcome(p)
        self.counters.add("transfers_ok" if not kind else f"failed_{kind}")
        self.counters.add("bytes", p.nbytes)
        landed = -1
        if not kind and self.setup.role == "decode" and key.peer_node in self.routes.verified:
            try:
                landed = self._landed_digest(p)
            except Exception as e:  # noqa: BLE001 -- fails this request, not the rank
                log.exception("rank %d: transfer digest of %s failed", self.setup.tp_rank, key)
                kind, message = FailureKind.TRANSFER_ERROR.value, f"transfer digest failed: {e}"
        if kind:
            self._done(key, kind, message, nbytes=p.nbytes)
        elif self.setup.role == "prefill":
            self._done(key, kind, message, nbytes=p.nbytes,
                       computed=(p.computed_from, p.final_at), posted_at=p.posted_at)
        else:
            self._done(key, kind, message, nbytes=p.nbytes, landed_at=time.monotonic(),
                       digest=landed)

    def _probe(self, keys: list[RequestKey]) -> None:
        """An instrumented rank (``setup.probes``): a ``RankProbe`` of each request about to be
        settled, all before their ``RankDone`` (see
        :class:`~statebridge.connector.messages.RankProbe`)."""
        checksums = self.setup.probes == "checksums" and self.setup.role == "decode"
        prefill = self.setup.role == "prefill"
        now, staging = time.perf_counter(), self.transport.staging_bytes
        for key in keys:
            p = self.pending.get(key)
            ok = not self.pending.outcome(p)[0]
            checksum = kv_sum = ""
            if ok and checksums:
                checksum = page_checksum(self.geometry, self.cache.page_bytes(p.page))
                if p.blocks and self.kv is not None:
                    kv_sum = kv_checksum(self.kv, p.blocks, p.kv_tokens)
            self._send(m.RankProbe(
                tp_rank=self.setup.tp_rank, peer_node=key.peer_node, request_id=key.request_id,
                generation=key.generation, seconds=now - p.started, messages=p.messages,
                staging_bytes=staging, checksum=checksum, kv_checksum=kv_sum,
                state_final_at=p.final_at if prefill and ok else 0.0,
                held_at=time.monotonic() if not prefill and ok else 0.0))
        ops.add("probes_sent", len(keys))

    def _done(self, key: RequestKey, kind: "FailureKind | str", message: str, *,
              nbytes: int = 0, computed: tuple[float, float] = (0.0, 0.0),
              posted_at: float = 0.0, landed_at: float = 0.0, digest: int = -1) -> None:
        """Answer the coordinator (the times, ``time.monotonic()``, travel as wall-clock
        seconds: see :class:`~statebridge.connector.messages.RankDone`)."""
        self._send(m.RankDone(tp_rank=self.setup.tp_rank, peer_node=key.peer_node,
                              request_id=key.request_id, generation=key.generation,
                              kind=str(kind), message=message, nbytes=nbytes,
                              computed_from=wall_clock(computed[0]),
                              state_final_at=wall_clock(computed[1]),
                              posted_at=wall_clock(posted_at), landed_at=wall_clock(landed_at),
                              digest=digest))


def wall_clock(monotonic: float) -> float:
    """``time.monotonic()`` value ``monotonic`` as seconds since the epoch (0.0 stays 0.0:
    not measured)."""
    return monotonic + time.time() - time.monotonic() if monotonic else 0.0


def generation_after(a: int, b: int) -> bool:
    """``a`` is newer than ``b`` in the 32-bit generation sequence (serial number arithmetic,
    so the order survives the wrap-around after 2**32 attempts)."""
    return 0 < (a - b) % (1 << 32) < 1 << 31
