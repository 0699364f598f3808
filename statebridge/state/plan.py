"""The transfer plan: which bytes of a source page go where in a destination page.

Computed once per (source group, destination group) pair -- pure integer arithmetic, no I/O.
For every (source rank, destination rank) it lists contiguous byte runs relative to the page
start; per request only the two page base offsets are added (:meth:`PairPlan.runs_at`).

How it is built, per rank pair (s, d):

1. For every state tensor and segment, the destination's global channel range is intersected
   with the source's (:mod:`statebridge.state.sharding`). A segment that every source rank holds
   whole (replicated, or a source TP of 1) is taken from exactly ONE source rank: the one that
   feeds ``d`` the channel just before it (so equal TP with equal layouts stays one run per pair),
   never once per source rank.
2. Each intersection is a *box* ``(all layers) x (channel range) x (all inner)`` in both pages.
3. The box is cut into *units*: the longest run of innermost axes that is contiguous on BOTH
   sides (same trailing axis order, full extents). Units are paired one to one.
4. Paired units are sorted by destination offset and coalesced where both sides continue
   (bridging alignment padding when both gaps are pure padding).

If the two sides' axis orders differ, pairing can cut each side's natural contiguous pieces into
many small runs. The pair is then flagged ``staged``: the source packs its natural pieces into a
contiguous staging buffer (``pack``), sends it as one message, and the destination scatters it
(``unpack``). The zero-copy runs are kept for every pair; the data plane chooses::

      source page                         staging (staged pairs)          destination page
      [==a==]   [==b==]      pack ->      [==a==|==b==]      unpack ->    [a0][b0][a1][b1]...
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from statebridge.errors import ConfigError
from statebridge.state.layout import Layout, PageGeometry, RegionLayout
from statebridge.state.sharding import SegmentShard, shard_segments
from statebridge.state.spec import StateSpec

__all__ = ["Box", "PairPlan", "PairTable", "TransferPlan", "paired_units", "coalesce"]

_EMPTY = np.zeros((0, 3), dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Box:
    """A channel range of one tensor that moves from one source rank to one destination rank
    (all layers, all inner elements). Channel starts are local to each side."""

    group: int
    tensor: str
    segment: str
    src_channel: int
    dst_channel: int
    channels: int


@dataclass(frozen=True, eq=False)
class PairPlan:
    """Everything one source rank sends to one destination rank for one request.

    All arrays are int64 ``[R, 3]`` byte triples relative to page starts:

    - ``runs``:   (src offset, dst offset, length) -- zero-copy pairing, sorted by dst offset;
    - ``pack``:   (src offset, staging offset, length) -- the source's natural pieces;
    - ``unpack``: (staging offset, dst offset, length).
    """

    src_rank: int
    dst_rank: int
    boxes: tuple[Box, ...]
    runs: np.ndarray
    pack: np.ndarray
    unpack: np.ndarray
    nbytes: int
    staged: bool
    dst_pieces: int

    @property
    def src_pieces(self) -> int:
        """Natural contiguous pieces of the source page this pair reads."""
        return len(self.pack)

    @property
    def staging_bytes(self) -> int:
        """Size of the staging buffer of a staged pair (0 when zero-copy)."""
        return int(self.pack[:, 2].sum()) if self.staged else 0

    @property
    def messages(self) -> int:
        """Messages on the wire per request: one staging buffer, or one per zero-copy run."""
        return 1 if self.staged else len(self.runs)

    @property
    def wire_bytes(self) -> int:
        """Bytes sent per request (payload plus any bridged alignment padding)."""
        table = self.pack if self.staged else self.runs
        return int(table[:, 2].sum())

    def runs_at(self, src_base: int, dst_base: int) -> np.ndarray:
        """The zero-copy runs with the two pages' byte offsets added."""
        return self.runs + np.array([src_base, dst_base, 0], dtype=np.int64)

    def summary(self) -> dict[str, Any]:
        return {
            "src_rank": self.src_rank,
            "dst_rank": self.dst_rank,
            "runs": self.messages,
            "bytes": self.nbytes,
            "zero_copy_runs": len(self.runs),
            "src_pieces": self.src_pieces,
            "dst_pieces": self.dst_pieces,
            "staged": self.staged,
            "staging_bytes": self.staging_bytes,
        }


