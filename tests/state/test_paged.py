"""vLLM's per-layer paged memory and its plan, executed with memory copies against an oracle.

The oracle lays a rank's buffer out from vLLM's definition alone (tests/state/_oracle.py and
_kv_oracle.py for which channels and heads a rank holds): each layer's block ``b`` at ``base +
b * stride``; a recurrent block holds the conv state ``[S, D_local]`` (SD) or ``[D_local, S]``
(DS) at byte 0 and the SSM state ``[H_local, P, N]`` right after it; an attention block holds
``[H_local, K/V, T, E]``. Every other byte is background that must stay untouched.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from statebridge.errors import ConfigError, LayoutError
from statebridge.state.paged import LayerSlot, PagedGeometry, PagedPlan
from statebridge.state.spec import StateSpec

from ._kv_oracle import rank_heads
from ._oracle import copy_runs, global_state, rank_channel_index

TPS = (1, 2, 4, 8)

# Shapes vLLM serves (attention heads split or replicated at every TP of 1..8).
CONFIGS = {
    "lfm2-hybrid": {"model_type": "lfm2", "hidden_size": 40, "conv_L_cache": 3,
                    "num_attention_heads": 8, "num_key_value_heads": 2,
                    "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention"],
                    "torch_dtype": "float32"},
    "mamba2-g1": {"model_type": "mamba2", "hidden_size": 16, "expand": 2, "head_dim": 4,
                  "state_size": 6, "n_groups": 1, "conv_kernel": 4, "num_hidden_layers": 3,
                  "torch_dtype": "float32"},
    "mamba2-g8": {"model_type": "mamba2", "hidden_size": 12, "expand": 2, "head_dim": 3,
                  "state_size": 5, "n_groups": 8, "conv_kernel": 4, "num_hidden_layers": 2,
                  "torch_dtype": "float16"},
    "granite-hybrid": {"model_type": "granitemoehybrid", "hidden_size": 16,
                       "num_hidden_layers": 4, "num_attention_heads": 4,
                       "num_key_value_heads": 1,
                       "layer_types": ["mamba", "mamba", "attention", "mamba"],
                       "mamba_n_heads": 8, "mamba_d_head": 4, "mamba_d_state": 3,
                       "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
                       "intermediate_size": 32, "shared_intermediate_size": 32,
                       "num_local_experts": 0, "torch_dtype": "float32"},
}
BLOCK_SIZE = 4
NUM_BLOCKS = 6


def _spec(name: str) -> StateSpec:
    return StateSpec.from_config(CONFIGS[name])


def _allowed(spec: StateSpec, tp: int) -> bool:
    try:
        PagedGeometry(spec, tp, "SD", BLOCK_SIZE, _slots(spec, tp, 0))
        return True
    except ConfigError:
        return False


def _state_bytes(spec: StateSpec, tp: int) -> int:
    out = 0
    for g in spec.groups:
        n = 0
        for t in g.tensors:
            local = len(rank_channel_index(t, tp, 0))
            n += local * int(np.prod(t.inner_shape)) * t.itemsize
        out = max(out, n)
    return out


def _kv_bytes(spec: StateSpec, tp: int) -> int:
    kv = spec.kv
    return len(rank_heads(kv.num_kv_heads, tp, 0)) * 2 * BLOCK_SIZE * kv.head_dim * kv.itemsize


def _slots(spec: StateSpec, tp: int, seed: int) -> dict[int, LayerSlot]:
    """Every layer its own region of one buffer, in a shuffled order, padded pages (as vLLM
    pads recurrent pages to the attention page)."""
    stride = max(_state_bytes(spec, tp), _kv_bytes(spec, tp) if spec.kv else 0) + 8 * (seed + 1)
    stride = -(-stride // 8) * 8
    layers = [i for g in spec.groups for i in g.layer_ids]
    layers += list(spec.kv.layer_ids) if spec.kv else []
    order = np.random.default_rng(seed).permutation(len(layers))
    return {layers[k]: LayerSlot(16 + int(pos) * stride * NUM_BLOCKS, stride, NUM_BLOCKS)
            for k, pos in enumerate(order)}


def _buffer_size(slots) -> int:
    return max(s.base + s.block_stride * s.num_blocks for s in slots.values()) + 16


def _fill(spec, tp, rank, layout, slots, state, kv_values, state_block, kv_table, background):
    """The rank's buffer as vLLM lays it out, and a mask of the bytes that hold the request."""
    buf = ((np.arange(_buffer_size(slots)) * 7 + background) % 251).astype(np.uint8)
    mask = np.zeros(buf.size, dtype=bool)
    for gi, group in enumerate(spec.groups):
        for li, layer in enumerate(group.layer_ids):
            pos = slots[layer].base + state_block[layer] * slots[layer].block_stride
            for t in group.tensors:
                local = state[(gi, t.name)][li][rank_channel_index(t, tp, rank)]  # [C, *inner]
                if t.name == "conv" and layout == "SD":
                    local = local.T                                          # [S, D]
                raw = np.ascontiguousarray(local).reshape(-1).view(np.uint8)
                buf[pos:pos + raw.size] = raw
                mask[pos:pos + raw.size] = True
                pos += raw.size
    if spec.kv is not None:
        heads = rank_heads(spec.kv.num_kv_heads, tp, rank)
        for li, layer in enumerate(spec.kv.layer_ids):
            for i, block in enumerate(kv_table[layer]):
                v = kv_values[li, :, i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE][:, :, heads]  # C T H E
                raw = np.ascontiguousarray(v.transpose(2, 0, 1, 3)).reshape(-1).view(np.uint8)
                pos = slots[layer].base + block * slots[layer].block_stride
                buf[pos:pos + raw.size] = raw
                mask[pos:pos + raw.size] = True
    return buf, mask


