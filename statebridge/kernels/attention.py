"""Paged decode attention over a block table, and varlen causal prefill attention.

Letters (as in the rest of this package, with the head dim called D here, ``E`` in
``state/kv.py``, ``P`` in the SSM kernels)::

    B    requests          Hq   query heads        Hkv  KV heads (Hq % Hkv == 0)
    NB   blocks in the pool   BS  tokens per block   MB  block-table width    D  head dim

Decode. For request b, query head h and its KV head ``g = h // (Hq / Hkv)`` (GQA), with
``T = seq_lens[b]`` and token t living in physical block ``block_tables[b, t // BS]`` at slot
``t % BS``::

    s[t]        = scale * sum_d q[b, h, d] * k_cache[block(t), g, t % BS, d]      t < T
    out[b, h]   = sum_t softmax(s)[t] * v_cache[block(t), g, t % BS]

in float32; the result takes ``q``'s dtype. Positions ``t >= T`` (the tail of the last block,
later blocks) and table entries past ``ceil(T / BS)`` are never read, so they may hold
anything (NaN, -1).

``k_cache`` and ``v_cache`` are the strided views ``[NB, Hkv, BS, D]`` that
:meth:`statebridge.state.kv.BlockGeometry.view` returns for one attention layer; they are
never copied to a canonical layout, so every pool layout runs the same kernel::

    HB  HBLCTE   strides (B, H, T, E) = (L*2*BS*D, NB*L*2*BS*D, D, 1)
    BH  BHLCTE   strides              = (Hkv*L*2*BS*D, L*2*BS*D, D, 1)
    LH  BLCHTE   strides              = (L*2*Hkv*BS*D, BS*D, D, 1)

:func:`paged_attention_decode` is split-K: one program per (request, KV head, split of the
context) serves that head's whole GQA group with ``tl.dot`` (each K/V element is read once),
gathering ``BLOCK_T`` tokens at a time through the block table and running an online softmax;
a second kernel combines the splits. The split count comes from the block table's width (host
metadata), never from ``seq_lens``, so a call reads nothing on the host.
:func:`paged_attention_decode_ref` is plain torch with the same signature.

Values (``seq_lens`` in ``[1, MB * BS]``, used table entries in ``[0, NB)``) are checked on
every call when the tensors live on the CPU, where reading them costs nothing. On a GPU they
are not read (that would stall the device queue every call and every layer): the caller checks
its block tables when it plans them (:func:`check_paged_kv`; the model runner checks every
table on the host before it reaches the device).

Prefill. :func:`varlen_attention_prefill` is causal attention over B packed sequences of new
tokens (each from position 0): a flash-attention kernel over the packed token axis that reads
no length on the host; :func:`varlen_attention_prefill_ref` runs SDPA per sequence.

Chunked prefill. :func:`paged_prefill_attention` is causal attention of B packed chunks, chunk
b continuing its sequence at position ``starts[b]``: its K and V (earlier chunks' and its own)
are already in the paged pool, so each query token is one decode query over the pool (the
decode kernel with one row per token; nothing read on the host).
:func:`paged_prefill_attention_ref` gathers each sequence's context and runs SDPA with the
offset causal mask.

No kernel here is autotuned.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from statebridge.errors import ConfigError, ShapeError
from statebridge.kernels._common import (
    check_dims,
    check_float,
    check_int,
    check_same_device,
    check_shape,
    next_power_of_2,
    reference_of,
)
from statebridge.kernels._jit import BLOCK_B, dot, find_chunk, seq_span, varlen_programs
from statebridge.kernels._launch import FLOATS, INDEX, Launcher

__all__ = [
    "check_paged_kv",
    "paged_attention_decode",
    "paged_attention_decode_ref",
    "varlen_attention_prefill",
    "varlen_attention_prefill_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
]

# Head dims the kernels are built for (tl.dot needs every block dim >= 16).
HEAD_DIM_BLOCKS = (16, 32, 64, 128, 256)
_BLOCK_G = 16  # query heads per program (a larger GQA group takes several programs)
_BLOCK_T = 64  # tokens per step of the decode kernel (any block size: gathered per token)
_MAX_SPLITS = 64
_TARGET_PROGRAMS = 1024  # enough (request, KV head, split) programs to fill a large GPU
_PREFILL_BLOCK_M = 64
_PREFILL_BLOCK_N = 64


def _head_dim_block(head_dim: int) -> int:
    block = max(16, next_power_of_2(head_dim))
    if block not in HEAD_DIM_BLOCKS:
        raise ConfigError(f"the Triton attention kernels are built for head dims <= {HEAD_DIM_BLOCKS[-1]}, got D={head_dim}")
    return block


# --------------------------------------------------------------------------------------------
# Decode (split-K over the block table)
# --------------------------------------------------------------------------------------------


@triton.jit
def _paged_attention_split_kernel(
    p_q,
    p_k,
    p_v,
    p_bt,
    p_lens,
    p_part_o,
    p_part_ml,
    scale,
    group,
    q_heads,
    block_size,
    head_dim,
    tokens_per_split,
    num_splits,
    stride_q_b,
    stride_q_h,
    stride_q_d,
    stride_k_n,
    stride_k_h,
    stride_k_t,
    stride_k_d,
    stride_v_n,
    stride_v_h,
    stride_v_t,
    stride_v_d,
    stride_bt_b,
    stride_bt_i,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: one request x one KV head x one split of the context, BLOCK_G of the `group`
    # query heads that read the head (all of them unless group > BLOCK_G). Writes the split's
    # unnormalised output and its softmax max and sum.
    i_b = tl.program_id(0).to(tl.int64)
    n_gblocks = tl.cdiv(group, BLOCK_G)
    i_kv = (tl.program_id(1) // n_gblocks).to(tl.int64)
    i_gb = tl.program_id(1) % n_gblocks
    i_s = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(p_lens + i_b).to(tl.int64)
    t_lo = i_s * tokens_per_split
    t_hi = tl.minimum(t_lo + tokens_per_split, seq_len)

    o_g = i_gb * BLOCK_G + tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < group
    m_d = o_d < head_dim
    o_h = i_kv * group + o_g  # query heads of this group
    p_qs = p_q + i_b * stride_q_b + o_h[:, None] * stride_q_h + o_d[None, :] * stride_q_d
    b_q = tl.load(p_qs, mask=m_g[:, None] & m_d[None, :], other=0.0)

    b_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        m_t = o_t < t_hi
        # Every token is gathered through the table: a step may span several blocks.
        b_blk = tl.load(p_bt + i_b * stride_bt_b + (o_t // block_size) * stride_bt_i, mask=m_t, other=0).to(tl.int64)
        o_row = b_blk * stride_k_n + i_kv * stride_k_h + (o_t % block_size) * stride_k_t
        m_td = m_t[:, None] & m_d[None, :]
        b_k = tl.load(p_k + o_row[:, None] + o_d[None, :] * stride_k_d, mask=m_td, other=0.0)  # [T, D]
        b_s = dot(b_q, tl.trans(b_k)) * scale  # [G, T]
        b_s = tl.where(m_t[None, :], b_s, float("-inf"))
        # Every step holds >= 1 token of the request, so the new max is finite.
        b_new = tl.maximum(b_max, tl.max(b_s, axis=1))
        b_alpha = tl.exp(b_max - b_new)
        b_p = tl.exp(b_s - b_new[:, None])  # masked tokens: exp(-inf) = 0
        b_sum = b_sum * b_alpha + tl.sum(b_p, axis=1)
        o_row_v = b_blk * stride_v_n + i_kv * stride_v_h + (o_t % block_size) * stride_v_t
        b_v = tl.load(p_v + o_row_v[:, None] + o_d[None, :] * stride_v_d, mask=m_td, other=0.0)  # [T, D]
        b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_v.dtype), b_v)
        b_max = b_new

    # workspace [B, Hq, num_splits, D] and [B, Hq, num_splits, 2], contiguous; an empty split
    # writes max -inf, sum 0, output 0
    o_row_part = (i_b * q_heads + o_h) * num_splits + i_s
    tl.store(p_part_o + o_row_part[:, None] * BLOCK_D + o_d[None, :], b_acc, mask=m_g[:, None])
    tl.store(p_part_ml + o_row_part * 2, b_max, mask=m_g)
    tl.store(p_part_ml + o_row_part * 2 + 1, b_sum, mask=m_g)


@triton.jit
def _paged_attention_combine_kernel(
    p_part_o,
    p_part_ml,
    p_out,
    num_splits,
    head_dim,
    q_heads,
    stride_o_b,
    stride_o_h,
    stride_o_d,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    # One program: one request x one query head; combines its splits' partial softmaxes.
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    row = (i_b * q_heads + i_h) * num_splits
    o_s = tl.arange(0, BLOCK_SPLITS)
    m_s = o_s < num_splits
    b_m = tl.load(p_part_ml + (row + o_s) * 2, mask=m_s, other=float("-inf"))
    b_l = tl.load(p_part_ml + (row + o_s) * 2 + 1, mask=m_s, other=0.0)
    b_top = tl.max(b_m, axis=0)  # split 0 holds >= 1 token: finite
    b_w = tl.where(m_s, tl.exp(b_m - b_top), 0.0)
    b_total = tl.sum(b_w * b_l, axis=0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_dim
    b_o = tl.load(p_part_o + (row + o_s)[:, None] * BLOCK_D + o_d[None, :], mask=m_s[:, None], other=0.0)
    b_out = tl.sum(b_o * b_w[:, None], axis=0) / b_total
    tl.store(p_out + i_b * stride_o_b + i_h * stride_o_h + o_d * stride_o_d, b_out.to(p_out.dtype.element_ty), mask=m_d)


# The launches, declared once (the compile check builds every variant).
_DECODE_SPLIT = Launcher(
    _paged_attention_split_kernel,
    name="attention.decode_split",
    constexprs=dict(BLOCK_G=(_BLOCK_G,), BLOCK_T=(_BLOCK_T,), BLOCK_D=HEAD_DIM_BLOCKS),
    dtypes={
        "p_q": FLOATS,
        ("p_k", "p_v"): FLOATS,
        "p_bt": INDEX,
        "p_lens": INDEX,
        ("p_part_o", "p_part_ml"): (torch.float32,),
    },
    floats=("scale",),
)
_DECODE_COMBINE = Launcher(
    _paged_attention_combine_kernel,
    name="attention.decode_combine",
    constexprs=dict(BLOCK_D=HEAD_DIM_BLOCKS, BLOCK_SPLITS=(_MAX_SPLITS,)),
    dtypes={("p_part_o", "p_part_ml"): (torch.float32,), "p_out": FLOATS},
)


def check_paged_kv(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raise :class:`ShapeError` unless every ``seq_lens[b]`` is in ``[1, MB * BS]`` and every
    used entry of ``block_tables`` (the first ``ceil(seq_lens[b] / BS)`` of row b) is a block of
    the pool ``[0, num_blocks)``. Reads the values on the host: one device-to-host copy for
    device tensors, so call it when a table is planned, not per step."""
    batch, max_blocks = block_tables.shape
    if not batch:
        return
    capacity = max_blocks * block_size
    lens = seq_lens.long()
    bad_len = (lens < 1) | (lens > capacity)
    used = torch.arange(max_blocks, device=lens.device)[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    bad_block = used & ((block_tables < 0) | (block_tables >= num_blocks))
    # one host copy: first bad request by length, first bad (request, block) by id
    flags = torch.stack([bad_len.any(), bad_block.any()]).tolist()
    if flags[0]:
        b = int(bad_len.nonzero()[0, 0])
        raise ShapeError(
            f"seq_lens[{b}]={int(lens[b])} must be in [1, {capacity}] (block_tables has {max_blocks} "
            f"blocks of {block_size} tokens)"
        )
    if flags[1]:
        b, i = bad_block.nonzero()[0].tolist()
        raise ShapeError(
            f"block_tables[{b}, {i}]={int(block_tables[b, i])} is not a block of the pool [0, {num_blocks}) "
            f"(seq_lens[{b}]={int(lens[b])})"
        )


def _check_args(
    q, k_cache, v_cache, block_tables, seq_lens, scale, out
) -> tuple[int, int, int, int, int]:
    """Validate :func:`paged_attention_decode`'s arguments; return ``(B, Hq, Hkv, BS, D)``.
    Reads ``seq_lens`` and the used block-table entries only when they are on the CPU (see the
    module docstring)."""
    check_dims("q", q, 3)
    check_dims("k_cache", k_cache, 4)
    check_float("q", q)
    check_float("k_cache", k_cache)
    batch, q_heads, head_dim = q.shape
    num_blocks, kv_heads, block_size, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ShapeError(
            f"k_cache and v_cache must have one shape and dtype, got {list(k_cache.shape)} {k_cache.dtype} and "
            f"{list(v_cache.shape)} {v_cache.dtype}"
        )
    if kv_dim != head_dim:
        raise ShapeError(
            f"q head dim D={head_dim} differs from the KV cache's D={kv_dim} (k_cache {list(k_cache.shape)})"
        )
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ShapeError(f"query heads Hq={q_heads} must be a multiple of KV heads Hkv={kv_heads}")
    if head_dim == 0 or block_size == 0:
        raise ShapeError(f"k_cache must have D >= 1 and block_size >= 1, got {list(k_cache.shape)}")
    check_dims("block_tables", block_tables, 2)
    check_int("block_tables", block_tables)
    if block_tables.shape[0] != batch:
        raise ShapeError(f"block_tables must have B={batch} rows (one per query), got {list(block_tables.shape)}")
    check_int("seq_lens", seq_lens)
    check_shape("seq_lens", seq_lens, (batch,))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ConfigError(f"scale must be a finite float, got {scale!r}")
    if out is not None:
        check_shape("out", out, (batch, q_heads, head_dim))
        if out.dtype != q.dtype:
            raise ShapeError(f"out must have q's dtype {q.dtype}, got {out.dtype}")
    device = check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens, out=out
    )
    if device.type == "cpu":
        check_paged_kv(block_tables, seq_lens, num_blocks, block_size)
    return batch, q_heads, kv_heads, block_size, head_dim