class PairTable:
    """Queries over ``self.pairs`` (``(src rank, dst rank) -> pair plan``, sorted), shared by
    the page plan and the KV plan."""

    pairs: dict

    def __iter__(self) -> Iterator:
        return iter(self.pairs.values())

    def pair(self, src_rank: int, dst_rank: int):
        """The plan of one rank pair, or None when the source sends nothing to that rank."""
        return self.pairs.get((src_rank, dst_rank))

    def for_source(self, src_rank: int) -> list:
        return [p for p in self if p.src_rank == src_rank]

    def for_destination(self, dst_rank: int) -> list:
        return [p for p in self if p.dst_rank == dst_rank]


class TransferPlan(PairTable):
    """Runs between every (source rank, destination rank) of two page geometries.

    Build with :meth:`build` from a spec, or directly from two :class:`PageGeometry` objects
    (which may carry padded page sizes advertised by a peer).
    """

    def __init__(self, src: PageGeometry, dst: PageGeometry) -> None:
        if src.spec.to_dict() != dst.spec.to_dict():
            raise ConfigError(f"source and destination state specs differ: "
                              f"{src.spec.fingerprint()} != {dst.spec.fingerprint()}")
        self.src = src
        self.dst = dst
        self.spec = src.spec
        src_pad = _padding_table(src)
        dst_pad = _padding_table(dst)
        pairs = {}
        for d in range(dst.tp_size):
            sources = _boxes_for_destination(self.spec, src.tp_size, dst.tp_size, d)
            for s, boxes in sources.items():
                pairs[(s, d)] = _pair_plan(src, dst, s, d, tuple(boxes), src_pad, dst_pad)
        self.pairs: dict[tuple[int, int], PairPlan] = dict(sorted(pairs.items()))

    @classmethod
    def build(cls, spec: StateSpec, src_tp: int, src_layout: "Layout | str", dst_tp: int,
              dst_layout: "Layout | str | None" = None) -> "TransferPlan":
        """Plan from ``src_tp`` ranks with ``src_layout`` to ``dst_tp`` ranks with
        ``dst_layout`` (default: the same layout)."""
        dst_layout = src_layout if dst_layout is None else dst_layout
        return cls(PageGeometry(spec, src_tp, src_layout), PageGeometry(spec, dst_tp, dst_layout))

    # -- queries (and PairTable's) --------------------------------------------------------
    @property
    def bytes_per_request(self) -> int:
        return sum(p.nbytes for p in self)

    @property
    def messages_per_request(self) -> int:
        return sum(p.messages for p in self)

    @property
    def staging_bytes_per_request(self) -> int:
        return sum(p.staging_bytes for p in self)

    def summary(self) -> dict[str, Any]:
        """Plain-data summary (the CLI's ``--json`` output)."""
        def side(g: PageGeometry) -> dict[str, Any]:
            return {"tp": g.tp_size, "layout": g.layout.name, "page_size": g.page_size,
                    "data_bytes": g.data_bytes}
        return {
            "model_type": self.spec.model_type,
            "state_layers": self.spec.num_state_layers,
            "src": side(self.src),
            "dst": side(self.dst),
            "messages_per_request": self.messages_per_request,
            "bytes_per_request": self.bytes_per_request,
            "staging_bytes_per_request": self.staging_bytes_per_request,
            "pairs": [p.summary() for p in self],
        }


# -- step 1: which channels come from which source rank -----------------------------------------

def _owner(index: int, shard_size: int) -> int:
    return index // shard_size


