"""BlockGeometry.view of a pool that starts inside a larger buffer (after a rank's pages)."""

import torch

from statebridge.state.kv import BlockGeometry
from statebridge.state.spec import KVSpec


def test_view_of_an_offset_pool_writes_only_the_pool():
    geo = BlockGeometry(KVSpec((1, 3), 2, 4, "bfloat16"), 1, "HB", 4, 3)
    buffer = torch.zeros(128 + geo.nbytes, dtype=torch.uint8)
    for layer in range(2):
        k, v = geo.view(buffer[128:], layer)
        k.fill_(1.0)
        v.fill_(3.0)
    assert buffer[:128].eq(0).all()
    assert buffer[128:].ne(0).all()
