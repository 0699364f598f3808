"""A rank's side of the same-host shared-map protocol (:mod:`statebridge.connector.data.shared`).

A prefill rank writes a request's notice into the slot of each reading peer rank and sends it
(:meth:`SharedMaps.post_notices`), then holds the page until every reader answered
(:meth:`SharedMaps.answered`). A decode rank maps its peers' buffers at connect
(:meth:`SharedMaps.connect`), posts the receive of each notice, and when one came copies the
pair's runs out of the map into its page and KV blocks and answers (:meth:`SharedMaps.read`).
Which pairs go this way is the one rule, :func:`~statebridge.connector.data.shared.map_threshold`
(:meth:`SharedMaps.threshold`).

Device memory (both groups' pools on CUDA, one host): the prefill rank's map holds its control
words and the export record of its pool; the decode rank opens the pool once per peer rank at
connect (:meth:`~statebridge.connector.rank.memory.RankMemory.open_peer`). When a notice came
it gathers ALL of the pair's runs -- recurrent and KV, staged pairs too -- in ONE kernel launch
from a template held on its device (cached per peer and KV block count), on its own stream,
records an event (:meth:`~statebridge.connector.rank.memory.RankMemory.gather_from`), and
polls it on later loop passes; once it has fired the rank answers through the control word as
on the host. Reads stay receiver-driven: the prefill rank's process writes nothing into the
decode rank's memory (the decode rank exports nothing), so a frozen and resumed prefill rank
cannot write into a reused page.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from statebridge.connector.data import device as dev
from statebridge.connector.data import shared
from statebridge.connector.data.tags import READY_INDEX
from statebridge.connector.stats import ops
from statebridge.connector.rank.pending import Pending, fail_pending
from statebridge.errors import StatebridgeError, kind_of

if TYPE_CHECKING:
    from statebridge.connector import messages as m
    from statebridge.connector.control import EventLoop
    from statebridge.connector.data import Transport
    from statebridge.connector.rank.memory import RankMemory
    from statebridge.connector.rank.routes import KVRoute, Route
    from statebridge.state.cache import StateCache

log = logging.getLogger(__name__)

__all__ = ["SharedMaps", "Read"]

#: Most bytes a decode rank copies out of shared maps in one loop pass (see SharedMaps.read).
_READ_BUDGET = 64 << 20
#: Gather templates a decode rank keeps (per peer rank and KV block count; cleared when full).
_GATHER_TEMPLATES = 256


@dataclass
class Read:
    """A decode rank's shared-map read of one request from one prefill rank: its "ready"
    receive, then the copy of the pair's recurrent runs and KV runs out of the mapping (device
    memory: the gather, in flight while ``event`` is set)."""

    pending: Pending
    peer_rank: int
    peer: str
    handle: object                     # the "ready" notice's TransferHandle
    slot: shared.NoticeSlot            # where the notice lands in this rank's buffer
    event: object = None               # device memory: the gather's event, until it fired
    notice: "shared.Notice | None" = None
    source: object = None              # the peer's pool, held while the gather reads it


class SharedMaps:
    """This rank's shared-map links (one per peer node that has pairs going that way), its
    peers' mapped buffers (decode) and the reads under way. Loop thread only."""

    def __init__(self, role: str, tp_rank: int, side: shared.MapSide, memory: "RankMemory",
                 cache: "StateCache", transport: "Transport", loop: "EventLoop") -> None:
        self.role = role
        self.tp_rank = tp_rank
        self.side = side                       # this rank's group, for the rule
        self.memory = memory
        self.cache = cache
        self.transport = transport
        self.loop = loop
        #: Peer node -> the peer ranks this rank reads from (decode) or notifies (prefill)
        #: through shared maps, in order; decode: UCX peer id -> the mapping (or why not).
        self.peers: dict[str, list[tuple[int, str]]] = {}
        self.maps: dict[str, "shared.PeerMap | StatebridgeError"] = {}
        self.runs: dict[str, np.ndarray] = {}         # UCX peer id -> its pairs' runs
        self.kv: dict[str, list["KVRoute"]] = {}      # UCX peer id -> its shared-map KV pairs
        self.reads: list[Read] = []            # decode: reads whose notice is awaited
        self._serial = 0                       # prefill: numbers its requests' answers
        #: Device memory (this rank's pool on CUDA): the peers' opened pools (or why not),
        #: and the gather templates on this rank's device.
        self.device = memory.memory == "cuda"
        self.pools: dict[str, object] = {}
        self.templates: dict[tuple, object] = {}

    def threshold(self, info: "m.GroupInfo") -> int | None:
        """The shared-map rule for this rank's link with the peer group ``info``, as both
        sides see it: which pairs read out of the prefill rank's map (None: none)."""
        peer = shared.MapSide.of_info(info)
        return shared.map_threshold(self.side, peer) if self.role == "prefill" \
            else shared.map_threshold(peer, self.side)

    def connect(self, info: "m.GroupInfo", routes: "list[Route]",
                kv_routes: "list[KVRoute]") -> None:
        """The peer group ``info`` connected with these planned routes: note the peer ranks
        of the pairs that go through the map, their runs, and (decode) map their buffers."""
        peers = sorted({(r.peer_rank, r.peer) for r in [*routes, *kv_routes] if r.shm})
        self.peers[info.node_id] = peers
        # Per peer rank, its shared-map pairs' runs relative to the two pages (fixed per peer).
        self.runs.update({peer: np.concatenate(
            [r.pair.runs for r in routes if r.shm and r.peer == peer]
            or [np.zeros((0, 3), dtype=np.int64)]) for _, peer in peers})
        self.kv.update({peer: [r for r in kv_routes if r.shm and r.peer == peer]
                        for _, peer in peers})
        if self.role == "decode":
            for peer_rank, peer in peers:
                self.templates = {k: v for k, v in self.templates.items() if k[0] != peer}
                try:
                    self.maps[peer] = shared.PeerMap(info.rank_pids[peer_rank],
                                                     info.rank_shm_fds[peer_rank])
                except StatebridgeError as e:     # its requests fail, naming it
                    log.error("decode rank %d: %s", self.tp_rank, e)
                    self.maps[peer] = e
                    continue
                if self.device:
                    try:
                        self.pools[peer] = pool = self.memory.open_peer(self.maps[peer])
                        log.info("decode rank %d: opened %s's device pool (%d bytes, GPU %s)",
                                 self.tp_rank, peer, pool.record.nbytes, pool.record.uuid.hex())
                    except StatebridgeError as e:
                        log.error("decode rank %d: %s", self.tp_rank, e)
                        self.pools[peer] = e

    def drop_dead_maps(self) -> None:
        """Unmap the buffers of prefill ranks whose process has exited: a mapping keeps the
        memfd's memory alive, and a restarted prefill node comes back under a new node id (its
        old maps would never be replaced). A read of a dropped peer fails, naming it."""
        for peer, mapped in list(self.maps.items()):
            if isinstance(mapped, shared.PeerMap) and not shared.process_alive(mapped.pid):
                log.info("decode rank %d: %s exited, unmapping its buffer", self.tp_rank, peer)
                del self.maps[peer]
                self.pools.pop(peer, None)        # a gather in flight holds its own reference

    # -- per request --------------------------------------------------------------------------
    def post_notices(self, pending: Pending, direction: str, base: int) -> None:
        """Shared-map reads of the request (none when its node has no such pair): a prefill
        rank writes the "ready" notice of each peer rank into its slot and sends it; a decode
        rank posts the receive of the notice (the copy and the answer follow in
        :meth:`read`). Raises like the transport's posts."""
        peers = self.peers.get(pending.key.peer_node)
        if not peers:
            return
        transport, key, slots = self.transport, pending.key, self.memory.notices
        if direction == "send":
            self._serial = serial = shared.next_serial(self._serial)
            pending.serial = serial
            first_block = pending.blocks[0] if pending.blocks else 0
            for peer_rank, peer in peers:
                slot = slots.slot(pending.page, peer_rank)
                slot.write(base, serial, self.memory.kv_base, first_block)
                pending.answers.append((slot, peer))
                pending.handles.append(transport.post_notice(
                    "send", peer, key.generation, self.tp_rank, READY_INDEX, slot.offset,
                    shared.NOTICE_BYTES))
            return
        for peer_rank, peer in peers:
            slot = slots.slot(pending.page, peer_rank)
            handle = transport.post_notice("recv", peer, key.generation, peer_rank, READY_INDEX,
                                           slot.offset, shared.NOTICE_BYTES)
            pending.handles.append(handle)
            pending.unread += 1
            self.reads.append(Read(pending, peer_rank, peer, handle, slot))

    @staticmethod
    def answered(p: Pending) -> bool:
        """Prefill rank: whether every shared-map reader of ``p`` answered (or ``p`` failed:
        then nothing waits for them; a reader still copying reads, it writes nothing here)."""
        if p.failure is not None:
            return True
        serial = p.serial
        for slot, _ in p.answers:
            if not slot.answered(serial):
                return False
        return True

    def read(self) -> None:
        """Decode rank: for each shared-map read whose notice came, copy the pair's runs out
        of the prefill rank's mapping into this rank's page, then answer "done" (the prefill
        rank frees its page once every reader answered). A read whose notice was cancelled
        copies nothing; a request that failed meanwhile copies nothing and answers. At most
        :data:`_READ_BUDGET` bytes per loop pass (the loop comes straight back for the rest):
        heartbeats and cancels are never held up by a backlog of copies.

        Device memory: the copy is a gather launched here and left running; a later pass
        sees its event fired and answers then (the loop does not sleep while one runs). The
        request stays unsettled until then, whatever happened to it meanwhile: nothing is
        settled while a gather may still write into its page."""
        waiting, copied, running = [], 0, False
        for read in self.reads:
            p = read.pending
            if read.event is not None:                       # a gather in flight
                if not self.memory.gather_done(read.event):
                    waiting.append(read)
                    running = True
                    continue
                read.event = read.source = None
                p.unread -= 1
                self._answer(read, read.notice)
                continue
            handle = read.handle
            if copied >= _READ_BUDGET or not handle.finished():
                waiting.append(read)
                continue
            if handle.error is not None:
                p.unread -= 1
                continue
            notice = read.slot.read()
            if p.failure is None:
                try:
                    if self.device:
                        self._gather(read, notice)
                        read.notice = notice
                        waiting.append(read)
                        running = True
                        continue
                    copied += self._copy(read, notice)
                except StatebridgeError as e:
                    fail_pending(p, kind_of(e), f"shared-map read failed: {e}")
            p.unread -= 1
            self._answer(read, notice)
        self.reads = waiting
        if running or copied >= _READ_BUDGET and waiting:
            self.loop.call_soon(lambda: None)    # no sleep before the next pass

    def _peer_map(self, peer: str) -> shared.PeerMap:
        """The mapping of ``peer``'s buffer; the error that kept it from being mapped (or that
        it was dropped) otherwise."""
        src = self.maps.get(peer)
        if not isinstance(src, shared.PeerMap):
            raise src if isinstance(src, StatebridgeError) else StatebridgeError(
                f"no shared map of {peer!r}")
        return src

    def _gather(self, read: Read, notice: shared.Notice) -> None:
        """Launch the gather of every run of the pair (this rank, ``read.peer_rank``) of the
        request out of the peer's device pool: the recurrent runs at the two pages, the KV
        runs at the two tables' first blocks, one launch (:meth:`_copy` on the host). The
        template comes from the cache: per peer rank and, with KV, per block count; only a
        scattered decode table builds runs for the request."""
        src = self.pools.get(read.peer)
        if not isinstance(src, dev.PeerPool):
            raise src if isinstance(src, StatebridgeError) else StatebridgeError(
                f"no device pool of {read.peer!r} is open")
        p, peer = read.pending, read.peer
        recurrent = self.runs[peer]
        bases = [(notice.page_offset, self.cache.page_offset(p.page))]
        kv = self.kv.get(peer)
        key: tuple | None = (peer, 0)
        groups: list = [recurrent]
        if kv and p.blocks:
            first, n = notice.first_block, len(p.blocks)
            strides = {(r.pair.src_block_stride, r.pair.dst_block_stride) for r in kv}
            if p.first_block is not None and len(strides) == 1:
                (src_stride, dst_stride), = strides
                key = (peer, n)
                groups = [recurrent, None]            # built below when not cached
                bases.append((notice.kv_base + first * src_stride,
                              self.memory.kv_base + p.first_block * dst_stride))
            else:                                     # a scattered decode table: its own runs
                key = None
                groups.append(np.concatenate([r.pair.runs(range(first, first + n), p.blocks)
                                              for r in kv]))
                bases.append((notice.kv_base, self.memory.kv_base))
        template = self.templates.get(key) if key is not None else None
        if template is None:
            if groups[-1] is None:
                groups[-1] = np.concatenate([r.pair.contiguous_runs(key[1]) for r in kv])
            template = self.memory.prepare_gather(groups)
            if key is not None:
                if len(self.templates) >= _GATHER_TEMPLATES:
                    self.templates.clear()
                self.templates[key] = template
        read.source = src
        read.event = self.memory.gather_from(src, template, bases)
        ops.add("device_gathers")

    def _answer(self, read: Read, notice: shared.Notice) -> None:
        """Tell the prefill rank of ``read`` that this rank is done with its page (the
        notice's answer, :meth:`~statebridge.connector.data.shared.Notice.answer`)."""
        try:
            if not notice.answer(self._peer_map(read.peer)):
                log.info("decode rank %d: %s no longer waits for serial %d (answer word at "
                         "%d)", self.tp_rank, read.peer, notice.serial, notice.answer_offset)
        except StatebridgeError as e:             # the prefill side's timeout covers it
            log.warning("decode rank %d: answering %s failed: %s", self.tp_rank, read.peer, e)

    def _copy(self, read: Read, notice: shared.Notice) -> int:
        """Copy the runs of the pair (this rank, ``read.peer_rank``) of the request out of the
        peer's mapping into this rank's page and KV blocks; the ``notice`` gave the source
        page's offset, the source KV pool's base and the source table's first block (the
        prefill side's table is always one range of consecutive blocks)."""
        src = self._peer_map(read.peer)
        p = read.pending
        kv_base = self.memory.kv_base
        # The cached run tables go to the copy as they are, with the request's bases (the C
        # copy shifts and checks every row): no per-request arrays.
        groups = [(self.runs[read.peer], notice.page_offset, self.cache.page_offset(p.page))]
        kv = self.kv.get(read.peer)
        if kv and p.blocks:
            first, n = notice.first_block, len(p.blocks)
            src_pool, d0 = notice.kv_base, p.first_block
            for route in kv:
                pair = route.pair
                if d0 is None:                  # a scattered decode table: its own runs
                    groups.append((pair.runs(range(first, first + n), p.blocks), src_pool,
                                   kv_base))
                else:
                    groups.append((pair.contiguous_runs(n),
                                   src_pool + first * pair.src_block_stride,
                                   kv_base + d0 * pair.dst_block_stride))
        copied = self.memory.copy_from(src, groups)
        ops.add("shared_map_reads")
        return copied

    def close(self) -> None:
        self.reads.clear()
        self.maps.clear()
        self.pools.clear()
        self.templates.clear()
