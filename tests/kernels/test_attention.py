"""paged_attention_decode: Triton (split-K over the block table) == reference == naive, on real
KV pool views of every layout.

Every unwritten byte of the pool (the tail of each request's last block, blocks in no table,
the other layers) holds NaN, so a kernel that reads a position it must not read fails.
"""

from __future__ import annotations

import pytest
import torch

from statebridge.errors import ConfigError, ShapeError
from statebridge.kernels.attention import paged_attention_decode, paged_attention_decode_ref
from statebridge.state.kv import BlockGeometry
from statebridge.state.spec import KVSpec

from .helpers import noncontig

pytestmark = pytest.mark.usefixtures("nan_empty")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPE_NAMES = {F32: "float32", BF16: "bfloat16", F16: "float16"}
LAYER = 1  # the view is the middle one of three attention layers
SPARE_BLOCKS = 3  # blocks in no table (NaN)
OPS = {"ref": paged_attention_decode_ref, "triton": paged_attention_decode}

# (id, seq_lens, Hq, Hkv, D, block_size, layout, dtype, table padding, pool byte offset, strided out)
CASES = [
    ("hb-mha-d8-edges-fp32", [1, 3, 4, 5], 3, 3, 8, 4, "HB", F32, "neg", 0, False),
    ("bh-gqa2-d16-fp32", [4 * 4 + 3, 2, 8], 6, 3, 16, 4, "BH", F32, "garbage", 0, True),
    ("lh-gqa4-d8-fp32", [5, 16, 1], 12, 3, 8, 4, "LH", F32, "neg", 0, False),
    ("hb-gqa3-d16-offset-fp32", [4 * 4 + 3], 3, 1, 16, 4, "HB", F32, "neg", 24, False),
    ("lh-gqa2-bs5-d12-fp32", [9, 5, 4, 6], 4, 2, 12, 5, "LH", F32, "garbage", 8, True),
    ("bh-gqa4-d12-bf16", [4 * 8 + 3, 7], 8, 2, 12, 8, "BH", BF16, "neg", 0, False),
    ("hb-gqa2-bs5-d16-bf16", [3, 9, 11], 6, 3, 16, 5, "HB", BF16, "garbage", 16, True),
    ("lh-mha-d8-fp16", [2, 7], 3, 3, 8, 4, "LH", F16, "neg", 0, False),
    # contexts of 1, BS-1, BS, BS+1 and many blocks in one batch: several splits of the context,
    # some of them empty for the short requests
    ("hb-gqa4-bs16-splits-fp32", [1, 15, 16, 17, 200], 8, 2, 64, 16, "HB", F32, "neg", 0, False),
    # a GQA group of 17 query heads (two programs per KV head), head dim 40 (masked to 64)
    ("lh-group17-d40-splits-bf16", [70, 3], 34, 2, 40, 8, "LH", BF16, "garbage", 0, True),
    # blocks of 5 tokens: split boundaries (every 64 tokens) fall inside blocks
    ("bh-bs5-splits-mid-block-fp32", [66, 130], 4, 2, 16, 5, "BH", F32, "neg", 8, False),
]


def kv_pool(layout: str, num_blocks: int, kv_heads: int, head_dim: int, block_size: int, dtype, offset: int):
    """A real KV pool (3 attention layers) of NaN, starting ``offset`` bytes into a larger
    allocation; returns (allocation, K view, V view) of layer ``LAYER``."""
    spec = KVSpec(layer_ids=(0, 3, 5), num_kv_heads=kv_heads, head_dim=head_dim, dtype=DTYPE_NAMES[dtype])
    geo = BlockGeometry(spec, 1, layout, block_size, num_blocks)
    alloc = torch.zeros(offset + geo.nbytes + 8, dtype=torch.uint8)
    buffer = alloc[offset : offset + geo.nbytes]
    buffer.view(dtype).fill_(float("nan"))
    k, v = geo.view(buffer, LAYER)
    assert k.storage_offset() * k.element_size() >= offset
    return alloc, k, v


def setup(case, seed: int = 0):
    """Pool, scattered block tables, and the written K/V of every request's tokens."""
    _, lens, q_heads, kv_heads, head_dim, bs, layout, dtype, pad, offset, strided_out = case
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    max_blocks = max(need) + 1  # every row has padding after its used entries
    num_blocks = sum(need) + SPARE_BLOCKS
    alloc, k, v = kv_pool(layout, num_blocks, kv_heads, head_dim, bs, dtype, offset)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-monotonic
    fill = -1 if pad == "neg" else 1 << 30
    table = torch.full((len(lens), max_blocks), fill, dtype=torch.int32 if pad == "neg" else torch.int64)
    for b, n in enumerate(lens):
        for i in range(need[b]):
            blk = perm.pop()
            table[b, i] = blk
            t = min(bs, n - i * bs)
            k[blk, :, :t] = torch.randn(kv_heads, t, head_dim, generator=gen).to(dtype)
            v[blk, :, :t] = torch.randn(kv_heads, t, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), q_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return alloc, q, k, v, table, seq_lens, head_dim**-0.5


