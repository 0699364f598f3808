"""Deterministic synthetic state: what a prefill rank "computes" in transfer tests and
benchmarks, and what every decode rank must then hold.

The global state of a request is random bits seeded by the request id; a rank's page holds its
shard of it (:mod:`statebridge.state.sharding`), written through the page views.
The checksum a decode rank reports of its page is :func:`statebridge.state.cache.page_checksum`
(library code: the rank computes it).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from statebridge.state.cache import StateCache
from statebridge.state.sharding import shard_segments
from statebridge.state.spec import StateSpec

__all__ = ["request_seed", "global_state", "rank_channels", "fill_page"]

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

