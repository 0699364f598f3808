"""An independent model of sharded pages, written for the tests from the design text alone.

It does not call statebridge's sharding or plan code: it computes, from a spec's segment list,
which global channels each rank holds, lays every region out byte by byte with numpy, and
executes a plan's runs with plain memory copies while counting writes per destination byte.
"""

from __future__ import annotations

import numpy as np

from statebridge.state.layout import PageGeometry
from statebridge.state.spec import Sharding, StateSpec, StateTensorSpec

_INT_OF_SIZE = {2: np.int16, 4: np.int32, 8: np.int64}


def rank_channel_index(tensor: StateTensorSpec, tp_size: int, tp_rank: int) -> np.ndarray:
    """Global channel indices rank ``tp_rank`` holds, in its local order."""
    out, base = [], 0
    for seg in tensor.segments:
        replicated = (seg.sharding is Sharding.REPLICATED
                      or (seg.sharding is Sharding.GROUPED and seg.groups == 1))
        if replicated or tp_size == 1:
            out.append(base + np.arange(seg.size))
        else:
            n = seg.size // tp_size
            out.append(base + tp_rank * n + np.arange(n))
        base += seg.size
    return np.concatenate(out)


def global_state(spec: StateSpec, seed: int = 0) -> dict[tuple[int, str], np.ndarray]:
    """Every (group, tensor) as an integer array ``[L, C_global, *inner]`` of distinct values
    (integers of the tensor's item size, so the comparison is byte exact)."""
    out, start = {}, 1 + seed
    for gi, group in enumerate(spec.groups):
        for t in group.tensors:
            shape = (group.num_layers, t.channels, *t.inner_shape)
            n = int(np.prod(shape))
            values = (np.arange(start, start + n, dtype=np.int64) % (2 ** (8 * t.itemsize - 1) - 1))
            out[(gi, t.name)] = values.astype(_INT_OF_SIZE[t.itemsize]).reshape(shape)
            start += n
    return out


def page_of_rank(geometry: PageGeometry, state, tp_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(page bytes, data mask) that rank ``tp_rank`` of ``geometry`` must hold."""
    page = np.zeros(geometry.page_size, dtype=np.uint8)
    mask = np.zeros(geometry.page_size, dtype=bool)
    for region in geometry.regions:
        local = state[(region.group, region.tensor.name)][
            :, rank_channel_index(region.tensor, geometry.tp_size, tp_rank)]
        canonical = "L" + region.tensor.axes
        physical = np.ascontiguousarray(np.transpose(local, [canonical.index(a) for a in region.order]))
        raw = physical.reshape(-1).view(np.uint8)
        page[region.offset:region.offset + raw.size] = raw
        mask[region.offset:region.offset + raw.size] = True
    return page, mask


def byte_index(runs: np.ndarray, column: int) -> np.ndarray:
    """Every byte address covered by ``runs[:, column]`` with lengths ``runs[:, 2]``, in order."""
    lengths = runs[:, 2]
    if len(lengths) == 0:
        return np.zeros(0, dtype=np.int64)
    run_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.repeat(runs[:, column] - run_start, lengths) + np.arange(lengths.sum())


def copy_runs(src: np.ndarray, dst: np.ndarray, runs: np.ndarray, writes: np.ndarray | None = None):
    """``dst[to:to+n] = src[from:from+n]`` for every (from, to, n) run; count writes."""
    s, d = byte_index(runs, 0), byte_index(runs, 1)
    dst[d] = src[s]
    if writes is not None:
        np.add.at(writes, d, 1)
