"""A rank's pairs with each peer group, planned once per connection, and the ONE path that posts
a request's transfers -- on both sides.

At connect the rank turns the transfer plans (:mod:`statebridge.state.plan` for the recurrent
state, :mod:`statebridge.state.kv` for attention KV) into :class:`Route`\\ s and
:class:`KVRoute`\\ s: the other rank, its UCX peer id, and the zero-copy runs checked once as a
:class:`~statebridge.connector.data.RunTemplate`. Per request :meth:`Routes.post` adds the
request's page offset (and KV block bases) and posts every route: a prefill rank sends, a
decode rank receives, in the same order (recurrent pairs, then KV pairs, then the shared-map
notices), with the same tags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from statebridge.connector.data import RunTemplate
from statebridge.connector.rank.digest import StreamDigest
from statebridge.state.kv import BlockGeometry, KVPairPlan, KVPlan, range_start
from statebridge.state.layout import PageGeometry
from statebridge.state.plan import PairPlan, TransferPlan

if TYPE_CHECKING:
    from statebridge.connector import messages as m
    from statebridge.connector.data import Transport
    from statebridge.connector.rank.pending import Pending
    from statebridge.state.spec import StateSpec

__all__ = ["Route", "KVRoute", "Routes", "MapNotices", "pair_digest"]

#: Block counts whose KV templates a KV route keeps (cleared when full).
_KV_TEMPLATES = 256


@dataclass(frozen=True)
class Route:
    """One rank pair of this rank with a peer node, fixed per peer: the pair's plan, the other
    rank, its UCX peer id, and the zero-copy runs as a template (None for a staged pair, whose
    single message is ``staged_bytes`` long)."""

    pair: PairPlan
    peer_rank: int
    peer: str
    template: "RunTemplate | None"
    staged_bytes: int
    shm: bool = False                  # read out of the prefill rank's shared map (zero-copy;
    #                                    device memory: staged pairs too, gathered)
    #: This side's runs of the pair in wire order (transfer verification on; else None).
    digest: "StreamDigest | None" = None


@dataclass(frozen=True)
class KVRoute:
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
    #: (block count, column) -> their digest plan (transfer verification)
    _digests: dict = field(default_factory=dict, repr=False, compare=False)

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

    def digest(self, blocks: int, col: int) -> StreamDigest:
        """The digest plan of :meth:`template` ``(blocks, col)``."""
        key = (blocks, col)
        digest = self._digests.get(key)
        if digest is None:
            if len(self._digests) >= _KV_TEMPLATES:
                self._digests.clear()
            template = self.template(blocks, col)
            digest = self._digests[key] = StreamDigest(template.offsets, template.lengths)
        return digest


class MapNotices(Protocol):
    """What :class:`Routes` needs of the rank's shared-map side
    (:class:`~statebridge.connector.rank.shared_map.SharedMaps`)."""

    #: This rank's pool is device memory (staged pairs read out of the map too).
    device: bool

    def post_notices(self, pending: "Pending", direction: str, base: int) -> None:
        """Post the request's shared-map notices (after its routes)."""


