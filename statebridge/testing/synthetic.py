"""Deterministic synthetic state: what a prefill rank "computes" in transfer tests and
benchmarks, and what every decode rank must then hold.

The global state of a request is random bits seeded by the request id; a rank's page holds its
shard of it (:mod:`statebridge.state.sharding`), written through the page views.
The checksum a decode rank reports of its page is :func:`statebridge.state.cache.page_checksum`
(library code: the rank computes it).

Attention KV (specs with ``spec.kv``): the global K and V of a request's first ``tokens`` tokens
are random bits seeded by the request id too (:func:`global_kv`, ``[layer, K/V, token, KV head,
head_dim]``); a rank's blocks hold its heads (:func:`statebridge.state.sharding.kv_heads`),
written through the block views (:func:`fill_kv`); slots past ``tokens`` in the last block are
zero. A decode rank reports :func:`statebridge.connector.rank.kv_checksum` of them.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from statebridge.state.cache import StateCache
from statebridge.state.sharding import shard_segments
from statebridge.state.spec import KVSpec, StateSpec

__all__ = ["request_seed", "global_state", "rank_channels", "fill_page", "global_kv", "fill_kv"]

_INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def request_seed(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


def global_state(spec: StateSpec, seed: int) -> dict[tuple[int, str], torch.Tensor]:
    """Every (group, tensor) as random bits ``[L, C_global, *inner]`` in the tensor's dtype."""
    rng = np.random.default_rng(seed)
    out = {}
    for gi, group in enumerate(spec.groups):
        for t in group.tensors:
            shape = (group.num_layers, t.channels, *t.inner_shape)
            raw = rng.integers(0, 256, size=int(np.prod(shape)) * t.itemsize, dtype=np.uint8)
            out[(gi, t.name)] = torch.from_numpy(raw).view(t.torch_dtype).reshape(shape)
    return out


def rank_channels(spec: StateSpec, group: int, tensor: str, tp_size: int,
                  tp_rank: int) -> torch.Tensor:
    """Global channel indices a rank holds for one tensor, in its local order."""
    t = spec.groups[group].tensor(tensor)
    return torch.cat([torch.arange(s.seg_offset + s.global_start, s.seg_offset + s.global_stop)
                      for s in shard_segments(t, tp_size, tp_rank)])


def fill_page(cache: StateCache, page: int, state: dict[tuple[int, str], torch.Tensor],
              tp_rank: int) -> None:
    """Write rank ``tp_rank``'s shard of ``state`` into ``page`` of ``cache`` (via the views)."""
    geo = cache.geometry
    for region in geo.regions:
        name = region.tensor.name
        local = state[(region.group, name)][
            :, rank_channels(geo.spec, region.group, name, geo.tp_size, tp_rank)]
        cache.view(region.group, name)[page].copy_(local)



def global_kv(kv: "KVSpec", seed: int, tokens: int) -> torch.Tensor:
    """The request's global KV as random bits ``[layers, 2, tokens, num_kv_heads, head_dim]``
    in the KV dtype (its own stream of ``seed``: the recurrent state is unchanged)."""
    rng = np.random.default_rng([seed, 0x4B56])
    shape = (kv.num_layers, 2, tokens, kv.num_kv_heads, kv.head_dim)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * kv.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(kv.torch_dtype).reshape(shape)


def fill_kv(kv_blocks, blocks, state: torch.Tensor, tp_rank: int) -> None:
    """Write rank ``tp_rank``'s heads of ``state`` (from :func:`global_kv`) into ``blocks`` of
    ``kv_blocks`` (a :class:`~statebridge.connector.rank.KVBlocks`) via its views."""
    geo = kv_blocks.geometry
    first, count = geo.head_range(tp_rank)
    layers, _, tokens, _, dim = state.shape
    n, size = len(blocks), geo.block_size
    padded = torch.zeros((layers, 2, n * size, count, dim), dtype=state.dtype)
    padded[:, :, :tokens] = state[:, :, :, first:first + count]
    # [L, 2, block, token, head, dim] -> [L, 2, block, head, token, dim] (the views' order)
    padded = padded.reshape(layers, 2, n, size, count, dim).permute(0, 1, 2, 4, 3, 5)
    idx = torch.as_tensor(list(blocks), dtype=torch.int64)
    for layer in range(layers):
        k, v = kv_blocks.view(layer)
        k[idx] = padded[layer, 0]
        v[idx] = padded[layer, 1]
