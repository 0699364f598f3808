"""mamba_chunk_scan_varlen (Triton SSD scan on the state slots) == its reference == the per-token
recurrence: odd lengths, one token, several sequences, chunk boundaries (the kernel's chunk is
SCAN_CHUNK = 64 tokens), empty sequences, both SSM layouts, mixed dtypes.

Slots told not to read their state hold NaN; every byte of the page buffer outside the slots of
the batch must be left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from statebridge.errors import ShapeError
from statebridge.kernels.ssd import SCAN_CHUNK, mamba_chunk_scan_varlen, mamba_chunk_scan_varlen_ref

from .helpers import element_ids, naive_ssm, noncontig, qsl_of, ssm_region

pytestmark = pytest.mark.usefixtures("nan_empty")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
NUM_PAGES, LAYERS, LAYER = 7, 2, 1
SCAN = {"ref": mamba_chunk_scan_varlen_ref, "triton": mamba_chunk_scan_varlen}
assert SCAN_CHUNK == 64  # the lengths below sit on its boundaries

# (id, lengths, has_initial_state, H, P, N, G, layout, state dtype, x dtype, D, z, dt_bias, softplus)
CASES = [
    ("one-token-lhpn-fp32", [1], [True], 2, 3, 4, 1, "LHPN", F32, F32, "H", False, True, True),
    ("chunk-edges-hlpn-fp32", [63, 64, 65], [True, False, True], 2, 4, 8, 2, "HLPN", F32, F32, "H", False, True, True),
    ("varlen-empty-several-chunks-lhpn-fp32", [1, 130, 0, 0, 7], [False, True, True, False, True], 4, 3, 5, 2,
     "LHPN", F32, F32, "HP", True, True, True),
    ("tiles-p40-n70-hlpn-fp32", [66, 2], [True, True], 2, 40, 70, 1, "HLPN", F32, F32, "H", False, True, True),
    ("bf16-x-fp32-state-lhpn", [70, 5], [True, False], 4, 8, 16, 4, "LHPN", F32, BF16, "H", False, True, True),
    ("bf16-state-no-bias-no-softplus-hlpn", [20, 3], [True, True], 2, 4, 6, 1, "HLPN", BF16, F32, None, True,
     False, False),
    ("fp16-x-lhpn", [9, 65], [False, True], 2, 3, 4, 2, "LHPN", F32, F16, "HP", False, True, True),
]
REF_CHUNK = 16  # the reference's chunk length; the kernel's is SCAN_CHUNK


def _setup(case, seed: int = 0):
    _, lens, has_init, heads, hd, n, groups, layout, st_dtype, x_dtype, d_kind, with_z, with_dtb, softplus = case
    gen = torch.Generator().manual_seed(seed)
    flat, views = ssm_region(layout, NUM_PAGES, LAYERS, heads, hd, n, st_dtype, seed=seed)
    view = views[LAYER]
    slots = torch.randperm(NUM_PAGES, generator=gen)[: len(lens)]
    for slot, init in zip(slots.tolist(), has_init):
        if not init:
            view[slot] = float("nan")  # must not be read
    total = sum(lens)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(x_dtype)

    x = rnd(total, heads, hd)
    # softplus(dt + bias) in about [0.05, 2]; without softplus dt is the step itself (positive)
    dt = rnd(total, heads) if softplus else (0.05 + torch.rand(total, heads, generator=gen)).to(x_dtype)
    args = dict(
        A=-torch.rand(heads, generator=gen) * 2,
        B=rnd(total, groups, n, scale=0.5),
        C=rnd(total, groups, n, scale=0.5),
        D={"H": torch.randn(heads, generator=gen), "HP": torch.randn(heads, hd, generator=gen), None: None}[d_kind],
        z=rnd(total, heads, hd) if with_z else None,
        dt_bias=torch.randn(heads, generator=gen) * 0.5 if with_dtb else None,
        dt_softplus=softplus,
    )
    return flat, view, x, dt, slots, torch.tensor(has_init), qsl_of(lens), args


def _run(op, case, flat, view, x, dt, slots, has_init, qsl, args):
    a = dict(args)
    A, B, C = a.pop("A"), a.pop("B"), a.pop("C")
    return SCAN[op](x, dt, A, B, C, view, qsl, slots, has_init, chunk_size=REF_CHUNK, **a)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_matches_ref(case, assert_close):
    x_dtype, st_dtype = case[9], case[8]
    flat, view, x, dt, slots, has_init, qsl, args = _setup(case)
    before = flat.clone()
    flat_ref = flat.clone()
    view_ref = flat_ref.as_strided(view.shape, view.stride(), view.storage_offset())

    got = _run("triton", case, flat, view, x, dt, slots, has_init, qsl, args)
    want = _run("ref", case, flat_ref, view_ref, x, dt, slots, has_init, qsl, args)

    assert got.shape == x.shape and got.dtype == x.dtype
    # bf16/fp16 inputs: the kernel feeds tl.dot 16-bit operands (tensor cores), the reference
    # multiplies in fp32; the tolerance is the input dtype's.
    assert_close(got, want, x_dtype)
    assert_close(view[slots], view_ref[slots], st_dtype if st_dtype != F32 else x_dtype)
    assert torch.equal(_outside_slots(flat, view, slots), _outside_slots(before, view, slots))


def _outside_slots(flat: torch.Tensor, view: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The elements of ``flat`` outside the given slots of ``view``."""
    keep = torch.ones(flat.numel(), dtype=torch.bool)
    for slot in slots.tolist():
        keep[element_ids(flat, view[slot : slot + 1])] = False
    return flat[keep]