@dataclass(eq=False, repr=False)
class Routes:
    """This rank's routes per peer node, and :meth:`post`. Loop thread only."""

    role: str
    tp_rank: int
    spec: "StateSpec"
    geometry: PageGeometry
    kv_geometry: BlockGeometry | None
    kv_base: int
    transport: "Transport"
    maps: MapNotices
    #: peer node -> this rank's pairs
    recurrent: dict[str, list[Route]] = field(default_factory=dict, init=False)
    #: peer node -> this rank's KV pairs
    kv: dict[str, list[KVRoute]] = field(default_factory=dict, init=False)
    #: Peer nodes whose transfers this rank digests (transfer verification).
    verified: set[str] = field(default_factory=set, init=False)
    #: peer node -> its TP size
    _peer_sizes: dict[str, int] = field(default_factory=dict, init=False)

    def __contains__(self, node: str) -> bool:
        return node in self.recurrent

    def peers_of(self, node: str) -> list[str]:
        """The UCX peer ids of ``node``'s ranks that this rank has pairs with."""
        peers = [route.peer for route in self.recurrent.get(node, ())]
        return peers + [r.peer for r in self.kv.get(node, ()) if r.peer not in peers]

    # -- at connect ---------------------------------------------------------------------------
    def plan(self, info: "m.GroupInfo", shm: int | None,
             verify: bool = False) -> tuple[list[Route], list[KVRoute]]:
        """Plan (and keep) this rank's pairs with the peer group ``info``. ``shm``: the
        shared-map rule's threshold for the link (None: no pair reads out of the map).
        ``verify``: the link's transfers are verified (:meth:`digests`)."""
        peer_geo = PageGeometry(self.spec, info.tp_size, info.layout,
                                region_align=info.region_align, page_size=info.page_size)
        routes = self.recurrent[info.node_id] = self._routes(info.node_id, peer_geo, shm,
                                                             verify)
        self._peer_sizes[info.node_id] = info.tp_size
        if verify:
            self.verified.add(info.node_id)
        else:
            self.verified.discard(info.node_id)
        kv_routes = self.kv[info.node_id] = self._kv_routes(info, routes, shm is not None)
        return routes, kv_routes

    def _routes(self, node: str, peer_geo: PageGeometry, shm: int | None,
                verify: bool = False) -> list[Route]:
        """This rank's pairs with ``node`` (whose ranks have ``peer_geo``), each with its UCX
        peer and, for zero-copy pairs, the runs checked once as a
        :class:`~statebridge.connector.data.RunTemplate`. With ``shm`` (a byte threshold)
        zero-copy pairs moving at least that much per request read out of the shared map."""
        routes = []
        if self.role == "prefill":
            plan = TransferPlan(self.geometry, peer_geo)
            pairs, direction = plan.for_source(self.tp_rank), "send"
        else:
            plan = TransferPlan(peer_geo, self.geometry)
            pairs, direction = plan.for_destination(self.tp_rank), "recv"
        for pair in pairs:
            peer_rank = pair.dst_rank if direction == "send" else pair.src_rank
            template = None if pair.staged else self.transport.template(pair.runs, direction)
            staged_bytes = int(pair.pack[:, 2].sum()) if pair.staged else 0
            # Device memory gathers every pair of a request in one launch, staged ones too.
            routes.append(Route(pair, peer_rank, f"{node}/{peer_rank}", template, staged_bytes,
                                shm=shm is not None and (template is not None or self.maps.device)
                                and pair.nbytes >= shm,
                                digest=pair_digest(pair, direction) if verify else None))
        return routes

    def _kv_routes(self, info: "m.GroupInfo", routes: list[Route],
                   shm: bool = False) -> list[KVRoute]:
        """This rank's KV pairs with the peer group ``info`` (none without KV on both sides);
        ``shm``: read out of the shared map."""
        if self.kv_geometry is None or not info.num_blocks:
            return []
        peer_geo = BlockGeometry(self.spec.kv, info.tp_size, info.kv_layout, info.block_size,
                                 info.num_blocks)
        if self.role == "prefill":
            plan = KVPlan(self.kv_geometry, peer_geo)
            pairs = plan.for_source(self.tp_rank)
        else:
            plan = KVPlan(peer_geo, self.kv_geometry)
            pairs = plan.for_destination(self.tp_rank)
        recurrent = {r.peer_rank: len(r.template) if r.template is not None else 0
                     for r in routes}
        out = []
        for pair in pairs:
            peer_rank = pair.dst_rank if self.role == "prefill" else pair.src_rank
            out.append(KVRoute(pair, peer_rank, f"{info.node_id}/{peer_rank}",
                               recurrent.get(peer_rank, 0), shm))
        return out

    # -- per request --------------------------------------------------------------------------
    def post(self, pending: "Pending", direction: str, base: int,
             src_blocks: "tuple[int, ...] | None" = None,
             dst_blocks: tuple[int, ...] = ()) -> None:
        """Post every route of this rank with the request's peer node: the recurrent pairs at
        page offset ``base`` (zero-copy from their templates, staged ones packed from /
        unpacked into the page), the KV pairs of the block tables (:meth:`_post_kv`), then the
        shared-map notices. Handles and byte counts go into ``pending``. Raises
        :class:`~statebridge.errors.StatebridgeError` when a post fails (the handles posted so
        far are in ``pending``)."""
        transport = self.transport
        node, generation = pending.key.peer_node, pending.key.generation
        for route in self.recurrent[node]:
            pair = route.pair
            if route.shm:                        # read out of the shared map: no post
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
        if dst_blocks:
            self._post_kv(pending, direction, src_blocks, dst_blocks)
        self.maps.post_notices(pending, direction, base)

    def _kv_runs(self, node: str, direction: str, src_blocks: "tuple[int, ...] | None",
                 dst_blocks: tuple[int, ...], digests: bool = False):
        """Each KV route of ``node`` with its runs of the request on this side and the base
        they are posted at: ``(route, template, base)``, or with ``digests``
        ``(route, digest plan, base)``."""
        routes = self.kv.get(node, ())
        if not routes:
            return
        col = 0 if direction == "send" else 1
        n = len(dst_blocks)
        if src_blocks is None:                   # a range of n blocks, relative to its start
            src_blocks, src_start = range(n), 0
        else:
            src_start = range_start(src_blocks) if len(src_blocks) == n else None
        dst_start = range_start(dst_blocks)
        contiguous = src_start is not None and dst_start is not None
        start = src_start if col == 0 else dst_start
        for route in routes:
            pair = route.pair
            if contiguous:
                template = route.digest(n, col) if digests else route.template(n, col)
                base = self.kv_base + start * (pair.src_block_stride if col == 0
                                               else pair.dst_block_stride)
            else:
                shift = np.zeros(3, dtype=np.int64)
                shift[col] = self.kv_base
                template, base = RunTemplate(pair.runs(src_blocks, dst_blocks) + shift, col,
                                             "KV runs"), 0
                if digests:
                    template = StreamDigest(template.offsets, template.lengths)
            yield route, template, base

    def _post_kv(self, pending: "Pending", direction: str,
                 src_blocks: "tuple[int, ...] | None", dst_blocks: tuple[int, ...]) -> None:
        """Post this rank's KV runs of the request (absolute offsets: the pool's base added on
        this rank's side).

        The prefill side's block table is always one range of consecutive ids: a decode rank
        passes ``src_blocks`` None (it knows the source table's length, not its start, and the
        runs' sizes and order do not depend on the start). Block tables that are ranges on
        both sides (the decode side's allocator prefers them) post the pair's template for
        that many blocks at this side's first block: per request only the base is added and
        checked. Other tables build and check their runs for the request."""
        generation = pending.key.generation
        for route, template, base in self._kv_runs(pending.key.peer_node, direction, src_blocks,
                                                   dst_blocks):
            pair = route.pair
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

    # -- transfer verification --------------------------------------------------------------
    def peer_size(self, node: str) -> int:
        """The TP size of peer node ``node``'s group."""
        return self._peer_sizes[node]

    def digests(self, buffer, key_node: str, direction: str, base: int,
                src_blocks: "tuple[int, ...] | None" = None,
                dst_blocks: tuple[int, ...] = ()) -> dict[int, list]:
        """The digests (:mod:`~statebridge.connector.rank.digest`) of every pair of this rank
        with ``key_node`` for one request, from ``buffer`` (the rank's registered buffer: the
        pages, then the KV pool), by the other rank: ``{peer rank: [0-d tensors]}``. The same
        arguments as :meth:`post`; a prefill rank digests what it sends, a decode rank what
        landed."""
        out: dict[int, list] = {}
        for route in self.recurrent.get(key_node, ()):
            out.setdefault(route.peer_rank, []).append(route.digest.of(buffer, base))
        if dst_blocks:
            for route, digest, kv_base in self._kv_runs(key_node, direction, src_blocks,
                                                        dst_blocks, digests=True):
                out.setdefault(route.peer_rank, []).append(digest.of(buffer, kv_base))
        return out


def pair_digest(pair: PairPlan, direction: str) -> StreamDigest:
    """A recurrent pair's digest plan on this side: its zero-copy runs in plan order, or (a
    staged pair) its pack / unpack runs in staging order -- the same stream on both sides."""
    if not pair.staged:
        col = 0 if direction == "send" else 1
        return StreamDigest(pair.runs[:, col], pair.runs[:, 2])
    if direction == "send":
        table = pair.pack[np.argsort(pair.pack[:, 1], kind="stable")]
        return StreamDigest(table[:, 0], table[:, 2])
    table = pair.unpack[np.argsort(pair.unpack[:, 0], kind="stable")]
    return StreamDigest(table[:, 1], table[:, 2])
