"""Which global channels a TP rank holds."""

from __future__ import annotations

import pytest

from statebridge.errors import ConfigError
from statebridge.state.sharding import (
    check_tp,
    kv_heads,
    kv_is_replicated,
    local_channels,
    shard_segments,
)
from statebridge.state.spec import StateSpec
from tests.state.test_spec import GRANITE_4_0_H_1B


def mamba2(n_groups, **kw):
    return StateSpec.from_config({"model_type": "mamba2", "hidden_size": 64, "expand": 2,
                                  "head_dim": 16, "state_size": 8, "n_groups": n_groups,
                                  "conv_kernel": 4, "num_hidden_layers": 2, **kw})


def ranges(tensor, tp_size, tp_rank):
    return [(s.segment.name, s.global_start, s.global_stop, s.local_start, s.replicated)
            for s in shard_segments(tensor, tp_size, tp_rank)]


def test_split_groups_shard_x_b_c_separately():
    conv, ssm = mamba2(n_groups=4).groups[0].tensors   # I = 128, G*N = 32, H = 8
    assert ranges(conv, 4, 1) == [("x", 32, 64, 0, False), ("B", 8, 16, 32, False),
                                  ("C", 8, 16, 40, False)]
    assert ranges(ssm, 4, 3) == [("heads", 6, 8, 0, False)]
    assert local_channels(conv, 4) == 48


def test_single_group_is_replicated_beyond_tp1():
    conv, _ = mamba2(n_groups=1).groups[0].tensors     # G*N = 8
    assert ranges(conv, 1, 0) == [("x", 0, 128, 0, False), ("B", 0, 8, 128, False),
                                  ("C", 0, 8, 136, False)]
    assert ranges(conv, 2, 1) == [("x", 64, 128, 0, False), ("B", 0, 8, 64, True),
                                  ("C", 0, 8, 72, True)]
    assert local_channels(conv, 8) == 16 + 16


def test_ranks_tile_the_split_segments():
    conv, _ = mamba2(n_groups=8).groups[0].tensors
    for tp in (1, 2, 4, 8):
        for i, seg in enumerate(conv.segments):
            pieces = sorted((shard_segments(conv, tp, r)[i].global_start,
                             shard_segments(conv, tp, r)[i].global_stop) for r in range(tp))
            assert pieces[0][0] == 0 and pieces[-1][1] == seg.size
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


@pytest.mark.parametrize("n_groups,tp,needle", [(4, 8, "n_groups 4"), (2, 3, "TP size 3"),
                                                (1, 3, "TP size 3")])
def test_indivisible_tp_names_size_and_tp(n_groups, tp, needle):
    with pytest.raises(ConfigError) as info:
        check_tp(mamba2(n_groups), tp)
    assert needle in str(info.value) and f"TP size {tp}" in str(info.value)


@pytest.mark.parametrize("tp_size,tp_rank", [(0, 0), (2, 2), (2, -1), (True, 0)])
def test_bad_rank_or_size(tp_size, tp_rank):
    conv, _ = mamba2(1).groups[0].tensors
    with pytest.raises(ConfigError, match=str(tp_rank if tp_size in (2,) else tp_size)):
        shard_segments(conv, tp_size, tp_rank)


def test_bare_segments_shard_like_their_state_tensor():
    """A fused weight axis given as bare segments (how models/tp.py cuts weights) is sharded by
    the same rule as the state tensor made of those segments; errors name the axis."""
    for n_groups, tp in ((1, 2), (4, 4), (8, 2)):
        conv, _ = mamba2(n_groups).groups[0].tensors
        for rank in range(tp):
            assert shard_segments(list(conv.segments), tp, rank) == shard_segments(conv, tp, rank)
    conv, _ = mamba2(4).groups[0].tensors
    with pytest.raises(ConfigError, match="in_proj.weight segment 'B': n_groups 4"):
        shard_segments(conv.segments, 8, 0, name="in_proj.weight")


def test_granite_bc_replicated_and_x_heads_split_at_every_tp():
    """Granite-4.0-H has n_groups = 1: every rank holds all of B and C beyond TP 1 (the
    #55208 class), its slice of x and of the SSM heads."""
    conv, ssm = StateSpec.from_config(GRANITE_4_0_H_1B).groups[0].tensors
    assert ranges(conv, 1, 0) == [("x", 0, 3072, 0, False), ("B", 0, 128, 3072, False),
                                  ("C", 0, 128, 3200, False)]
    for tp in (2, 4, 8):
        x = 3072 // tp
        for rank in range(tp):
            assert ranges(conv, tp, rank) == [("x", rank * x, (rank + 1) * x, 0, False),
                                              ("B", 0, 128, x, True), ("C", 0, 128, x + 128, True)]
            assert ranges(ssm, tp, rank) == [("heads", rank * 48 // tp, (rank + 1) * 48 // tp, 0,
                                              False)]


# (tp, (first KV head, count) of every rank): 4 KV heads split at TP 2 and 4, shared by two
# consecutive ranks at TP 8.
GRANITE_KV = [
    (1, [(0, 4)]),
    (2, [(0, 2), (2, 2)]),
    (4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
    (8, [(0, 1), (0, 1), (1, 1), (1, 1), (2, 1), (2, 1), (3, 1), (3, 1)]),
]


@pytest.mark.parametrize("tp,heads", GRANITE_KV, ids=[f"tp{c[0]}" for c in GRANITE_KV])
def test_granite_kv_heads_split_then_replicated(tp, heads):
    spec = StateSpec.from_config(GRANITE_4_0_H_1B)
    assert [kv_heads(spec.kv, tp, r) for r in range(tp)] == heads
    assert kv_is_replicated(spec.kv, tp) == (tp == 8)
    check_tp(spec, tp)


def test_granite_tp3_names_kv_heads_and_tp():
    """x (3072) and the heads (48) split over 3; the 4 KV heads cannot."""
    with pytest.raises(ConfigError) as info:
        check_tp(StateSpec.from_config(GRANITE_4_0_H_1B), 3)
    assert "num_kv_heads=4" in str(info.value) and "tp_size=3" in str(info.value)
