"""Mamba2 prefill: the chunked scan (SSD) of packed prompts on the state slots.

:func:`mamba_chunk_scan_varlen` runs it in three Triton kernels that read each prompt's initial
state from its slot (a strided view of a page region, as in :mod:`statebridge.kernels.ssm`) and
write its final state back; :func:`mamba_chunk_scan_varlen_ref` does the same with
:func:`mamba_chunk_scan_ref`, the plain-torch scan that returns the outputs and the final
states. The recurrence is the decode step's (:mod:`statebridge.kernels.ssm`), taken a chunk of
tokens at a time.

The in-place kernels are not autotuned: autotuning runs a kernel several times on the same
arguments and every extra run would advance the SSM state again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from statebridge.errors import ShapeError
from statebridge.kernels._common import (
    check_dims, check_float, check_int, check_same_device, check_shape, check_varlen, reference_of,
)
from statebridge.kernels._jit import BLOCK_B, chunks_before, dot, find_chunk, seq_span, softplus, varlen_programs
from statebridge.kernels._launch import BOOLS, FLOATS, INDEX, VARLEN_SLOTS, Launcher
from statebridge.kernels.ssm import time_step_ref

__all__ = ["SCAN_CHUNK", "mamba_chunk_scan_ref", "mamba_chunk_scan_varlen",
           "mamba_chunk_scan_varlen_ref"]


# --------------------------------------------------------------------------------------------
# Chunked scan (prefill reference)
# --------------------------------------------------------------------------------------------


def _chunk_scan_fp32(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over chunks. x ``[b, T, H, P]``, dt ``[b, T, H]`` (final step sizes), A ``[H]``,
    B/C ``[b, T, H, N]`` (already per head), state ``[b, H, P, N]``; all fp32.
    Returns y ``[b, T, H, P]`` (without the D skip) and the final state ``[b, H, P, N]``."""
    num_tokens = x.shape[1]
    ys = []
    for c0 in range(0, num_tokens, chunk_size):
        xc = x[:, c0 : c0 + chunk_size]
        dtc = dt[:, c0 : c0 + chunk_size]
        Bc = B[:, c0 : c0 + chunk_size]
        Cc = C[:, c0 : c0 + chunk_size]
        length = xc.shape[1]
        a_cum = torch.cumsum(dtc * A, dim=1)  # [b, l, H] log-decay from chunk start to t
        # decay from s to t (s <= t): exp(a_cum[t] - a_cum[s]); masked before exp.
        seg = a_cum[:, :, None, :] - a_cum[:, None, :, :]  # [b, t, s, H]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
        xdt = xc * dtc[..., None]  # [b, l, H, P]
        scores = torch.einsum("bthn,bshn->btsh", Cc, Bc) * decay
        y = torch.einsum("btsh,bshp->bthp", scores, xdt)
        y = y + torch.einsum("bthn,bhpn->bthp", Cc, state) * torch.exp(a_cum)[..., None]
        to_end = torch.exp(a_cum[:, -1:, :] - a_cum)  # [b, l, H] decay from s to chunk end
        state = state * torch.exp(a_cum[:, -1])[:, :, None, None] + torch.einsum(
            "blhn,blhp->bhpn", Bc * to_end[..., None], xdt
        )
        ys.append(y)
    if not ys:
        return torch.zeros_like(x), state
    return torch.cat(ys, dim=1), state


