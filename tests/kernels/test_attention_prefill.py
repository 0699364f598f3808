"""varlen_attention_prefill: Triton (flash attention over the packed token axis) == reference
(SDPA per sequence) == naive (per query, per key, float64)."""

from __future__ import annotations

import pytest
import torch

from statebridge.errors import ConfigError, ShapeError
from statebridge.kernels.attention import varlen_attention_prefill, varlen_attention_prefill_ref

from .helpers import noncontig, qsl_of

pytestmark = pytest.mark.usefixtures("nan_empty")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OPS = {"ref": varlen_attention_prefill_ref, "triton": varlen_attention_prefill}

# (id, lengths, Hq, Hkv, D, dtype, strided q): the kernel's query and key blocks are 64 tokens
CASES = [
    ("one-token-mha-d8-fp32", [1], 2, 2, 8, F32, False),
    ("block-edges-gqa2-d16-fp32", [63, 64, 65], 4, 2, 16, F32, True),
    ("varlen-empty-gqa3-d12-fp32", [5, 0, 130, 1], 3, 1, 12, F32, False),
    ("gqa4-d40-bf16", [70, 9], 8, 2, 40, BF16, True),
    ("mha-d64-fp16", [17, 66], 2, 2, 64, F16, False),
]


def _setup(case, seed: int = 0):
    _, lens, q_heads, kv_heads, head_dim, dtype, strided = case
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    if strided:
        q = noncontig(q)
    return q, k, v, qsl_of(lens), head_dim**-0.5


def naive(q, k, v, qsl, scale) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    starts = qsl.tolist()
    for s, e in zip(starts[:-1], starts[1:]):
        for t in range(s, e):
            for h in range(q.shape[1]):
                scores = torch.stack([scale * (q[t, h].double() * k[u, h // group].double()).sum()
                                      for u in range(s, t + 1)])
                w = torch.softmax(scores, 0)
                out[t, h] = (w[:, None] * v[s : t + 1, h // group].double()).sum(0)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_matches_ref(case, assert_close):
    dtype = case[5]
    q, k, v, qsl, scale = _setup(case)
    got = varlen_attention_prefill(q, k, v, qsl, scale)
    want = varlen_attention_prefill_ref(q, k, v, qsl, scale)
    assert got.shape == q.shape and got.dtype == dtype
    assert_close(got, want, dtype)


@pytest.mark.parametrize("op", ["ref", "triton"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=[CASES[0][0], CASES[2][0]])
def test_matches_naive(op, case, assert_close):
    q, k, v, qsl, scale = _setup(case, seed=1)
    assert_close(OPS[op](q, k, v, qsl, scale), naive(q, k, v, qsl, scale), torch.float32)


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_rejects_bad_arguments(op):
    fn = OPS[op]
    q, k, v, qsl = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8), qsl_of([2, 3])
    assert fn(q[:0], k[:0], v[:0], qsl_of([]), 0.5).shape == (0, 4, 8)
    with pytest.raises(ShapeError, match="multiple of KV heads"):
        fn(torch.randn(5, 3, 8), k, v, qsl, 0.5)
    with pytest.raises(ShapeError, match="v must have shape"):
        fn(q, k, v[:, :, :4], qsl, 0.5)
    with pytest.raises(ShapeError, match="one dtype"):
        fn(q, k.to(BF16), v, qsl, 0.5)
    with pytest.raises(ShapeError, match="query_start_loc must be int32 or int64"):
        fn(q, k, v, qsl.float(), 0.5)
    with pytest.raises(ConfigError, match="scale must be a finite float"):
        fn(q, k, v, qsl, float("inf"))


def test_triton_refuses_head_dims_it_is_not_built_for():
    q = torch.randn(3, 2, 300)
    with pytest.raises(ConfigError, match="head dims <= 256, got D=300"):
        varlen_attention_prefill(q, q, q, qsl_of([3]), 0.1)
