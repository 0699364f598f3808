"""selective_state_update (Triton == reference == naive, on LHPN and HLPN) and the chunked scan
(== per-token recurrence; chunked prefill then one decode step == one long prefill)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from statebridge.errors import ShapeError
from statebridge.kernels.ssd import mamba_chunk_scan_ref
from statebridge.kernels.ssm import selective_state_update, selective_state_update_ref

from .helpers import naive_ssm, noncontig, outside, qsl_of, ssm_region

pytestmark = pytest.mark.usefixtures("nan_empty")

F32, BF16 = torch.float32, torch.bfloat16
NUM_PAGES, LAYERS, LAYER = 6, 3, 2
SSU = {"ref": selective_state_update_ref, "triton": selective_state_update}


def same_view(flat: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    return flat.as_strided(view.shape, view.stride(), view.storage_offset())


# --------------------------------------------------------------------------- decode step

# (id, B, H, P, N, G, layout, state dtype, x dtype, D, z, dt_bias, softplus, indices, tied)
# "tied": A, dt, D, dt_bias expanded from per-head values with zero strides, as Mamba2 passes them.
SSU_CASES = [
    ("g1-lhpn-fp32-tied", 2, 4, 3, 5, 1, "LHPN", F32, F32, True, False, True, True, True, True),
    ("g2-hlpn-fp32-all-options", 3, 4, 5, 3, 2, "HLPN", F32, F32, True, True, True, True, True, False),
    ("g4-hlpn-bf16", 2, 4, 2, 7, 4, "HLPN", BF16, BF16, True, False, True, True, False, True),
    ("no-options-lhpn-fp32", 1, 2, 3, 4, 2, "LHPN", F32, F32, False, False, False, False, False, False),
    ("bf16-x-fp32-state-two-pblocks-hlpn", 2, 2, 70, 8, 1, "HLPN", F32, BF16, True, True, True, True, True, True),
    ("g2-lhpn-bf16-state-noncontig-x", 2, 6, 3, 4, 2, "LHPN", BF16, F32, True, True, True, True, True, False),
]


def _ssu_setup(case, seed: int = 0):
    _, batch, heads, hd, n, groups, layout, st_dtype, x_dtype, has_d, has_z, has_dtb, softplus, has_idx, tied = case
    gen = torch.Generator().manual_seed(seed)
    flat, views = ssm_region(layout, NUM_PAGES, LAYERS, heads, hd, n, st_dtype, seed=seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    x = rnd(batch, heads, hd).to(x_dtype)
    if case[0].endswith("noncontig-x"):
        x = noncontig(x)
    if tied:
        dt = (rnd(batch, heads) if softplus else torch.rand(batch, heads, generator=gen))[:, :, None].expand(-1, -1, hd)
        A = (-torch.rand(heads, generator=gen) * 2)[:, None, None].expand(heads, hd, n)
        D = rnd(heads)[:, None].expand(heads, hd) if has_d else None
        dt_bias = rnd(heads)[:, None].expand(heads, hd) if has_dtb else None
    else:
        dt = rnd(batch, heads, hd) if softplus else torch.rand(batch, heads, hd, generator=gen)
        A = -torch.rand(heads, hd, n, generator=gen) * 2
        D = rnd(heads, hd) if has_d else None
        dt_bias = rnd(heads, hd) if has_dtb else None
    dt = dt.to(x_dtype)
    B = rnd(batch, groups, n).to(x_dtype)
    C = rnd(batch, groups, n).to(x_dtype)
    z = rnd(batch, heads, hd).to(x_dtype) if has_z else None
    idx = torch.randperm(NUM_PAGES, generator=gen)[:batch].to(torch.int32) if has_idx else None
    args = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=softplus, state_batch_indices=idx)
    return flat, views[LAYER], (x, dt, A, B, C), args


@pytest.mark.parametrize("case", SSU_CASES, ids=[c[0] for c in SSU_CASES])
def test_ssu_triton_matches_ref(case, assert_close):
    st_dtype, x_dtype = case[7], case[8]
    flat, view, tensors, args = _ssu_setup(case)
    flat_ref = flat.clone()
    view_ref = same_view(flat_ref, view)
    untouched = outside(flat, view).clone()

    out = selective_state_update(view, *tensors, **args)
    out_ref = selective_state_update_ref(view_ref, *tensors, **args)

    assert out.shape == tensors[0].shape and out.dtype == x_dtype
    assert_close(out, out_ref, x_dtype)
    assert_close(view, view_ref, st_dtype)
    assert torch.equal(outside(flat, view), untouched)


def naive_ssu_step(state, x, dt, A, B, C, D, z, dt_bias, softplus):
    """One step, loops over requests and heads, float64. state ``[B, H, P, N]`` (gathered)."""
    batch, heads, _ = x.shape
    groups = B.shape[1]
    new = state.double().clone()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // groups)
            d = dt[b, h].double() + (dt_bias[h].double() if dt_bias is not None else 0.0)
            if softplus:
                d = F.softplus(d)
            decay = torch.exp(d[:, None] * A[h].double())
            new[b, h] = decay * new[b, h] + (d * x[b, h].double())[:, None] * B[b, g].double()
            out[b, h] = new[b, h] @ C[b, g].double()
            if D is not None:
                out[b, h] += D[h].double() * x[b, h].double()
            if z is not None:
                out[b, h] *= F.silu(z[b, h].double())
    return out, new


@pytest.mark.parametrize("case", SSU_CASES, ids=[c[0] for c in SSU_CASES])
def test_ssu_ref_matches_naive(case, assert_close):
    st_dtype, x_dtype = case[7], case[8]
    _, view, tensors, args = _ssu_setup(case, seed=1)
    idx = args["state_batch_indices"]
    slots = idx.long() if idx is not None else torch.arange(tensors[0].shape[0])
    old = view[slots].clone()

    out = selective_state_update_ref(view, *tensors, **args)

    want_out, want_state = naive_ssu_step(
        old, *tensors, args["D"], args["z"], args["dt_bias"], args["dt_softplus"]
    )
    assert_close(out, want_out, x_dtype)
    assert_close(view[slots], want_state, st_dtype)


@pytest.mark.parametrize("provider", ["ref", "triton"])
def test_ssu_softplus_keeps_tiny_steps_exact(provider, assert_close):
    """From a zero state with B = C = 1 the output is x * softplus(dt) per state column; for
    dt << 0 a naive log(1 + exp(dt)) in fp32 would be off by percents (x scales the result
    out of the absolute tolerance)."""
    heads, hd, n = 3, 4, 2
    dt = torch.linspace(-16.0, -6.0, heads * hd).view(1, heads, hd)
    state = torch.zeros(1, heads, hd, n)
    ones = torch.ones(1, 1, n)
    x = torch.full((1, heads, hd), 1e6)
    out = SSU[provider](state, x, dt, -torch.ones(heads, hd, n), ones, ones, dt_softplus=True)
    want = F.softplus(dt.double()) * 1e6 * n  # every state column is x * softplus(dt); C sums N
    assert_close(out, want, torch.float32)


# --------------------------------------------------------------------------- chunked scan

# (id, batch (None: varlen) , lengths, chunk, H, P, N, G, initial state, D shape, z, x dtype)
SCAN_CASES = [
    ("batched-shorter-than-chunk", 2, [3], 4, 2, 3, 4, 1, False, "H", False, F32),
    ("batched-multi-chunk-init-z", 2, [13], 4, 4, 2, 3, 2, True, "HP", True, F32),
    ("batched-exact-chunks", 1, [8], 4, 2, 2, 2, 2, True, None, False, F32),
    ("varlen-mixed-with-empty", None, [1, 9, 0, 4], 4, 4, 3, 2, 4, True, "H", True, F32),
    ("varlen-chunk-one", None, [5, 2], 1, 2, 2, 3, 1, False, "H", False, F32),
    ("varlen-bf16", None, [6, 11], 8, 2, 3, 4, 2, True, "H", False, BF16),
]


def _scan_inputs(case, seed: int = 0):
    _, batch, lens, chunk, heads, hd, n, groups, with_init, d_kind, with_z, dtype = case
    gen = torch.Generator().manual_seed(seed)
    lead = (batch, lens[0]) if batch is not None else (sum(lens),)
    num_seqs = batch if batch is not None else len(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    x = rnd(*lead, heads, hd).to(dtype)
    dt = rnd(*lead, heads).to(dtype)
    A = -torch.rand(heads, generator=gen) * 2
    B = rnd(*lead, groups, n).to(dtype)
    C = rnd(*lead, groups, n).to(dtype)
    D = {"H": rnd(heads), "HP": rnd(heads, hd), None: None}[d_kind]
    z = rnd(*lead, heads, hd).to(dtype) if with_z else None
    dt_bias = rnd(heads)
    init = rnd(num_seqs, heads, hd, n) if with_init else None
    cu = qsl_of(lens) if batch is None else None
    return dict(x=x, dt=dt, A=A, B=B, C=C, chunk_size=chunk, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
                initial_states=init, cu_seqlens=cu)


def _sequences(kw, case):
    """Per sequence: (token slice of the leading axes, index into the batch of states)."""
    batch, lens = case[1], case[2]
    if batch is not None:
        return [((b, slice(None)), b) for b in range(batch)]
    starts = qsl_of(lens).tolist()
    return [((slice(starts[i], starts[i + 1]),), i) for i in range(len(lens))]


@pytest.mark.parametrize("case", SCAN_CASES, ids=[c[0] for c in SCAN_CASES])
def test_chunk_scan_matches_per_token_recurrence(case, assert_close):
    dtype = case[-1]
    kw = _scan_inputs(case)
    y, final = mamba_chunk_scan_ref(**kw)
    assert y.shape == kw["x"].shape and y.dtype == dtype
    assert final.dtype == torch.float32
    heads, hd, n = kw["x"].shape[-2], kw["x"].shape[-1], kw["B"].shape[-1]
    for sel, i in _sequences(kw, case):
        init = kw["initial_states"][i] if kw["initial_states"] is not None else torch.zeros(heads, hd, n)
        step = F.softplus(kw["dt"][sel].double() + kw["dt_bias"].double())
        z = kw["z"][sel] if kw["z"] is not None else None
        want_y, want_state = naive_ssm(kw["x"][sel], step, kw["A"], kw["B"][sel], kw["C"][sel], kw["D"], z, init)
        assert_close(y[sel], want_y, dtype)
        assert_close(final[i], want_state, torch.float32)


@pytest.mark.parametrize("provider", ["ref", "triton"])
@pytest.mark.parametrize("layout", ["LHPN", "HLPN"])
def test_chunked_prefill_then_decode_equals_one_prefill(layout, provider, assert_close):
    """Chunked scan over p[0..N-2], state written into the page, selective_state_update on
    p[N-1] == chunked scan over p[0..N-1] (output of the last token and final state)."""
    gen = torch.Generator().manual_seed(5)
    lens, heads, hd, n, groups, chunk = [6, 11, 2], 4, 3, 5, 2, 4
    total = sum(lens)
    x = torch.randn(total, heads, hd, generator=gen)
    dt = torch.randn(total, heads, generator=gen)
    A_h = -torch.rand(heads, generator=gen) * 2
    B = torch.randn(total, groups, n, generator=gen)
    C = torch.randn(total, groups, n, generator=gen)
    D_h = torch.randn(heads, generator=gen)
    dtb_h = torch.randn(heads, generator=gen)
    common = dict(D=D_h, dt_bias=dtb_h, dt_softplus=True)

    y_full, final_full = mamba_chunk_scan_ref(x, dt, A_h, B, C, chunk, **common, cu_seqlens=qsl_of(lens))

    starts = qsl_of(lens).tolist()
    head_idx = torch.cat([torch.arange(starts[i], starts[i + 1] - 1) for i in range(len(lens))])
    last_idx = torch.tensor([starts[i + 1] - 1 for i in range(len(lens))])
    y_head, final_head = mamba_chunk_scan_ref(
        x[head_idx], dt[head_idx], A_h, B[head_idx], C[head_idx], chunk, **common,
        cu_seqlens=qsl_of([m - 1 for m in lens]),
    )
    _, views = ssm_region(layout, NUM_PAGES, LAYERS, heads, hd, n, torch.float32, seed=5)
    state = views[LAYER]
    slots = torch.tensor([4, 0, 3])
    state[slots] = final_head
    y_last = SSU[provider](
        state,
        x[last_idx],
        dt[last_idx][:, :, None].expand(-1, -1, hd),
        A_h[:, None, None].expand(heads, hd, n),
        B[last_idx],
        C[last_idx],
        D=D_h[:, None].expand(heads, hd),
        dt_bias=dtb_h[:, None].expand(heads, hd),
        dt_softplus=True,
        state_batch_indices=slots,
    )
    assert_close(y_head, y_full[head_idx], torch.float32)
    assert_close(y_last, y_full[last_idx], torch.float32)
    assert_close(state[slots], final_full, torch.float32)


# --------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_ssu_rejects_bad_arguments(op):
    ssu = SSU[op]
    state = torch.zeros(2, 4, 3, 5)
    x = torch.randn(2, 4, 3)
    A = torch.randn(4, 3, 5)
    B = torch.randn(2, 3, 5)  # 3 groups do not divide 4 heads
    with pytest.raises(ShapeError, match="multiple of groups"):
        ssu(state, x, x, A, B, B)
    B = torch.randn(2, 2, 5)
    with pytest.raises(ShapeError, match="state"):
        ssu(torch.zeros(2, 5, 3, 5), x, x, A, B, B)  # 5 heads in the state, 4 in x
    with pytest.raises(ShapeError, match="dt_bias"):
        ssu(state, x, x, A, B, B, dt_bias=torch.randn(4))
    with pytest.raises(ShapeError, match="slots"):
        ssu(torch.zeros(1, 4, 3, 5), x, x, A, B, B)


def test_chunk_scan_rejects_bad_arguments():
    x = torch.randn(2, 5, 4, 3)
    dt = torch.randn(2, 5, 4)
    B = torch.randn(2, 5, 2, 6)
    with pytest.raises(ShapeError, match="chunk_size"):
        mamba_chunk_scan_ref(x, dt, torch.randn(4), B, B, 0)
    with pytest.raises(ShapeError, match="initial_states"):
        mamba_chunk_scan_ref(x, dt, torch.randn(4), B, B, 4, initial_states=torch.zeros(2, 4, 3, 5))
    with pytest.raises(ShapeError, match="D must be"):
        mamba_chunk_scan_ref(x, dt, torch.randn(4), B, B, 4, D=torch.randn(3))
