"""pack / unpack: Triton == reference == a per-run slice copy; layout change through staging;
the data plane's host copy (``copy_runs_host``) == the same slice copy."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from statebridge.errors import ShapeError
from statebridge.kernels.pack import RunTemplate, copy_runs_host, pack, pack_ref, prepare_runs, unpack, unpack_ref

from .helpers import conv_region

# (import_module: the package's ``pack`` attribute is the function, which shadows the module)
pack_module = importlib.import_module("statebridge.kernels.pack")

FILL = 0xAB  # staging/destination bytes outside every run must keep this value


def naive_copy(frm: torch.Tensor, runs, to: torch.Tensor) -> torch.Tensor:
    out = to.clone()
    for f, t, n in np.asarray(runs).tolist():
        out[t : t + n] = frm[f : f + n]
    return out


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _many_small() -> np.ndarray:
    return np.array([[7 * i + 1, 3 * i, 3] for i in range(50)], dtype=np.int64)


# (id, src bytes, staging bytes, runs, src byte offset inside a larger buffer)
CASES = [
    ("unaligned-bytes", 1000, 400, [[3, 0, 10], [100, 10, 1], [501, 11, 300], [0, 399, 1]], 0),
    ("int64-words", 1024, 256, [[8, 0, 16], [800, 16, 64], [512, 128, 128]], 0),
    ("int32-words", 1024, 256, [[4, 0, 12], [500, 12, 20]], 0),
    ("int16-words", 1024, 256, [[2, 0, 6], [998, 6, 26]], 0),
    ("aligned-runs-misaligned-buffer", 1024, 256, [[8, 0, 16], [800, 16, 64]], 1),
    ("many-small-runs", 400, 150, _many_small(), 0),
    ("long-run-several-programs", 6000, 5200, [[10, 0, 5000], [5500, 5000, 200]], 0),
    ("zero-length-runs", 64, 64, [[0, 0, 0], [5, 3, 4], [64, 64, 0]], 0),
    ("no-runs", 64, 64, np.zeros((0, 3), dtype=np.int64), 0),
]


def _case(case):
    _, src_n, stage_n, runs, offset = case
    src = random_bytes(src_n + offset, seed=src_n)[offset:]
    return src, np.asarray(runs, dtype=np.int64), stage_n


@pytest.mark.parametrize("runs_as", ["numpy", "torch", "template"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pack_matches_ref_and_naive(case, runs_as, assert_close):
    src, runs, stage_n = _case(case)
    given_runs = {"numpy": runs, "torch": torch.from_numpy(runs),
                  "template": prepare_runs(runs, src.numel(), stage_n)}[runs_as]
    staging = torch.full((stage_n,), FILL, dtype=torch.uint8)
    staging_ref = staging.clone()
    want = naive_copy(src, runs, staging)

    assert pack(src, given_runs, staging) is staging
    pack_ref(src, given_runs, staging_ref)

    assert_close(staging, want, torch.uint8)
    assert_close(staging_ref, want, torch.uint8)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_unpack_matches_ref_and_naive(case, assert_close):
    src, runs, stage_n = _case(case)
    # the same runs read backwards: from staging offsets into the src-sized destination
    back = runs[:, [1, 0, 2]]
    staging = random_bytes(stage_n, seed=7)
    dst = torch.full((src.numel(),), FILL, dtype=torch.uint8)
    dst_ref = dst.clone()
    want = naive_copy(staging, back, dst)

    assert unpack(staging, back, dst) is dst
    unpack_ref(staging, back, dst_ref)

    assert_close(dst, want, torch.uint8)
    assert_close(dst_ref, want, torch.uint8)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_layout_change_through_staging(impl, assert_close):
    """Pack a channel range of an LSD conv region (S pieces per layer and page), then unpack it
    element by element into a DLS region: the transfer of a Mamba conv shard between layouts."""
    do_pack, do_unpack = (pack_ref, unpack_ref) if impl == "ref" else (pack, unpack)
    pages, layers, dim, state_len, c0, c1, dtype = 3, 2, 6, 3, 1, 4, torch.bfloat16
    esize = torch.tensor([], dtype=dtype).element_size()
    src_flat, src_views = conv_region("LSD", pages, layers, dim, state_len, dtype, seed=11)
    dst_flat, dst_views = conv_region("DLS", pages, layers, dim, state_len, dtype, seed=12)
    page, width = 1, c1 - c0

    # pack: one run per (layer, s) row of the LSD region, channels [c0, c1) are contiguous
    runs, pos = [], 0
    for l in range(layers):
        for s in range(state_len):
            off = src_views[l][page, c0, s].data_ptr() - src_flat.data_ptr()
            runs.append([off, pos, width * esize])
            pos += width * esize
    staging = torch.zeros(pos, dtype=torch.uint8)
    do_pack(src_flat.view(torch.uint8), np.array(runs), staging)
    want_rows = torch.stack([src_views[l][page, c0:c1, s] for l in range(layers) for s in range(state_len)])
    assert_close(staging.view(dtype).view(layers * state_len, width), want_rows, torch.float32)

    # unpack: staging element (l, s, c) goes to DLS position (c, l, s) of the destination page
    runs = []
    for l in range(layers):
        for s in range(state_len):
            for j in range(width):
                frm = ((l * state_len + s) * width + j) * esize
                to = dst_views[l][page, c0 + j, s].data_ptr() - dst_flat.data_ptr()
                runs.append([frm, to, esize])
    before = dst_flat.clone()
    do_unpack(staging, np.array(runs), dst_flat.view(torch.uint8))
    for l in range(layers):
        assert_close(dst_views[l][page, c0:c1], src_views[l][page, c0:c1], torch.float32)
    changed = (dst_flat.view(torch.int16) != before.view(torch.int16)).nonzero().flatten()
    assert changed.numel() <= layers * state_len * width  # nothing else was written


@st.composite
def disjoint_runs(draw):
    src_n = draw(st.integers(1, 300))
    lengths = draw(st.lists(st.integers(0, 40), min_size=0, max_size=12))
    gaps = draw(st.lists(st.integers(0, 9), min_size=len(lengths), max_size=len(lengths)))
    runs, pos = [], 0
    for n, gap in zip(lengths, gaps):
        n = min(n, src_n)
        pos += gap
        frm = draw(st.integers(0, src_n - n))
        runs.append([frm, pos, n])
        pos += n
    order = draw(st.permutations(list(range(len(runs)))))
    return src_n, pos + draw(st.integers(0, 5)), np.array([runs[i] for i in order], dtype=np.int64).reshape(-1, 3)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(disjoint_runs())
def test_pack_random_runs(drawn):
    src_n, stage_n, runs = drawn
    src = random_bytes(src_n, seed=src_n)
    want = naive_copy(src, runs, torch.full((stage_n,), FILL, dtype=torch.uint8))
    for op in (pack, pack_ref):
        staging = torch.full((stage_n,), FILL, dtype=torch.uint8)
        op(src, runs, staging)
        assert torch.equal(staging, want), op.__name__


@pytest.mark.parametrize("op", [pack, pack_ref], ids=["triton", "ref"])
def test_rejects_bad_runs_and_buffers(op):
    src = torch.zeros(100, dtype=torch.uint8)
    staging = torch.zeros(50, dtype=torch.uint8)
    with pytest.raises(ShapeError, match="ends past src"):
        op(src, np.array([[90, 0, 20]]), staging)
    with pytest.raises(ShapeError, match="ends past staging"):
        op(src, np.array([[0, 40, 20]]), staging)
    with pytest.raises(ShapeError, match="overlap in staging"):
        op(src, np.array([[0, 0, 10], [50, 9, 5]]), staging)
    with pytest.raises(ShapeError, match="negative"):
        op(src, np.array([[0, 0, -1]]), staging)
    with pytest.raises(ShapeError, match=r"\[R, 3\]"):
        op(src, np.array([0, 0, 1]), staging)
    with pytest.raises(ShapeError, match="integers"):
        op(src, np.array([[0.0, 0.0, 1.0]]), staging)
    with pytest.raises(ShapeError, match="uint8"):
        op(src.view(torch.int16), np.array([[0, 0, 1]]), staging)
    with pytest.raises(ShapeError, match="contiguous"):
        op(torch.zeros(200, dtype=torch.uint8)[::2], np.array([[0, 0, 1]]), staging)
    assert torch.equal(staging, torch.zeros(50, dtype=torch.uint8))  # nothing copied on error


@pytest.mark.parametrize("lengths", [
    pytest.param([1], id="one-byte"),
    pytest.param([2, 2, 2, 2], id="uniform"),
    pytest.param([3, 7, 1, 4096, 7, 0, 5], id="mixed-with-empty"),
    pytest.param([65536, 2, 65536], id="large-and-tiny"),
])
def test_copy_runs_host_matches_loop_and_ref(lengths):
    rng = np.random.default_rng(len(lengths))
    src = rng.integers(0, 256, 300_000, dtype=np.uint8)
    # Disjoint destination slots in shuffled order, arbitrary (overlapping) source offsets.
    order = rng.permutation(len(lengths))
    dst_off = np.cumsum([0] + [lengths[i] + 3 for i in order])[:-1]
    runs = np.array([[rng.integers(0, src.size - n + 1), 0, n] for n in lengths], dtype=np.int64)
    runs[order, 1] = dst_off
    got = np.full(200_000, 0xEE, dtype=np.uint8)
    want = naive_copy(torch.from_numpy(src), runs, torch.from_numpy(got)).numpy()
    ref = pack_ref(torch.from_numpy(src), runs, torch.from_numpy(got.copy())).numpy()
    copy_runs_host(src, runs, got)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ref, want)


def test_template_is_checked_once_and_reused(monkeypatch, assert_close):
    """Given a RunTemplate, pack/unpack neither check the runs again nor copy them to the device:
    only the buffers' sizes and addresses (host metadata) are compared."""
    src, runs, stage_n = _case(CASES[5])
    template = prepare_runs(runs, src.numel(), stage_n, src.device, from_name="src", to_name="staging")
    assert isinstance(template, RunTemplate) and len(template) == len(runs)
    assert template.word == 1 and template.max_length == 3 and template.total == 3 * len(runs)

    def refuse(*a, **k):
        raise AssertionError("runs checked or copied again")

    monkeypatch.setattr(pack_module, "prepare_runs", refuse)
    monkeypatch.setattr(pack_module, "_host_runs", refuse)
    want = naive_copy(src, runs, torch.full((stage_n,), FILL, dtype=torch.uint8))
    for op in (pack, pack_ref):
        for _ in range(2):
            staging = torch.full((stage_n,), FILL, dtype=torch.uint8)
            op(src, template, staging)
            assert_close(staging, want, torch.uint8)


def test_template_words_and_buffer_checks():
    runs = np.array([[8, 0, 16], [800, 16, 64], [0, 100, 0]], dtype=np.int64)
    template = prepare_runs(runs, 1024, 256)
    assert template.word == 8 and len(template) == 2  # the empty run is dropped
    assert template.runs.dtype == torch.int64 and template.runs.shape == (2, 3)
    src = random_bytes(1025, seed=1)
    want = naive_copy(src[1:], runs, torch.zeros(256, dtype=torch.uint8))
    for op in (pack, pack_ref):
        staging = torch.zeros(256, dtype=torch.uint8)
        op(src[1:], template, staging)  # a misaligned source: bytes instead of words, same result
        assert torch.equal(staging, want)
    with pytest.raises(ShapeError, match="staging has 200 bytes; the run template was checked against 256"):
        pack(src[:1024], template, torch.zeros(200, dtype=torch.uint8))
    with pytest.raises(ShapeError, match="ends past to buffer"):
        prepare_runs(runs, 1024, 70)