def _splits(batch: int, kv_heads: int, max_tokens: int) -> tuple[int, int]:
    """``(num_splits, tokens_per_split)`` for contexts of at most ``max_tokens``: enough programs
    to fill a GPU, each with whole steps of ``_BLOCK_T`` tokens."""
    steps = max(1, triton.cdiv(max_tokens, _BLOCK_T))
    want = triton.cdiv(_TARGET_PROGRAMS, max(1, batch * kv_heads))
    splits = max(1, min(want, steps, _MAX_SPLITS))
    tokens_per_split = triton.cdiv(steps, splits) * _BLOCK_T
    return triton.cdiv(max_tokens, tokens_per_split), tokens_per_split


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one new token per request over its paged KV.

    Args:
        q: ``[B, Hq, D]`` fp32/fp16/bf16 query of each request's new token, any strides.
        k_cache: ``[NB, Hkv, BS, D]`` strided view of one layer's K (``BlockGeometry.view``),
            already holding the new token; ``Hq % Hkv == 0``, query head h reads KV head
            ``h // (Hq / Hkv)``.
        v_cache: ``[NB, Hkv, BS, D]`` V, the same shape and dtype as ``k_cache``.
        block_tables: ``[B, MB]`` int32/int64; request b's token t is in block
            ``block_tables[b, t // BS]``. Entries past ``ceil(seq_lens[b] / BS)`` are not read.
        seq_lens: ``[B]`` int32/int64 tokens each request attends to, in ``[1, MB * BS]``.
        scale: softmax scale (e.g. ``D ** -0.5``).
        out: optional ``[B, Hq, D]`` result in ``q.dtype`` (any strides), written and returned.

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``: ``softmax(scale * q . k) @ v`` in fp32.
    """
    batch, q_heads, kv_heads, block_size, head_dim = _check_args(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out
    )
    group = q_heads // kv_heads
    block_d = _head_dim_block(head_dim)
    _DECODE_SPLIT.check_runnable(q)
    if out is None:
        out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    num_splits, tokens_per_split = _splits(batch, kv_heads, block_tables.shape[1] * block_size)
    part_o = torch.empty((batch, q_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((batch, q_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    _DECODE_SPLIT(
        (batch, kv_heads * triton.cdiv(group, _BLOCK_G), num_splits),
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_o,
        part_ml,
        float(scale),
        group,
        q_heads,
        block_size,
        head_dim,
        tokens_per_split,
        num_splits,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        BLOCK_G=_BLOCK_G,
        BLOCK_T=_BLOCK_T,
        BLOCK_D=block_d,
    )
    _DECODE_COMBINE(
        (batch, q_heads),
        part_o,
        part_ml,
        out,
        num_splits,
        head_dim,
        q_heads,
        *out.stride(),
        BLOCK_D=block_d,
        BLOCK_SPLITS=_MAX_SPLITS,
    )
    return out


@reference_of(paged_attention_decode)
def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, *, out=None):
    batch, q_heads, kv_heads, block_size, head_dim = _check_args(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out
    )
    if out is None:
        out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    group = q_heads // kv_heads
    for b, seq_len in enumerate(seq_lens.tolist()):
        n_blocks = -(-seq_len // block_size)
        ids = block_tables[b, :n_blocks].long()

        def gather(cache: torch.Tensor) -> torch.Tensor:
            # [n_blocks, Hkv, BS, D] -> [T, Hkv, D] -> [T, Hq, D]; the tail past T is dropped
            blocks = cache.index_select(0, ids).float().transpose(1, 2)
            return blocks.reshape(n_blocks * block_size, kv_heads, head_dim)[:seq_len].repeat_interleave(group, dim=1)

        k, v = gather(k_cache), gather(v_cache)
        scores = torch.einsum("hd,thd->ht", q[b].float(), k) * scale  # [Hq, T]
        probs = torch.softmax(scores, dim=-1)
        out[b].copy_(torch.einsum("ht,thd->hd", probs, v))
    return out



# --------------------------------------------------------------------------------------------
# Prefill (varlen, causal, from position 0)
# --------------------------------------------------------------------------------------------


@triton.jit
def _varlen_attention_kernel(
    p_q,
    p_k,
    p_v,
    p_qsl,
    p_out,
    batch,
    scale,
    group,
    head_dim,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # One program: BLOCK_M queries of one sequence x one query head; online softmax over the
    # keys up to the last query (causal). The chunk comes from the packed token axis.
    i_b, i_m = find_chunk(p_qsl, batch, tl.program_id(0), BLOCK_M, BLOCK_B)
    if i_b >= batch:
        return
    i_h = tl.program_id(1).to(tl.int64)
    i_kv = i_h // group
    bos, seqlen = seq_span(p_qsl, i_b)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < seqlen
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_dim
    p_qs = p_q + (bos + o_m)[:, None] * stride_q_t + i_h * stride_q_h + o_d[None, :] * stride_q_d
    b_q = tl.load(p_qs, mask=m_m[:, None] & m_d[None, :], other=0.0)

    b_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = tl.minimum((i_m + 1) * BLOCK_M, seqlen)
    for n0 in range(0, end, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_nd = (o_n < seqlen)[:, None] & m_d[None, :]
        p_ks = p_k + (bos + o_n)[:, None] * stride_k_t + i_kv * stride_k_h + o_d[None, :] * stride_k_d
        b_k = tl.load(p_ks, mask=m_nd, other=0.0)
        b_s = dot(b_q, tl.trans(b_k)) * scale  # [M, N]
        # key n is seen by query m when n <= m; key 0 always is, so every row max is finite
        b_s = tl.where((o_n[None, :] <= o_m[:, None]) & (o_n < seqlen)[None, :], b_s, float("-inf"))
        b_new = tl.maximum(b_max, tl.max(b_s, axis=1))
        b_alpha = tl.exp(b_max - b_new)
        b_p = tl.exp(b_s - b_new[:, None])
        b_sum = b_sum * b_alpha + tl.sum(b_p, axis=1)
        p_vs = p_v + (bos + o_n)[:, None] * stride_v_t + i_kv * stride_v_h + o_d[None, :] * stride_v_d
        b_v = tl.load(p_vs, mask=m_nd, other=0.0)
        b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_v.dtype), b_v)
        b_max = b_new
    b_out = b_acc / b_sum[:, None]
    p_os = p_out + (bos + o_m)[:, None] * stride_o_t + i_h * stride_o_h + o_d[None, :] * stride_o_d
    tl.store(p_os, b_out.to(p_out.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


_PREFILL = Launcher(
    _varlen_attention_kernel,
    name="attention.prefill_varlen",
    constexprs=dict(
        BLOCK_M=(_PREFILL_BLOCK_M,), BLOCK_N=(_PREFILL_BLOCK_N,), BLOCK_D=HEAD_DIM_BLOCKS, BLOCK_B=(BLOCK_B,)
    ),
    dtypes={("p_q", "p_k", "p_v", "p_out"): FLOATS, "p_qsl": INDEX},
    floats=("scale",),
)


def _check_prefill_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor, scale: float
) -> tuple[int, int, int]:
    """Validate; return ``(Hq, Hkv, D)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dims(name, t, 3)
        check_float(name, t)
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    check_shape("k", k, (num_tokens, kv_heads, head_dim))
    check_shape("v", v, (num_tokens, kv_heads, head_dim))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ShapeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ShapeError(f"query heads Hq={q_heads} must be a multiple of KV heads Hkv={kv_heads}")
    check_int("query_start_loc", query_start_loc)
    check_dims("query_start_loc", query_start_loc, 1)
    if query_start_loc.shape[0] < 1:
        raise ShapeError(f"query_start_loc must be [B + 1], got {list(query_start_loc.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ConfigError(f"scale must be a finite float, got {scale!r}")
    check_same_device(q=q, k=k, v=v, query_start_loc=query_start_loc)
    return q_heads, kv_heads, head_dim


def varlen_attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of B packed sequences, each from position 0.

    Args:
        q: ``[T, Hq, D]`` queries of B sequences packed along T, any strides.
        k, v: ``[T, Hkv, D]`` keys and values (q's dtype), ``Hq % Hkv == 0``: query head h
            reads KV head ``h // (Hq / Hkv)``.
        query_start_loc: ``[B + 1]`` int32/int64, sequence b is tokens ``qsl[b]:qsl[b+1]``.
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in q's dtype (fp32 softmax); token t of a sequence attends to its tokens
        ``0..t``. Tokens outside ``[qsl[0], qsl[B])`` are not written.
    """
    q_heads, kv_heads, head_dim = _check_prefill_args(q, k, v, query_start_loc, scale)
    block_d = _head_dim_block(head_dim)
    _PREFILL.check_runnable(q)
    out = torch.empty_like(q)
    batch = query_start_loc.shape[0] - 1
    if batch == 0 or q.shape[0] == 0:
        return out
    _PREFILL(
        (varlen_programs(q.shape[0], batch, _PREFILL_BLOCK_M), q_heads),
        q,
        k,
        v,
        query_start_loc,
        out,
        batch,
        float(scale),
        q_heads // kv_heads,
        head_dim,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        BLOCK_M=_PREFILL_BLOCK_M,
        BLOCK_N=_PREFILL_BLOCK_N,
        BLOCK_D=block_d,
        BLOCK_B=BLOCK_B,
    )
    return out


@reference_of(varlen_attention_prefill)
def varlen_attention_prefill_ref(q, k, v, query_start_loc, scale):
    # F.scaled_dot_product_attention per sequence.
    q_heads, kv_heads, _ = _check_prefill_args(q, k, v, query_start_loc, scale)
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, e in zip(starts[:-1], starts[1:]):
        if e <= s:
            continue
        qs = q[s:e].transpose(0, 1)  # [Hq, n, D]
        ks = k[s:e].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[s:e].repeat_interleave(group, dim=1).transpose(0, 1)
        out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


# --------------------------------------------------------------------------------------------
# Chunked prefill (varlen, causal, continuing at a position, keys in the paged pool)
# --------------------------------------------------------------------------------------------


def _check_paged_prefill(q: torch.Tensor, block_tables: torch.Tensor,
                         query_start_loc: torch.Tensor, starts: torch.Tensor) -> int:
    """Validate the arguments :func:`_check_args` does not see; return B."""
    check_dims("q", q, 3)
    check_int("query_start_loc", query_start_loc)
    check_dims("query_start_loc", query_start_loc, 1)
    batch = query_start_loc.shape[0] - 1
    if batch < 0:
        raise ShapeError(f"query_start_loc must be [B + 1], got {list(query_start_loc.shape)}")
    check_int("starts", starts)
    check_shape("starts", starts, (batch,))
    check_dims("block_tables", block_tables, 2)
    if block_tables.shape[0] != batch:
        raise ShapeError(f"block_tables must have B={batch} rows (one per chunk), got "
                         f"{list(block_tables.shape)}")
    return batch


def _token_rows(query_start_loc: torch.Tensor, starts: torch.Tensor,
                num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk of each packed token, tokens each one attends to) ``[T]``, on the device."""
    qsl = query_start_loc.long()
    batch = qsl.shape[0] - 1
    seq = torch.repeat_interleave(torch.arange(batch, device=qsl.device), qsl[1:] - qsl[:-1],
                                  output_size=num_tokens)
    positions = torch.arange(num_tokens, device=qsl.device) - qsl[seq] + starts.long()[seq]
    return seq, positions + 1


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of B packed chunks over their sequences' paged K and V.

    Args:
        q: ``[T, Hq, D]`` queries of B chunks packed along T.
        k_cache, v_cache: ``[NB, Hkv, BS, D]`` views of one layer's pool (as for
            :func:`paged_attention_decode`), already holding every key of each chunk: its
            sequence's positions ``0 .. starts[b] + len_b - 1``.
        block_tables: ``[B, MB]`` int, row b the block table of chunk b's sequence.
        query_start_loc: ``[B + 1]`` int32/int64, chunk b is tokens ``qsl[b]:qsl[b+1]``.
        starts: ``[B]`` int32/int64, the position of each chunk's first token.
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in q's dtype (fp32 softmax): the token at position p of a sequence
        attends to its positions ``0..p``.
    """
    _check_paged_prefill(q, block_tables, query_start_loc, starts)
    seq, seq_lens = _token_rows(query_start_loc, starts, q.shape[0])
    return paged_attention_decode(q, k_cache, v_cache, block_tables.index_select(0, seq),
                                  seq_lens, scale)


@reference_of(paged_prefill_attention)
def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, starts, scale):
    # F.scaled_dot_product_attention per chunk.
    batch = _check_paged_prefill(q, block_tables, query_start_loc, starts)
    seq, seq_lens = _token_rows(query_start_loc, starts, q.shape[0])
    _check_args(q, k_cache, v_cache, block_tables.index_select(0, seq), seq_lens, scale, None)
    num_blocks, kv_heads, block_size, head_dim = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    bounds, offsets = query_start_loc.tolist(), starts.tolist()
    for b in range(batch):
        s, e = bounds[b], bounds[b + 1]
        if e <= s:
            continue
        ctx = offsets[b] + e - s
        n_blocks = -(-ctx // block_size)
        ids = block_tables[b, :n_blocks].long()

        def gather(cache: torch.Tensor) -> torch.Tensor:
            # [n_blocks, Hkv, BS, D] -> [Hq, ctx, D]
            blocks = cache.index_select(0, ids).transpose(1, 2)
            flat = blocks.reshape(n_blocks * block_size, kv_heads, head_dim)[:ctx]
            return flat.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)

        keys = torch.arange(ctx, device=q.device)
        queries = torch.arange(offsets[b], ctx, device=q.device)
        mask = keys[None, :] <= queries[:, None]                          # [n, ctx]
        out[s:e] = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), gather(k_cache), gather(v_cache), attn_mask=mask,
            scale=scale).transpose(0, 1)
    return out
