"""Attention KV: the block pool geometry, its allocator and the KV plan, executed with plain
memory copies against an independent oracle (:mod:`._kv_oracle`)."""

from __future__ import annotations

import itertools
import json
import zlib

import numpy as np
import pytest
import torch

from statebridge.errors import CacheFullError, ConfigError, DoubleFreeError, LayoutError, \
    ShapeError, UnknownPageError
from statebridge.state.kv import BlockGeometry, BlockPool, KVLayout, KVPlan, blocks_for
from statebridge.state.sharding import kv_heads, kv_is_replicated
from statebridge.state.spec import KVSpec, StateSpec

from . import _kv_oracle as oracle
from ._oracle import byte_index, copy_runs

TPS = (1, 2, 4, 8)
PRESETS = ("HB", "BH", "LH")
BLOCK_SIZE = 4
TOKENS = (1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 5 * BLOCK_SIZE + 3)
SRC_BLOCKS, DST_BLOCKS = 9, 11          # pool sizes: larger than any request, and unequal

LFM2_1_2B_ATTENTION = (2, 5, 8, 10, 12, 14)


def lfm2(num_layers: int, attention, *, hidden: int, heads: int, kv_heads: int,
         dtype: str = "bfloat16") -> dict:
    return {"model_type": "lfm2", "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "torch_dtype": dtype,
            "layer_types": ["full_attention" if i in attention else "conv"
                            for i in range(num_layers)]}


# Tiny specs with the real attention patterns. head_dim = hidden / attention heads.
KV_CONFIGS = {
    # LFM2-1.2B: 16 layers, attention at 2,5,8,10,12,14, 8 KV heads (head_dim 2 here).
    "lfm2-1.2b-like": lfm2(16, LFM2_1_2B_ATTENTION, hidden=16, heads=8, kv_heads=8),
    # Granite-4.0-H-like: 4 KV heads (replicated at TP 8), head_dim 3, as an LFM2 config
    # (the reader has no GraniteMoeHybrid yet).
    "granite-4.0-h-like": lfm2(5, (1, 4), hidden=24, heads=8, kv_heads=4, dtype="float16"),
    # 2 KV heads (replicated from TP 4), head_dim 4, one attention layer, fp32.
    "kv2": lfm2(3, (1,), hidden=16, heads=4, kv_heads=2, dtype="float32"),
}


def kv_spec(name: str) -> KVSpec:
    return StateSpec.from_config(KV_CONFIGS[name]).kv


def heads_kv(num_layers: int, kv_heads: int = 8) -> KVSpec:
    """An 8-head (default) bf16 KV spec of ``num_layers`` attention layers, head_dim 2."""
    config = lfm2(2 * num_layers, range(1, 2 * num_layers, 2), hidden=16, heads=8,
                  kv_heads=kv_heads)
    return StateSpec.from_config(config).kv


# -- 1. exhaustive plan execution ---------------------------------------------------------------

def tables(blocks: int, rng: np.random.Generator):
    """(name, src table, dst table): contiguous at different bases, and scattered
    (different random permutations with gaps on each side)."""
    yield "contiguous", list(range(blocks)), list(range(2, 2 + blocks))
    # Contiguous again at other bases, as a range and a tuple: the plan's runs for n
    # contiguous blocks are computed once and shifted (KVPairPlan.runs), so this checks the
    # shifted copy byte for byte.
    yield "contiguous, other bases", range(SRC_BLOCKS - blocks, SRC_BLOCKS), \
        tuple(range(1, 1 + blocks))
    yield "scattered", rng.choice(SRC_BLOCKS, blocks, replace=False).tolist(), \
        rng.choice(DST_BLOCKS, blocks, replace=False).tolist()


