"""paged_prefill_attention (chunks continuing their sequences, keys in the paged pool): Triton
and reference both equal the tail of whole-sequence causal attention computed from scratch
(float64, per query and key)."""

from __future__ import annotations

import pytest
import torch

from statebridge.errors import ShapeError
from statebridge.kernels.attention import paged_prefill_attention, paged_prefill_attention_ref

from .test_attention_prefill import naive

OPS = {"ref": paged_prefill_attention_ref, "triton": paged_prefill_attention}
F32, BF16 = torch.float32, torch.bfloat16

# (id, [(tokens before the chunk, chunk length)], Hq, Hkv, D, block size, dtype)
CASES = [
    ("first-chunks-mha-d8", [(0, 3), (0, 1)], 2, 2, 8, 4, F32),
    ("continuations-gqa2-d16", [(5, 3), (0, 4), (8, 9), (1, 1)], 4, 2, 16, 4, F32),
    ("long-context-gqa4-d32-bf16", [(70, 6), (3, 65)], 8, 2, 32, 16, BF16),
]


def _setup(case, seed: int = 0):
    _, seqs, q_heads, kv_heads, head_dim, bs, dtype = case
    gen = torch.Generator().manual_seed(seed)
    totals = [start + n for start, n in seqs]
    num_blocks = sum(-(-t // bs) for t in totals) + 2
    k_cache = torch.full((num_blocks, kv_heads, bs, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, full, nxt = [], [], 1
    for total in totals:                       # blocks scattered, in reverse order
        n = -(-total // bs)
        table = list(range(nxt + n - 1, nxt - 1, -1))
        nxt += n
        q = torch.randn(total, q_heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        for t in range(total):
            k_cache[table[t // bs], :, t % bs] = k[t]
            v_cache[table[t // bs], :, t % bs] = v[t]
        tables.append(table)
        full.append((q, k, v))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    q = torch.cat([f[0][start:] for f, (start, _) in zip(full, seqs)])
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0)
    starts = torch.tensor([start for start, _ in seqs])
    scale = head_dim ** -0.5
    # expected: whole-sequence causal attention from scratch, keep each chunk's queries
    want = torch.cat([naive(f[0], f[1], f[2], torch.tensor([0, start + n]), scale)[start:]
                      for f, (start, n) in zip(full, seqs)])
    return (q, k_cache, v_cache, block_tables, qsl, starts, scale), want


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_chunks_equal_the_tail_of_whole_sequence_attention(case, op, assert_close):
    args, want = _setup(case)
    got = OPS[op](*args)
    assert got.dtype == case[-1]
    assert_close(got, want.to(case[-1]), case[-1])


@pytest.mark.parametrize("op", OPS)
def test_rejects_starts_of_the_wrong_shape(op):
    args, _ = _setup(CASES[1])
    q, k_cache, v_cache, block_tables, qsl, starts, scale = args
    with pytest.raises(ShapeError, match="starts"):
        OPS[op](q, k_cache, v_cache, block_tables, qsl, starts[:2], scale)
