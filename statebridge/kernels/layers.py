"""Mixers that run on ONE tensor-parallel rank's shard and on its strided state views.

Both mixers are column-parallel on the way in and row-parallel on the way out: ``prefill`` and
``decode`` return this rank's *partial* output, before the all-reduce over the TP group (the
out_proj bias, if any, is carried by rank 0 only, so the partials sum to the full output).

Prefill is varlen: ``hidden [T, hidden]`` packs B sequences, ``query_start_loc [B + 1]`` marks
them, ``slots [B]`` names each one's state slot and ``has_initial_state [B]`` says whether the
slot already holds a state to continue from. The final states are written into the slots in
place. Decode takes one new token per request, ``hidden [B, hidden]``.

The mixers take this rank's LOCAL weights and read no model config: cutting them from a Hugging
Face checkpoint (and reading its ``config.json``) is :mod:`statebridge.models.tp`'s job, e.g.
``models.tp.mamba2_from_hf(ModelConfig.load(path), state_dict, tp_size, tp_rank)``.

Kernels: ``provider="auto"`` uses the Triton kernels for CUDA tensors and the torch references
elsewhere; ``"ref"`` / ``"triton"`` force one (Triton on CPU needs ``TRITON_INTERPRET=1``). On
the Triton path nothing on the per-step path reads a device value on the host: lengths, slots,
positions and block tables stay on the device, and varlen kernels find their sequences
themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from statebridge.errors import ConfigError, ShapeError
from statebridge.kernels._common import check_provider, use_triton
from statebridge.kernels.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_fn_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from statebridge.kernels.attention import (
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    varlen_attention_prefill,
    varlen_attention_prefill_ref,
)
from statebridge.kernels.ssd import mamba_chunk_scan_varlen, mamba_chunk_scan_varlen_ref
from statebridge.kernels.ssm import selective_state_update, selective_state_update_ref

__all__ = ["ShortConvMixer", "Mamba2Mixer", "AttentionMixer", "AllReduce", "rotary"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Returns the elementwise sum of its argument over the TP group (e.g. wraps dist.all_reduce)."""


def _conv_ops(provider: str, device: torch.device) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    if use_triton(provider, device):
        return causal_conv1d_fn, causal_conv1d_update
    return causal_conv1d_fn_ref, causal_conv1d_update_ref


def _check_prefill_args(hidden: torch.Tensor, hidden_size: int, slots: torch.Tensor) -> None:
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ShapeError(f"prefill hidden must be [T, hidden={hidden_size}], got {list(hidden.shape)}")
    if slots.dim() != 1:
        raise ShapeError(f"slots must be [B], got {list(slots.shape)}")


def _check_decode_args(hidden: torch.Tensor, hidden_size: int, slots: torch.Tensor) -> None:
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size or slots.shape != (hidden.shape[0],):
        raise ShapeError(
            f"decode hidden must be [B, hidden={hidden_size}] with slots [B], got {list(hidden.shape)} "
            f"and slots {list(slots.shape)}"
        )


def _register_buffers(module: torch.nn.Module, **buffers: torch.Tensor | None) -> None:
    """Register each tensor (or None) as a buffer of ``module``, in the order given."""
    for name, t in buffers.items():
        module.register_buffer(name, t)


