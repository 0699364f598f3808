"""Triton helpers shared by the kernels: varlen chunk look-up and a dot with fp32 accumulation.

Varlen kernels launch over the packed token axis without reading any length on the host: B
sequences of ``n_b`` tokens cut into chunks of ``BLOCK`` tokens have
``sum_b ceil(n_b / BLOCK) <= ceil(T / BLOCK) + B`` chunks, so a grid of that many programs
covers them all, and each program finds its (sequence, chunk) from ``query_start_loc`` itself
(:func:`find_chunk`). Programs past the last chunk return at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Sequences read per step of the look-up loops.
BLOCK_B = 64


def varlen_programs(num_tokens: int, batch: int, block: int) -> int:
    """Programs that cover every chunk of ``block`` tokens of ``batch`` sequences packed in
    ``num_tokens`` tokens, whatever their lengths."""
    return triton.cdiv(num_tokens, block) + batch


@triton.jit
def _chunk_counts(p_qsl, b0, end, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(b_n, m_b)``: chunks of ``BLOCK`` tokens of the sequences ``b0 .. b0 + BLOCK_B - 1``
    (0 at and past ``end``), and the mask of those before ``end``."""
    o_b = b0 + tl.arange(0, BLOCK_B)
    m_b = o_b < end
    b_lo = tl.load(p_qsl + o_b, mask=m_b, other=0).to(tl.int64)
    b_hi = tl.load(p_qsl + o_b + 1, mask=m_b, other=0).to(tl.int64)
    return (b_hi - b_lo + BLOCK - 1) // BLOCK, m_b


@triton.jit
def find_chunk(p_qsl, batch, i_c, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(i_b, i_t)``: program ``i_c`` serves chunk ``i_t`` of sequence ``i_b``, counting the chunks
    of ``BLOCK`` tokens of every sequence in order (an empty sequence has none). ``i_b == batch``
    when ``i_c`` is past the last chunk."""
    i_b = tl.zeros([], dtype=tl.int32)
    start = tl.zeros([], dtype=tl.int64)
    total = tl.zeros([], dtype=tl.int64)
    for b0 in range(0, batch, BLOCK_B):
        b_n, m_b = _chunk_counts(p_qsl, b0, batch, BLOCK, BLOCK_B)
        # the inclusive running count is monotonic: the sequences done before i_c are a prefix
        b_done = ((tl.cumsum(b_n, 0) + total) <= i_c) & m_b
        i_b += tl.sum(b_done.to(tl.int32), 0)
        start += tl.sum(tl.where(b_done, b_n, 0), 0)
        total += tl.sum(b_n, 0)
    return i_b, i_c - start


@triton.jit
def chunks_before(p_qsl, i_b, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
    """Chunks of ``BLOCK`` tokens of the sequences before ``i_b`` (the index of its first chunk
    in :func:`find_chunk`'s order)."""
    total = tl.zeros([], dtype=tl.int64)
    for b0 in range(0, i_b, BLOCK_B):
        b_n, _ = _chunk_counts(p_qsl, b0, i_b, BLOCK, BLOCK_B)
        total += tl.sum(b_n, 0)
    return total


@triton.jit
def seq_span(p_qsl, i_b):
    """``(bos, seqlen)`` of sequence ``i_b``: its first token and its length, as int64."""
    bos = tl.load(p_qsl + i_b).to(tl.int64)
    return bos, tl.load(p_qsl + i_b + 1).to(tl.int64) - bos


@triton.jit
def slot_of(p_slots, i_b, HAS_SLOTS: tl.constexpr):
    """The state slot of request ``i_b``: ``p_slots[i_b]``, or ``i_b`` itself without slots."""
    if HAS_SLOTS:
        slot = tl.load(p_slots + i_b).to(tl.int64)
    else:
        slot = i_b.to(tl.int64)
    return slot


@triton.jit
def dot(a, b):
    """``a @ b`` accumulated in fp32. Two 16-bit operands of one dtype use the tensor cores (their
    products are exact in fp32); anything else is multiplied in fp32 with IEEE precision, not
    TF32, so fp32 results match a torch reference to fp32 rounding."""
    if a.dtype == b.dtype and a.dtype != tl.float32:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def softplus(b_x):
    # softplus(x) = log1p(exp(x)), linear above 20 like torch; log1p via Goldberg's trick,
    # log(w) * u / (w - 1) with w = 1 + u, exact where a plain log(1 + u) loses all digits.
    b_u = tl.exp(tl.minimum(b_x, 20.0))
    b_w = 1.0 + b_u
    b_log1p = tl.where(b_w == 1.0, b_u, tl.log(b_w) * b_u / (b_w - 1.0))
    return tl.where(b_x <= 20.0, b_log1p, b_x)
