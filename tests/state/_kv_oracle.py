"""An independent model of sharded KV block pools, written for the tests from the design text.

It does not call statebridge's sharding, geometry or plan code: from a spec's KV numbers it
computes which global KV heads each rank holds, builds a rank's pool as a numpy array in the
canonical axis order ``[B, H, L, C, T, E]`` (block, local head, attention layer, K/V, token in
block, head_dim) and transposes it to the physical order string (``"HBLCTE"``, ...) with
``np.ascontiguousarray``; no strides are computed here. Runs are executed with
:func:`._oracle.copy_runs`.
"""

from __future__ import annotations

import numpy as np

from statebridge.state.spec import KVSpec

CANONICAL = "BHLCTE"
PRESETS = {"HB": "HBLCTE", "BH": "BHLCTE", "LH": "BLCHTE"}     # from the design text
_INT_OF_SIZE = {2: np.int16, 4: np.int32, 8: np.int64}


def rank_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> np.ndarray:
    """Global KV heads of rank ``tp_rank``: an equal split, or one head shared by
    ``tp_size // num_kv_heads`` consecutive ranks."""
    if num_kv_heads >= tp_size:
        assert num_kv_heads % tp_size == 0
        per = num_kv_heads // tp_size
        return np.arange(tp_rank * per, (tp_rank + 1) * per)
    assert tp_size % num_kv_heads == 0
    return np.array([tp_rank // (tp_size // num_kv_heads)])


def source_rank(head: int, num_kv_heads: int, src_tp: int) -> int:
    """The source rank a head is read from: the lowest rank holding it."""
    if num_kv_heads >= src_tp:
        return head // (num_kv_heads // src_tp)
    return head * (src_tp // num_kv_heads)


def pair_heads(num_kv_heads: int, src_tp: int, dst_tp: int) -> dict[tuple[int, int], int]:
    """(source rank, destination rank) -> number of heads that pair moves."""
    out: dict[tuple[int, int], int] = {}
    for d in range(dst_tp):
        for h in rank_heads(num_kv_heads, dst_tp, d):
            key = (source_rank(int(h), num_kv_heads, src_tp), d)
            out[key] = out.get(key, 0) + 1
    return out


def int_dtype(kv: KVSpec):
    return _INT_OF_SIZE[kv.itemsize]


def global_kv(kv: KVSpec, tokens: int) -> np.ndarray:
    """The request's KV ``[T, L, C, H_global, E]`` as distinct positive integers of the KV
    item size (so every comparison is byte exact)."""
    shape = (tokens, kv.num_layers, 2, kv.num_kv_heads, kv.head_dim)
    n = int(np.prod(shape))
    dtype = int_dtype(kv)
    assert n < np.iinfo(dtype).max, "spec too large for distinct values"
    return np.arange(1, n + 1, dtype=np.int64).astype(dtype).reshape(shape)


def pool_shape(kv: KVSpec, heads: int, block_size: int, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, heads, kv.num_layers, 2, block_size, kv.head_dim)


def canonical_pool(kv: KVSpec, tp_size: int, tp_rank: int, block_size: int, num_blocks: int,
                   table, values: np.ndarray, background: int) -> np.ndarray:
    """Rank ``tp_rank``'s pool ``[B, H, L, C, T, E]``: the request's blocks (``table``: logical
    block i at physical block table[i]) hold ``values`` of the rank's heads; every other
    element a distinct negative value (``background`` apart per rank)."""
    heads = rank_heads(kv.num_kv_heads, tp_size, tp_rank)
    shape = pool_shape(kv, len(heads), block_size, num_blocks)
    n = int(np.prod(shape))
    dtype = int_dtype(kv)
    back = -1 - ((background + np.arange(n, dtype=np.int64)) % (np.iinfo(dtype).max - 1))
    pool = back.astype(dtype).reshape(shape)
    blocks = len(table)
    if blocks:
        mine = values[:blocks * block_size][:, :, :, heads, :]          # [n*T, L, C, H, E]
        mine = mine.reshape(blocks, block_size, kv.num_layers, 2, len(heads), kv.head_dim)
        pool[np.asarray(table)] = mine.transpose(0, 4, 2, 3, 1, 5)      # -> [n, H, L, C, T, E]
    return pool


def physical(canonical: np.ndarray, order: str) -> np.ndarray:
    """A canonical ``[B, H, L, C, T, E]`` array in physical axis order, flat."""
    return np.ascontiguousarray(
        np.transpose(canonical, [CANONICAL.index(a) for a in order])).reshape(-1)


def pool_bytes(canonical: np.ndarray, order: str) -> np.ndarray:
    """The pool's bytes as its rank lays them out."""
    return physical(canonical, order).view(np.uint8)


def byte_labels(labels: np.ndarray, order: str, itemsize: int) -> np.ndarray:
    """A per-element canonical label array (broadcast to the pool shape) as one label per
    physical byte."""
    return np.repeat(physical(labels, order), itemsize)


def block_mask(kv: KVSpec, heads: int, block_size: int, num_blocks: int, table,
               order: str) -> np.ndarray:
    """True for every byte of the blocks in ``table``."""
    shape = pool_shape(kv, heads, block_size, num_blocks)
    in_table = np.zeros(num_blocks, dtype=bool)
    in_table[np.asarray(table, dtype=np.int64)] = True
    labels = np.broadcast_to(in_table.reshape(-1, 1, 1, 1, 1, 1), shape)
    return byte_labels(labels, order, kv.itemsize)


def head_of_byte(kv: KVSpec, heads: int, block_size: int, num_blocks: int,
                 order: str) -> np.ndarray:
    """The local head each byte of a pool belongs to."""
    shape = pool_shape(kv, heads, block_size, num_blocks)
    labels = np.broadcast_to(np.arange(heads).reshape(1, -1, 1, 1, 1, 1), shape)
    return byte_labels(labels, order, kv.itemsize)


def bytes_per_block(kv: KVSpec, heads: int, block_size: int) -> int:
    return block_size * kv.num_layers * 2 * heads * kv.head_dim * kv.itemsize
