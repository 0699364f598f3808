"""Paged decode attention: one new query token per request over its KV blocks.

Letters (as in the rest of this package, with the head dim called D here, ``E`` in
``state/kv.py``, ``P`` in the SSM kernels)::

    B    requests          Hq   query heads        Hkv  KV heads (Hq % Hkv == 0)
    NB   blocks in the pool   BS  tokens per block   MB  block-table width    D  head dim

For request b, query head h and its KV head ``g = h // (Hq / Hkv)`` (GQA), with
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

:func:`paged_attention_decode` is the Triton kernel (one program per request and KV head: it
serves that head's whole GQA group, so each K/V element is read once, and runs an online
softmax over the request's blocks); :func:`paged_attention_decode_ref` is plain torch with the
same signature. Both check ``seq_lens`` and the used block-table entries on the host (one
device-to-host copy per call). The kernel is not autotuned.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from statebridge.errors import ConfigError, ShapeError
from statebridge.kernels._common import (
    check_dims,
    check_float,
    check_int,
    check_same_device,
    check_shape,
    check_triton_runnable,
    next_power_of_2,
)

__all__ = ["paged_attention_decode", "paged_attention_decode_ref"]


@triton.jit
def _paged_attention_decode_kernel(
    p_q,
    p_k,
    p_v,
    p_bt,
    p_lens,
    p_out,
    scale,
    group,
    block_size,
    head_dim,
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
    stride_o_b,
    stride_o_h,
    stride_o_d,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: one request x one KV head, all `group` query heads that read it.
    i_b = tl.program_id(0).to(tl.int64)
    i_kv = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(p_lens + i_b).to(tl.int64)
    n_blocks = (seq_len + block_size - 1) // block_size

    o_g = tl.arange(0, BLOCK_G)
    o_t = tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < group
    m_d = o_d < head_dim
    o_h = i_kv * group + o_g  # query heads of this group

    p_qs = p_q + i_b * stride_q_b + o_h[:, None] * stride_q_h + o_d[None, :] * stride_q_d
    b_q = tl.load(p_qs, mask=m_g[:, None] & m_d[None, :], other=0.0).to(tl.float32) * scale

    b_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for i in range(0, n_blocks):
        block = tl.load(p_bt + i_b * stride_bt_b + i * stride_bt_i).to(tl.int64)
        # Tokens of this block the request attends to; the rest is never loaded.
        m_t = (o_t < block_size) & (i * block_size + o_t < seq_len)
        m_td = m_t[:, None] & m_d[None, :]
        p_ks = p_k + block * stride_k_n + i_kv * stride_k_h + o_t[:, None] * stride_k_t + o_d[None, :] * stride_k_d
        p_vs = p_v + block * stride_v_n + i_kv * stride_v_h + o_t[:, None] * stride_v_t + o_d[None, :] * stride_v_d
        b_k = tl.load(p_ks, mask=m_td, other=0.0).to(tl.float32)  # [T, D]
        b_v = tl.load(p_vs, mask=m_td, other=0.0).to(tl.float32)  # [T, D]
        # Scores [G, T] by broadcasting (tl.dot needs every dim >= 16; G is often 1..8).
        b_s = tl.sum(b_q[:, None, :] * b_k[None, :, :], axis=2)
        b_s = tl.where(m_t[None, :], b_s, float("-inf"))
        # Every block in the loop holds >= 1 valid token, so the new max is finite.
        b_new = tl.maximum(b_max, tl.max(b_s, axis=1))
        b_alpha = tl.exp(b_max - b_new)
        b_p = tl.exp(b_s - b_new[:, None])  # masked tokens: exp(-inf) = 0
        b_sum = b_sum * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.sum(b_p[:, :, None] * b_v[None, :, :], axis=1)
        b_max = b_new

    b_out = b_acc / b_sum[:, None]
    p_os = p_out + i_b * stride_o_b + o_h[:, None] * stride_o_h + o_d[None, :] * stride_o_d
    tl.store(p_os, b_out.to(p_out.dtype.element_ty), mask=m_g[:, None] & m_d[None, :])


def _check_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
) -> tuple[int, int, int, int, int]:
    """Validate; return ``(B, Hq, Hkv, BS, D)``. Reads ``seq_lens`` and the used block-table
    entries on the host."""
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
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens, out=out)
    if batch:
        max_blocks = block_tables.shape[1]
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
    return batch, q_heads, kv_heads, block_size, head_dim


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
    check_triton_runnable(_paged_attention_decode_kernel, q)
    if out is None:
        out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = q_heads // kv_heads
    _paged_attention_decode_kernel[(batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        float(scale),
        group,
        block_size,
        head_dim,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        BLOCK_G=next_power_of_2(group),
        BLOCK_T=next_power_of_2(block_size),
        BLOCK_D=next_power_of_2(head_dim),
    )
    return out


def paged_attention_decode_ref(
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