def execute(plan: KVPlan, kv: KVSpec, src_table, dst_table, values):
    """Fill every source pool, run every pair's runs with byte copies; return the destination
    pools, per-byte write counts and, per destination rank, {local head: source ranks}."""
    src, dst = plan.src, plan.dst
    src_pools = {}
    for s in range(src.tp_size):
        canon = oracle.canonical_pool(kv, src.tp_size, s, src.block_size, src.num_blocks,
                                      src_table, values, background=s * 7919)
        src_pools[s] = oracle.pool_bytes(canon, src.layout.order)
    dst_heads = len(oracle.rank_heads(kv.num_kv_heads, dst.tp_size, 0))
    head_of = oracle.head_of_byte(kv, dst_heads, dst.block_size, dst.num_blocks,
                                  dst.layout.order)
    src_heads = len(oracle.rank_heads(kv.num_kv_heads, src.tp_size, 0))
    src_mask = oracle.block_mask(kv, src_heads, src.block_size, src.num_blocks, src_table,
                                 src.layout.order)
    nbytes = len(head_of)
    dst_pools = {d: np.full(nbytes, 0xEE, dtype=np.uint8) for d in range(dst.tp_size)}
    writes = {d: np.zeros(nbytes, dtype=np.int64) for d in range(dst.tp_size)}
    sources: dict[int, dict[int, set[int]]] = {d: {} for d in range(dst.tp_size)}
    moved = {d: 0 for d in range(dst.tp_size)}
    for pair in plan:
        runs = pair.runs(src_table, dst_table)
        assert runs.dtype == np.int64 and runs.shape[1:] == (3,)
        assert (runs[:, 2] > 0).all()
        assert runs[:, 0].min() >= 0 and (runs[:, 0] + runs[:, 2]).max() <= len(src_mask)
        assert runs[:, 1].min() >= 0 and (runs[:, 1] + runs[:, 2]).max() <= nbytes
        assert src_mask[byte_index(runs, 0)].all(), \
            f"pair {pair.src_rank}->{pair.dst_rank} reads outside the request's source blocks"
        copy_runs(src_pools[pair.src_rank], dst_pools[pair.dst_rank], runs,
                  writes[pair.dst_rank])
        for h in np.unique(head_of[byte_index(runs, 1)]).tolist():
            sources[pair.dst_rank].setdefault(h, set()).add(pair.src_rank)
        moved[pair.dst_rank] += int(runs[:, 2].sum())
    return dst_pools, writes, sources, moved


def check_request(plan: KVPlan, kv: KVSpec, tokens: int, src_table, dst_table, what: str):
    src, dst = plan.src, plan.dst
    blocks = len(src_table)
    values = oracle.global_kv(kv, blocks * BLOCK_SIZE)
    dst_pools, writes, sources, moved = execute(plan, kv, src_table, dst_table, values)
    heads_local = len(oracle.rank_heads(kv.num_kv_heads, dst.tp_size, 0))
    mask = oracle.block_mask(kv, heads_local, dst.block_size, dst.num_blocks, dst_table,
                             dst.layout.order)
    per_block = oracle.bytes_per_block(kv, heads_local, BLOCK_SIZE)
    for d in range(dst.tp_size):
        where = f"{what}, {tokens} tokens, decode rank {d}"
        canon = oracle.canonical_pool(kv, dst.tp_size, d, dst.block_size, dst.num_blocks,
                                      dst_table, values, background=0)
        expected = oracle.pool_bytes(canon, dst.layout.order)
        # Whole blocks move: every slot of the request's blocks, not only those < tokens.
        np.testing.assert_array_equal(dst_pools[d][mask], expected[mask],
                                      err_msg=f"{where}: wrong bytes")
        assert (writes[d][mask] == 1).all(), \
            f"{where}: request bytes written {np.unique(writes[d][mask]).tolist()} times"
        assert not writes[d][~mask].any(), f"{where}: bytes outside the request written"
        assert moved[d] == blocks * per_block, where
        for h, global_head in enumerate(oracle.rank_heads(kv.num_kv_heads, dst.tp_size, d)):
            assert sources[d].get(h) == {oracle.source_rank(int(global_head), kv.num_kv_heads,
                                                            src.tp_size)}, \
                f"{where}: head {h} from source ranks {sources[d].get(h)}"


PLAN_CASES = [
    pytest.param(name, p, d, sl, dl, id=f"{name}-{p}x{d}-{sl}-{dl}")
    for name in KV_CONFIGS
    for p, d in itertools.product(TPS, TPS)
    for sl, dl in itertools.product(PRESETS, PRESETS)
]


