"""causal_conv1d_fn / causal_conv1d_update: Triton == reference == naive, on every conv layout."""

from __future__ import annotations

import pytest
import torch

from statebridge.errors import ConfigError, ShapeError
from statebridge.kernels.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_fn_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)

from .helpers import conv_region, naive_conv, noncontig, outside, qsl_of

pytestmark = pytest.mark.usefixtures("nan_empty")

F32, BF16 = torch.float32, torch.bfloat16
NUM_PAGES, LAYERS, LAYER = 7, 3, 1
FN = {"ref": causal_conv1d_fn_ref, "triton": causal_conv1d_fn}
UPDATE = {"ref": causal_conv1d_update_ref, "triton": causal_conv1d_update}


def make_x(dim: int, num_tokens: int, kind: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``[D, T]`` inputs: "tmajor" (a transposed ``[T, D]``, as the mixers pass it), "strided"
    (every other column of a wider tensor) or "contiguous"."""
    if kind == "tmajor":
        return torch.randn(num_tokens, dim, generator=gen).to(dtype).t()
    base = torch.randn(dim, num_tokens, generator=gen).to(dtype)
    return noncontig(base) if kind == "strided" else base


def same_view(flat: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The view with ``view``'s geometry on another flat buffer (a clone of its base)."""
    return flat.as_strided(view.shape, view.stride(), view.storage_offset())


def weights(dim: int, width: int, dtype: torch.dtype, with_bias: bool, gen: torch.Generator):
    w = (torch.randn(dim, width, generator=gen) / width**0.5).to(dtype)
    b = torch.randn(dim, generator=gen).to(dtype) if with_bias else None
    return w, b


# --------------------------------------------------------------------------- prefill (varlen)

# (id, D, K, S, sequence lengths, has_initial_state, layout, dtype, activation, bias, x kind)
FN_CASES = [
    ("k2-one-token-lsd-fp32", 5, 2, 1, [1], [True], "LSD", F32, None, True, "tmajor"),
    ("k3-varlen-lds-fp32-silu", 7, 3, 2, [1, 2, 5, 9], [True, False, True, False], "LDS", F32, "silu", False,
     "strided"),
    ("k4-odd-dls-fp32", 3, 4, 3, [3, 1, 11], [False, True, True], "DLS", F32, None, True, "contiguous"),
    ("k4-two-chunks-two-dblocks-lsd-fp32", 67, 4, 3, [70, 2], [True, False], "LSD", F32, "silu", True, "tmajor"),
    ("k3-varlen-lsd-bf16-silu", 6, 3, 2, [4, 1, 7], [True, True, False], "LSD", BF16, "silu", True, "tmajor"),
    ("k2-varlen-lds-bf16", 9, 2, 1, [2, 3], [False, True], "LDS", BF16, None, False, "strided"),
    ("k4-short-seqs-dls-bf16", 5, 4, 3, [1, 2, 1], [True, True, False], "DLS", BF16, None, True, "contiguous"),
    ("k3-wide-state-lds-fp32", 4, 3, 4, [1, 6], [True, True], "LDS", F32, None, False, "tmajor"),
]


def _fn_setup(case, seed: int = 0):
    _, dim, width, state_len, lens, has_init, layout, dtype, act, with_bias, kind = case
    gen = torch.Generator().manual_seed(seed)
    flat, views = conv_region(layout, NUM_PAGES, LAYERS, dim, state_len, dtype, seed=seed)
    view = views[LAYER]
    slots = torch.randperm(NUM_PAGES, generator=gen)[: len(lens)].to(torch.int32)
    for slot, init in zip(slots.tolist(), has_init):
        if not init:
            view[slot] = float("nan")  # a kernel that reads a state it was told not to read fails
    x = make_x(dim, sum(lens), kind, dtype, gen)
    w, b = weights(dim, width, dtype, with_bias, gen)
    args = dict(
        query_start_loc=qsl_of(lens), cache_indices=slots, has_initial_state=torch.tensor(has_init), activation=act
    )
    return flat, view, x, w, b, args


@pytest.mark.parametrize("case", FN_CASES, ids=[c[0] for c in FN_CASES])
def test_fn_triton_matches_ref(case, assert_close):
    dtype = case[7]
    flat, view, x, w, b, args = _fn_setup(case)
    flat_ref = flat.clone()
    view_ref = same_view(flat_ref, view)
    untouched = outside(flat, view).clone()

    out = causal_conv1d_fn(x, w, b, view, **args)
    out_ref = causal_conv1d_fn_ref(x, w, b, view_ref, **args)

    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, out_ref, dtype)
    assert_close(view, view_ref, dtype)
    # nothing outside this layer's view (other layers, the padding, other regions) was written
    assert torch.equal(outside(flat, view), untouched)
    assert torch.equal(outside(flat_ref, view_ref), untouched)


