"""Which global channels (or heads) a TP rank holds: all shard math lives here (the weight
sharding in :mod:`statebridge.models.tp` applies the same :func:`shard_segments`).

For a state tensor whose channel axis is ``[seg_0 | seg_1 | ...]`` (see
:mod:`statebridge.state.spec`), rank ``r`` of ``t`` holds, per segment::

    split       global [r*n/t, (r+1)*n/t)       local size n/t
    replicated  global [0, n)                   local size n
    grouped     split by groups if groups % t == 0; replicated if groups == 1

and its local channel axis is the concatenation of those pieces in segment order
(e.g. Mamba2 at t=2: ``[x_r | B_r | C_r]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from statebridge.errors import ConfigError
from statebridge.state.spec import KVSpec, Segment, Sharding, StateSpec, StateTensorSpec

__all__ = ["SegmentShard", "segment_is_replicated", "shard_segments", "local_channels",
           "kv_heads", "kv_is_replicated",
           "check_tp"]


@dataclass(frozen=True, slots=True)
class SegmentShard:
    """The piece of one segment a rank holds.

    ``global_start`` is relative to the segment; ``local_start`` is the offset of the piece on the
    rank's local channel axis; ``seg_offset`` is the segment's offset on the global channel axis.
    """

    segment: Segment
    index: int
    seg_offset: int
    global_start: int
    size: int
    local_start: int
    replicated: bool

    @property
    def global_stop(self) -> int:
        return self.global_start + self.size


def _check_tp_size(tp_size: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"TP size must be a positive integer, got {tp_size!r}")


def segment_is_replicated(segment: Segment, tp_size: int, *, tensor: str = "?") -> bool:
    """Whether ``segment`` is replicated at ``tp_size``; a ConfigError if it cannot be sharded."""
    _check_tp_size(tp_size)
    if segment.sharding is Sharding.REPLICATED:
        return True
    if segment.sharding is Sharding.SPLIT:
        if segment.size % tp_size:
            raise ConfigError(f"{tensor} segment {segment.name!r}: size {segment.size} is not "
                              f"divisible by TP size {tp_size}")
        return False
    # GROUPED
    if segment.groups == 1:
        return tp_size > 1
    if segment.groups % tp_size:
        raise ConfigError(f"{tensor} segment {segment.name!r}: n_groups {segment.groups} is "
                          f"neither divisible by TP size {tp_size} nor 1")
    return False


def shard_segments(tensor: StateTensorSpec | Sequence[Segment], tp_size: int, tp_rank: int, *,
                   name: str = "weight") -> tuple[SegmentShard, ...]:
    """The pieces of every segment of ``tensor`` that rank ``tp_rank`` of ``tp_size`` holds.

    ``tensor`` is a state tensor, or the segments of any fused axis: the weight sharding
    (:mod:`statebridge.models.tp`) cuts weights with this same rule, so weights and state never
    disagree. ``name`` names such a bare axis in errors.
    """
    _check_tp_size(tp_size)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"TP rank must be in [0, {tp_size}), got {tp_rank!r}")
    if isinstance(tensor, StateTensorSpec):
        segments, name = tensor.segments, tensor.name
    else:
        segments = tuple(tensor)
    shards = []
    seg_offset = 0
    local = 0
    for i, seg in enumerate(segments):
        if segment_is_replicated(seg, tp_size, tensor=name):
            start, size, repl = 0, seg.size, True
        else:
            size = seg.size // tp_size
            start, repl = tp_rank * size, False
        shards.append(SegmentShard(seg, i, seg_offset, start, size, local, repl))
        seg_offset += seg.size
        local += size
    return tuple(shards)


def local_channels(tensor: StateTensorSpec, tp_size: int) -> int:
    """Size of the local channel axis of ``tensor`` on any rank of ``tp_size``."""
    return sum(s.size for s in shard_segments(tensor, tp_size, 0))


def kv_heads(kv: KVSpec, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(first global KV head, count)`` held by rank ``tp_rank`` of ``tp_size``: an equal split
    when ``num_kv_heads % tp_size == 0``; one head per rank when ``tp_size`` is a multiple of
    ``num_kv_heads`` (consecutive ranks share it: rank r holds head ``r * heads // tp_size``,
    as vLLM's GQA weight partitioning does); anything else is a ConfigError naming both."""
    _check_tp_size(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
    heads = kv.num_kv_heads
    if heads % tp_size == 0:
        per = heads // tp_size
        return tp_rank * per, per
    if tp_size % heads == 0:
        return tp_rank * heads // tp_size, 1
    raise ConfigError(f"num_kv_heads={heads} cannot be split over tp_size={tp_size} (needs "
                      f"num_kv_heads % tp_size == 0, or tp_size a multiple of num_kv_heads)")


def kv_is_replicated(kv: KVSpec, tp_size: int) -> bool:
    """Whether ranks of ``tp_size`` share KV heads (tp_size > num_kv_heads)."""
    kv_heads(kv, tp_size, 0)
    return tp_size > kv.num_kv_heads


def check_tp(spec: StateSpec, tp_size: int) -> None:
    """Raise ConfigError if any tensor of ``spec`` cannot be sharded over ``tp_size`` ranks."""
    for group in spec.groups:
        for tensor in group.tensors:
            shard_segments(tensor, tp_size, 0)
    if spec.kv is not None:
        kv_heads(spec.kv, tp_size, 0)