@pytest.mark.parametrize("spec_name,src_tp,dst_tp,src_layout,dst_layout", PLAN_CASES)
def test_kv_plan_moves_every_block_byte_exactly_once(spec_name, src_tp, dst_tp, src_layout,
                                                     dst_layout):
    kv = kv_spec(spec_name)
    plan = KVPlan(BlockGeometry(kv, src_tp, src_layout, BLOCK_SIZE, SRC_BLOCKS),
                  BlockGeometry(kv, dst_tp, dst_layout, BLOCK_SIZE, DST_BLOCKS))
    # The pairs and the heads each moves: every destination head from its lowest holder.
    expected_pairs = oracle.pair_heads(kv.num_kv_heads, src_tp, dst_tp)
    assert {k: sum(n for _, _, n in p.heads) for k, p in plan.pairs.items()} == expected_pairs
    heads_local = len(oracle.rank_heads(kv.num_kv_heads, dst_tp, 0))
    for d in range(dst_tp):
        assert sum(p.bytes_per_block for p in plan.for_destination(d)) == \
            oracle.bytes_per_block(kv, heads_local, BLOCK_SIZE)
    rng = np.random.default_rng(zlib.crc32(f"{spec_name}{src_tp}{dst_tp}{src_layout}"
                                           f"{dst_layout}".encode()))
    for tokens in TOKENS:
        blocks = blocks_for(tokens, BLOCK_SIZE)
        assert plan.blocks(tokens) == blocks
        for what, src_table, dst_table in tables(blocks, rng):
            check_request(plan, kv, tokens, src_table, dst_table, what)
    # A request that fills both pools exactly: runs may then join across heads and layers.
    blocks = blocks_for(TOKENS[-1], BLOCK_SIZE)
    full = KVPlan(BlockGeometry(kv, src_tp, src_layout, BLOCK_SIZE, blocks),
                  BlockGeometry(kv, dst_tp, dst_layout, BLOCK_SIZE, blocks))
    check_request(full, kv, TOKENS[-1], list(range(blocks)), list(range(blocks)), "full pools")


@pytest.mark.parametrize("src_order,dst_order", [("TLHBCE", "HB"), ("BH", "CHTLBE"),
                                                  ("LBTHCE", "LTCBHE")])
@pytest.mark.parametrize("src_tp,dst_tp", [(1, 4), (8, 2), (2, 2)])
def test_kv_plan_with_explicit_axis_orders(src_order, dst_order, src_tp, dst_tp):
    """Orders beyond the presets (the order is data): still every byte exactly once."""
    kv = kv_spec("granite-4.0-h-like")
    plan = KVPlan(BlockGeometry(kv, src_tp, src_order, BLOCK_SIZE, SRC_BLOCKS),
                  BlockGeometry(kv, dst_tp, dst_order, BLOCK_SIZE, DST_BLOCKS))
    rng = np.random.default_rng(3)
    for tokens in (1, 2 * BLOCK_SIZE + 1):
        for what, src_table, dst_table in tables(blocks_for(tokens, BLOCK_SIZE), rng):
            check_request(plan, kv, tokens, src_table, dst_table, what)


def test_empty_and_mismatched_tables():
    kv = kv_spec("kv2")
    plan = KVPlan(BlockGeometry(kv, 1, "HB", BLOCK_SIZE, 4), BlockGeometry(kv, 2, "HB",
                                                                           BLOCK_SIZE, 4))
    assert all(p.runs([], []).shape == (0, 3) for p in plan)
    with pytest.raises(ConfigError, match="2 source, 1 destination"):
        plan.pair(0, 0).runs([0, 1], [3])


def test_kv_plan_rejects_different_specs_and_block_sizes():
    a = BlockGeometry(kv_spec("kv2"), 1, "HB", 4, 8)
    with pytest.raises(ConfigError, match="specs differ"):
        KVPlan(a, BlockGeometry(kv_spec("granite-4.0-h-like"), 1, "HB", 4, 8))
    with pytest.raises(ConfigError, match="source 4, destination 8"):
        KVPlan(a, BlockGeometry(kv_spec("kv2"), 1, "HB", 8, 8))


# -- 2. run counts -------------------------------------------------------------------------------