@pytest.mark.parametrize("case", FN_CASES, ids=[c[0] for c in FN_CASES])
def test_fn_ref_matches_naive(case, assert_close):
    dtype, act = case[7], case[8]
    lens, has_init = case[4], case[5]
    _, view, x, w, b, args = _fn_setup(case, seed=1)
    slots = args["cache_indices"].tolist()
    starts = args["query_start_loc"].tolist()
    olds = [view[s].clone() if init else None for s, init in zip(slots, has_init)]

    out = causal_conv1d_fn_ref(x, w, b, view, **args)

    xs = [x[:, starts[i] : starts[i + 1]] for i in range(len(lens))]
    want_out, want_state = naive_conv(xs, w, b, olds, silu=act == "silu")
    for i, slot in enumerate(slots):
        assert_close(out[:, starts[i] : starts[i + 1]], want_out[i], dtype)
        assert_close(view[slot], want_state[i], dtype)


# (id, D, K, sequence lengths, layout, dtype, new tokens per request)
SPLIT_CASES = [
    ("k2-lsd-fp32-1new", 5, 2, [2, 7], "LSD", F32, 1),
    ("k3-lds-bf16-1new", 7, 3, [2, 3, 9], "LDS", BF16, 1),
    ("k4-dls-fp32-1new", 3, 4, [4, 2, 12], "DLS", F32, 1),
    ("k4-lsd-fp32-3new", 6, 4, [4, 8], "LSD", F32, 3),
    ("k3-dls-bf16-2new", 5, 3, [3, 6], "DLS", BF16, 2),
]


@pytest.mark.parametrize("provider", ["ref", "triton"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c[0] for c in SPLIT_CASES])
def test_prefill_then_decode_equals_one_prefill(case, provider, assert_close):
    """N-1 protocol: prefill p[0..N-1-n] then update on the last n tokens == prefill p[0..N-1]."""
    _, dim, width, lens, layout, dtype, n_new = case
    gen = torch.Generator().manual_seed(2)
    flat_a, views_a = conv_region(layout, NUM_PAGES, LAYERS, dim, width - 1, dtype, seed=2)
    flat_b = flat_a.clone()
    state_a, state_b = views_a[LAYER], same_view(flat_b, views_a[LAYER])
    slots = torch.randperm(NUM_PAGES, generator=gen)[: len(lens)].to(torch.int32)
    no_init = torch.zeros(len(lens), dtype=torch.bool)
    w, b = weights(dim, width, dtype, True, gen)
    seqs = [torch.randn(dim, n, generator=gen).to(dtype) for n in lens]

    full = torch.cat(seqs, 1)
    out_full = FN[provider](full, w, b, state_a, qsl_of(lens), slots, no_init, "silu")

    heads = torch.cat([s[:, :-n_new] for s in seqs], 1)
    out_head = FN[provider](heads, w, b, state_b, qsl_of([n - n_new for n in lens]), slots, no_init, "silu")
    tails = torch.stack([s[:, -n_new:] for s in seqs])  # [B, D, n_new]
    x_new = tails[:, :, 0] if n_new == 1 else tails
    out_tail = UPDATE[provider](x_new, state_b, w, b, "silu", slots)

    starts = qsl_of(lens).tolist()
    head_starts = qsl_of([n - n_new for n in lens]).tolist()
    for i in range(len(lens)):
        want = out_full[:, starts[i] : starts[i + 1]]
        assert_close(out_head[:, head_starts[i] : head_starts[i + 1]], want[:, :-n_new], dtype)
        got_tail = out_tail[i][:, None] if n_new == 1 else out_tail[i]
        assert_close(got_tail, want[:, -n_new:], dtype)
    assert_close(state_b, state_a, dtype)


# --------------------------------------------------------------------------- decode update

# (id, D, K, S, B, new tokens (None: x is [B, D]), layout, dtype, activation, with indices, x kind)
UPDATE_CASES = [
    ("k2-2d-lsd-fp32", 5, 2, 1, 3, None, "LSD", F32, None, True, "contiguous"),
    ("k3-2d-lds-bf16-silu", 7, 3, 2, 2, None, "LDS", BF16, "silu", True, "strided"),
    ("k4-3tok-dls-fp32", 3, 4, 3, 2, 3, "DLS", F32, None, True, "strided"),
    ("k4-5tok-more-than-state-lsd-bf16", 6, 4, 3, 3, 5, "LSD", BF16, "silu", False, "contiguous"),
    ("k3-wide-state-lds-fp32", 9, 3, 4, 2, 2, "LDS", F32, None, True, "contiguous"),
    ("k2-two-dblocks-no-indices-dls-fp32", 130, 2, 1, 2, None, "DLS", F32, "silu", False, "strided"),
]


