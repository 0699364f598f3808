"""The compiled Triton kernels on a CUDA GPU against their torch references (on the same GPU), in
fp32 and bf16, at sizes where every block, split and chunk boundary is crossed; and the Triton
path of each wrapper and mixer runs with ``torch.cuda.set_sync_debug_mode("error")``, so any
host synchronisation on the per-step path fails.

Run on a GPU machine with ``pytest -m cuda``; without a GPU every test here is skipped and says
why (``pytest -rs``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from statebridge.kernels import (
    Mamba2Mixer,
    ShortConvMixer,
    causal_conv1d_fn,
    causal_conv1d_fn_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    mamba_chunk_scan_varlen,
    mamba_chunk_scan_varlen_ref,
    pack,
    pack_ref,
    paged_attention_decode,
    paged_attention_decode_ref,
    prepare_runs,
    selective_state_update,
    selective_state_update_ref,
    unpack,
    varlen_attention_prefill,
    varlen_attention_prefill_ref,
)
from statebridge.kernels.layers import AttentionMixer
from statebridge.state.kv import BlockGeometry
from statebridge.state.spec import KVSpec

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU and none is visible; run `pytest -m cuda` on a GPU machine"),
]

F32, BF16 = torch.float32, torch.bfloat16
DTYPES = [pytest.param(F32, id="fp32"), pytest.param(BF16, id="bf16")]
DEV = "cuda"
# lengths around the 64-token blocks/chunks of the kernels, one token, an empty sequence
LENS = [1, 63, 64, 65, 300, 0, 17]


@contextlib.contextmanager
def no_sync():
    """Any host synchronisation inside raises (torch's CUDA sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def assert_close_scaled(assert_close, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``assert_close`` of both divided by ``max(1, max |want|)``: an error of a long fp32 sum, or
    of a sum of 16-bit ``tl.dot`` operands, scales with the terms, not with the (possibly
    cancelled) result. A wrong kernel is off by the order of the result itself."""
    scale = max(1.0, float(want.abs().max()))
    assert_close(got.double() / scale, want.double() / scale, dtype)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, g, dtype=F32, scale=1.0):
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def qsl(lens) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64, device=DEV)


def twin(t: torch.Tensor):
    """A clone of ``t``'s whole storage and the same view of it."""
    base = torch.empty(t.untyped_storage().size() // t.element_size(), dtype=t.dtype, device=t.device)
    base.copy_(torch.as_strided(t, (base.numel(),), (1,), 0))
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["LDS", "LSD"])
def test_conv_prefill_and_update(dtype, layout, assert_close):
    g = gen(0)
    dim, width, pages = 300, 4, 12
    if layout == "LDS":
        states = randn(pages, 2, dim, width - 1, g=g, dtype=dtype)[:, 1]
    else:
        states = randn(pages, 2, width - 1, dim, g=g, dtype=dtype)[:, 1].transpose(-1, -2)
    states_ref = twin(states)
    x = randn(sum(LENS), dim, g=g, dtype=dtype).t()
    w, b = randn(dim, width, g=g, dtype=dtype, scale=0.5), randn(dim, g=g, dtype=dtype)
    slots = torch.randperm(pages, device=DEV)[: len(LENS)]
    init = torch.tensor([i % 2 == 0 for i in range(len(LENS))], device=DEV)
    args = (qsl(LENS), slots, init, "silu")
    with no_sync():
        out = causal_conv1d_fn(x, w, b, states, *args)
    want = causal_conv1d_fn_ref(x, w, b, states_ref, *args)
    assert_close(out, want, dtype)
    assert_close(states, states_ref, dtype)

    xd = randn(len(LENS), dim, g=g, dtype=dtype)
    with no_sync():
        out = causal_conv1d_update(xd, states, w, b, "silu", slots)
    want = causal_conv1d_update_ref(xd, states_ref, w, b, "silu", slots)
    assert_close(out, want, dtype)
    assert_close(states, states_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssm_decode(dtype, assert_close):
    g = gen(1)
    batch, heads, hd, n, groups = 6, 8, 64, 128, 2
    state = randn(10, heads, 2, hd, n, g=g)[:, :, 1]  # HLPN, fp32 state
    state_ref = twin(state)
    x, dt = randn(batch, heads, hd, g=g, dtype=dtype), randn(batch, heads, g=g, dtype=dtype)
    A = -torch.rand(heads, device=DEV)[:, None, None].expand(heads, hd, n)
    B, C = randn(batch, groups, n, g=g, dtype=dtype), randn(batch, groups, n, g=g, dtype=dtype)
    kw = dict(D=randn(heads, g=g)[:, None].expand(heads, hd), dt_bias=randn(heads, g=g)[:, None].expand(heads, hd),
              dt_softplus=True, state_batch_indices=torch.randperm(10, device=DEV)[:batch])
    dt3 = dt[:, :, None].expand(-1, -1, hd)
    with no_sync():
        out = selective_state_update(state, x, dt3, A, B, C, **kw)
    want = selective_state_update_ref(state_ref, x, dt3, A, B, C, **kw)
    assert_close(out, want, dtype)
    assert_close(state, state_ref, F32)


@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_scan(dtype, state_dtype, assert_close):
    g = gen(2)
    heads, hd, n, groups, pages = 8, 64, 128, 2, 10
    total = sum(LENS)
    state = randn(pages, 2, heads, hd, n, g=g, dtype=state_dtype)[:, 1]  # LHPN
    state_ref = twin(state)
    x = randn(total, heads, hd, g=g, dtype=dtype)
    dt = randn(total, heads, g=g, dtype=dtype)
    A = -torch.rand(heads, device=DEV) * 2
    B, C = randn(total, groups, n, g=g, dtype=dtype, scale=0.3), randn(total, groups, n, g=g, dtype=dtype, scale=0.3)
    slots = torch.randperm(pages, device=DEV)[: len(LENS)]
    init = torch.tensor([i % 3 != 1 for i in range(len(LENS))], device=DEV)
    # the reference scans chunks of 64 tokens too: the same order of sums, fewer rounding differences
    kw = dict(chunk_size=64, D=randn(heads, g=g), dt_bias=randn(heads, g=g, scale=0.5), dt_softplus=True)
    with no_sync():
        y = mamba_chunk_scan_varlen(x, dt, A, B, C, state, qsl(LENS), slots, init, **kw)
    want = mamba_chunk_scan_varlen_ref(x, dt, A, B, C, state_ref, qsl(LENS), slots, init, **kw)
    assert_close_scaled(assert_close, y, want, dtype)
    assert_close_scaled(assert_close, state, state_ref, BF16 if BF16 in (dtype, state_dtype) else F32)


def _kv_pool(dtype, layout, kv_heads, hd, bs, num_blocks, g):
    spec = KVSpec((0, 2), kv_heads, hd, {F32: "float32", BF16: "bfloat16"}[dtype])
    geo = BlockGeometry(spec, 1, layout, bs, num_blocks)
    buf = torch.empty(geo.nbytes, dtype=torch.uint8, device=DEV)
    buf.view(dtype).copy_(randn(geo.nbytes // buf.view(dtype).element_size(), g=g, dtype=dtype))
    return geo.view(buf, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd,group,layout", [(64, 4, "HB"), (128, 8, "LH"), (128, 1, "BH")])
def test_decode_attention(dtype, hd, group, layout, assert_close):
    g = gen(3)
    lens = [1, 15, 16, 17, 1000, 4100]
    bs, kv_heads = 16, 2
    need = [-(-n // bs) for n in lens]
    k, v = _kv_pool(dtype, layout, kv_heads, hd, bs, sum(need) + 5, g)
    perm = torch.randperm(sum(need) + 5, device=DEV)
    table = torch.full((len(lens), max(need) + 3), -1, dtype=torch.int32, device=DEV)
    at = 0
    for b, m in enumerate(need):
        table[b, :m] = perm[at:at + m].int()
        at += m
    q = randn(len(lens), kv_heads * group, hd, g=g, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    with no_sync():
        out = paged_attention_decode(q, k, v, table, seq_lens, hd**-0.5)
    assert_close(out, paged_attention_decode_ref(q, k, v, table, seq_lens, hd**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd,group", [(64, 4), (128, 1)])
def test_prefill_attention(dtype, hd, group, assert_close):
    g = gen(4)
    total, kv_heads = sum(LENS), 2
    q = randn(total, kv_heads * group, hd, g=g, dtype=dtype)
    k, v = randn(total, kv_heads, hd, g=g, dtype=dtype), randn(total, kv_heads, hd, g=g, dtype=dtype)
    with no_sync():
        out = varlen_attention_prefill(q, k, v, qsl(LENS), hd**-0.5)
    assert_close(out, varlen_attention_prefill_ref(q, k, v, qsl(LENS), hd**-0.5), dtype)


def test_pack_and_unpack_with_a_template(assert_close):
    rng = np.random.default_rng(5)
    length, count = 192, 3000
    frm = rng.permutation(2 * count)[:count].astype(np.int64) * length
    runs = np.stack([frm, np.arange(count) * length, np.full(count, length)], axis=1)
    src = torch.randint(0, 256, (2 * count * length,), dtype=torch.uint8, device=DEV)
    template = prepare_runs(runs, src.numel(), count * length, DEV)
    staging, staging_ref = (torch.zeros(count * length, dtype=torch.uint8, device=DEV) for _ in range(2))
    with no_sync():
        pack(src, template, staging)
    pack_ref(src, template, staging_ref)
    assert torch.equal(staging, staging_ref)
    back = prepare_runs(runs[:, [1, 0, 2]], count * length, src.numel(), DEV)
    dst = torch.zeros_like(src)
    with no_sync():
        unpack(staging, back, dst)
    mask = torch.zeros_like(src, dtype=torch.bool)
    for f in frm.tolist():
        mask[f:f + length] = True
    assert torch.equal(dst[mask], src[mask]) and not dst[~mask].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixers_match_their_reference_path_without_syncs(dtype, assert_close):
    """Mixers with provider='auto' (Triton on CUDA) == provider='ref', on the same GPU."""
    g = gen(6)
    hidden, lens = 128, [1, 70, 5]
    batch, tokens = len(lens), sum(lens)
    slots = torch.tensor([3, 0, 5], device=DEV)
    init = torch.tensor([False, True, True], device=DEV)
    h, hd = randn(tokens, hidden, g=g, dtype=dtype), randn(batch, hidden, g=g, dtype=dtype)

    def w(*shape):
        return randn(*shape, g=g, dtype=dtype, scale=shape[-1] ** -0.5)

    conv_w = dict(in_proj_weight=w(3 * 96, hidden), conv_weight=w(96, 3), out_proj_weight=w(hidden, 96))
    heads, hdim, n = 4, 32, 64
    inner, conv_dim = heads * hdim, heads * hdim + 2 * n
    mamba_w = dict(in_proj_weight=w(inner + conv_dim + heads, hidden), conv_weight=w(conv_dim, 4),
                   dt_bias=randn(heads, g=g, dtype=dtype, scale=0.5), A_log=randn(heads, g=g, dtype=dtype),
                   D=randn(heads, g=g, dtype=dtype), norm_weight=w(inner), out_proj_weight=w(hidden, inner),
                   head_dim=hdim, d_state=n, n_groups_local=1, norm_group_size=inner, chunk_size=256, norm_eps=1e-5)
    attn_w = dict(q_proj_weight=w(8 * 64, hidden), k_proj_weight=w(2 * 64, hidden), v_proj_weight=w(2 * 64, hidden),
                  o_proj_weight=w(hidden, 8 * 64), head_dim=64, scale=0.125, rope_theta=1e4)
    pages = 6
    conv_state = randn(pages, 96, 2, g=g, dtype=dtype)
    m_conv, m_ssm = randn(pages, conv_dim, 3, g=g, dtype=dtype), randn(pages, heads, hdim, n, g=g)
    k_cache, v_cache = _kv_pool(dtype, "HB", 2, 64, 16, 24, g)
    table = torch.tensor([[5, -1, -1, -1, -1, -1], [0, 9, 3, 17, 2, 11], [7, -1, -1, -1, -1, -1]], device=DEV)
    positions = torch.tensor(lens, device=DEV)

    results = {}
    for provider in ("auto", "ref"):
        states = [twin(t) for t in (conv_state, m_conv, m_ssm, k_cache, v_cache)]
        conv = ShortConvMixer(**conv_w, provider=provider)
        mamba = Mamba2Mixer(**mamba_w, provider=provider)
        attn = AttentionMixer(**attn_w, provider=provider)
        ctx = no_sync() if provider == "auto" else contextlib.nullcontext()
        with ctx:
            outs = [
                conv.prefill(h, states[0], qsl(lens), slots, init),
                conv.decode(hd, states[0], slots),
                mamba.prefill(h, states[1], states[2], qsl(lens), slots, init),
                mamba.decode(hd, states[1], states[2], slots),
                attn.prefill(h, states[3], states[4], qsl(lens), table),
                attn.decode(hd, states[3], states[4], table, positions),
            ]
        results[provider] = outs, states
    for got, want in zip(*(results[p][0] for p in ("auto", "ref"))):
        assert_close_scaled(assert_close, got, want, dtype)
    for got, want in zip(*(results[p][1] for p in ("auto", "ref"))):
        assert_close_scaled(assert_close, got, want, dtype)


def test_page_checksum_of_a_device_page():
    """``page_checksum`` reads a page wherever it lives (it used to call ``.numpy()``, which
    raises on a CUDA tensor)."""
    from transformers import Lfm2Config

    from statebridge.hf_config import ModelConfig
    from statebridge.state import PageGeometry, StateCache, StateSpec
    from statebridge.state.cache import page_checksum

    config = Lfm2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, layer_types=["conv"] * 2,
                        conv_L_cache=3, num_attention_heads=4, num_key_value_heads=2)
    geo = PageGeometry(StateSpec.from_config(ModelConfig.from_dict(config.to_dict())), 1, "LDS")
    host = StateCache(geo, 3)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    dev = StateCache(geo, 3, device=DEV)
    dev.buffer.copy_(host.buffer)
    for page in range(3):
        assert page_checksum(geo, dev.page_bytes(page)) == page_checksum(geo, host.page_bytes(page).numpy())


def test_transfer_digest_of_device_bytes_equals_the_host_one():
    """A transfer digest (``--verify-transfers``) reads runs wherever the rank buffer lives,
    aligned (views, no copy) or not (gathered), with no host synchronization until
    :func:`~statebridge.connector.rank.digest.total` reads the sum."""
    from statebridge.connector.rank.digest import StreamDigest, total

    host = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dev = host.to(DEV)
    for offsets, lengths in (([0, 4096, 8192], [4096, 4096, 4096]), ([0], [8 * 70001]),
                             ([3, 1001], [10, 333])):
        plan = StreamDigest(offsets, lengths)
        for base in (0, 64, 5):
            with torch.cuda.set_sync_debug_mode("error") if base % 8 == 0 \
                    else contextlib.nullcontext():
                got = plan.of(dev, base)
            assert got.device.type == "cuda"
            assert total([got]) == total([plan.of(host, base)])