def pair_runs(kv: KVSpec, src_tp: int, dst_tp: int, layout: str, src_table, dst_table,
              *, src_blocks: int = 64, dst_blocks: int = 80) -> dict[tuple[int, int], int]:
    plan = KVPlan(BlockGeometry(kv, src_tp, layout, BLOCK_SIZE, src_blocks),
                  BlockGeometry(kv, dst_tp, layout, BLOCK_SIZE, dst_blocks))
    return {key: len(p.runs(src_table, dst_table)) for key, p in plan.pairs.items()}


def whole_heads(kv: KVSpec, src_tp: int, dst_tp: int, count: int) -> bool:
    """Whether a pair moves every head its source rank and its destination rank hold."""
    return count == len(oracle.rank_heads(kv.num_kv_heads, src_tp, 0)) == \
        len(oracle.rank_heads(kv.num_kv_heads, dst_tp, 0))


ALL_TP_PAIRS = list(itertools.product(TPS, TPS))
KV_HEAD_COUNTS = (8, 4, 2)


@pytest.mark.parametrize("num_kv_heads", KV_HEAD_COUNTS)
@pytest.mark.parametrize("src_tp,dst_tp", ALL_TP_PAIRS)
def test_hb_contiguous_is_one_run_per_head(num_kv_heads, src_tp, dst_tp):
    """HB, contiguous tables: one run per head a pair moves, for 2 or 6 layers and 1..9
    blocks; with k contiguous ranges (the same on both sides): heads x k."""
    expected = oracle.pair_heads(num_kv_heads, src_tp, dst_tp)
    for layers, blocks in itertools.product((2, 6), (1, 3, 9)):
        kv = heads_kv(layers, num_kv_heads)
        runs = pair_runs(kv, src_tp, dst_tp, "HB", list(range(5, 5 + blocks)),
                         list(range(blocks)))
        assert runs == expected, (layers, blocks)
    ranges = [range(40, 43), range(3, 5), range(20, 27)]         # out of id order on purpose
    table = [b for r in ranges for b in r]
    runs = pair_runs(heads_kv(6, num_kv_heads), src_tp, dst_tp, "HB", table, table)
    assert runs == {k: n * len(ranges) for k, n in expected.items()}


@pytest.mark.parametrize("layout", ["HB", "BH", "LH"])
def test_contiguous_runs_are_read_only_and_shift_by_the_block_strides(layout):
    """What a rank posts for consecutive block ids (the template of blocks [0, n) at the
    tables' first blocks) is what the plan computes for those tables, and the cached runs
    cannot be changed by a caller."""
    kv = heads_kv(3)
    plan = KVPlan(BlockGeometry(kv, 2, layout, 16, SRC_BLOCKS),
                  BlockGeometry(kv, 4, layout, 16, DST_BLOCKS))
    for pair in plan:
        runs = pair.contiguous_runs(5)
        assert not runs.flags.writeable
        with pytest.raises(ValueError):
            runs[0, 0] = 1
        shifted = runs + np.array([7 * pair.src_block_stride, 3 * pair.dst_block_stride, 0])
        np.testing.assert_array_equal(pair.runs(range(7, 12), list(range(3, 8))), shifted)
        np.testing.assert_array_equal(pair.runs(range(5), range(5)), runs)


@pytest.mark.parametrize("num_kv_heads", KV_HEAD_COUNTS)
@pytest.mark.parametrize("src_tp,dst_tp", ALL_TP_PAIRS)
def test_bh_runs_are_one_per_block_unless_whole_blocks_move(num_kv_heads, src_tp, dst_tp):
    """BH, contiguous tables: a pair that moves all heads of both its ranks (equal TP, or one
    head per rank on both sides) moves the request's blocks as ONE run; any other pair one
    run per block. Independent of the layers."""
    expected = oracle.pair_heads(num_kv_heads, src_tp, dst_tp)
    for layers, blocks in itertools.product((2, 6), (1, 3, 9)):
        kv = heads_kv(layers, num_kv_heads)
        runs = pair_runs(kv, src_tp, dst_tp, "BH", list(range(7, 7 + blocks)),
                         list(range(1, 1 + blocks)))
        for key, n in expected.items():
            whole = whole_heads(kv, src_tp, dst_tp, n)
            assert runs[key] == (1 if whole else blocks), (key, layers, blocks)
        if src_tp == dst_tp:
            assert set(runs.values()) == {1}


