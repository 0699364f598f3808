"""The eviction window search against brute force: every start of ``count`` free-able block
ids, ranked by (units in it, sum of their last uses, start)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from statebridge.connector.eviction_window import cheapest_window


def _brute(blocked, units_of, last_use, count):
    best = None
    for s in range(len(blocked) - count + 1):
        if blocked[s:s + count].any():
            continue
        units = {u for b in range(s, s + count) for u in units_of.get(b, ())}
        cost = (len(units), sum(map(last_use, units)), s)
        if best is None or cost < best[0]:
            best = (cost, units)
    return None if best is None else (best[0][2], best[1])


@pytest.mark.parametrize("seed", range(40))
def test_the_window_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    blocked = np.array([rng.random() < 0.2 for _ in range(n)])
    names = [f"u{i}" for i in range(rng.randrange(0, 8))]
    ticks = {u: rng.randrange(100) for u in names}
    units_of = {}
    for b in range(n):
        if names and not blocked[b] and rng.random() < 0.6:
            units_of[b] = rng.sample(names, rng.randrange(1, min(3, len(names)) + 1))
    for count in (1, 2, 5, n, n + 1, 0):
        got = cheapest_window(blocked, units_of, ticks.__getitem__, count)
        want = _brute(blocked, units_of, ticks.__getitem__, count) if 1 <= count <= n else None
        if want is None:
            assert got is None
        else:
            assert got[0] == want[0] and set(got[1]) == want[1]