class ShortConvMixer(torch.nn.Module):
    """LFM2 ShortConv on one TP rank: ``in_proj -> B, C, x -> conv(B*x) -> C * . -> out_proj``.

    Local weights (``D_l = D / t``): in_proj ``[3*D_l, hidden]`` (rows B_r, C_r, x_r), conv
    ``[D_l, K]``, out_proj ``[hidden, D_l]``; optional biases ``[3*D_l]``, ``[D_l]``,
    ``[hidden]`` (out_proj bias on rank 0 only). The conv state view is ``[num_slots, D_l, S]``.
    """

    def __init__(
        self,
        *,
        in_proj_weight: torch.Tensor,
        conv_weight: torch.Tensor,
        out_proj_weight: torch.Tensor,
        in_proj_bias: torch.Tensor | None = None,
        conv_bias: torch.Tensor | None = None,
        out_proj_bias: torch.Tensor | None = None,
        provider: str = "auto",
    ) -> None:
        super().__init__()
        self.provider = check_provider(provider)
        dim_local, width = conv_weight.shape
        hidden = in_proj_weight.shape[1]
        if in_proj_weight.shape != (3 * dim_local, hidden) or out_proj_weight.shape != (hidden, dim_local):
            raise ShapeError(
                f"ShortConv weights disagree: in_proj {list(in_proj_weight.shape)}, conv {list(conv_weight.shape)}, "
                f"out_proj {list(out_proj_weight.shape)}"
            )
        self.hidden_size = hidden
        self.dim_local = dim_local
        self.width = width
        _register_buffers(self, in_proj_weight=in_proj_weight, in_proj_bias=in_proj_bias, conv_weight=conv_weight,
                          conv_bias=conv_bias, out_proj_weight=out_proj_weight, out_proj_bias=out_proj_bias)

    @property
    def state_len(self) -> int:
        """S = K - 1 columns of conv state per channel."""
        return self.width - 1

    def prefill(
        self,
        hidden: torch.Tensor,
        conv_state: torch.Tensor,
        query_start_loc: torch.Tensor,
        slots: torch.Tensor,
        has_initial_state: torch.Tensor,
    ) -> torch.Tensor:
        """Varlen prefill. hidden ``[T, hidden]``, conv_state ``[num_slots, D_l, S]`` (written in
        place), query_start_loc ``[B + 1]``, slots ``[B]``, has_initial_state ``[B]`` bool.
        Returns the partial output ``[T, hidden]``."""
        _check_prefill_args(hidden, self.hidden_size, slots)
        conv_fn, _ = _conv_ops(self.provider, hidden.device)
        B, C, x = F.linear(hidden, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        conv_out = conv_fn(
            (B * x).t(), self.conv_weight, self.conv_bias, conv_state, query_start_loc, slots, has_initial_state, None
        )  # [D_l, T]
        return F.linear(C * conv_out.t(), self.out_proj_weight, self.out_proj_bias)

    def decode(self, hidden: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token per request. hidden ``[B, hidden]``, conv_state ``[num_slots, D_l, S]``
        (updated in place), slots ``[B]``. Returns the partial output ``[B, hidden]``."""
        _check_decode_args(hidden, self.hidden_size, slots)
        _, conv_update = _conv_ops(self.provider, hidden.device)
        B, C, x = F.linear(hidden, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        conv_out = conv_update(B * x, conv_state, self.conv_weight, self.conv_bias, None, slots)  # [B, D_l]
        return F.linear(C * conv_out, self.out_proj_weight, self.out_proj_bias)


class Mamba2Mixer(torch.nn.Module):
    """Mamba2 mixer on one TP rank.

    ``in_proj -> [z | xBC | dt] -> silu(conv(xBC)) -> [x | B | C] -> SSM -> RMSNorm(y * silu(z))
    -> out_proj``. Local sizes (``I_l = I/t``, ``H_l = H/t``, ``G_l = G/t``, or ``G_l = 1`` with B
    and C replicated when ``G == 1 < t``): in_proj ``[I_l + conv_dim_l + H_l, hidden]`` with
    ``conv_dim_l = I_l + 2*G_l*N``; conv ``[conv_dim_l, K]`` over local channels
    ``[x_r | B_r | C_r]``; ``A_log``, ``D``, ``dt_bias`` ``[H_l]``; norm ``[I_l]``; out_proj
    ``[hidden, I_l]``. State views: conv ``[num_slots, conv_dim_l, S]``, SSM
    ``[num_slots, H_l, P, N]``.

    The gated RMSNorm has groups of ``I/G`` channels and epsilon ``norm_eps`` (the config's
    ``layer_norm_epsilon``; no default here, so it cannot drift from the config's). When
    ``G == 1 < t`` a group spans every rank, so the sum of squares goes through ``all_reduce``
    (required then).
    """

    def __init__(
        self,
        *,
        in_proj_weight: torch.Tensor,
        conv_weight: torch.Tensor,
        dt_bias: torch.Tensor,
        A_log: torch.Tensor,
        D: torch.Tensor,
        norm_weight: torch.Tensor,
        out_proj_weight: torch.Tensor,
        head_dim: int,
        d_state: int,
        n_groups_local: int,
        norm_group_size: int,
        chunk_size: int,
        norm_eps: float,
        in_proj_bias: torch.Tensor | None = None,
        conv_bias: torch.Tensor | None = None,
        out_proj_bias: torch.Tensor | None = None,
        all_reduce: AllReduce | None = None,
        provider: str = "auto",
    ) -> None:
        super().__init__()
        self.provider = check_provider(provider)
        heads_local = A_log.shape[0]
        inner_local = heads_local * head_dim
        conv_dim_local = inner_local + 2 * n_groups_local * d_state
        hidden = in_proj_weight.shape[1]
        expected = {
            "in_proj_weight": (in_proj_weight, (inner_local + conv_dim_local + heads_local, hidden)),
            "conv_weight": (conv_weight, (conv_dim_local, conv_weight.shape[-1])),
            "dt_bias": (dt_bias, (heads_local,)),
            "D": (D, (heads_local,)),
            "norm_weight": (norm_weight, (inner_local,)),
            "out_proj_weight": (out_proj_weight, (hidden, inner_local)),
        }
        for name, (t, shape) in expected.items():
            if tuple(t.shape) != shape:
                raise ShapeError(f"Mamba2 {name} must be {list(shape)}, got {list(t.shape)}")
        if heads_local % n_groups_local:
            raise ShapeError(f"local heads {heads_local} must be a multiple of local groups {n_groups_local}")
        self.spans_ranks = norm_group_size > inner_local
        if self.spans_ranks and all_reduce is None:
            raise ConfigError(
                f"the gated norm group ({norm_group_size} channels) spans ranks holding {inner_local} each: "
                "pass all_reduce"
            )
        if not self.spans_ranks and inner_local % norm_group_size:
            raise ConfigError(f"norm group size {norm_group_size} does not divide local channels {inner_local}")
        self.hidden_size = hidden
        self.heads_local = heads_local
        self.head_dim = head_dim
        self.d_state = d_state
        self.n_groups_local = n_groups_local
        self.inner_local = inner_local
        self.conv_dim_local = conv_dim_local
        self.width = conv_weight.shape[-1]
        self.norm_group_size = norm_group_size
        self.norm_eps = norm_eps
        self.chunk_size = chunk_size
        self.all_reduce = all_reduce
        _register_buffers(self, in_proj_weight=in_proj_weight, in_proj_bias=in_proj_bias, conv_weight=conv_weight,
                          conv_bias=conv_bias, dt_bias=dt_bias, A=-torch.exp(A_log.float()), D=D,
                          norm_weight=norm_weight, out_proj_weight=out_proj_weight, out_proj_bias=out_proj_bias)

    @property
    def state_len(self) -> int:
        """S = K - 1 columns of conv state per channel."""
        return self.width - 1

    def _split_proj(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        proj = F.linear(hidden, self.in_proj_weight, self.in_proj_bias)
        return proj.split([self.inner_local, self.conv_dim_local, self.heads_local], dim=-1)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups_local * self.d_state
        x, B, C = xbc.split([self.inner_local, gn, gn], dim=-1)
        lead = xbc.shape[:-1]
        return (
            x.reshape(*lead, self.heads_local, self.head_dim),
            B.reshape(*lead, self.n_groups_local, self.d_state),
            C.reshape(*lead, self.n_groups_local, self.d_state),
        )

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm(y * silu(z)) over groups of ``norm_group_size`` channels; y, z ``[T, I_l]``."""
        h = y.float() * F.silu(z.float())
        if self.spans_ranks:
            sum_sq = self.all_reduce(h.pow(2).sum(-1, keepdim=True))
            h = h * torch.rsqrt(sum_sq / self.norm_group_size + self.norm_eps)
        else:
            g = h.view(*h.shape[:-1], -1, self.norm_group_size)
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            h = g.view(h.shape)
        return self.norm_weight * h.to(y.dtype)

    def _out(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = self._gated_norm(y.reshape(z.shape), z)
        return F.linear(y.to(dtype), self.out_proj_weight, self.out_proj_bias)

    def prefill(
        self,
        hidden: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        query_start_loc: torch.Tensor,
        slots: torch.Tensor,
        has_initial_state: torch.Tensor,
    ) -> torch.Tensor:
        """Varlen prefill. hidden ``[T, hidden]``; conv_state ``[num_slots, conv_dim_l, S]`` and
        ssm_state ``[num_slots, H_l, P, N]`` written in place; query_start_loc ``[B + 1]``;
        slots ``[B]``; has_initial_state ``[B]`` bool. Returns the partial output ``[T, hidden]``."""
        _check_prefill_args(hidden, self.hidden_size, slots)
        tri = use_triton(self.provider, hidden.device)
        conv_fn = causal_conv1d_fn if tri else causal_conv1d_fn_ref
        scan = mamba_chunk_scan_varlen if tri else mamba_chunk_scan_varlen_ref
        z, xbc, dt = self._split_proj(hidden)
        xbc = conv_fn(
            xbc.t(), self.conv_weight, self.conv_bias, conv_state, query_start_loc, slots, has_initial_state, "silu"
        ).t()  # [T, conv_dim_l]
        x, B, C = self._split_xbc(xbc)
        y = scan(
            x,
            dt,
            self.A,
            B,
            C,
            ssm_state,
            query_start_loc,
            slots,
            has_initial_state,
            chunk_size=self.chunk_size,
            D=self.D,
            dt_bias=self.dt_bias,
            dt_softplus=True,
        )  # final states written into the slots
        return self._out(y, z, hidden.dtype)

    def decode(
        self, hidden: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """One token per request. hidden ``[B, hidden]``; conv_state ``[num_slots, conv_dim_l, S]``
        and ssm_state ``[num_slots, H_l, P, N]`` updated in place; slots ``[B]``.
        Returns the partial output ``[B, hidden]``."""
        _check_decode_args(hidden, self.hidden_size, slots)
        tri = use_triton(self.provider, hidden.device)
        conv_update = causal_conv1d_update if tri else causal_conv1d_update_ref
        ssu = selective_state_update if tri else selective_state_update_ref
        z, xbc, dt = self._split_proj(hidden)
        xbc = conv_update(xbc, conv_state, self.conv_weight, self.conv_bias, "silu", slots)  # [B, conv_dim_l]
        x, B, C = self._split_xbc(xbc)
        heads, head_dim, d_state = self.heads_local, self.head_dim, self.d_state
        y = ssu(
            ssm_state,
            x,
            dt[:, :, None].expand(-1, heads, head_dim),
            self.A[:, None, None].expand(heads, head_dim, d_state),
            B,
            C,
            D=self.D[:, None].expand(heads, head_dim),
            z=None,
            dt_bias=self.dt_bias[:, None].expand(heads, head_dim),
            dt_softplus=True,
            state_batch_indices=slots,
        )  # [B, H_l, P]
        return self._out(y, z, hidden.dtype)


def _rms_norm_last(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis exactly as transformers' ``Lfm2RMSNorm`` (fp32 statistics)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Default RoPE (transformers' ``apply_rotary_pos_emb`` with ``rotate_half``) of
    ``x [T, heads, P]`` at integer ``positions [T]``: cos/sin computed in fp32 and cast to
    ``x``'s dtype, as transformers' rotary embedding does."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=x.device)
                                .float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class AttentionMixer(torch.nn.Module):
    """GQA attention on one TP rank, its K and V in a paged KV block pool.

    Local weights (``Hq_l`` query heads, ``Hkv_l`` KV heads of this rank, head dim P):
    q_proj ``[Hq_l*P, hidden]``, k_proj / v_proj ``[Hkv_l*P, hidden]``, o_proj
    ``[hidden, Hq_l*P]`` (row-parallel: its bias on rank 0 only); optional q/k/v biases
    (Granite ``attention_bias``); optional per-head ``q_norm`` / ``k_norm`` ``[P]`` (LFM2's
    ``q_layernorm`` / ``k_layernorm``, RMSNorm over P before RoPE). ``rope_theta`` None means no
    rotary embedding (Granite ``nope``); ``scale`` is the softmax scale.

    K and V live in the views ``[num_blocks, Hkv_l, block_size, P]`` of
    :meth:`statebridge.state.kv.BlockGeometry.view` (any layout). A request's block table
    maps its logical block ``i`` (tokens ``[i*bs, (i+1)*bs)``) to a physical block. Prefill
    writes K/V of positions ``0..n-1``; decode writes the new token's K/V at its position and
    attends to positions ``0..position``; nothing reads a position that was not written.
    """

    def __init__(self, *, q_proj_weight: torch.Tensor, k_proj_weight: torch.Tensor,
                 v_proj_weight: torch.Tensor, o_proj_weight: torch.Tensor, head_dim: int,
                 scale: float, rope_theta: float | None = None,
                 q_proj_bias: torch.Tensor | None = None, k_proj_bias: torch.Tensor | None = None,
                 v_proj_bias: torch.Tensor | None = None, o_proj_bias: torch.Tensor | None = None,
                 q_norm_weight: torch.Tensor | None = None,
                 k_norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-5,
                 provider: str = "auto") -> None:
        super().__init__()
        self.provider = check_provider(provider)
        hidden = q_proj_weight.shape[1]
        if q_proj_weight.shape[0] % head_dim or k_proj_weight.shape[0] % head_dim:
            raise ShapeError(f"attention: q_proj rows {q_proj_weight.shape[0]} / k_proj rows "
                             f"{k_proj_weight.shape[0]} are not multiples of head_dim={head_dim}")
        self.heads_local = q_proj_weight.shape[0] // head_dim
        self.kv_heads_local = k_proj_weight.shape[0] // head_dim
        if not self.kv_heads_local or self.heads_local % self.kv_heads_local:
            raise ShapeError(f"attention: {self.heads_local} local query heads are not a multiple "
                             f"of {self.kv_heads_local} local KV heads")
        if tuple(v_proj_weight.shape) != tuple(k_proj_weight.shape) or \
                tuple(o_proj_weight.shape) != (hidden, self.heads_local * head_dim):
            raise ShapeError(f"attention weights disagree: q {list(q_proj_weight.shape)}, k "
                             f"{list(k_proj_weight.shape)}, v {list(v_proj_weight.shape)}, o "
                             f"{list(o_proj_weight.shape)}")
        self.hidden_size = hidden
        self.head_dim = head_dim
        self.scale = float(scale)
        self.rope_theta = rope_theta
        self.norm_eps = norm_eps
        _register_buffers(self, q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight,
                          v_proj_weight=v_proj_weight, o_proj_weight=o_proj_weight,
                          q_proj_bias=q_proj_bias, k_proj_bias=k_proj_bias,
                          v_proj_bias=v_proj_bias, o_proj_bias=o_proj_bias,
                          q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)

    def _qkv(self, hidden: torch.Tensor, positions: torch.Tensor):
        """q ``[T, Hq_l, P]``, k and v ``[T, Hkv_l, P]`` (normed, rotated)."""
        T, P = hidden.shape[0], self.head_dim
        q = F.linear(hidden, self.q_proj_weight, self.q_proj_bias).view(T, -1, P)
        k = F.linear(hidden, self.k_proj_weight, self.k_proj_bias).view(T, -1, P)
        v = F.linear(hidden, self.v_proj_weight, self.v_proj_bias).view(T, -1, P)
        if self.q_norm_weight is not None:
            q = _rms_norm_last(q, self.q_norm_weight, self.norm_eps)
        if self.k_norm_weight is not None:
            k = _rms_norm_last(k, self.k_norm_weight, self.norm_eps)
        if self.rope_theta is not None:
            q = rotary(q, positions, self.rope_theta)
            k = rotary(k, positions, self.rope_theta)
        return q, k, v

    def _out(self, attn: torch.Tensor) -> torch.Tensor:
        return F.linear(attn.reshape(attn.shape[0], -1), self.o_proj_weight, self.o_proj_bias)

    @staticmethod
    def _write(cache: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor,
               slots: torch.Tensor) -> None:
        """``cache[blocks[i], :, slots[i]] = values[i]`` (``values [T, Hkv_l, P]``)."""
        cache[blocks, :, slots] = values.to(cache.dtype)

    def prefill(self, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                query_start_loc: torch.Tensor,
                block_tables: torch.Tensor | Sequence[torch.Tensor],
                starts: torch.Tensor | None = None) -> torch.Tensor:
        """Varlen causal prefill. hidden ``[T, hidden]``, query_start_loc ``[B + 1]``
        (``qsl[0] == 0``, ``qsl[B] == T``), block_tables ``[B, max_blocks]`` int (rows padded
        with anything, e.g. -1) or B 1-D int tensors, each covering its sequence up to the
        chunk's end. ``starts [B]`` int (None: all 0): the position of each sequence's first
        token here -- a chunk continuing a sequence whose earlier positions' K/V are already in
        its blocks (chunked prefill). Writes K/V of every token into the pool; returns the
        partial output ``[T, hidden]``. Positions and block ids are computed on the device (no
        host read)."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ShapeError(f"prefill hidden must be [T, hidden={self.hidden_size}], got "
                             f"{list(hidden.shape)}")
        if not isinstance(block_tables, torch.Tensor):
            block_tables = torch.nn.utils.rnn.pad_sequence(
                [t.long() for t in block_tables], batch_first=True, padding_value=-1) \
                if len(block_tables) else torch.zeros(0, 0, dtype=torch.int64, device=hidden.device)
        num_tokens, dev = hidden.shape[0], hidden.device
        qsl = query_start_loc.long()
        batch = qsl.shape[0] - 1
        if block_tables.dim() != 2 or block_tables.shape[0] != batch:
            raise ShapeError(f"block_tables must be [B={batch}, max_blocks], got "
                             f"{list(block_tables.shape)}")
        if starts is not None and tuple(starts.shape) != (batch,):
            raise ShapeError(f"starts must be [B={batch}], got {list(starts.shape)}")
        lens = qsl[1:] - qsl[:-1]
        seq = torch.repeat_interleave(torch.arange(batch, device=dev), lens, output_size=num_tokens)
        positions = torch.arange(num_tokens, device=dev) - qsl[seq]
        if starts is not None:
            positions = positions + starts.long()[seq]
        q, k, v = self._qkv(hidden, positions)
        bs = k_cache.shape[2]
        blocks = block_tables[seq, positions // bs]
        self._write(k_cache, k, blocks, positions % bs)
        self._write(v_cache, v, blocks, positions % bs)
        triton_path = use_triton(self.provider, dev)
        if starts is None:
            attend = varlen_attention_prefill if triton_path else varlen_attention_prefill_ref
            return self._out(attend(q, k, v, query_start_loc, self.scale))
        attend = paged_prefill_attention if triton_path else paged_prefill_attention_ref
        return self._out(attend(q, k_cache, v_cache, block_tables, query_start_loc, starts,
                                self.scale))

    def decode(self, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One new token per request at ``positions [B]`` (its K/V written there), attending to
        positions ``0..position``. block_tables ``[B, max_blocks]`` int64 (rows padded with
        -1). Returns the partial output ``[B, hidden]``."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size or \
                positions.shape != (hidden.shape[0],):
            raise ShapeError(f"decode hidden must be [B, hidden={self.hidden_size}] with "
                             f"positions [B], got {list(hidden.shape)} and "
                             f"{list(positions.shape)}")
        bs = k_cache.shape[2]
        q, k, v = self._qkv(hidden, positions)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        blocks = block_tables[rows, positions // bs]
        self._write(k_cache, k, blocks, positions % bs)
        self._write(v_cache, v, blocks, positions % bs)
        attend = paged_attention_decode if use_triton(self.provider, hidden.device) else \
            paged_attention_decode_ref
        out = attend(q, k_cache, v_cache, block_tables, positions + 1, self.scale)
        return self._out(out)