@pytest.mark.parametrize("num_kv_heads", KV_HEAD_COUNTS)
@pytest.mark.parametrize("src_tp,dst_tp", ALL_TP_PAIRS)
def test_lh_runs_grow_with_layers(num_kv_heads, src_tp, dst_tp):
    """LH (BLCHTE), contiguous tables: a pair moving part of a side's heads needs one run per
    (block, layer, K/V); a pair that moves whole blocks needs one."""
    expected = oracle.pair_heads(num_kv_heads, src_tp, dst_tp)
    counts = {}
    for layers, blocks in itertools.product((2, 6), (1, 3, 9)):
        kv = heads_kv(layers, num_kv_heads)
        runs = pair_runs(kv, src_tp, dst_tp, "LH", list(range(blocks)),
                         list(range(3, 3 + blocks)))
        for key, n in expected.items():
            whole = whole_heads(kv, src_tp, dst_tp, n)
            assert runs[key] == (1 if whole else blocks * layers * 2), (key, layers, blocks)
        counts[layers, blocks] = sum(runs.values())
    partial = not all(whole_heads(heads_kv(2, num_kv_heads), src_tp, dst_tp, n)
                      for n in expected.values())
    if partial:
        assert all(counts[6, b] > counts[2, b] for b in (1, 3, 9))


def test_lfm2_1_2b_run_counts_at_1024_tokens():
    """The real LFM2-1.2B KV (8 heads of 64, 6 layers, bf16), 1024 tokens in 64 blocks of 16."""
    kv = StateSpec.from_config(lfm2(16, LFM2_1_2B_ATTENTION, hidden=2048, heads=32,
                                    kv_heads=8)).kv
    assert (kv.num_kv_heads, kv.head_dim, kv.num_layers) == (8, 64, 6)
    expected = {  # (src_tp, dst_tp): runs per layout
        (1, 4): {"HB": 8, "BH": 256, "LH": 3072},
        (4, 1): {"HB": 8, "BH": 256, "LH": 3072},
        (2, 4): {"HB": 8, "BH": 256, "LH": 3072},
        (4, 4): {"HB": 8, "BH": 4, "LH": 4},
    }
    for (src_tp, dst_tp), by_layout in expected.items():
        for layout, total in by_layout.items():
            plan = KVPlan(BlockGeometry(kv, src_tp, layout, 16, 256),
                          BlockGeometry(kv, dst_tp, layout, 16, 256))
            summary = plan.summary(1024)
            assert summary["blocks"] == 64
            assert summary["kv_runs"] == total, (src_tp, dst_tp, layout)
            assert summary["kv_bytes"] == 1024 * kv.bytes_per_token()


# -- 3. BlockPool --------------------------------------------------------------------------------

def test_pool_first_fit_then_fewest_ranges():
    pool = BlockPool(16)
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.allocate(3) == [4, 5, 6]
    pool.free([1, 2])
    pool.free([5])
    # Free now: [1, 2], [5], [7, 16). One range fits 2 (first fit) and 9 (the tail).
    assert pool.allocate(2) == [1, 2]
    pool.free([1, 2])
    assert pool.allocate(9) == list(range(7, 16))
    # Nothing holds 3 in one range: largest first -> [1, 2] then [5].
    assert pool.allocate(3) == [1, 2, 5]
    assert (pool.num_free, pool.num_used) == (0, 16)


def test_pool_fewest_ranges_prefers_the_largest():
    pool = BlockPool(12)
    pool.allocate(12)
    pool.free([0, 4, 5, 6, 9, 10])        # free: [0], [4, 7), [9, 11)
    assert pool.allocate(5) == [4, 5, 6, 9, 10]
    assert pool.allocate(1) == [0]


def test_pool_after_extends_the_last_block():
    pool = BlockPool(10)
    a = pool.allocate(2)                   # [0, 1]
    assert pool.allocate(3, after=a[-1]) == [2, 3, 4]
    b = pool.allocate(1)                   # [5]
    # The blocks right after 4 are taken: 'after' gives what follows it, then first fit.
    assert pool.allocate(2, after=4) == [6, 7]
    pool.free([6, 7])
    assert pool.allocate(2, after=b[-1]) == [6, 7]
    # Part free after: take [8, 9], the rest first fit.
    pool.free([0, 1])
    assert pool.allocate(3, after=7) == [8, 9, 0]
    assert pool.allocate(1, after=9) == [1]          # last block: plain first fit
    assert pool.num_free == 0