def _case(spec, src_tp, dst_tp, layout, tokens):
    rng = np.random.default_rng(src_tp * 31 + dst_tp)
    state = global_state(spec)
    kv_values = None
    n_blocks = -(-tokens // BLOCK_SIZE)
    if spec.kv is not None:
        kv = spec.kv
        shape = (kv.num_layers, 2, n_blocks * BLOCK_SIZE, kv.num_kv_heads, kv.head_dim)
        kv_values = (np.arange(int(np.prod(shape))).reshape(shape) + 10_000).astype(
            {2: np.int16, 4: np.int32}[kv.itemsize])
    layers_state = [i for g in spec.groups for i in g.layer_ids]
    layers_kv = list(spec.kv.layer_ids) if spec.kv else []
    sides = {}
    for side, tp, seed in (("src", src_tp, 1), ("dst", dst_tp, 2)):
        slots = _slots(spec, tp, seed)
        state_block = {i: int(rng.integers(NUM_BLOCKS)) for i in layers_state}
        table = {i: [int(b) for b in rng.permutation(NUM_BLOCKS)[:n_blocks]] for i in layers_kv}
        sides[side] = (slots, state_block, table)
    return state, kv_values, sides


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_every_tp_pair_moves_exactly_the_bytes_each_destination_rank_owns(name, layout):
    spec = _spec(name)
    pairs = [(s, d) for s, d in itertools.product(TPS, TPS)
             if _allowed(spec, s) and _allowed(spec, d)]
    assert len(pairs) >= 4, pairs
    for src_tp, dst_tp in pairs:
        state, kv_values, sides = _case(spec, src_tp, dst_tp, layout, tokens=9)
        (s_slots, s_state, s_kv), (d_slots, d_state, d_kv) = sides["src"], sides["dst"]
        plan = PagedPlan(PagedGeometry(spec, src_tp, layout, BLOCK_SIZE, s_slots),
                         PagedGeometry(spec, dst_tp, layout, BLOCK_SIZE, d_slots))
        src_bufs = [_fill(spec, src_tp, r, layout, s_slots, state, kv_values, s_state, s_kv,
                          background=r)[0] for r in range(src_tp)]
        for d in range(dst_tp):
            want, mask = _fill(spec, dst_tp, d, layout, d_slots, state, kv_values, d_state, d_kv,
                               background=100 + d)
            got = ((np.arange(want.size) * 7 + 100 + d) % 251).astype(np.uint8)
            writes = np.zeros(got.size, dtype=np.int64)
            for s in plan.sources_of(d):
                copy_runs(src_bufs[s], got, plan.runs(s, d, s_state, d_state, s_kv, d_kv), writes)
            case = f"{name} {layout} TP {src_tp} -> {dst_tp}, destination rank {d}"
            assert np.array_equal(got, want), case
            assert (writes[mask] == 1).all(), f"{case}: a byte written {writes[mask].max()}x"
            assert (writes[~mask] == 0).all(), f"{case}: bytes outside the request written"


def test_dim_first_moves_a_channel_range_of_a_layer_in_one_run_per_segment():
    spec = _spec("mamba2-g1")
    slots1, slots2 = _slots(spec, 1, 1), _slots(spec, 2, 2)
    counts = {}
    for layout in ("SD", "DS"):
        plan = PagedPlan(PagedGeometry(spec, 1, layout, None, slots1),
                         PagedGeometry(spec, 2, layout, None, slots2))
        blocks = {i: 0 for i in range(3)}
        counts[layout] = len(plan.runs(0, 1, blocks, blocks))
    # Destination rank 1 of 2 holds the second half of x, then B and C whole (n_groups 1,
    # replicated): on the TP-1 source that is the tail of every conv row. DS: one conv run and
    # one SSM run per layer; SD: one conv run per state slot (S = 3) and one SSM run.
    assert counts == {"DS": 3 * 2, "SD": 3 * (3 + 1)}


def test_mismatched_peers_are_refused_naming_the_values():
    spec = _spec("lfm2-hybrid")
    a = PagedGeometry(spec, 1, "SD", BLOCK_SIZE, _slots(spec, 1, 1))
    with pytest.raises(LayoutError, match="SD.*DS"):
        PagedPlan(a, PagedGeometry(spec, 2, "DS", BLOCK_SIZE, _slots(spec, 2, 2)))
    with pytest.raises(ConfigError, match="block sizes differ: source 4, destination 2"):
        PagedPlan(a, PagedGeometry(spec, 2, "SD", 2, _slots(spec, 2, 2)))
    other = StateSpec.from_config({**CONFIGS["lfm2-hybrid"], "hidden_size": 48})
    with pytest.raises(ConfigError, match="specs differ"):
        PagedPlan(a, PagedGeometry(other, 1, "SD", BLOCK_SIZE, _slots(other, 1, 1)))
    with pytest.raises(ConfigError, match=r"no memory for layers \[4\]"):
        slots = _slots(spec, 1, 1)
        del slots[4]
        PagedGeometry(spec, 1, "SD", BLOCK_SIZE, slots)
    plan = PagedPlan(a, PagedGeometry(spec, 1, "SD", BLOCK_SIZE, _slots(spec, 1, 2)))
    blocks = {i: 0 for i in (0, 1, 3)}
    with pytest.raises(ConfigError, match="block id 6 outside"):
        plan.runs(0, 0, {**blocks, 1: 6}, blocks)


def test_description_round_trips():
    spec = _spec("granite-hybrid")
    g = PagedGeometry(spec, 2, "DS", BLOCK_SIZE, _slots(spec, 2, 3))
    back = PagedGeometry.from_description(spec, g.describe())
    assert back.describe() == g.describe()
    with pytest.raises(ConfigError, match="malformed paged geometry"):
        PagedGeometry.from_description(spec, {"tp_size": 2})
