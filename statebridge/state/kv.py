"""Attention KV beside the recurrent state: the per-rank block pool, its layouts, and the KV part
of the transfer plan.

A rank keeps the KV of every request in ONE registrable buffer of ``num_blocks`` fixed-size
token blocks (``block_size`` tokens each), separate from the recurrent-state pages, so neither
is padded to the other. A block holds every attention layer's K and V for its tokens, of the
rank's KV heads. The buffer is a 6-axis array whose physical axis order is data (carried in the
handshake, like page layouts)::

    B  block        H  KV head (local)   L  attention layer
    C  K or V       T  token in block    E  head_dim (always innermost)

    preset  order    a rank pair's head range of a request ...
    "HB"    HBLCTE   heads outermost over the pool: one run per head for a contiguous
                     block range -- independent of the layers and of the block count
    "BH"    BHLCTE   heads outermost inside each block: ONE run per block for all layers;
                     consecutive blocks coalesce where a side moves all its heads
    "LH"    BLCHTE   per layer, K then V, head-major (what vLLM registers): runs grow
                     with layers x 2 x blocks

A request owns a block table: physical block ids, the same on every rank of a group (as page
ids are). :class:`BlockPool` hands out contiguous ranges when it can, so a request's blocks
coalesce into few runs.

The plan (:class:`KVPlan`) is integer arithmetic computed once per (source group, destination
group): per rank pair, the runs of one block at block id 0 on both sides
(:attr:`KVPairPlan.block_runs`); per request only the block bases are added
(:meth:`KVPairPlan.runs`) and adjacent runs coalesced. A replicated KV head (TP above the
number of KV heads) is read from exactly one source rank. The last block of a prompt moves
whole: its slots past the prompt carry bytes the decode side overwrites before it reads them
(it reads positions below its sequence length only), so the runs do not depend on the prompt
length inside a block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from statebridge.errors import CacheFullError, ConfigError, DoubleFreeError, LayoutError, \
    ShapeError, UnknownPageError
from statebridge.state.plan import PairTable, coalesce, paired_units
from statebridge.state.sharding import kv_heads
from statebridge.state.spec import KVSpec

__all__ = ["KV_AXES", "KV_LAYOUT_PRESETS", "DEFAULT_KV_LAYOUT", "DEFAULT_BLOCK_SIZE", "KVLayout",
           "BlockGeometry", "BlockPool", "KVPairPlan", "KVPlan", "blocks_for", "range_start"]

KV_AXES = "BHLCTE"
KV_LAYOUT_PRESETS: dict[str, str] = {"HB": "HBLCTE", "BH": "BHLCTE", "LH": "BLCHTE"}
DEFAULT_KV_LAYOUT = "HB"
DEFAULT_BLOCK_SIZE = 16

_EMPTY = np.zeros((0, 3), dtype=np.int64)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks a request of ``tokens`` tokens needs."""
    if tokens < 0:
        raise ConfigError(f"token count must be >= 0, got {tokens}")
    return -(-tokens // block_size)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The physical axis order of a KV block pool (a permutation of ``BHLCTE``, ``E`` last)."""

    order: str = KV_LAYOUT_PRESETS[DEFAULT_KV_LAYOUT]

    def __post_init__(self) -> None:
        if not isinstance(self.order, str) or sorted(self.order) != sorted(KV_AXES) \
                or not self.order.endswith("E"):
            raise LayoutError(f"KV block order {self.order!r} is not a permutation of "
                              f"{KV_AXES!r} ending in 'E'; presets: "
                              f"{', '.join(f'{k}={v}' for k, v in KV_LAYOUT_PRESETS.items())}")

    @classmethod
    def parse(cls, name: "str | KVLayout") -> "KVLayout":
        """A preset (``"HB"``, ``"BH"``, ``"LH"``) or an explicit order like ``"BHLCTE"``."""
        if isinstance(name, KVLayout):
            return name
        if not isinstance(name, str):
            raise LayoutError(f"KV layout must be a string, got {name!r}")
        return cls(KV_LAYOUT_PRESETS.get(name, name))

    @property
    def name(self) -> str:
        for preset, order in KV_LAYOUT_PRESETS.items():
            if order == self.order:
                return preset
        return self.order

    def __str__(self) -> str:
        return self.name


class BlockGeometry:
    """Byte geometry of the KV block pool of every rank of one TP group (all ranks hold the
    same number of heads)."""

    def __init__(self, kv: KVSpec, tp_size: int, layout: "KVLayout | str", block_size: int,
                 num_blocks: int, *, block_bytes: int | None = None) -> None:
        """``block_bytes``: bytes from one block to the next when blocks are padded (an engine
        whose KV block shares its page size with recurrent-state pages); only with ``B``
        outermost. Default: the block's own bytes."""
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.kv = kv
        self.tp_size = tp_size
        self.layout = KVLayout.parse(layout)
        self.block_size = block_size
        self.num_blocks = num_blocks
        _, heads = kv_heads(kv, tp_size, 0)       # ConfigError for an impossible split
        self.heads = heads
        self.dim = {"B": num_blocks, "H": heads, "L": kv.num_layers, "C": 2, "T": block_size,
                    "E": kv.head_dim}
        self.itemsize = kv.itemsize
        strides, step = {}, 1
        for axis in reversed(self.layout.order):
            if axis == "B" and block_bytes is not None:
                natural = step * self.itemsize
                if self.layout.order[0] != "B" or isinstance(block_bytes, bool) \
                        or not isinstance(block_bytes, int) or block_bytes < natural \
                        or block_bytes % self.itemsize:
                    raise ConfigError(f"block_bytes {block_bytes!r} must be a multiple of "
                                      f"{self.itemsize} of at least the block's {natural} "
                                      f"bytes, with blocks outermost (order "
                                      f"{self.layout.order!r})")
                step = block_bytes // self.itemsize
            strides[axis] = step
            step *= self.dim[axis]
        self.strides = strides                    # elements
        self.nbytes = step * self.itemsize

    def head_range(self, tp_rank: int) -> tuple[int, int]:
        """(first global head, count) of rank ``tp_rank``."""
        return kv_heads(self.kv, self.tp_size, tp_rank)

    @property
    def block_stride(self) -> int:
        """Bytes between block b and b+1 of the same (head, layer, K/V, token)."""
        return self.strides["B"] * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Data bytes of one block on one rank (without a padded block's padding)."""
        d = self.dim
        return d["H"] * d["L"] * d["C"] * d["T"] * d["E"] * self.itemsize

    def offset(self, block: int, head: int, layer: int, kv: int, token: int) -> int:
        """Byte offset of element 0 of ``head_dim`` (local head; layer index among the
        attention layers; kv 0 = K, 1 = V)."""
        s = self.strides
        return (block * s["B"] + head * s["H"] + layer * s["L"] + kv * s["C"] + token * s["T"]) \
            * self.itemsize

    def view(self, buffer: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of attention layer ``layer`` (its index among the attention layers) as
        strided views ``[blocks, heads, block_size, head_dim]`` of ``buffer`` (the pool's
        bytes, uint8, contiguous; it may start inside a larger allocation) -- whatever the
        layout."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.nbytes:
            raise ShapeError(f"KV pool buffer must be 1-D uint8 of >= {self.nbytes} bytes, got "
                             f"{buffer.dtype} {tuple(buffer.shape)}")
        if buffer.stride(0) != 1 or buffer.storage_offset() % self.itemsize:
            raise ShapeError(f"KV pool buffer must be contiguous and start on a multiple of "
                             f"{self.itemsize} bytes, got stride {buffer.stride(0)}, storage "
                             f"offset {buffer.storage_offset()}")
        if not 0 <= layer < self.kv.num_layers:
            raise ShapeError(f"attention layer index {layer} not in [0, {self.kv.num_layers})")
        typed = buffer[:self.nbytes].view(self.kv.torch_dtype)
        s = self.strides
        shape = (self.num_blocks, self.heads, self.block_size, self.kv.head_dim)
        stride = (s["B"], s["H"], s["T"], s["E"])
        # as_strided's offset counts from the storage, not from ``typed``: add typed's own.
        base = typed.storage_offset() + layer * s["L"]
        return (typed.as_strided(shape, stride, base),
                typed.as_strided(shape, stride, base + s["C"]))

    def describe(self) -> dict[str, Any]:
        return {"layout": self.layout.name, "order": self.layout.order,
                "block_size": self.block_size, "num_blocks": self.num_blocks,
                "heads": self.heads, "nbytes": self.nbytes}


class BlockPool:
    """Which KV blocks of a group are in use; ids are the same on every rank. Allocation
    prefers one contiguous range (first fit), else the fewest ranges (largest first)."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._used = np.zeros(num_blocks, dtype=bool)
        self._num_used = 0
        self._free_buf = np.zeros(num_blocks + 2, dtype=np.int8)

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._num_used

    @property
    def num_used(self) -> int:
        return self._num_used

    def _free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Maximal free ranges as (starts, lengths) arrays in id order."""
        free = self._free_buf                        # [0, free..., 0] as int8
        np.logical_not(self._used, out=free[1:-1].view(bool))
        edges = free[1:] - free[:-1]
        # (ndarray.nonzero: np.flatnonzero's ravel and dispatch wrappers cost more than the
        # search itself; admission and every contiguous allocation come here)
        starts = (edges == 1).nonzero()[0]
        return starts, (edges == -1).nonzero()[0] - starts

    def _free_ranges(self) -> list[tuple[int, int]]:
        """Maximal free ranges ``(start, length)`` in id order."""
        starts, lengths = self._free_runs()
        return list(zip(starts.tolist(), lengths.tolist()))

    def largest_free_range(self) -> int:
        """Length of the longest run of consecutive free block ids."""
        _, lengths = self._free_runs()
        return int(lengths.max()) if len(lengths) else 0

    def _first_fit(self, count: int) -> int | None:
        """Start of the first free range of ``count`` or more blocks, or None."""
        starts, lengths = self._free_runs()
        fit = np.flatnonzero(lengths >= count)
        return int(starts[fit[0]]) if len(fit) else None

    def allocate(self, count: int, *, after: int | None = None,
                 contiguous: bool = False) -> list[int]:
        """``count`` block ids (CacheFullError naming wanted / free / total when fewer are
        free; nothing is taken then). ``after``: a block the request already owns -- the
        blocks right after it come first, so a growing table stays contiguous.
        ``contiguous``: one range of consecutive ids or CacheFullError (the prefill side's
        tables, so that the decode side knows the runs without being told the table)."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConfigError(f"block count must be a non-negative integer, got {count!r}")
        if count > self.num_free:
            raise CacheFullError(f"{count} KV blocks wanted, {self.num_free} free of "
                                 f"{self.num_blocks}")
        if not count:
            return []
        if contiguous:
            start = self._first_fit(count)
            if start is None:
                raise CacheFullError(
                    f"{count} contiguous KV blocks wanted, longest free range "
                    f"{self.largest_free_range()} ({self.num_free} free of "
                    f"{self.num_blocks})")
            self._used[start:start + count] = True
            self._num_used += count
            return list(range(start, start + count))
        out: list[int] = []
        if after is not None and 0 <= after < self.num_blocks - 1:
            b = after + 1
            while len(out) < count and b < self.num_blocks and not self._used[b]:
                out.append(b)
                b += 1
            if out:
                self._used[out[0]:out[-1] + 1] = True
        left = count - len(out)
        if left:
            start = self._first_fit(left)
            if start is not None:
                out.extend(range(start, start + left))          # first fit: one range
                self._used[start:start + left] = True
            else:
                ranges = self._free_ranges()
                for a, n in sorted(ranges, key=lambda r: (-r[1], r[0])):   # fewest ranges
                    take = min(n, left)
                    out.extend(range(a, a + take))
                    self._used[a:a + take] = True
                    left -= take
                    if not left:
                        break
        self._num_used += len(out)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Return ``blocks`` (DoubleFreeError / UnknownPageError naming the id; nothing is
        freed then)."""
        start = range_start(blocks) if type(blocks) in (range, list, tuple) and len(blocks) \
            else None
        if start is not None:
            # one range of consecutive ids (what allocate prefers): a slice, not a gather
            end = start + len(blocks)
            if 0 <= start and end <= self.num_blocks:
                held = self._used[start:end]
                if held.all():
                    held[:] = False
                    self._num_used -= len(blocks)
                    return
            # out of range or not all allocated: the general path names the id
        idx = np.asarray(blocks if isinstance(blocks, np.ndarray) else list(blocks),
                         dtype=np.int64)
        if len(idx) == 0:
            return
        if idx.min() < 0 or idx.max() >= self.num_blocks:
            bad = idx[(idx < 0) | (idx >= self.num_blocks)]
            raise UnknownPageError(f"KV block {int(bad[0])} not in [0, {self.num_blocks})")
        if self._used[idx].all():
            self._used[idx] = False
            if np.count_nonzero(self._used) == self._num_used - len(idx):
                self._num_used -= len(idx)
                return
            self._used[idx] = True                # an id repeated: undo, name it below
        seen: set[int] = set()
        for b in idx.tolist():                    # the first id not allocated or repeated
            if not self._used[b] or b in seen:
                raise DoubleFreeError(f"KV block {b} is not allocated (or freed twice)")
            seen.add(b)
        raise AssertionError("unreachable: every id allocated and distinct")

    def is_allocated(self, block: int) -> bool:
        return 0 <= block < self.num_blocks and bool(self._used[block])

    def used_mask(self) -> np.ndarray:
        """A copy of the in-use flags, one bool per block id (for callers that choose which
        blocks to free so that a contiguous range opens, e.g. the prefix cache)."""
        return self._used.copy()


#: Block counts whose contiguous-table runs a KVPairPlan keeps (cleared when full).
_CONTIGUOUS_CACHE = 256


def range_start(blocks: Sequence[int]) -> int | None:
    """The first id when ``blocks`` (not empty) are consecutive increasing ids, else None
    (C-level: about a microsecond for a table of 64)."""
    if type(blocks) is range:
        return blocks.start if blocks.step == 1 or len(blocks) == 1 else None
    first = blocks[0]
    if type(first) is not int:
        return None
    table = blocks if type(blocks) is tuple else tuple(blocks)
    return first if table == tuple(range(first, first + len(table))) else None


@dataclass(frozen=True, eq=False)
class KVPairPlan:
    """The KV one source rank sends to one destination rank, per block.

    ``heads``: ``(src local head, dst local head, count)`` ranges. ``block_runs``: int64
    ``[R, 3]`` (src offset, dst offset, length) of one block at block id 0 on both sides,
    sorted by dst offset and coalesced.
    """

    src_rank: int
    dst_rank: int
    heads: tuple[tuple[int, int, int], ...]
    block_runs: np.ndarray
    src_block_stride: int
    dst_block_stride: int
    bytes_per_block: int
    #: block count -> runs of blocks [0, n) on both sides (see :meth:`runs`)
    _contiguous: dict = field(default_factory=dict, repr=False, compare=False)

    def runs(self, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> np.ndarray:
        """Absolute runs (pool byte offsets) for a request whose logical blocks live at
        ``src_blocks`` on the source and ``dst_blocks`` on the destination, coalesced where
        both sides continue."""
        if len(src_blocks) != len(dst_blocks):
            raise ConfigError(f"block tables differ in length: {len(src_blocks)} source, "
                              f"{len(dst_blocks)} destination")
        if not len(src_blocks):
            return _EMPTY
        s0, d0 = range_start(src_blocks), range_start(dst_blocks)
        if s0 is not None and d0 is not None:
            # Both tables are ranges of consecutive ids (the common case: the allocator
            # prefers them, the prefill side only has them). Runs depend on the block ids
            # only through ``id x stride``, so the runs of blocks [0, n) on both sides,
            # shifted, are the answer: computed once per n.
            out = self.contiguous_runs(len(src_blocks)).copy()
            out[:, 0] += s0 * self.src_block_stride
            out[:, 1] += d0 * self.dst_block_stride
            return out
        return self._runs(src_blocks, dst_blocks)

    def contiguous_runs(self, blocks: int) -> np.ndarray:
        """The runs of blocks ``[0, blocks)`` on both sides (read-only, cached per count): a
        request whose tables start at ids ``s0`` and ``d0`` moves these runs shifted by
        ``s0 x src_block_stride`` and ``d0 x dst_block_stride``."""
        runs = self._contiguous.get(blocks)
        if runs is None:
            runs = self._runs(range(blocks), range(blocks))
            runs.flags.writeable = False
            if len(self._contiguous) >= _CONTIGUOUS_CACHE:
                self._contiguous.clear()
            self._contiguous[blocks] = runs
        return runs

    def _runs(self, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> np.ndarray:
        """:meth:`runs` for any tables (block by block, then coalesced)."""
        base = np.stack([np.asarray(src_blocks, dtype=np.int64) * self.src_block_stride,
                         np.asarray(dst_blocks, dtype=np.int64) * self.dst_block_stride,
                         np.zeros(len(src_blocks), dtype=np.int64)], axis=1)
        runs = (self.block_runs[None, :, :] + base[:, None, :]).reshape(-1, 3)
        return coalesce(runs[np.argsort(runs[:, 1], kind="stable")])

    def summary(self, blocks: int) -> dict[str, Any]:
        runs = self.runs(range(blocks), range(blocks))
        return {"src_rank": self.src_rank, "dst_rank": self.dst_rank, "kv_runs": len(runs),
                "kv_bytes": int(runs[:, 2].sum()) if len(runs) else 0}


class KVPlan(PairTable):
    """KV runs between every (source rank, destination rank) of two block geometries."""

    def __init__(self, src: BlockGeometry, dst: BlockGeometry) -> None:
        if src.kv != dst.kv:
            raise ConfigError(f"source and destination KV specs differ: {src.kv} != {dst.kv}")
        if src.block_size != dst.block_size:
            raise ConfigError(f"KV block sizes differ: source {src.block_size}, destination "
                              f"{dst.block_size} tokens")
        self.src, self.dst, self.kv = src, dst, src.kv
        pairs: dict[tuple[int, int], KVPairPlan] = {}
        for d in range(dst.tp_size):
            for s, heads in _sources(src, dst, d).items():
                pairs[(s, d)] = _pair(src, dst, s, d, tuple(heads))
        self.pairs = dict(sorted(pairs.items()))

    def blocks(self, tokens: int) -> int:
        return blocks_for(tokens, self.src.block_size)

    def summary(self, tokens: int) -> dict[str, Any]:
        """Runs and bytes per rank pair and in total for a prompt of ``tokens`` KV tokens, with
        contiguous block tables on both sides."""
        n = self.blocks(tokens)
        pairs = [p.summary(n) for p in self]
        return {"tokens": tokens, "blocks": n, "block_size": self.src.block_size,
                "src_layout": self.src.layout.name, "dst_layout": self.dst.layout.name,
                "kv_runs": sum(p["kv_runs"] for p in pairs),
                "kv_bytes": sum(p["kv_bytes"] for p in pairs), "pairs": pairs}


def _sources(src: BlockGeometry, dst: BlockGeometry, d: int) -> dict[int, list]:
    """Source rank -> ``[src local head, dst local head, count]`` ranges feeding rank ``d``.
    A head several source ranks hold (replicated source) comes from the lowest of them."""
    d_start, d_count = dst.head_range(d)
    holders: dict[int, int] = {}
    for s in range(src.tp_size):
        s_start, s_count = src.head_range(s)
        for h in range(s_start, s_start + s_count):
            holders.setdefault(h, s)
    out: dict[int, list] = {}
    for i in range(d_count):
        h = d_start + i
        s = holders[h]
        s_start, _ = src.head_range(s)
        ranges = out.setdefault(s, [])
        if ranges and ranges[-1][0] + ranges[-1][2] == h - s_start \
                and ranges[-1][1] + ranges[-1][2] == i:
            ranges[-1][2] += 1
        else:
            ranges.append([h - s_start, i, 1])
    return {s: [tuple(r) for r in rs] for s, rs in out.items()}


def _pair(src: BlockGeometry, dst: BlockGeometry, s: int, d: int,
          heads: tuple[tuple[int, int, int], ...]) -> KVPairPlan:
    units = [_units(src, dst, sh, dh, n) for sh, dh, n in heads]
    runs = np.concatenate(units) if units else _EMPTY
    runs = coalesce(runs[np.argsort(runs[:, 1], kind="stable")])
    nbytes = int(runs[:, 2].sum())
    return KVPairPlan(s, d, heads, runs, src.block_stride, dst.block_stride, nbytes)


def _units(src: BlockGeometry, dst: BlockGeometry, src_head: int, dst_head: int,
           count: int) -> np.ndarray:
    """Paired runs ``[U, 3]`` of ``count`` heads of block 0."""
    ext = dict(dst.dim)
    ext["B"], ext["H"] = 1, count
    item = src.itemsize
    return paired_units(src.layout.order, dst.layout.order, ext, src.dim, dst.dim, src.strides,
                        dst.strides, item, src_head * src.strides["H"] * item,
                        dst_head * dst.strides["H"] * item)
