"""Which consecutive block ids to free by evicting cached units: the search behind
:meth:`statebridge.connector.prefix_cache.PrefixCache.cheapest_window` (a prefill request
needs one contiguous range of KV blocks).

Pure numpy and Python over a block mask and the units holding each block; no pools, no cache
state.
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence, TypeVar

import numpy as np

__all__ = ["cheapest_window"]

U = TypeVar("U", bound=Hashable)


def cheapest_window(blocked: np.ndarray, units_of: Mapping[int, Sequence[U]],
                    last_use: Callable[[U], int], count: int) -> tuple[int, list[U]] | None:
    """The start of ``count`` consecutive block ids none of which is ``blocked`` (bool per
    block id: in use by something that eviction cannot free), and the units holding blocks in
    it (``units_of``: block -> units), chosen by fewest units, then the least recently used
    (smallest sum of ``last_use``), then the lowest start. None when no such range exists.
    One pass over the candidate starts, a sliding window of unit counts."""
    n = len(blocked)
    if count < 1 or count > n:
        return None
    bad = np.concatenate([[0], np.cumsum(blocked, dtype=np.int64)])
    starts = np.flatnonzero(bad[count:] - bad[:-count] == 0)
    if not len(starts):
        return None
    best: tuple[int, int, int] | None = None
    best_units: list[U] = []
    counts: dict[U, int] = {}
    ticks = 0
    prev = None

    def move(b: int, step: int) -> None:
        """Block ``b`` enters (+1) or leaves (-1) the window: count its units."""
        nonlocal ticks
        for u in units_of.get(b, ()):
            was = counts.get(u, 0)
            counts[u] = was + step
            if not was or not counts[u]:       # the unit entered or left the window
                ticks += step * last_use(u)
            if not counts[u]:
                del counts[u]

    for s in starts.tolist():
        if prev is not None and s == prev + 1:
            move(prev, -1)
            move(s + count - 1, +1)
        else:
            counts.clear()
            ticks = 0
            for b in range(s, s + count):
                move(b, +1)
        prev = s
        cost = (len(counts), ticks, s)
        if best is None or cost < best:
            best, best_units = cost, list(counts)
    return best[2], best_units