def _boxes_for_destination(spec: StateSpec, src_tp: int, dst_tp: int,
                           d: int) -> dict[int, list[Box]]:
    """Boxes that destination rank ``d`` receives, keyed by source rank."""
    out: dict[int, list[Box]] = {}
    for gi, group in enumerate(spec.groups):
        for tensor in group.tensors:
            dst_shards = shard_segments(tensor, dst_tp, d)
            src_shards = [shard_segments(tensor, src_tp, s) for s in range(src_tp)]
            whole = [all(src_shards[s][i].size == seg.size for s in range(src_tp))
                     for i, seg in enumerate(tensor.segments)]
            chosen = _replica_sources(dst_shards, whole, src_tp, d)
            for i, dsh in enumerate(dst_shards):
                if whole[i]:
                    s = chosen[i]
                    ssh = src_shards[s][i]
                    pieces = [(s, ssh, dsh.global_start, dsh.global_stop)]
                else:
                    pieces = []
                    for s in range(src_tp):
                        ssh = src_shards[s][i]
                        lo = max(ssh.global_start, dsh.global_start)
                        hi = min(ssh.global_stop, dsh.global_stop)
                        if lo < hi:
                            pieces.append((s, ssh, lo, hi))
                for s, ssh, lo, hi in pieces:
                    out.setdefault(s, []).append(Box(
                        gi, tensor.name, dsh.segment.name,
                        src_channel=ssh.local_start + lo - ssh.global_start,
                        dst_channel=dsh.local_start + lo - dsh.global_start,
                        channels=hi - lo))
    return out