def test_pool_full_names_wanted_free_total_and_takes_nothing():
    pool = BlockPool(8)
    pool.allocate(5)
    with pytest.raises(CacheFullError, match=r"4 KV blocks wanted, 3 free of 8"):
        pool.allocate(4)
    with pytest.raises(CacheFullError, match=r"4 KV blocks wanted, 3 free of 8"):
        pool.allocate(4, after=4)
    assert (pool.num_free, pool.num_used) == (3, 5)
    assert pool.allocate(3) == [5, 6, 7]
    assert pool.allocate(0) == []


@pytest.mark.parametrize("ids,error,named", [
    ([2, 6], DoubleFreeError, "KV block 6 "),          # 6 never allocated
    ([1, 3, 3], DoubleFreeError, "KV block 3 "),       # freed twice in one call
    ([0, 8], UnknownPageError, "KV block 8 "),         # out of range
    ([-1], UnknownPageError, "KV block -1 "),
    # consecutive ids (free's slice path) fall back to the named error
    ([3, 4], DoubleFreeError, "KV block 4 "),
    (range(2, 6), DoubleFreeError, "KV block 4 "),
    ((3, 4, 5, 6, 7, 8), UnknownPageError, "KV block 8 "),
    (range(-1, 2), UnknownPageError, "KV block -1 "),
])
def test_pool_bad_free_names_the_block_and_frees_nothing(ids, error, named):
    pool = BlockPool(8)
    pool.allocate(4)
    with pytest.raises(error, match=named):
        pool.free(ids)
    assert pool.num_used == 4 and all(pool.is_allocated(b) for b in range(4))
    pool.free([0, 1, 2, 3])
    with pytest.raises(DoubleFreeError, match="KV block 2 "):
        pool.free([2])


@pytest.mark.parametrize("table", [lambda a, n: list(range(a, a + n)),
                                   lambda a, n: tuple(range(a, a + n)), lambda a, n: range(a, a + n)],
                         ids=["list", "tuple", "range"])
def test_pool_frees_a_consecutive_table_exactly(table):
    pool = BlockPool(16)
    assert pool.allocate(16) == list(range(16))
    pool.free(table(5, 4))
    assert [b for b in range(16) if not pool.is_allocated(b)] == [5, 6, 7, 8]
    assert (pool.num_used, pool.num_free) == (12, 4)
    assert pool.allocate(4, contiguous=True) == [5, 6, 7, 8]
    pool.free(table(0, 16))
    assert pool.num_used == 0 and not any(pool.is_allocated(b) for b in range(16))


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_pool_rejects_bad_sizes(bad):
    with pytest.raises(ConfigError):
        BlockPool(bad)
    if bad != 0:
        with pytest.raises(ConfigError):
            BlockPool(4).allocate(bad)


def test_pool_random_allocations_never_share_a_block():
    rng = np.random.default_rng(11)
    pool = BlockPool(57)
    owned: dict[int, list[int]] = {}
    used = np.zeros(57, dtype=bool)
    for step in range(3000):
        if owned and (rng.random() < 0.45 or pool.num_free == 0):
            rid = int(rng.choice(list(owned)))
            blocks = owned.pop(rid)
            pool.free(blocks)
            used[blocks] = False
        elif owned and rng.random() < 0.3:         # grow a request from its last block
            rid = int(rng.choice(list(owned)))
            n = int(rng.integers(1, 4))
            if n > pool.num_free:
                with pytest.raises(CacheFullError):
                    pool.allocate(n, after=owned[rid][-1])
                continue
            new = pool.allocate(n, after=owned[rid][-1])
            assert len(new) == n and not used[new].any(), step
            used[new] = True
            owned[rid] += new
        else:
            n = int(rng.integers(1, 12))
            if n > pool.num_free:
                with pytest.raises(CacheFullError):
                    pool.allocate(n)
                continue
            new = pool.allocate(n)
            assert len(new) == len(set(new)) == n and not used[new].any(), step
            assert all(0 <= b < 57 for b in new)
            used[new] = True
            owned[step] = new
        assert pool.num_used == int(used.sum()) and pool.num_free == 57 - pool.num_used
        assert all(pool.is_allocated(b) == used[b] for b in range(57))


