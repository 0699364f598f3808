"""Mamba2 SSM: the decode step on a strided state.

The recurrence, per head h, head-dim row p and state column n, for one token with input x,
step dt (after ``dt_bias`` and softplus), group vectors B and C::

    state[h, p, n] = exp(dt[h, p] * A[h, p, n]) * state[h, p, n] + dt[h, p] * x[h, p] * B[g(h), n]
    out[h, p]      = sum_n state[h, p, n] * C[g(h), n] + D[h, p] * x[h, p]     (* silu(z[h, p]))

with ``g(h) = h // (H / G)``. The state is a strided view ``[num_slots, H, P, N]`` of a page
region, so both SSM layouts run the same kernel::

    LHPN  buf [pages, L, H, P, N] -> buf[:, l]        (contiguous per page)
    HLPN  buf [pages, H, L, P, N] -> buf[:, :, l]     (stride of H is L*P*N)

:func:`selective_state_update` is the Triton kernel with :func:`selective_state_update_ref`
beside it. The prefill's chunked scan (SSD) is :mod:`statebridge.kernels.ssd`.

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
    check_dims, check_float, check_same_device, check_shape, check_slots, reference_of,
)
from statebridge.kernels._jit import slot_of, softplus
from statebridge.kernels._launch import BOOLS, FLOATS, INDEX, Launcher, placeholder

__all__ = ["selective_state_update", "selective_state_update_ref"]


# Not autotuned: every run advances the SSM state in place, so autotuning's trial runs corrupt it.
@triton.jit
def _selective_state_update_kernel(
    p_state,
    p_x,
    p_dt,
    p_A,
    p_B,
    p_C,
    p_D,
    p_z,
    p_dt_bias,
    p_slots,
    p_out,
    head_dim,
    d_state,
    heads_per_group,
    stride_st_b,
    stride_st_h,
    stride_st_p,
    stride_st_n,
    stride_x_b,
    stride_x_h,
    stride_x_p,
    stride_dt_b,
    stride_dt_h,
    stride_dt_p,
    stride_A_h,
    stride_A_p,
    stride_A_n,
    stride_B_b,
    stride_B_g,
    stride_B_n,
    stride_C_b,
    stride_C_g,
    stride_C_n,
    stride_D_h,
    stride_D_p,
    stride_z_b,
    stride_z_h,
    stride_z_p,
    stride_dtb_h,
    stride_dtb_p,
    stride_o_b,
    stride_o_h,
    stride_o_p,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program: one request x one head x a block of BLOCK_P head-dim rows, all d_state columns
    # in steps of BLOCK_N.
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2)
    i_g = i_h // heads_per_group
    slot = slot_of(p_slots, i_b, HAS_SLOTS)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    m_p = o_p < head_dim

    b_x = tl.load(p_x + i_b * stride_x_b + i_h * stride_x_h + o_p * stride_x_p, mask=m_p, other=0.0).to(tl.float32)
    b_dt = tl.load(p_dt + i_b * stride_dt_b + i_h * stride_dt_h + o_p * stride_dt_p, mask=m_p, other=0.0).to(
        tl.float32
    )
    if HAS_DT_BIAS:
        b_dt += tl.load(p_dt_bias + i_h * stride_dtb_h + o_p * stride_dtb_p, mask=m_p, other=0.0).to(tl.float32)
    if DT_SOFTPLUS:
        b_dt = softplus(b_dt)

    b_out = tl.zeros([BLOCK_P], dtype=tl.float32)
    for n0 in range(0, d_state, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < d_state
        m_pn = m_p[:, None] & m_n[None, :]
        p_st = (
            p_state + slot * stride_st_b + i_h * stride_st_h + o_p[:, None] * stride_st_p + o_n[None, :] * stride_st_n
        )
        b_state = tl.load(p_st, mask=m_pn, other=0.0).to(tl.float32)
        p_a = p_A + i_h * stride_A_h + o_p[:, None] * stride_A_p + o_n[None, :] * stride_A_n
        b_A = tl.load(p_a, mask=m_pn, other=0.0).to(tl.float32)
        b_B = tl.load(p_B + i_b * stride_B_b + i_g * stride_B_g + o_n * stride_B_n, mask=m_n, other=0.0).to(
            tl.float32
        )
        b_C = tl.load(p_C + i_b * stride_C_b + i_g * stride_C_g + o_n * stride_C_n, mask=m_n, other=0.0).to(
            tl.float32
        )
        b_state = b_state * tl.exp(b_A * b_dt[:, None]) + (b_dt * b_x)[:, None] * b_B[None, :]
        tl.store(p_st, b_state.to(p_state.dtype.element_ty), mask=m_pn)
        b_out += tl.sum(b_state * b_C[None, :], axis=1)

    if HAS_D:
        b_out += b_x * tl.load(p_D + i_h * stride_D_h + o_p * stride_D_p, mask=m_p, other=0.0).to(tl.float32)
    if HAS_Z:
        b_z = tl.load(p_z + i_b * stride_z_b + i_h * stride_z_h + o_p * stride_z_p, mask=m_p, other=0.0).to(tl.float32)
        b_out = b_out * (b_z * tl.sigmoid(b_z))
    tl.store(p_out + i_b * stride_o_b + i_h * stride_o_h + o_p * stride_o_p, b_out.to(p_out.dtype.element_ty), mask=m_p)


# The launches, declared once (the compile check builds every variant). Fixed blocks: one
# compiled variant serves every head dim and d_state.
_SSU_BLOCK_P = 16
_SSU_BLOCK_N = 128
_SSU = Launcher(
    _selective_state_update_kernel,
    name="ssm.selective_state_update",
    constexprs=dict(
        HAS_D=BOOLS,
        HAS_Z=BOOLS,
        HAS_DT_BIAS=BOOLS,
        DT_SOFTPLUS=BOOLS,
        HAS_SLOTS=BOOLS,
        BLOCK_P=(_SSU_BLOCK_P,),
        BLOCK_N=(_SSU_BLOCK_N,),
    ),
    dtypes={
        "p_state": FLOATS,
        ("p_x", "p_out"): FLOATS,
        "p_dt": FLOATS,
        "p_A": FLOATS,
        ("p_B", "p_C"): FLOATS,
        "p_D": FLOATS,
        "p_z": FLOATS,
        "p_dt_bias": FLOATS,
        "p_slots": INDEX,
    },
)


def _check_ssu_args(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices) -> tuple[int, int, int, int, int]:
    """Validate :func:`selective_state_update`'s tensors; return ``(B, H, P, N, G)``."""
    check_dims("state", state, 4)
    check_dims("x", x, 3)
    batch, heads, head_dim = x.shape
    n_state = state.shape[3]
    check_shape("state", state, (None, heads, head_dim, n_state))
    check_dims("B", B, 3)
    groups = B.shape[1]
    if groups == 0 or heads % groups != 0:
        raise ShapeError(f"heads H={heads} must be a multiple of groups G={groups} (B is {list(B.shape)})")
    for name, t, shape in (
        ("dt", dt, (batch, heads, head_dim)),
        ("A", A, (heads, head_dim, n_state)),
        ("B", B, (batch, groups, n_state)),
        ("C", C, (batch, groups, n_state)),
        ("D", D, (heads, head_dim)),
        ("z", z, (batch, heads, head_dim)),
        ("dt_bias", dt_bias, (heads, head_dim)),
    ):
        if t is not None:
            check_float(name, t)
            check_shape(name, t, shape)
    check_float("state", state)
    check_float("x", x)
    check_slots("state", state, "state_batch_indices", state_batch_indices, batch)
    check_same_device(
        state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, state_batch_indices=state_batch_indices
    )
    return batch, heads, head_dim, n_state, groups


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Mamba2 decode step: advances each request's SSM state in place and returns its output.

    Args:
        state: ``[num_slots, H, P, N]`` strided view; updated in place (arithmetic in fp32).
        x: ``[B, H, P]`` SSM input (the conv output's x part).
        dt: ``[B, H, P]`` raw time step (Mamba2 passes ``[B, H]`` expanded over P).
        A: ``[H, P, N]`` (Mamba2 passes ``-exp(A_log)`` of ``[H]`` expanded, zero strides).
        B: ``[B, G, N]`` with ``H % G == 0``; head h uses group ``h // (H / G)``.
        C: ``[B, G, N]``.
        D: ``[H, P]`` skip weight, or None.
        z: ``[B, H, P]`` gate (output times ``silu(z)``), or None.
        dt_bias: ``[H, P]`` added to dt before the softplus, or None.
        dt_softplus: apply softplus to ``dt (+ dt_bias)``.
        state_batch_indices: ``[B]`` int32/int64 distinct slots, or None for slot b = request b.

    Returns:
        ``[B, H, P]`` output in ``x.dtype``.
    """
    batch, heads, head_dim, n_state, groups = _check_ssu_args(
        state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices
    )
    _SSU.check_runnable(x)
    out = torch.empty((batch, heads, head_dim), dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    grid = (batch, heads, triton.cdiv(head_dim, _SSU_BLOCK_P))

    def strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
        return tuple(t.stride()) if t is not None else (0,) * n

    _SSU(
        grid,
        state,
        x,
        dt,
        A,
        B,
        C,
        D if D is not None else x,
        z if z is not None else x,
        dt_bias if dt_bias is not None else x,
        state_batch_indices if state_batch_indices is not None else placeholder(x.device, torch.int64),
        out,
        head_dim,
        n_state,
        heads // groups,
        *state.stride(),
        *x.stride(),
        *dt.stride(),
        *A.stride(),
        *B.stride(),
        *C.stride(),
        *strides(D, 2),
        *strides(z, 3),
        *strides(dt_bias, 2),
        *out.stride(),
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus),
        HAS_SLOTS=state_batch_indices is not None,
        BLOCK_P=_SSU_BLOCK_P,
        BLOCK_N=_SSU_BLOCK_N,
    )
    return out


def time_step_ref(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool) -> torch.Tensor:
    """The step the recurrence takes, in fp32: ``dt (+ dt_bias)``, through softplus if asked."""
    dtf = dt.float()
    if dt_bias is not None:
        dtf = dtf + dt_bias.float()
    if dt_softplus:
        dtf = F.softplus(dtf)
    return dtf


@reference_of(selective_state_update)
def selective_state_update_ref(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None
):
    batch, heads, _, _, groups = _check_ssu_args(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    if state_batch_indices is None:
        slots = torch.arange(batch, device=x.device)
    else:
        slots = state_batch_indices.long()
    xf = x.float()
    dtf = time_step_ref(dt, dt_bias, dt_softplus)
    per_group = heads // groups
    Bh = B.float().repeat_interleave(per_group, dim=1)  # [B, H, N]
    Ch = C.float().repeat_interleave(per_group, dim=1)
    # index_select / index_copy_: advanced indexing is very slow on CPU for strided (HLPN) views
    old = state.index_select(0, slots).float()
    new = old * torch.exp(A.float() * dtf[..., None]) + (dtf * xf)[..., None] * Bh[:, :, None, :]
    state.index_copy_(0, slots, new.to(state.dtype))
    out = (new * Ch[:, :, None, :]).sum(-1)
    if D is not None:
        out = out + xf * D.float()
    if z is not None:
        out = out * F.silu(z.float())
    return out.to(x.dtype)