def _replica_sources(dst_shards: tuple[SegmentShard, ...], whole: list[bool], src_tp: int,
                     d: int) -> dict[int, int]:
    """For each segment every source holds whole, the ONE source rank ``d`` takes it from.

    Prefer the rank that feeds ``d`` the channel just before the segment (then the two pieces
    are adjacent on both sides and coalesce), else the rank that feeds the next split segment,
    else spread destinations over sources.
    """
    def last_owner(i: int) -> int:
        sh = dst_shards[i]
        return _owner(sh.global_stop - 1, sh.segment.size // src_tp)

    def first_owner(i: int) -> int:
        sh = dst_shards[i]
        return _owner(sh.global_start, sh.segment.size // src_tp)

    chosen: dict[int, int] = {}
    prev: int | None = None
    for i in range(len(dst_shards)):
        if not whole[i]:
            prev = last_owner(i)
            continue
        if prev is None:
            nxt = next((j for j in range(i + 1, len(dst_shards)) if not whole[j]), None)
            prev = first_owner(nxt) if nxt is not None else d % src_tp
        chosen[i] = prev
    return chosen


# -- steps 2-4: boxes -> byte runs ----------------------------------------------------------------

def _box_units(src: RegionLayout, dst: RegionLayout, box: Box) -> np.ndarray:
    """Paired units ``[U, 3]`` (src off, dst off, len) of one box, in destination order."""
    ch = src.tensor.channel_axis
    ext = dict(dst.dim)
    ext[ch] = box.channels
    item = src.itemsize
    return paired_units(src.order, dst.order, ext, src.dim, dst.dim, src.strides, dst.strides,
                        item, src.offset + box.src_channel * src.strides[ch] * item,
                        dst.offset + box.dst_channel * dst.strides[ch] * item)


def paired_units(src_order: str, dst_order: str, ext: dict[str, int], src_dim: dict[str, int],
                 dst_dim: dict[str, int], src_strides: dict[str, int],
                 dst_strides: dict[str, int], item: int, src_off: int,
                 dst_off: int) -> np.ndarray:
    """Paired byte units ``[U, 3]`` (src off, dst off, len), in destination order, of a box of
    extents ``ext`` (per axis letter) starting at byte ``src_off`` / ``dst_off`` in two arrays
    with the given axis orders, extents and element strides. A unit is the longest run of
    trailing axes in the same order on both sides and full on both (page regions and KV block
    pools alike)."""
    unit_axes: list[str] = []
    for a_src, a_dst in zip(reversed(src_order), reversed(dst_order)):
        if a_src != a_dst:
            break
        unit_axes.append(a_dst)
        if ext[a_dst] != src_dim[a_dst] or ext[a_dst] != dst_dim[a_dst]:
            break
    unit_bytes = math.prod(ext[a] for a in unit_axes) * item
    src = np.array(src_off, dtype=np.int64)
    dst = np.array(dst_off, dtype=np.int64)
    for axis in dst_order:
        if axis in unit_axes:
            continue
        idx = np.arange(ext[axis], dtype=np.int64)
        src = src[..., None] + idx * (src_strides[axis] * item)
        dst = dst[..., None] + idx * (dst_strides[axis] * item)
    src, dst = src.reshape(-1), dst.reshape(-1)
    return np.stack([src, dst, np.full_like(src, unit_bytes)], axis=1)


def coalesce(runs: np.ndarray) -> np.ndarray:
    """Merge consecutive runs (sorted) that continue on both sides (no padding bridged)."""
    return _coalesce(runs, None, None)


def _padding_table(geometry: PageGeometry) -> tuple[np.ndarray, np.ndarray]:
    pads = geometry.padding_intervals()
    return (np.array([a for a, _ in pads], dtype=np.int64),
            np.array([b for _, b in pads], dtype=np.int64))


def _is_padding(start: np.ndarray, stop: np.ndarray, pad: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Whether each byte interval ``[start, stop)`` lies inside one padding interval."""
    if pad is None or len(pad[0]) == 0:
        return np.zeros(start.shape, dtype=bool)
    pad_start, pad_stop = pad
    k = np.searchsorted(pad_start, start, side="right") - 1
    kk = np.clip(k, 0, None)
    return (k >= 0) & (pad_start[kk] <= start) & (stop <= pad_stop[kk])


def _coalesce(runs: np.ndarray, src_pad, dst_pad, *, src_only: bool = False) -> np.ndarray:
    """Merge consecutive runs (already sorted) that continue on both sides -- or on the source
    side alone with ``src_only`` -- bridging gaps that are pure padding."""
    if len(runs) <= 1:
        return runs
    end = runs[:-1, 0] + runs[:-1, 2]
    gap_src = runs[1:, 0] - end
    if src_only:
        join = (gap_src == 0)
        bridge = (gap_src > 0) & ~join
        if bridge.any():
            join[bridge] = _is_padding(end[bridge], runs[1:, 0][bridge], src_pad)
    else:
        dst_end = runs[:-1, 1] + runs[:-1, 2]
        gap_dst = runs[1:, 1] - dst_end
        join = (gap_src == 0) & (gap_dst == 0)
        bridge = (gap_src == gap_dst) & (gap_src > 0)
        if bridge.any():
            ok = (_is_padding(end[bridge], runs[1:, 0][bridge], src_pad)
                  & _is_padding(dst_end[bridge], runs[1:, 1][bridge], dst_pad))
            join[bridge] = ok
    starts = np.concatenate([[0], np.nonzero(~join)[0] + 1])
    stops = np.concatenate([starts[1:], [len(runs)]])
    merged = runs[starts].copy()
    last = stops - 1
    merged[:, 2] = runs[last, 0] + runs[last, 2] - runs[starts, 0]
    return merged


def _pair_plan(src: PageGeometry, dst: PageGeometry, s: int, d: int, boxes: tuple[Box, ...],
               src_pad, dst_pad) -> PairPlan:
    units = [_box_units(src.region(b.group, b.tensor), dst.region(b.group, b.tensor), b)
             for b in boxes]
    units = np.concatenate(units) if units else _EMPTY
    nbytes = int(units[:, 2].sum())
    by_dst = units[np.argsort(units[:, 1], kind="stable")]
    runs = _coalesce(by_dst, src_pad, dst_pad)
    # Natural pieces of each side: the moved bytes as maximal intervals of that side alone
    # (without bridging padding: that is an optimisation of paired runs only, so it must not
    # make a side look less fragmented than the pairing).
    by_src = units[np.argsort(units[:, 0], kind="stable")]
    src_pieces = _coalesce(by_src, None, None, src_only=True)
    dst_pieces = _coalesce(by_dst[:, [1, 0, 2]], None, None, src_only=True)
    paired = _coalesce(by_dst, None, None)
    staged = len(paired) > max(len(src_pieces), len(dst_pieces))
    # Staging buffer: the source pieces back to back, in source order.
    stage_start = np.concatenate([[0], np.cumsum(src_pieces[:, 2])[:-1]]).astype(np.int64)
    pack = np.stack([src_pieces[:, 0], stage_start, src_pieces[:, 2]], axis=1)
    k = np.searchsorted(src_pieces[:, 0], paired[:, 0], side="right") - 1
    unpack = np.stack([stage_start[k] + paired[:, 0] - src_pieces[k, 0], paired[:, 1],
                       paired[:, 2]], axis=1)
    unpack = _coalesce(unpack, None, None)
    return PairPlan(s, d, boxes, runs, pack, unpack, nbytes, staged, len(dst_pieces))
