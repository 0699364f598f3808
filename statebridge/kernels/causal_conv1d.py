"""Causal depthwise conv1d over a recurrent conv state: varlen prefill and decode update.

What the conv state holds: the last ``S = K - 1`` *inputs* of the depthwise conv, oldest first
(ShortConv: ``B*x``; Mamba2: ``xBC`` before the activation). For a sequence of inputs ``in``::

    out[:, t] = act(bias + sum_k weight[:, k] * in[:, t - (K - 1) + k])

where inputs before the sequence come from the state (or are zero without one).

Both functions take the state as a strided view ``[num_slots, D, S]`` and never copy it to a
canonical layout, so every page layout runs the same kernels::

    LSD  buf [pages, L, S, D] -> buf[:, l].transpose(-1, -2)   strides (page, 1, D)
    LDS  buf [pages, L, D, S] -> buf[:, l]                      strides (page, S, 1)
    DLS  buf [pages, D, L, S] -> buf[:, :, l, :]                strides (page, L*S, 1)

Each public op ``op`` has a plain-torch ``op_ref`` with the same signature; the tests hold them
equal. Arithmetic is float32; outputs take ``x``'s dtype and states keep their own dtype.

The in-place kernels are not autotuned: autotuning runs a kernel several times on the same
arguments, and every extra run would shift the conv state again and corrupt it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from statebridge.errors import ConfigError, ShapeError
from statebridge.kernels._common import (
    check_activation, check_dims, check_float, check_same_device, check_shape, check_slots, check_varlen, reference_of,
)
from statebridge.kernels._jit import BLOCK_B, find_chunk, seq_span, slot_of, varlen_programs
from statebridge.kernels._launch import BOOLS, FLOATS, INDEX, VARLEN_SLOTS, Launcher, placeholder

__all__ = [
    "causal_conv1d_fn",
    "causal_conv1d_fn_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
]


def _depthwise_taps(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out[..., t] = bias + sum_k weight[:, k] * window[..., t + k]`` in fp32.

    window ``[..., D, K - 1 + n]`` -> ``[..., D, n]``. K shifted multiply-adds: on CPU this is
    much faster than a grouped ``F.conv1d`` with D groups.
    """
    width = weight.shape[1]
    n = window.shape[-1] - (width - 1)
    w = weight.float()
    acc = window[..., 0:n] * w[:, 0:1]
    for k in range(1, width):
        acc = acc + window[..., k : k + n] * w[:, k : k + 1]
    if bias is not None:
        acc = acc + bias.float()[:, None]
    return acc


# --------------------------------------------------------------------------------------------
# Prefill (varlen)
# --------------------------------------------------------------------------------------------