# -- 4. BlockGeometry.view -------------------------------------------------------------------------

VIEW_ORDERS = ("HB", "BH", "LH", "TLHBCE", "CHTLBE")


@pytest.mark.parametrize("order", VIEW_ORDERS)
@pytest.mark.parametrize("spec_name,tp", [("lfm2-1.2b-like", 2), ("granite-4.0-h-like", 8),
                                          ("kv2", 1)])
@pytest.mark.parametrize("lead", [0, 16])
def test_view_writes_land_at_the_oracle_offsets(order, spec_name, tp, lead):
    kv = kv_spec(spec_name)
    geo = BlockGeometry(kv, tp, order, 3, 5)
    heads = len(oracle.rank_heads(kv.num_kv_heads, tp, 0))
    shape = oracle.pool_shape(kv, heads, 3, 5)
    values = np.arange(1, int(np.prod(shape)) + 1).astype(oracle.int_dtype(kv)).reshape(shape)
    # The pool may start inside a larger allocation (``lead`` bytes in) and be followed by more.
    storage = torch.full((lead + geo.nbytes + 8,), 0xEE, dtype=torch.uint8)
    buffer = storage[lead:]
    for layer in range(kv.num_layers):
        k, v = geo.view(buffer, layer)
        assert k.shape == v.shape == (5, heads, 3, kv.head_dim)
        assert k.dtype == v.dtype == kv.torch_dtype
        for c, t in enumerate((k, v)):
            t.copy_(torch.from_numpy(np.ascontiguousarray(values[:, :, layer, c]))
                    .view(kv.torch_dtype))
    expected = oracle.pool_bytes(values, KVLayout.parse(order).order)
    assert geo.nbytes == len(expected) and geo.bytes_per_block * 5 == geo.nbytes
    np.testing.assert_array_equal(buffer[:geo.nbytes].numpy(), expected)
    assert (storage[:lead] == 0xEE).all() and (storage[lead + geo.nbytes:] == 0xEE).all()


