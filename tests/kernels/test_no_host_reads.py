"""On the GPU path the wrappers and mixers read no device value on the host and copy nothing
between host and device: they run here on ``meta`` tensors (shapes and strides, no data), so
any ``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)`` or ``.numpy()`` raises, and a guard
refuses every copy between devices. Kernel launches are recorded instead of run; their grids
are checked against the sizes the host knows without reading anything (no length from
``query_start_loc`` or ``seq_lens``).

``meta`` stands in for ``cuda`` because the wrappers only check values on the CPU (where
reading them is free), exactly as they skip them on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import triton

from statebridge.kernels import (
    Mamba2Mixer,
    ShortConvMixer,
    causal_conv1d_fn,
    causal_conv1d_update,
    mamba_chunk_scan_varlen,
    pack,
    paged_attention_decode,
    prepare_runs,
    selective_state_update,
    unpack,
    varlen_attention_prefill,
)
from statebridge.kernels._launch import Launcher
from statebridge.kernels.layers import AttentionMixer

META = torch.device("meta")


@pytest.fixture
def launches(monkeypatch):
    """Record (launcher name, grid) instead of launching; refuse copies between devices."""
    recorded: list[tuple[str, tuple[int, ...]]] = []

    def record(self, grid, args, constexprs):
        recorded.append((self.name, tuple(grid)))

    monkeypatch.setattr(Launcher, "_launch", record)
    real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

    def guarded_to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.device != self.device:
            raise AssertionError(f"copy from {self.device} to {out.device} on the per-step path")
        return out

    def guarded_copy(self, src, *args, **kwargs):
        if src.device != self.device:
            raise AssertionError(f"copy from {src.device} to {self.device} on the per-step path")
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", guarded_to)
    monkeypatch.setattr(torch.Tensor, "copy_", guarded_copy)
    return recorded


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device=META)


def test_meta_tensors_cannot_be_read():
    """The premise: every host read of a meta tensor raises."""
    t = meta(3, dtype=torch.int64)
    for read in (lambda: t.tolist(), lambda: t.max().item(), lambda: int(t[0]), lambda: bool(t.any())):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


def test_conv_prefill_and_update(launches):
    dim, width, batch, tokens = 200, 4, 3, 150
    states = meta(9, 2, dim, width - 1)[:, 1]
    w, b = meta(dim, width), meta(dim)
    x = meta(tokens, dim).t()
    qsl, slots, init = meta(batch + 1, dtype=torch.int64), meta(batch, dtype=torch.int32), meta(batch, dtype=torch.bool)
    out = causal_conv1d_fn(x, w, b, states, qsl, slots, init, "silu")
    assert out.device == META and out.shape == (dim, tokens)
    out = causal_conv1d_update(meta(batch, dim), states, w, None, None, slots)
    assert out.shape == (batch, dim)
    assert launches == [
        ("causal_conv1d.fwd", (triton.cdiv(tokens, 64) + batch, triton.cdiv(dim, 64))),
        ("causal_conv1d.update", (batch, triton.cdiv(dim, 128))),
    ]


def test_ssm_decode_and_scan(launches):
    batch, heads, hd, n, groups, tokens = 3, 4, 40, 70, 2, 130
    state = meta(9, heads, 2, hd, n)[:, :, 1]
    selective_state_update(
        state, meta(batch, heads, hd), meta(batch, heads, hd), meta(heads, hd, n), meta(batch, groups, n),
        meta(batch, groups, n), D=meta(heads, hd), dt_bias=meta(heads, hd), dt_softplus=True,
        state_batch_indices=meta(batch, dtype=torch.int64),
    )
    y = mamba_chunk_scan_varlen(
        meta(tokens, heads, hd), meta(tokens, heads), meta(heads), meta(tokens, groups, n), meta(tokens, groups, n),
        state, meta(batch + 1, dtype=torch.int64), meta(batch, dtype=torch.int64), meta(batch, dtype=torch.bool),
        chunk_size=256, D=meta(heads), dt_bias=meta(heads), dt_softplus=True,
    )
    assert y.shape == (tokens, heads, hd)
    chunks = triton.cdiv(tokens, 64) + batch
    tiles = triton.cdiv(hd, 32) * triton.cdiv(n, 64)
    assert launches == [
        ("ssm.selective_state_update", (batch, heads, triton.cdiv(hd, 16))),
        ("ssm.scan_chunk_state", (chunks, heads, tiles)),
        ("ssm.scan_state_passing", (batch, heads, tiles)),
        ("ssm.scan_chunk_scan", (chunks, heads, triton.cdiv(hd, 32))),
    ]


def test_attention_decode_and_prefill(launches):
    batch, q_heads, kv_heads, hd, bs, width = 2, 8, 2, 64, 16, 20
    k = meta(50, kv_heads, bs, hd)
    out = paged_attention_decode(meta(batch, q_heads, hd), k, meta(50, kv_heads, bs, hd),
                                 meta(batch, width, dtype=torch.int32), meta(batch, dtype=torch.int32), 0.125)
    assert out.shape == (batch, q_heads, hd)
    varlen_attention_prefill(meta(70, q_heads, hd), meta(70, kv_heads, hd), meta(70, kv_heads, hd),
                             meta(batch + 1, dtype=torch.int32), 0.125)
    # the split count comes from the table's width (20 blocks of 16 = 320 tokens): 5 splits of 64
    assert launches == [
        ("attention.decode_split", (batch, kv_heads, 5)),
        ("attention.decode_combine", (batch, q_heads)),
        ("attention.prefill_varlen", (triton.cdiv(70, 64) + batch, q_heads)),
    ]


@pytest.fixture
def template():
    """Runs checked and copied to the device ONCE, before any step (outside the guard)."""
    return prepare_runs(torch.tensor([[0, 0, 64], [128, 64, 4096]]).numpy(), 8192, 8192, META)


def test_pack_with_a_template(template, launches):
    src, dst = meta(8192, dtype=torch.uint8), meta(8192, dtype=torch.uint8)
    pack(src, template, dst)
    unpack(src, template, dst)
    assert [name for name, _ in launches] == ["pack.copy_runs"] * 2


def test_mixers_prefill_and_decode(launches):
    """The three mixers with provider='triton', as a runner step calls them."""
    hidden, batch, tokens, slots_n = 32, 3, 20, 6
    qsl = meta(batch + 1, dtype=torch.int64)
    slots = meta(batch, dtype=torch.int64)
    init = meta(batch, dtype=torch.bool)

    conv = ShortConvMixer(in_proj_weight=meta(3 * 16, hidden), conv_weight=meta(16, 3),
                          out_proj_weight=meta(hidden, 16), provider="triton")
    conv_state = meta(slots_n, 16, 2)
    assert conv.prefill(meta(tokens, hidden), conv_state, qsl, slots, init).shape == (tokens, hidden)
    assert conv.decode(meta(batch, hidden), conv_state, slots).shape == (batch, hidden)

    heads, hd, n, groups = 4, 8, 16, 1
    inner, conv_dim = heads * hd, heads * hd + 2 * groups * n
    mamba = Mamba2Mixer(
        in_proj_weight=meta(inner + conv_dim + heads, hidden), conv_weight=meta(conv_dim, 4), dt_bias=meta(heads),
        A_log=meta(heads), D=meta(heads), norm_weight=meta(inner), out_proj_weight=meta(hidden, inner), head_dim=hd,
        d_state=n, n_groups_local=groups, norm_group_size=inner, chunk_size=256, norm_eps=1e-5, provider="triton",
    )
    m_conv, m_ssm = meta(slots_n, conv_dim, 3), meta(slots_n, heads, hd, n)
    assert mamba.prefill(meta(tokens, hidden), m_conv, m_ssm, qsl, slots, init).shape == (tokens, hidden)
    assert mamba.decode(meta(batch, hidden), m_conv, m_ssm, slots).shape == (batch, hidden)

    attn = AttentionMixer(q_proj_weight=meta(4 * 16, hidden), k_proj_weight=meta(2 * 16, hidden),
                          v_proj_weight=meta(2 * 16, hidden), o_proj_weight=meta(hidden, 4 * 16), head_dim=16,
                          scale=0.25, rope_theta=1e4, provider="triton")
    k_cache, v_cache = meta(12, 2, 4, 16), meta(12, 2, 4, 16)
    table = meta(batch, 6, dtype=torch.int64)
    assert attn.prefill(meta(tokens, hidden), k_cache, v_cache, qsl, table).shape == (tokens, hidden)
    assert attn.decode(meta(batch, hidden), k_cache, v_cache, table,
                       meta(batch, dtype=torch.int64)).shape == (batch, hidden)

    assert [name for name, _ in launches] == [
        "causal_conv1d.fwd", "causal_conv1d.update",
        "causal_conv1d.fwd", "ssm.scan_chunk_state", "ssm.scan_state_passing", "ssm.scan_chunk_scan",
        "causal_conv1d.update", "ssm.selective_state_update",
        "attention.prefill_varlen", "attention.decode_split", "attention.decode_combine",
    ]