# Not autotuned: it writes conv_states in place, and autotuning's repeated runs would shift it.
@triton.jit
def _causal_conv1d_fwd_kernel(
    p_x,
    p_w,
    p_bias,
    p_states,
    p_qsl,
    p_slots,
    p_has_init,
    p_out,
    batch,
    dim,
    state_len,
    stride_x_d,
    stride_x_t,
    stride_w_d,
    stride_w_k,
    stride_st_b,
    stride_st_d,
    stride_st_s,
    stride_o_d,
    stride_o_t,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # One program: one chunk of BLOCK_T tokens of one sequence x one block of BLOCK_D channels.
    # The chunk comes from the packed token axis (find_chunk), so no length is read on the host.
    i_b, i_t = find_chunk(p_qsl, batch, tl.program_id(0), BLOCK_T, BLOCK_B)
    if i_b >= batch:
        return
    i_d = tl.program_id(1)
    bos, seqlen = seq_span(p_qsl, i_b)
    slot = tl.load(p_slots + i_b).to(tl.int64)
    # How many old-state columns may be read (state_len or 0). Masks are built from vector comparisons
    # against this integer rather than from a scalar bool (which the interpreter rejects).
    n_old = tl.load(p_has_init + i_b).to(tl.int64) * state_len

    o_d = (i_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    m_d = o_d < dim
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < seqlen
    p_x_rows = p_x + o_d[:, None] * stride_x_d + bos * stride_x_t
    p_st_rows = p_states + slot * stride_st_b + o_d[:, None] * stride_st_d

    b_acc = tl.zeros([BLOCK_D, BLOCK_T], dtype=tl.float32)
    for k in tl.static_range(K):
        # input position of tap k relative to the sequence start; negative = in the old state
        o_j = o_t - (K - 1) + k
        m_x = m_d[:, None] & (m_t & (o_j >= 0))[None, :]
        b_in = tl.load(p_x_rows + o_j[None, :] * stride_x_t, mask=m_x, other=0.0).to(tl.float32)
        if i_t == 0:
            # Only the first chunk reaches back into the state (BLOCK_T >= K - 1).
            m_s = m_d[:, None] & (m_t & (o_j < 0) & (o_j >= -n_old))[None, :]
            b_in += tl.load(p_st_rows + (state_len + o_j)[None, :] * stride_st_s, mask=m_s, other=0.0).to(tl.float32)
        b_w = tl.load(p_w + o_d * stride_w_d + k * stride_w_k, mask=m_d, other=0.0).to(tl.float32)
        b_acc += b_w[:, None] * b_in
    if HAS_BIAS:
        b_acc += tl.load(p_bias + o_d, mask=m_d, other=0.0).to(tl.float32)[:, None]
    if SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    p_o = p_out + o_d[:, None] * stride_o_d + (bos + o_t)[None, :] * stride_o_t
    tl.store(p_o, b_acc.to(p_out.dtype.element_ty), mask=m_d[:, None] & m_t[None, :])

    if i_t == 0:
        # The final state is the last state_len inputs, oldest first: from x where the sequence is long
        # enough, else shifted old state (or zeros). This program is the only one that reads the
        # old state of this slot and channel block, so it is also the one that overwrites it.
        # Column s takes old column s + seqlen (seqlen >= 1), so walking the columns upwards a
        # block never reads a column an earlier block wrote.
        for s0 in range(0, state_len, BLOCK_S):
            o_s = s0 + tl.arange(0, BLOCK_S)
            m_s = o_s < state_len
            o_src = seqlen - state_len + o_s  # position of the input that lands in column o_s
            m_new_x = m_d[:, None] & (m_s & (o_src >= 0))[None, :]
            m_new_st = m_d[:, None] & (m_s & (o_src < 0) & (o_src >= -n_old))[None, :]
            b_new = tl.load(p_x_rows + o_src[None, :] * stride_x_t, mask=m_new_x, other=0.0).to(tl.float32)
            b_new += tl.load(
                p_st_rows + (state_len + o_src)[None, :] * stride_st_s, mask=m_new_st, other=0.0
            ).to(tl.float32)
            tl.debug_barrier()  # every read of the old state above happens before the overwrite
            tl.store(
                p_st_rows + o_s[None, :] * stride_st_s,
                b_new.to(p_states.dtype.element_ty),
                mask=m_d[:, None] & m_s[None, :],
            )


def _check_conv_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor, dim: int
) -> tuple[int, int]:
    """Validate weight/bias/state against ``dim`` channels; return ``(K, S)``."""
    check_float("x", x)
    check_float("weight", weight)
    check_float("conv_state", conv_state)
    check_dims("weight", weight, 2)
    if bias is not None and bias.dtype != weight.dtype:
        raise ShapeError(f"bias must have weight's dtype {weight.dtype}, got {bias.dtype}")
    if weight.shape[0] != dim:
        raise ShapeError(f"weight must be [D={dim}, K], got {list(weight.shape)}")
    width = weight.shape[1]
    if width < 2:
        raise ShapeError(f"conv width K must be >= 2, got weight {list(weight.shape)}")
    if bias is not None:
        check_float("bias", bias)
        check_shape("bias", bias, (dim,))
    check_dims("conv_state", conv_state, 3)
    if conv_state.shape[1] != dim or conv_state.shape[2] < width - 1:
        raise ShapeError(
            f"conv_state must be [num_slots, D={dim}, S>={width - 1}], got {list(conv_state.shape)}"
        )
    return width, conv_state.shape[2]


def _check_fn_args(
    x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation
) -> tuple[int, int, bool]:
    """Validate :func:`causal_conv1d_fn`'s arguments; return K, S and whether to apply SiLU."""
    silu = check_activation(activation)
    check_dims("x", x, 2)
    width, state_len = _check_conv_args(x, weight, bias, conv_states, x.shape[0])
    check_varlen(query_start_loc, "cache_indices", cache_indices, has_initial_state)
    check_same_device(
        x=x,
        weight=weight,
        bias=bias,
        conv_states=conv_states,
        query_start_loc=query_start_loc,
        cache_indices=cache_indices,
        has_initial_state=has_initial_state,
    )
    return width, state_len, silu


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = None,
) -> torch.Tensor:
    """Varlen causal depthwise conv over packed sequences; writes each final state in place.

    Args:
        x: ``[D, T]`` inputs of B sequences packed along T, any strides.
        weight: ``[D, K]`` conv taps, oldest input first.
        bias: ``[D]`` or None.
        conv_states: ``[num_slots, D, S]`` strided view, ``S >= K - 1``; slot
            ``cache_indices[b]`` holds sequence b's state (read if ``has_initial_state[b]``),
            and is overwritten with its last S inputs, left-padded with the old state (or
            zeros) when the sequence is shorter than S.
        query_start_loc: ``[B + 1]`` int32/int64, sequence b is ``x[:, qsl[b]:qsl[b+1]]``.
        cache_indices: ``[B]`` int32/int64 state slot per sequence (distinct).
        has_initial_state: ``[B]`` bool.
        activation: None, ``"silu"`` or ``"swish"`` (the same as silu).

    Returns:
        ``[D, T]`` output in ``x.dtype``. Tokens outside ``[qsl[0], qsl[B])`` are not written;
        an empty sequence leaves its slot untouched.
    """
    width, state_len, silu = _check_fn_args(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation
    )
    _check_triton_width(width)
    _FWD.check_runnable(x)
    dim, num_tokens = x.shape
    out = torch.empty_like(x)  # keeps x's layout when x is dense (e.g. a transposed [T, D])
    batch = cache_indices.shape[0]
    if batch == 0 or num_tokens == 0:
        return out
    # No length is read on the host: the grid covers every chunk of any split of the T tokens.
    grid = (varlen_programs(num_tokens, batch, _FWD_BLOCK_T), triton.cdiv(dim, _FWD_BLOCK_D))
    _FWD(
        grid,
        x,
        weight,
        bias if bias is not None else weight,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        out,
        batch,
        dim,
        state_len,
        *x.stride(),
        *weight.stride(),
        *conv_states.stride(),
        *out.stride(),
        K=width,
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_D=_FWD_BLOCK_D,
        BLOCK_T=_FWD_BLOCK_T,
        BLOCK_S=_BLOCK_S,
        BLOCK_B=BLOCK_B,
    )
    return out