def test_view_rejects_bad_buffers_and_layers():
    kv = kv_spec("granite-4.0-h-like")                    # 2 layers, fp16
    geo = BlockGeometry(kv, 2, "HB", 4, 3)
    good = torch.zeros(geo.nbytes, dtype=torch.uint8)
    for bad in (torch.zeros(geo.nbytes // 2, dtype=torch.float16),
                torch.zeros(geo.nbytes - 1, dtype=torch.uint8),
                good.view(2, -1),
                torch.zeros(2 * geo.nbytes, dtype=torch.uint8)[::2],
                torch.zeros(geo.nbytes + 1, dtype=torch.uint8)[1:]):
        with pytest.raises(ShapeError):
            geo.view(bad, 0)
    for layer in (-1, 2):
        with pytest.raises(ShapeError, match=f"layer index {layer} not in \\[0, 2\\)"):
            geo.view(good, layer)
    geo.view(good, 1)


@pytest.mark.parametrize("order", ["HBLCT", "HBLCTEE", "EHBLCT", "HBLCTX", 7])
def test_kv_layout_rejects_bad_orders(order):
    with pytest.raises(LayoutError):
        KVLayout.parse(order)


def test_kv_layout_presets_and_names():
    assert {p: KVLayout.parse(p).order for p in PRESETS} == oracle.PRESETS
    assert str(KVLayout.parse("BLCHTE")) == "LH"
    assert KVLayout.parse("TLHBCE").name == "TLHBCE"


@pytest.mark.parametrize("field,value", [("block_size", 0), ("num_blocks", -1),
                                         ("block_size", 2.0)])
def test_geometry_rejects_bad_sizes(field, value):
    args = {"block_size": 4, "num_blocks": 4, field: value}
    with pytest.raises(ConfigError, match=field):
        BlockGeometry(kv_spec("kv2"), 1, "HB", **args)


# -- 5. kv_heads and KVSpec ------------------------------------------------------------------------

@pytest.mark.parametrize("heads,tp", [(8, 1), (8, 2), (8, 4), (8, 8), (4, 8), (2, 4), (2, 8),
                                      (1, 4), (6, 3), (3, 6)])
def test_kv_heads_split_and_replication(heads, tp):
    kv = KVSpec((0,), heads, 2, "float16")
    got = [kv_heads(kv, tp, r) for r in range(tp)]
    if heads % tp == 0:
        per = heads // tp
        assert got == [(r * per, per) for r in range(tp)]
        assert not kv_is_replicated(kv, tp)
    else:
        assert got == [(r * heads // tp, 1) for r in range(tp)]
        assert kv_is_replicated(kv, tp)
        # Every head held by tp // heads consecutive ranks.
        assert [h for h, _ in got] == [h for h in range(heads) for _ in range(tp // heads)]
    for r in range(tp):
        start, count = got[r]
        assert list(range(start, start + count)) == oracle.rank_heads(heads, tp, r).tolist()


@pytest.mark.parametrize("heads,tp", [(8, 3), (4, 6), (6, 4), (2, 3)])
def test_kv_heads_impossible_split_names_both(heads, tp):
    kv = KVSpec((0,), heads, 2, "float16")
    with pytest.raises(ConfigError, match=f"num_kv_heads={heads}.*tp_size={tp}"):
        kv_heads(kv, tp, 0)
    with pytest.raises(ConfigError, match=f"num_kv_heads={heads}.*tp_size={tp}"):
        BlockGeometry(kv, tp, "HB", 4, 4)


def test_kv_heads_rejects_bad_rank():
    kv = KVSpec((0,), 4, 2, "float16")
    for rank in (-1, 4):
        with pytest.raises(ConfigError, match=f"got {rank}"):
            kv_heads(kv, 4, rank)


def test_kv_spec_of_lfm2_1_2b_like_and_json_round_trip():
    spec = StateSpec.from_config(KV_CONFIGS["lfm2-1.2b-like"])
    assert spec.kv == KVSpec(LFM2_1_2B_ATTENTION, 8, 2, "bfloat16")
    assert spec.kv.bytes_per_token() == 6 * 2 * 8 * 2 * 2
    assert spec.kv_bytes(5) == 5 * spec.kv.bytes_per_token()
    back = StateSpec.from_json(spec.to_json())
    assert back == spec and back.kv == spec.kv
    assert json.loads(spec.to_json())["kv"] == {"layer_ids": list(LFM2_1_2B_ATTENTION),
                                                "num_kv_heads": 8, "head_dim": 2,
                                                "dtype": "bfloat16"}
    fp32 = StateSpec.from_config(KV_CONFIGS["lfm2-1.2b-like"], kv_dtype="float32")
    assert fp32.kv.dtype == "float32" and fp32.fingerprint() != spec.fingerprint()
    assert StateSpec.from_json(fp32.to_json()).kv.itemsize == 4


def test_spec_without_attention_has_no_kv_key():
    spec = StateSpec.from_config(lfm2(3, (), hidden=16, heads=8, kv_heads=8))
    assert spec.kv is None and spec.kv_bytes(100) == 0
    assert set(spec.to_dict()) == {"model_type", "conv_kernel", "layer_types", "groups"}
    assert StateSpec.from_json(spec.to_json()).kv is None
    mamba = StateSpec.from_config({"model_type": "mamba2", "hidden_size": 16, "expand": 2,
                                   "head_dim": 4, "state_size": 6, "n_groups": 1,
                                   "num_hidden_layers": 2})
    assert mamba.kv is None and "kv" not in mamba.to_dict()


@pytest.mark.parametrize("kwargs,match", [
    ({"layer_ids": ()}, "without attention"),
    ({"layer_ids": (2, 2)}, "distinct"),
    ({"layer_ids": (-1,)}, "distinct"),
    ({"num_kv_heads": 0}, "num_kv_heads"),
    ({"head_dim": True}, "head_dim"),
    ({"dtype": "int8"}, "int8"),
])
def test_kv_spec_validation(kwargs, match):
    args = {"layer_ids": (1,), "num_kv_heads": 2, "head_dim": 4, "dtype": "float16", **kwargs}
    with pytest.raises(ConfigError, match=match):
        KVSpec(**args)