def mamba_chunk_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    initial_states: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 chunked scan (SSD) over whole prompts, vectorised per chunk; fp32 arithmetic.

    Batched (``cu_seqlens is None``):
        x ``[B, T, H, P]``, dt ``[B, T, H]``, B/C ``[B, T, G, N]``, z ``[B, T, H, P]``.
    Varlen (``cu_seqlens`` ``[B + 1]``, sequence b is tokens ``cu[b]:cu[b+1]``):
        x ``[T, H, P]``, dt ``[T, H]``, B/C ``[T, G, N]``, z ``[T, H, P]``.

    Args:
        A: ``[H]`` (negative; the decay per unit step is ``exp(dt * A)``).
        chunk_size: tokens per chunk (positive).
        D: ``[H]`` or ``[H, P]`` skip weight, or None.
        z: gate with x's shape (output times ``silu(z)``), or None.
        dt_bias: ``[H]`` added to dt before the softplus, or None.
        dt_softplus: apply softplus to ``dt (+ dt_bias)``.
        initial_states: ``[B, H, P, N]`` state before each sequence, or None for zeros.

    Returns:
        ``(out, final_states)``: out with x's shape in ``x.dtype``; final states
        ``[B, H, P, N]`` in float32 (the caller casts into its cache).
    """
    varlen = cu_seqlens is not None
    check_dims("x", x, 3 if varlen else 4)
    check_float("x", x)
    if chunk_size <= 0:
        raise ShapeError(f"chunk_size must be positive, got {chunk_size}")
    lead = x.shape[:-2]  # (T,) or (B, T)
    heads, head_dim = x.shape[-2:]
    check_shape("dt", dt, (*lead, heads))
    check_shape("A", A, (heads,))
    check_dims("B", B, x.dim())
    groups, n_state = B.shape[-2:]
    if groups == 0 or heads % groups != 0:
        raise ShapeError(f"heads H={heads} must be a multiple of groups G={groups} (B is {list(B.shape)})")
    check_shape("B", B, (*lead, groups, n_state))
    check_shape("C", C, (*lead, groups, n_state))
    if z is not None:
        check_shape("z", z, tuple(x.shape))
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, (heads,))
    if D is not None and tuple(D.shape) not in ((heads,), (heads, head_dim)):
        raise ShapeError(f"D must be [H={heads}] or [H, P={head_dim}], got {list(D.shape)}")
    if varlen:
        check_int("cu_seqlens", cu_seqlens)
        check_dims("cu_seqlens", cu_seqlens, 1)
        batch = cu_seqlens.shape[0] - 1
    else:
        batch = x.shape[0]
    if initial_states is not None:
        check_shape("initial_states", initial_states, (batch, heads, head_dim, n_state))
    check_same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states)

    dtf = time_step_ref(dt, dt_bias, dt_softplus)
    per_group = heads // groups
    Bh = B.float().repeat_interleave(per_group, dim=-2)
    Ch = C.float().repeat_interleave(per_group, dim=-2)
    xf = x.float()
    Af = A.float()
    if initial_states is None:
        init = torch.zeros((batch, heads, head_dim, n_state), dtype=torch.float32, device=x.device)
    else:
        init = initial_states.float()

    if varlen:
        y = torch.zeros_like(xf)
        finals = []
        bounds = cu_seqlens.tolist()
        for b in range(batch):
            bos, eos = bounds[b], bounds[b + 1]
            if eos <= bos:
                finals.append(init[b])
                continue
            seq = slice(bos, eos)
            yb, fb = _chunk_scan_fp32(
                xf[None, seq], dtf[None, seq], Af, Bh[None, seq], Ch[None, seq], init[b : b + 1], chunk_size
            )
            y[bos:eos] = yb[0]
            finals.append(fb[0])
        final = torch.stack(finals) if finals else init
    else:
        y, final = _chunk_scan_fp32(xf, dtf, Af, Bh, Ch, init, chunk_size)

    if D is not None:
        Df = D.float() if D.dim() == 2 else D.float()[:, None]
        y = y + xf * Df
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype), final



# --------------------------------------------------------------------------------------------
# Chunked scan (SSD) of packed prompts on the state slots: Triton kernels and reference
# --------------------------------------------------------------------------------------------
#
# Per sequence, head h and chunk c of Q tokens (the last one may be shorter), with
# a[t] = sum_{s <= t in c} dt[s] * A[h] (log decay from the chunk start to t) and S_c the state
# before the chunk:
#
#   chunk state    U_c      = sum_s exp(a[last] - a[s]) dt[s] x[s] B[s]^T                 [P, N]
#   state passing  S_{c+1}  = exp(a[last]) S_c + U_c,    S_0 = initial state (or 0)
#   output         y[t]     = sum_{s <= t} (C[t] . B[s]) exp(a[t] - a[s]) dt[s] x[s]
#                             + exp(a[t]) S_c C[t]  (+ D x[t]) (* silu(z[t]))
#
# Three kernels, in stream order: chunk states (and dt, a per token), state passing (one program
# walks the chunks of one sequence; reads the initial state from its slot, writes the final one
# back), chunk scan (outputs). Chunks never span two sequences; their programs come from the
# packed token axis (find_chunk), so no length is read on the host.

SCAN_CHUNK = 64  # tokens per chunk of the Triton scan
_SCAN_BLOCK_P = 32
_SCAN_BLOCK_N = 64


@triton.jit
def _ssd_chunk_state_kernel(
    p_x,
    p_dt,
    p_A,
    p_B,
    p_dt_bias,
    p_qsl,
    p_dt_out,
    p_acs,
    p_states,
    p_decay,
    batch,
    heads,
    head_dim,
    d_state,
    heads_per_group,
    stride_x_t,
    stride_x_h,
    stride_x_p,
    stride_dt_t,
    stride_dt_h,
    stride_B_t,
    stride_B_g,
    stride_B_n,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # One program: one chunk x one head x one [BLOCK_P, BLOCK_N] tile of its chunk state.
    i_c = tl.program_id(0)
    i_b, i_t = find_chunk(p_qsl, batch, i_c, CHUNK, BLOCK_B)
    if i_b >= batch:
        return
    i_h = tl.program_id(1).to(tl.int64)
    i_g = i_h // heads_per_group
    n_pblocks = tl.cdiv(head_dim, BLOCK_P)
    i_p = tl.program_id(2) % n_pblocks
    i_n = tl.program_id(2) // n_pblocks
    bos, seqlen = seq_span(p_qsl, i_b)
    o_q = tl.arange(0, CHUNK)
    m_q = i_t * CHUNK + o_q < seqlen
    o_tok = bos + i_t * CHUNK + o_q

    b_dt = tl.load(p_dt + o_tok * stride_dt_t + i_h * stride_dt_h, mask=m_q, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(p_dt_bias + i_h).to(tl.float32)
    if DT_SOFTPLUS:
        b_dt = softplus(b_dt)
    b_dt = tl.where(m_q, b_dt, 0.0)
    b_acs = tl.cumsum(b_dt * tl.load(p_A + i_h).to(tl.float32), axis=0)
    b_last = tl.sum(tl.where(o_q == tl.sum(m_q.to(tl.int32), axis=0) - 1, b_acs, 0.0), axis=0)
    if tl.program_id(2) == 0:
        # [T, H] fp32 per token; [NC, H] per chunk
        tl.store(p_dt_out + o_tok * heads + i_h, b_dt, mask=m_q)
        tl.store(p_acs + o_tok * heads + i_h, b_acs, mask=m_q)
        tl.store(p_decay + i_c * heads + i_h, tl.exp(b_last))

    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_p = o_p < head_dim
    m_n = o_n < d_state
    p_xs = p_x + o_tok[:, None] * stride_x_t + i_h * stride_x_h + o_p[None, :] * stride_x_p
    b_x = tl.load(p_xs, mask=m_q[:, None] & m_p[None, :], other=0.0)
    b_w = tl.where(m_q, tl.exp(b_last - b_acs) * b_dt, 0.0)
    b_xw = (b_x.to(tl.float32) * b_w[:, None]).to(b_x.dtype)  # [Q, P]
    p_Bs = p_B + o_tok[:, None] * stride_B_t + i_g * stride_B_g + o_n[None, :] * stride_B_n
    b_B = tl.load(p_Bs, mask=m_q[:, None] & m_n[None, :], other=0.0)  # [Q, N]
    b_u = dot(tl.trans(b_xw), b_B)  # [P, N]
    # [NC, H, P, N] fp32, contiguous
    p_u = p_states + ((i_c * heads + i_h) * head_dim + o_p[:, None]) * d_state + o_n[None, :]
    tl.store(p_u, b_u, mask=m_p[:, None] & m_n[None, :])


@triton.jit
def _ssd_state_passing_kernel(
    p_states,
    p_decay,
    p_ssm,
    p_qsl,
    p_slots,
    p_has_init,
    heads,
    head_dim,
    d_state,
    stride_ssm_b,
    stride_ssm_h,
    stride_ssm_p,
    stride_ssm_n,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # One program: one sequence x one head x one [BLOCK_P, BLOCK_N] tile of the state. Walks the
    # sequence's chunks in order, replacing each chunk's state contribution U_c by the state
    # S_c before the chunk, and writes the final state into the sequence's slot.
    i_b = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    n_pblocks = tl.cdiv(head_dim, BLOCK_P)
    i_p = tl.program_id(2) % n_pblocks
    i_n = tl.program_id(2) // n_pblocks
    bos, seqlen = seq_span(p_qsl, i_b)
    c0 = chunks_before(p_qsl, i_b, CHUNK, BLOCK_B)
    slot = tl.load(p_slots + i_b).to(tl.int64)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_pn = (o_p < head_dim)[:, None] & (o_n < d_state)[None, :]
    p_slot = p_ssm + slot * stride_ssm_b + i_h * stride_ssm_h + o_p[:, None] * stride_ssm_p + o_n[None, :] * stride_ssm_n
    # Masks are built from a vector comparison against an integer rather than from a scalar bool
    # (which the interpreter rejects).
    has_init = tl.load(p_has_init + i_b).to(tl.int32)
    b_s = tl.load(p_slot, mask=m_pn & (tl.zeros_like(o_n) + has_init > 0)[None, :], other=0.0).to(tl.float32)
    for i in range(0, tl.cdiv(seqlen, CHUNK)):
        c = c0 + i
        p_u = p_states + ((c * heads + i_h) * head_dim + o_p[:, None]) * d_state + o_n[None, :]
        b_u = tl.load(p_u, mask=m_pn, other=0.0)
        tl.store(p_u, b_s, mask=m_pn)
        b_s = tl.load(p_decay + c * heads + i_h) * b_s + b_u
    tl.store(p_slot, b_s.to(p_ssm.dtype.element_ty), mask=m_pn)


@triton.jit
def _ssd_chunk_scan_kernel(
    p_x,
    p_B,
    p_C,
    p_D,
    p_z,
    p_dt_out,
    p_acs,
    p_states,
    p_qsl,
    p_out,
    batch,
    heads,
    head_dim,
    d_state,
    heads_per_group,
    stride_x_t,
    stride_x_h,
    stride_x_p,
    stride_B_t,
    stride_B_g,
    stride_B_n,
    stride_C_t,
    stride_C_g,
    stride_C_n,
    stride_D_h,
    stride_D_p,
    stride_z_t,
    stride_z_h,
    stride_z_p,
    stride_o_t,
    stride_o_h,
    stride_o_p,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # One program: one chunk x one head x BLOCK_P head-dim columns of its outputs.
    i_c = tl.program_id(0)
    i_b, i_t = find_chunk(p_qsl, batch, i_c, CHUNK, BLOCK_B)
    if i_b >= batch:
        return
    i_h = tl.program_id(1).to(tl.int64)
    i_g = i_h // heads_per_group
    i_p = tl.program_id(2)
    bos, seqlen = seq_span(p_qsl, i_b)
    o_q = tl.arange(0, CHUNK)
    m_q = i_t * CHUNK + o_q < seqlen
    o_tok = bos + i_t * CHUNK + o_q
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    m_p = o_p < head_dim

    b_dt = tl.load(p_dt_out + o_tok * heads + i_h, mask=m_q, other=0.0)
    b_acs = tl.load(p_acs + o_tok * heads + i_h, mask=m_q, other=0.0)
    b_cb = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    b_y = tl.zeros([CHUNK, BLOCK_P], dtype=tl.float32)
    for n0 in range(0, d_state, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < d_state
        m_qn = m_q[:, None] & m_n[None, :]
        b_C = tl.load(p_C + o_tok[:, None] * stride_C_t + i_g * stride_C_g + o_n[None, :] * stride_C_n, mask=m_qn, other=0.0)
        b_B = tl.load(p_B + o_tok[:, None] * stride_B_t + i_g * stride_B_g + o_n[None, :] * stride_B_n, mask=m_qn, other=0.0)
        b_cb += dot(b_C, tl.trans(b_B))  # [Q, Q]
        # the state before the chunk, [NC, H, P, N] fp32
        p_s = p_states + ((i_c * heads + i_h) * head_dim + o_p[None, :]) * d_state + o_n[:, None]
        b_s = tl.load(p_s, mask=m_n[:, None] & m_p[None, :], other=0.0)  # [N, P]
        b_y += dot(b_C, b_s)  # [Q, P]
    b_y = b_y * tl.exp(b_acs)[:, None]
    # decay from s to t for s <= t, both in the chunk (masked before the exp: never overflows)
    m_causal = (o_q[None, :] <= o_q[:, None]) & m_q[None, :] & m_q[:, None]
    b_decay = tl.exp(tl.where(m_causal, b_acs[:, None] - b_acs[None, :], float("-inf")))
    p_xs = p_x + o_tok[:, None] * stride_x_t + i_h * stride_x_h + o_p[None, :] * stride_x_p
    b_x = tl.load(p_xs, mask=m_q[:, None] & m_p[None, :], other=0.0)  # [Q, P]
    b_m = b_cb * b_decay * b_dt[None, :]
    b_y += dot(b_m.to(b_x.dtype), b_x)
    if HAS_D:
        b_y += b_x.to(tl.float32) * tl.load(p_D + i_h * stride_D_h + o_p * stride_D_p, mask=m_p, other=0.0).to(
            tl.float32
        )[None, :]
    if HAS_Z:
        p_zs = p_z + o_tok[:, None] * stride_z_t + i_h * stride_z_h + o_p[None, :] * stride_z_p
        b_z = tl.load(p_zs, mask=m_q[:, None] & m_p[None, :], other=0.0).to(tl.float32)
        b_y = b_y * (b_z * tl.sigmoid(b_z))
    p_os = p_out + o_tok[:, None] * stride_o_t + i_h * stride_o_h + o_p[None, :] * stride_o_p
    tl.store(p_os, b_y.to(p_out.dtype.element_ty), mask=m_q[:, None] & m_p[None, :])


# The launches, declared once (the compile check builds every variant).
_SCAN_FIXED = dict(CHUNK=(SCAN_CHUNK,), BLOCK_P=(_SCAN_BLOCK_P,), BLOCK_N=(_SCAN_BLOCK_N,), BLOCK_B=(BLOCK_B,))
_SCAN_STATE = Launcher(
    _ssd_chunk_state_kernel,
    name="ssm.scan_chunk_state",
    constexprs=dict(HAS_DT_BIAS=BOOLS, DT_SOFTPLUS=BOOLS, **_SCAN_FIXED),
    dtypes={
        "p_x": FLOATS,
        "p_dt": FLOATS,
        "p_A": FLOATS,
        "p_B": FLOATS,
        "p_dt_bias": FLOATS,
        "p_qsl": INDEX,
        ("p_dt_out", "p_acs", "p_states", "p_decay"): (torch.float32,),
    },
)
_SCAN_PASS = Launcher(
    _ssd_state_passing_kernel,
    name="ssm.scan_state_passing",
    constexprs=_SCAN_FIXED,
    dtypes={
        ("p_states", "p_decay"): (torch.float32,),
        "p_ssm": FLOATS,
        **VARLEN_SLOTS,
    },
)
_SCAN_OUT = Launcher(
    _ssd_chunk_scan_kernel,
    name="ssm.scan_chunk_scan",
    constexprs=dict(HAS_D=BOOLS, HAS_Z=BOOLS, **_SCAN_FIXED),
    dtypes={
        ("p_x", "p_z", "p_out"): FLOATS,
        ("p_B", "p_C"): FLOATS,
        "p_D": FLOATS,
        ("p_dt_out", "p_acs", "p_states"): (torch.float32,),
        "p_qsl": INDEX,
    },
)


def _check_scan_varlen_args(
    x, dt, A, B, C, ssm_state, query_start_loc, slots, has_initial_state, chunk_size, D, z, dt_bias
) -> tuple[int, int, int, int, int]:
    """Validate :func:`mamba_chunk_scan_varlen`'s arguments; return ``(B, H, P, N, G)``."""
    check_dims("x", x, 3)
    num_tokens, heads, head_dim = x.shape
    check_dims("B", B, 3)
    groups, n_state = B.shape[1:]
    if groups == 0 or heads % groups != 0:
        raise ShapeError(f"heads H={heads} must be a multiple of groups G={groups} (B is {list(B.shape)})")
    check_dims("ssm_state", ssm_state, 4)
    check_shape("ssm_state", ssm_state, (None, heads, head_dim, n_state))
    for name, t, shape in (
        ("x", x, None),
        ("dt", dt, (num_tokens, heads)),
        ("A", A, (heads,)),
        ("B", B, (num_tokens, groups, n_state)),
        ("C", C, (num_tokens, groups, n_state)),
        ("z", z, (num_tokens, heads, head_dim)),
        ("dt_bias", dt_bias, (heads,)),
        ("ssm_state", ssm_state, None),
    ):
        if t is not None:
            check_float(name, t)
            if shape is not None:
                check_shape(name, t, shape)
    if z is not None and z.dtype != x.dtype:
        raise ShapeError(f"z must have x's dtype {x.dtype}, got {z.dtype}")
    if D is not None:
        check_float("D", D)
        if tuple(D.shape) not in ((heads,), (heads, head_dim)):
            raise ShapeError(f"D must be [H={heads}] or [H, P={head_dim}], got {list(D.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ShapeError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    batch = check_varlen(query_start_loc, "slots", slots, has_initial_state)
    check_same_device(
        x=x, dt=dt, A=A, B=B, C=C, ssm_state=ssm_state, query_start_loc=query_start_loc, slots=slots,
        has_initial_state=has_initial_state, D=D, z=z, dt_bias=dt_bias,
    )
    return batch, heads, head_dim, n_state, groups


def mamba_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> torch.Tensor:
    """Mamba2 chunked scan (SSD) of B packed prompts on their state slots; fp32 arithmetic.

    Args:
        x: ``[T, H, P]`` SSM inputs of B sequences packed along T.
        dt: ``[T, H]`` raw time steps.
        A: ``[H]`` (negative; the decay per unit step is ``exp(dt * A)``).
        B, C: ``[T, G, N]`` with ``H % G == 0``; head h uses group ``h // (H / G)``.
        ssm_state: ``[num_slots, H, P, N]`` strided view. Slot ``slots[b]`` holds sequence b's
            initial state (read if ``has_initial_state[b]``, else zeros) and receives its final
            state (an empty sequence's final state is its initial state).
        query_start_loc: ``[B + 1]`` int32/int64, sequence b is tokens ``qsl[b]:qsl[b+1]``.
        slots: ``[B]`` int32/int64 distinct slots.
        has_initial_state: ``[B]`` bool.
        chunk_size: tokens per chunk of the reference's scan. The Triton kernels scan chunks of
            :data:`SCAN_CHUNK` tokens whatever it is: the chunk length changes only rounding.
        D: ``[H]`` or ``[H, P]`` skip weight, or None.
        z: ``[T, H, P]`` gate in x's dtype (output times ``silu(z)``), or None.
        dt_bias: ``[H]`` added to dt before the softplus, or None.
        dt_softplus: apply softplus to ``dt (+ dt_bias)``.

    Returns:
        ``[T, H, P]`` output in ``x.dtype``. Tokens outside ``[qsl[0], qsl[B])`` are not written.
    """
    batch, heads, head_dim, n_state, groups = _check_scan_varlen_args(
        x, dt, A, B, C, ssm_state, query_start_loc, slots, has_initial_state, chunk_size, D, z, dt_bias
    )
    _SCAN_STATE.check_runnable(x)
    num_tokens = x.shape[0]
    out = torch.empty_like(x)
    if batch == 0:
        return out
    dev, f32 = x.device, torch.float32
    chunks = varlen_programs(num_tokens, batch, SCAN_CHUNK)
    dt_out = torch.empty((num_tokens, heads), dtype=f32, device=dev)
    acs = torch.empty((num_tokens, heads), dtype=f32, device=dev)
    states = torch.empty((chunks, heads, head_dim, n_state), dtype=f32, device=dev)
    decay = torch.empty((chunks, heads), dtype=f32, device=dev)
    tiles = triton.cdiv(head_dim, _SCAN_BLOCK_P) * triton.cdiv(n_state, _SCAN_BLOCK_N)
    fixed = dict(CHUNK=SCAN_CHUNK, BLOCK_P=_SCAN_BLOCK_P, BLOCK_N=_SCAN_BLOCK_N, BLOCK_B=BLOCK_B)
    _SCAN_STATE(
        (chunks, heads, tiles),
        x,
        dt,
        A,
        B,
        dt_bias if dt_bias is not None else dt,
        query_start_loc,
        dt_out,
        acs,
        states,
        decay,
        batch,
        heads,
        head_dim,
        n_state,
        heads // groups,
        *x.stride(),
        *dt.stride(),
        *B.stride(),
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus),
        **fixed,
    )
    _SCAN_PASS(
        (batch, heads, tiles),
        states,
        decay,
        ssm_state,
        query_start_loc,
        slots,
        has_initial_state,
        heads,
        head_dim,
        n_state,
        *ssm_state.stride(),
        **fixed,
    )
    if D is None:
        d_strides = (0, 0)
    elif D.dim() == 1:
        d_strides = (D.stride(0), 0)
    else:
        d_strides = tuple(D.stride())
    if num_tokens == 0:
        return out
    _SCAN_OUT(
        (chunks, heads, triton.cdiv(head_dim, _SCAN_BLOCK_P)),
        x,
        B,
        C,
        D if D is not None else x,
        z if z is not None else x,
        dt_out,
        acs,
        states,
        query_start_loc,
        out,
        batch,
        heads,
        head_dim,
        n_state,
        heads // groups,
        *x.stride(),
        *B.stride(),
        *C.stride(),
        *d_strides,
        *(z.stride() if z is not None else (0, 0, 0)),
        *out.stride(),
        HAS_D=D is not None,
        HAS_Z=z is not None,
        **fixed,
    )
    return out


@reference_of(mamba_chunk_scan_varlen)
def mamba_chunk_scan_varlen_ref(
    x, dt, A, B, C, ssm_state, query_start_loc, slots, has_initial_state, *,
    chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
):
    _check_scan_varlen_args(
        x, dt, A, B, C, ssm_state, query_start_loc, slots, has_initial_state, chunk_size, D, z, dt_bias
    )
    idx = slots.long()
    init = torch.where(has_initial_state[:, None, None, None], ssm_state.index_select(0, idx).float(), 0.0)
    y, final = mamba_chunk_scan_ref(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, initial_states=init,
        cu_seqlens=query_start_loc,
    )
    ssm_state.index_copy_(0, idx, final.to(ssm_state.dtype))
    return y