def naive_attention(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Per request, per query head, per position, in float64. Shares no code with the module."""
    batch, q_heads, head_dim = q.shape
    kv_heads, bs = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            g = h // (q_heads // kv_heads)
            scores, values = [], []
            for pos in range(int(seq_lens[b])):
                blk = int(block_tables[b, pos // bs])
                key = k_cache[blk, g, pos % bs].double()
                scores.append(scale * float((q[b, h].double() * key).sum()))
                values.append(v_cache[blk, g, pos % bs].double())
            top = max(scores)
            weights = [torch.exp(torch.tensor(s - top, dtype=torch.float64)) for s in scores]
            total = sum(weights)
            out[b, h] = sum(w * val for w, val in zip(weights, values)) / total
    return out


def poisoned_out(q: torch.Tensor, strided: bool) -> torch.Tensor:
    nan = torch.full(q.shape, float("nan"), dtype=q.dtype)
    return noncontig(nan) if strided else nan


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ref_matches_naive(case, assert_close):
    dtype = case[7]
    _, q, k, v, table, lens, scale = setup(case, seed=1)
    out = paged_attention_decode_ref(q, k, v, table, lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, naive_attention(q, k, v, table, lens, scale), dtype)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_matches_ref(case, assert_close):
    dtype, strided_out = case[7], case[10]
    alloc, q, k, v, table, lens, scale = setup(case)
    pool_before = alloc.clone()

    got = paged_attention_decode(q, k, v, table, lens, scale)
    want = paged_attention_decode_ref(q, k, v, table, lens, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got, want, dtype)

    # a NaN-filled preallocated out is fully overwritten and returned
    out = poisoned_out(q, strided_out)
    assert paged_attention_decode(q, k, v, table, lens, scale, out=out) is out
    assert_close(out, want, dtype)
    out_ref = poisoned_out(q, strided_out)
    assert paged_attention_decode_ref(q, k, v, table, lens, scale, out=out_ref) is out_ref
    assert_close(out_ref, want, dtype)

    assert torch.equal(alloc, pool_before)  # the pool is only read


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_k_and_v_with_different_strides(op, assert_close):
    """K and V are separate arguments: V from a pool of another layout must work too."""
    case = CASES[1]  # BH
    _, q, k, v, table, lens, scale = setup(case, seed=3)
    _, _, v_lh = kv_pool("LH", k.shape[0], k.shape[1], k.shape[3], k.shape[2], F32, 0)
    v_lh.copy_(v)
    assert v_lh.stride() != v.stride()
    want = naive_attention(q, k, v, table, lens, scale)
    assert_close(OPS[op](q, k, v_lh, table, lens, scale), want, F32)


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_other_scale_and_int64_lengths(op, assert_close):
    """Granite passes its attention_multiplier, not D**-0.5; seq_lens may be int64."""
    case = CASES[2]
    _, q, k, v, table, lens, _ = setup(case, seed=2)
    got = OPS[op](q, k, v, table, lens.long(), 0.3)
    assert_close(got, naive_attention(q, k, v, table, lens, 0.3), F32)


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_empty_batch(op):
    _, k, v = kv_pool("HB", 2, 2, 8, 4, F32, 0)
    q = torch.randn(0, 4, 8)
    got = OPS[op](q, k, v, torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0.5)
    assert got.shape == (0, 4, 8) and got.dtype == F32


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_rejects_bad_arguments(op):
    fn = OPS[op]
    _, k, v = kv_pool("BH", 6, 2, 8, 4, F32, 0)
    k.zero_()
    v.zero_()
    q = torch.randn(2, 4, 8)
    table = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32)
    lens = torch.tensor([9, 5], dtype=torch.int32)
    fn(q, k, v, table, lens, 0.5)  # the good call

    with pytest.raises(ShapeError, match=r"Hq=5 .*Hkv=2"):
        fn(torch.randn(2, 5, 8), k, v, table, lens, 0.5)
    with pytest.raises(ShapeError, match=r"seq_lens\[1\]=0 must be in \[1, 12\]"):
        fn(q, k, v, table, torch.tensor([9, 0]), 0.5)
    with pytest.raises(ShapeError, match=r"seq_lens\[0\]=13 must be in \[1, 12\].*3 blocks of 4"):
        fn(q, k, v, table, torch.tensor([13, 5]), 0.5)
    with pytest.raises(ShapeError, match=r"block_tables\[1, 1\]=9 .*\[0, 6\)"):
        fn(q, k, v, torch.tensor([[0, 1, 2], [3, 9, -1]]), lens, 0.5)
    with pytest.raises(ShapeError, match=r"D=16 .*D=8"):
        fn(torch.randn(2, 4, 16), k, v, table, lens, 0.5)
    with pytest.raises(ShapeError, match=r"\[6, 2, 4, 8\].*\[6, 2, 4, 4\]"):
        fn(q, k, v[..., :4], table, lens, 0.5)
    with pytest.raises(ShapeError, match="one shape and dtype"):
        fn(q, k, v.to(BF16), table, lens, 0.5)
    with pytest.raises(ShapeError, match=r"B=2 rows.*\[3, 3\]"):
        fn(q, k, v, torch.zeros(3, 3, dtype=torch.int32), lens, 0.5)
    with pytest.raises(ShapeError, match=r"seq_lens must have shape \[2\], got \[3\]"):
        fn(q, k, v, table, torch.tensor([1, 1, 1]), 0.5)
    with pytest.raises(ShapeError, match="block_tables must be int32 or int64"):
        fn(q, k, v, table.float(), lens, 0.5)
    with pytest.raises(ShapeError, match=r"out must have shape \[2, 4, 8\], got \[2, 4, 7\]"):
        fn(q, k, v, table, lens, 0.5, out=torch.zeros(2, 4, 7))
    with pytest.raises(ShapeError, match="out must have q's dtype"):
        fn(q, k, v, table, lens, 0.5, out=torch.zeros(2, 4, 8, dtype=BF16))
    with pytest.raises(ShapeError, match="q must have 3 dims"):
        fn(q[0], k, v, table, lens, 0.5)
    with pytest.raises(ConfigError, match="scale must be a finite float, got nan"):
        fn(q, k, v, table, lens, float("nan"))