@reference_of(causal_conv1d_fn)
def causal_conv1d_fn_ref(
    x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation=None
):
    width, state_len, silu = _check_fn_args(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation
    )
    dim, num_tokens = x.shape
    out = torch.empty_like(x)  # keeps x's layout when x is dense (e.g. a transposed [T, D])
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist()
    has_init = has_initial_state.tolist()
    for i, slot in enumerate(slots):
        bos, eos = starts[i], starts[i + 1]
        if eos <= bos:
            continue
        if has_init[i]:
            old = conv_states[slot].float()
        else:
            old = torch.zeros((dim, state_len), dtype=torch.float32, device=x.device)
        full = torch.cat([old, x[:, bos:eos].float()], dim=1)  # [D, S + n]
        y = _depthwise_taps(full[:, state_len - (width - 1) :], weight, bias)  # [D, n]
        if silu:
            y = F.silu(y)
        out[:, bos:eos] = y.to(out.dtype)
        conv_states[slot].copy_(full[:, -state_len:])
    return out


# --------------------------------------------------------------------------------------------
# Decode update
# --------------------------------------------------------------------------------------------


# Not autotuned: every run shifts conv_state in place, so autotuning's trial runs corrupt it.
@triton.jit
def _causal_conv1d_update_kernel(
    p_x,
    p_w,
    p_bias,
    p_state,
    p_slots,
    p_out,
    dim,
    state_len,
    num_new,
    stride_x_b,
    stride_x_d,
    stride_x_t,
    stride_w_d,
    stride_w_k,
    stride_st_b,
    stride_st_d,
    stride_st_s,
    stride_o_b,
    stride_o_d,
    stride_o_t,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # One program: one request x one block of BLOCK_D channels, all num_new new tokens.
    i_b = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1)
    slot = slot_of(p_slots, i_b, HAS_SLOTS)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    p_x_row = p_x + i_b * stride_x_b + o_d * stride_x_d
    p_st_row = p_state + slot * stride_st_b + o_d * stride_st_d
    p_o_row = p_out + i_b * stride_o_b + o_d * stride_o_d

    for t in range(num_new):
        b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(K):
            q = t - (K - 1) + k  # tap position relative to the first new token
            if q >= 0:
                b_in = tl.load(p_x_row + q * stride_x_t, mask=m_d, other=0.0).to(tl.float32)
            else:
                b_in = tl.load(p_st_row + (state_len + q) * stride_st_s, mask=m_d, other=0.0).to(tl.float32)
            b_w = tl.load(p_w + o_d * stride_w_d + k * stride_w_k, mask=m_d, other=0.0).to(tl.float32)
            b_acc += b_w * b_in
        if HAS_BIAS:
            b_acc += tl.load(p_bias + o_d, mask=m_d, other=0.0).to(tl.float32)
        if SILU:
            b_acc = b_acc * tl.sigmoid(b_acc)
        tl.store(p_o_row + t * stride_o_t, b_acc.to(p_out.dtype.element_ty), mask=m_d)

    # Shift left by num_new and append the new inputs: new[s] = [old | x][num_new + s]. Column s
    # takes old column s + num_new (num_new >= 1), so walking the columns upwards a block never
    # reads a column an earlier block wrote.
    for s0 in range(0, state_len, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < state_len
        o_q = num_new - state_len + o_s
        m_from_x = m_d[:, None] & (m_s & (o_q >= 0))[None, :]
        m_from_st = m_d[:, None] & (m_s & (o_q < 0))[None, :]
        b_new = tl.load(p_x_row[:, None] + o_q[None, :] * stride_x_t, mask=m_from_x, other=0.0).to(tl.float32)
        b_new += tl.load(
            p_st_row[:, None] + (state_len + o_q)[None, :] * stride_st_s, mask=m_from_st, other=0.0
        ).to(tl.float32)
        tl.debug_barrier()  # every read of the old state above happens before the overwrite
        tl.store(
            p_st_row[:, None] + o_s[None, :] * stride_st_s,
            b_new.to(p_state.dtype.element_ty),
            mask=m_d[:, None] & m_s[None, :],
        )


# The launches, declared once (the compile check builds every variant). Blocks are fixed, not
# derived from shapes, so one compiled variant serves every model size: masks cover the rest.
CONV_WIDTHS = (2, 3, 4)
_FWD_BLOCK_D = 64
_FWD_BLOCK_T = 64  # >= K - 1: only a sequence's first chunk reaches back into the state
_UPDATE_BLOCK_D = 128
_BLOCK_S = 4  # state columns per step of the state write
# The variants both kernels are built for: conv width, bias or none, SiLU or none.
_CONV_FLAGS = dict(K=CONV_WIDTHS, HAS_BIAS=BOOLS, SILU=BOOLS)

_FWD = Launcher(
    _causal_conv1d_fwd_kernel,
    name="causal_conv1d.fwd",
    constexprs=dict(
        **_CONV_FLAGS, BLOCK_D=(_FWD_BLOCK_D,), BLOCK_T=(_FWD_BLOCK_T,), BLOCK_S=(_BLOCK_S,), BLOCK_B=(BLOCK_B,)
    ),
    dtypes={
        ("p_x", "p_out"): FLOATS,
        ("p_w", "p_bias"): FLOATS,
        "p_states": FLOATS,
        **VARLEN_SLOTS,
    },
)
_UPDATE = Launcher(
    _causal_conv1d_update_kernel,
    name="causal_conv1d.update",
    constexprs=dict(**_CONV_FLAGS, HAS_SLOTS=BOOLS, BLOCK_D=(_UPDATE_BLOCK_D,), BLOCK_S=(_BLOCK_S,)),
    dtypes={("p_x", "p_out"): FLOATS, ("p_w", "p_bias"): FLOATS, "p_state": FLOATS, "p_slots": INDEX},
)


def _check_triton_width(width: int) -> None:
    if width not in CONV_WIDTHS:
        raise ConfigError(f"the Triton conv kernels are built for widths K in {CONV_WIDTHS}, got K={width}")


def _check_update_args(
    x, conv_state, weight, bias, activation, conv_state_indices
) -> tuple[torch.Tensor, int, int, bool]:
    """Validate :func:`causal_conv1d_update`'s arguments; return ``x`` as ``[B, D, T_new]``, K, S
    and whether to apply SiLU."""
    silu = check_activation(activation)
    check_dims("x", x, (2, 3))
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x
    batch, dim, _ = x3.shape
    width, state_len = _check_conv_args(x, weight, bias, conv_state, dim)
    check_slots("conv_state", conv_state, "conv_state_indices", conv_state_indices, batch)
    check_same_device(x=x, conv_state=conv_state, weight=weight, bias=bias, conv_state_indices=conv_state_indices)
    return x3, width, state_len, silu


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode step of the causal depthwise conv: reads, shifts and appends the state in place.

    Args:
        x: ``[B, D]`` one new token per request, or ``[B, D, T]`` a few new tokens; any strides.
        conv_state: ``[num_slots, D, S]`` strided view, ``S >= K - 1``; the slot of request b
            becomes the last S columns of ``[old state | x[b]]``.
        weight: ``[D, K]`` conv taps, oldest input first.
        bias: ``[D]`` or None.
        activation: None, ``"silu"`` or ``"swish"``.
        conv_state_indices: ``[B]`` int32/int64 distinct slots, or None for slot b = request b.

    Returns:
        Output with the shape of ``x`` (``[B, D]`` or ``[B, D, T]``) in ``x.dtype``.
    """
    x3, width, state_len, silu = _check_update_args(x, conv_state, weight, bias, activation, conv_state_indices)
    _check_triton_width(width)
    _UPDATE.check_runnable(x)
    batch, dim, num_new = x3.shape
    out3 = torch.empty((batch, dim, num_new), dtype=x.dtype, device=x.device)
    if batch > 0 and num_new > 0:
        grid = (batch, triton.cdiv(dim, _UPDATE_BLOCK_D))
        _UPDATE(
            grid,
            x3,
            weight,
            bias if bias is not None else weight,
            conv_state,
            conv_state_indices if conv_state_indices is not None else placeholder(x.device, torch.int64),
            out3,
            dim,
            state_len,
            num_new,
            *x3.stride(),
            *weight.stride(),
            *conv_state.stride(),
            *out3.stride(),
            K=width,
            HAS_BIAS=bias is not None,
            SILU=silu,
            HAS_SLOTS=conv_state_indices is not None,
            BLOCK_D=_UPDATE_BLOCK_D,
            BLOCK_S=_BLOCK_S,
        )
    return out3.squeeze(-1) if x.dim() == 2 else out3


@reference_of(causal_conv1d_update)
def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None):
    x3, width, state_len, silu = _check_update_args(x, conv_state, weight, bias, activation, conv_state_indices)
    batch, dim, _ = x3.shape
    if conv_state_indices is None:
        slots = torch.arange(batch, device=x.device)
    else:
        slots = conv_state_indices.long()
    # index_select / index_copy_ rather than advanced indexing, which is very slow on CPU for
    # non-contiguous views such as the LSD/DLS pages.
    full = torch.cat([conv_state.index_select(0, slots).float(), x3.float()], dim=-1)  # [B, D, S + T]
    y = _depthwise_taps(full[:, :, state_len - (width - 1) :], weight, bias)  # [B, D, T]
    if silu:
        y = F.silu(y)
    conv_state.index_copy_(0, slots, full[:, :, -state_len:].to(conv_state.dtype))
    y = y.to(x.dtype)
    return y.squeeze(-1) if x.dim() == 2 else y