def _update_setup(case, seed: int = 0):
    _, dim, width, state_len, batch, n_new, layout, dtype, act, with_idx, kind = case
    gen = torch.Generator().manual_seed(seed)
    flat, views = conv_region(layout, NUM_PAGES, LAYERS, dim, state_len, dtype, seed=seed)
    shape = (batch, dim) if n_new is None else (batch, dim, n_new)
    x = torch.randn(*shape, generator=gen).to(dtype)
    if kind == "strided":
        x = noncontig(x) if n_new is not None else torch.randn(dim, batch, generator=gen).to(dtype).t()
    w, b = weights(dim, width, dtype, True, gen)
    idx = torch.randperm(NUM_PAGES, generator=gen)[:batch] if with_idx else None
    return flat, views[LAYER], x, w, b, act, idx


@pytest.mark.parametrize("case", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES])
def test_update_triton_matches_ref(case, assert_close):
    dtype = case[7]
    flat, view, x, w, b, act, idx = _update_setup(case)
    flat_ref = flat.clone()
    view_ref = same_view(flat_ref, view)
    untouched = outside(flat, view).clone()

    out = causal_conv1d_update(x, view, w, b, act, idx)
    out_ref = causal_conv1d_update_ref(x, view_ref, w, b, act, idx)

    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, out_ref, dtype)
    assert_close(view, view_ref, dtype)
    assert torch.equal(outside(flat, view), untouched)


@pytest.mark.parametrize("case", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES])
def test_update_ref_matches_naive(case, assert_close):
    dtype, act = case[7], case[8]
    _, view, x, w, b, act, idx = _update_setup(case, seed=3)
    slots = idx.tolist() if idx is not None else list(range(x.shape[0]))
    olds = [view[s].clone() for s in slots]
    x3 = x if x.dim() == 3 else x[:, :, None]

    out = causal_conv1d_update_ref(x, view, w, b, act, idx)

    want_out, want_state = naive_conv(list(x3), w, b, olds, silu=act == "silu")
    out3 = out if out.dim() == 3 else out[:, :, None]
    for i, slot in enumerate(slots):
        assert_close(out3[i], want_out[i], dtype)
        assert_close(view[slot], want_state[i], dtype)


# --------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_fn_rejects_bad_arguments(op):
    fn = FN[op]
    x = torch.randn(4, 5)
    w = torch.randn(4, 3)
    state = torch.zeros(2, 4, 2)
    good = dict(query_start_loc=qsl_of([5]), cache_indices=torch.tensor([1]), has_initial_state=torch.tensor([False]))
    with pytest.raises(ShapeError, match="S>=2"):
        fn(x, w, None, torch.zeros(2, 4, 1), **good)
    with pytest.raises(ShapeError, match="weight"):
        fn(x, torch.randn(5, 3), None, state, **good)
    with pytest.raises(ShapeError, match="has_initial_state must be bool"):
        fn(x, w, None, state, **{**good, "has_initial_state": torch.tensor([0])})
    with pytest.raises(ShapeError, match="query_start_loc"):
        fn(x, w, None, state, **{**good, "query_start_loc": torch.tensor([0, 2, 5])})
    with pytest.raises(ConfigError, match="relu"):
        fn(x, w, None, state, **good, activation="relu")


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_update_rejects_bad_arguments(op):
    upd = UPDATE[op]
    w = torch.randn(4, 3)
    with pytest.raises(ShapeError, match="conv_state"):
        upd(torch.randn(2, 4), torch.zeros(2, 5, 2), w)
    with pytest.raises(ShapeError, match="slots"):
        upd(torch.randn(3, 4), torch.zeros(2, 4, 2), w)  # 3 requests, 2 slots, no indices
    with pytest.raises(ShapeError, match="conv_state_indices"):
        upd(torch.randn(2, 4), torch.zeros(4, 4, 2), w, conv_state_indices=torch.tensor([0, 1, 2]))
    with pytest.raises(ShapeError, match="must be one of"):
        upd(torch.randn(2, 4).double(), torch.zeros(2, 4, 2), w)