@pytest.mark.parametrize("op", ["ref", "triton"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]], ids=[CASES[i][0] for i in (0, 2, 3)])
def test_matches_per_token_recurrence(op, case, assert_close):
    """Both against the naive per-token recurrence (float64), output and the state in the slot;
    the bytes outside the batch's slots are untouched."""
    flat, view, x, dt, slots, has_init, qsl, args = _setup(case, seed=3)
    before = flat.clone()
    old = [view[s].clone() for s in slots.tolist()]
    y = _run(op, case, flat, view, x, dt, slots, has_init, qsl, args)
    starts = qsl.tolist()
    heads, hd, n = view.shape[1:]
    for i, slot in enumerate(slots.tolist()):
        seq = slice(starts[i], starts[i + 1])
        init = old[i].double() if has_init[i] else torch.zeros(heads, hd, n, dtype=torch.float64)
        step = dt[seq].double()
        if args["dt_bias"] is not None:
            step = step + args["dt_bias"].double()
        if args["dt_softplus"]:
            step = F.softplus(step)
        z = args["z"][seq] if args["z"] is not None else None
        want_y, want_state = naive_ssm(x[seq], step, args["A"], args["B"][seq], args["C"][seq], args["D"], z, init)
        assert_close(y[seq], want_y, torch.float32)
        assert_close(view[slot], want_state, torch.float32)
    assert torch.equal(_outside_slots(flat, view, slots), _outside_slots(before, view, slots))


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_two_calls_equal_one(op, assert_close):
    """A prompt scanned in two calls (the second resumes from the state the first wrote) equals
    one call: output and final state. The split falls inside a kernel chunk."""
    case = ("two-calls", [150], [False], 2, 3, 4, 1, "LHPN", F32, F32, "H", False, True, True)
    flat, view, x, dt, slots, has_init, qsl, args = _setup(case, seed=7)
    flat2 = flat.clone()
    view2 = flat2.as_strided(view.shape, view.stride(), view.storage_offset())
    y_one = _run(op, case, flat, view, x, dt, slots, has_init, qsl, args)

    cut = 93
    first = {k: (v[:cut] if k in ("B", "C", "z") and v is not None else v) for k, v in args.items()}
    second = {k: (v[cut:] if k in ("B", "C", "z") and v is not None else v) for k, v in args.items()}
    y1 = _run(op, case, flat2, view2, x[:cut], dt[:cut], slots, has_init, qsl_of([cut]), first)
    y2 = _run(op, case, flat2, view2, x[cut:], dt[cut:], slots, torch.tensor([True]), qsl_of([150 - cut]), second)
    assert_close(torch.cat([y1, y2]), y_one, F32)
    assert_close(view2[slots], view[slots], F32)


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_noncontiguous_inputs(op, assert_close):
    """x and B/C as the mixer passes them: column slices of one projection (row stride > width)."""
    case = CASES[1]
    flat, view, x, dt, slots, has_init, qsl, args = _setup(case, seed=2)
    flat_ref = flat.clone()
    view_ref = flat_ref.as_strided(view.shape, view.stride(), view.storage_offset())
    want = _run("ref", case, flat_ref, view_ref, x, dt, slots, has_init, qsl, args)
    strided = dict(args, B=noncontig(args["B"]), C=noncontig(args["C"]))
    assert not noncontig(x).is_contiguous() and not strided["B"].is_contiguous()
    got = _run(op, case, flat, view, noncontig(x), noncontig(dt), slots, has_init, qsl, strided)
    assert_close(got, want, F32)
    assert_close(view[slots], view_ref[slots], F32)


@pytest.mark.parametrize("op", ["ref", "triton"])
def test_empty_batch_and_rejects_bad_arguments(op):
    fn = SCAN[op]
    state = torch.zeros(3, 2, 3, 4)
    x, dt = torch.randn(5, 2, 3), torch.randn(5, 2)
    B = torch.randn(5, 1, 4)
    A = -torch.rand(2)
    slots, init, qsl = torch.tensor([0, 2]), torch.tensor([False, True]), qsl_of([2, 3])
    out = fn(x[:0], dt[:0], A, B[:0], B[:0], state, qsl_of([]), slots[:0], init[:0], chunk_size=4)
    assert out.shape == (0, 2, 3)
    with pytest.raises(ShapeError, match="multiple of groups"):
        fn(x, dt, A, torch.randn(5, 3, 4), torch.randn(5, 3, 4), state, qsl, slots, init, chunk_size=4)
    with pytest.raises(ShapeError, match="ssm_state must have shape"):
        fn(x, dt, A, B, B, torch.zeros(3, 2, 3, 5), qsl, slots, init, chunk_size=4)
    with pytest.raises(ShapeError, match="query_start_loc must have shape"):
        fn(x, dt, A, B, B, state, qsl_of([5]), slots, init, chunk_size=4)
    with pytest.raises(ShapeError, match="has_initial_state must be bool"):
        fn(x, dt, A, B, B, state, qsl, slots, init.int(), chunk_size=4)
    with pytest.raises(ShapeError, match="chunk_size"):
        fn(x, dt, A, B, B, state, qsl, slots, init, chunk_size=0)
    with pytest.raises(ShapeError, match="D must be"):
        fn(x, dt, A, B, B, state, qsl, slots, init, chunk_size=4, D=torch.randn(3))
    with pytest.raises(ShapeError, match="z must have x's dtype"):
        fn(x, dt, A, B, B, state, qsl, slots, init, chunk_size=4, z=x.to(torch.bfloat16))
