"""Tensor-parallel sharding of mixer *weights* (one place; the state's channel ranges are owned by
``state/sharding.py``).

A fused weight is a concatenation of segments along one axis, each sharded on its own::

    ShortConv in_proj rows   [ B (D) | C (D) | x (D) ]                      all split
    Mamba2 in_proj rows      [ z (I) | x (I) | B (G*N) | C (G*N) | dt (H) ]  B, C replicated if G == 1 < t
    Mamba2 conv rows         [ x (I) | B (G*N) | C (G*N) ]

Rank r of t takes rows ``[r*n/t, (r+1)*n/t)`` of a split segment of n rows and all n rows of a
replicated one, and the local weight is the concatenation of those pieces in segment order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from statebridge.errors import ConfigError, ShapeError

__all__ = ["Segment", "shard_segments", "mamba2_bc_replicated"]

Segment = tuple[int, bool]
"""``(global size, replicated)`` of one segment of a fused axis."""


def shard_segments(
    tensor: torch.Tensor, segments: Sequence[Segment], tp_size: int, tp_rank: int, dim: int = 0
) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of ``tensor`` along ``dim``, segment by segment (a contiguous copy).

    Args:
        tensor: a full weight whose ``dim`` is the concatenation of ``segments``.
        segments: ``(size, replicated)`` per segment, in order; sizes sum to ``tensor.shape[dim]``.
        tp_size: number of ranks t; every split segment size must be divisible by t.
        tp_rank: this rank r, ``0 <= r < t``.
        dim: the fused axis.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank} tp_size={tp_size}")
    total = sum(size for size, _ in segments)
    if tensor.shape[dim] != total:
        raise ShapeError(
            f"axis {dim} of shape {list(tensor.shape)} must equal the sum of segments {list(segments)} = {total}"
        )
    pieces = []
    start = 0
    for size, replicated in segments:
        if replicated:
            pieces.append(tensor.narrow(dim, start, size))
        else:
            if size % tp_size:
                raise ConfigError(f"segment of {size} rows cannot be split over tp_size={tp_size}")
            local = size // tp_size
            pieces.append(tensor.narrow(dim, start + tp_rank * local, local))
        start += size
    return torch.cat(pieces, dim=dim).contiguous()


def mamba2_bc_replicated(n_groups: int, tp_size: int) -> bool:
    """Whether Mamba2's B and C are replicated on every rank (``G == 1 < t``) rather than split
    by groups (``G % t == 0``); any other combination raises :class:`ConfigError`.

    The rule is the state's (``state/sharding.py``): weights and state must never disagree.
    """
    from statebridge.state.sharding import segment_is_replicated
    from statebridge.state.spec import Segment as StateSegment
    from statebridge.state.spec import Sharding

    if tp_size < 1 or n_groups < 1:
        raise ConfigError(f"Mamba2 n_groups={n_groups} and tp_size={tp_size} must be >= 1")
    return segment_is_replicated(StateSegment("B", n_groups, Sharding.GROUPED, n_groups),
                                 tp_size, tensor="Mamba2 in_proj")
