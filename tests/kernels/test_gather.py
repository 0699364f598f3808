"""gather: one launch copies every run of one or two groups, each at its own bases -- Triton
(interpreted on CPU, compiled on a GPU) == the torch reference == a per-run slice copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from statebridge.errors import ShapeError
from statebridge.kernels.pack import _CHUNK, gather, gather_ref, prepare_gather

FILL = 0xCD


def naive(src: torch.Tensor, dst: torch.Tensor, groups, bases) -> torch.Tensor:
    out = dst.clone()
    for runs, (s, d) in zip(groups, bases):
        for a, b, n in np.asarray(runs, dtype=np.int64).reshape(-1, 3).tolist():
            out[d + b:d + b + n] = src[s + a:s + a + n].to(out.device)
    return out


def runs(*groups) -> list[np.ndarray]:
    return [np.asarray(g, dtype=np.int64).reshape(-1, 3) for g in groups]


def random_bytes(n: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def _many(count: int, length: int, stride: int) -> np.ndarray:
    return np.array([[stride * i + 3, length * i, length] for i in range(count)], dtype=np.int64)


# (id, src bytes, dst bytes, groups of runs, bases per group)
CASES = [
    ("one-group-words", 4096, 4096, [[[0, 0, 64], [512, 64, 128], [1024, 1024, 8]]], [(0, 8)]),
    ("one-group-bytes", 4096, 4096, [[[1, 3, 5], [100, 9, 1], [7, 300, 33]]], [(5, 2)]),
    ("two-groups", 9000, 9000, [[[0, 0, 256], [256, 512, 256]], [[0, 0, 1000], [2000, 1000, 24]]],
     [(16, 0), (4096, 2048)]),
    ("two-groups-odd-base", 9000, 9000, [[[0, 0, 256]], [[8, 8, 64]]], [(3, 0), (4096, 4001)]),
    ("runs-across-chunks", 3 * _CHUNK + 500, 3 * _CHUNK + 900,
     [[[0, 0, 2 * _CHUNK + 17], [2 * _CHUNK + 100, 2 * _CHUNK + 400, 300]]], [(8, 16)]),
    ("many-small-runs", 20000, 20000, [_many(300, 24, 48)], [(0, 0)]),
    ("empty-first-group", 4096, 4096, [np.zeros((0, 3)), [[0, 0, 100]]], [(0, 0), (64, 128)]),
    ("empty-second-group", 4096, 4096, [[[0, 0, 100]], np.zeros((0, 3))], [(64, 128), (0, 0)]),
    ("zero-length-runs", 4096, 4096, [[[0, 0, 0], [10, 10, 6]], [[5, 0, 0]]], [(0, 0), (0, 100)]),
    ("nothing", 64, 64, [np.zeros((0, 3))], [(0, 0)]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("impl", [gather, gather_ref], ids=["triton", "ref"])
def test_gather_matches_a_per_run_copy(case, impl):
    _, src_n, dst_n, groups, bases = case
    src = random_bytes(src_n, seed=src_n)
    dst = torch.full((dst_n,), FILL, dtype=torch.uint8)
    template = prepare_gather(runs(*groups))
    want = naive(src, dst, groups, bases)
    assert impl(src, dst, template, bases) is dst
    assert torch.equal(dst, want)


def test_a_template_serves_many_requests_at_other_bases():
    """The runs are checked and copied to the device once; each request only moves bases."""
    recurrent = np.array([[0, 0, 96], [200, 96, 40]])
    kv = np.array([[0, 0, 512], [1024, 512, 512]])
    template = prepare_gather([recurrent, kv])
    src = random_bytes(16384, 1)
    for bases in [[(0, 0), (4096, 4096)], [(1000, 136), (6000, 9000)], [(7, 3), (8191, 10001)]]:
        dst = torch.full((12000,), FILL, dtype=torch.uint8)
        want = naive(src, dst, [recurrent, kv], bases)
        gather(src, dst, template, bases)
        assert torch.equal(dst, want), bases


@pytest.mark.parametrize("groups, match", [
    (runs([[0, 0, -1]]), "negative offset or length"),
    (runs([[-4, 0, 4]]), "negative offset or length"),
    (runs([[0, 0, 8], [100, 4, 8]]), "overlap in the destination"),
    (runs(*[np.zeros((0, 3))] * 3), "one or two groups"),
    ([np.zeros((2, 2), dtype=np.int64)], r"\[R, 3\]"),
    ([[[0, 0, 8]]], "numpy array or torch tensor"),
])
def test_bad_runs_are_refused_when_prepared(groups, match):
    with pytest.raises(ShapeError, match=match):
        prepare_gather(groups)


def test_bad_bases_are_refused_before_anything_is_copied():
    template = prepare_gather(runs([[0, 0, 64]], [[0, 0, 64]]))
    src, dst = random_bytes(256, 2), torch.full((256,), FILL, dtype=torch.uint8)
    for bases, match in [
        ([(0, 0)], r"1 \(src base, dst base\) pairs for a template of 2"),
        ([(0, 0), (200, 0)], r"group 1 at bases \(src 200, dst 0\) reaches past"),
        ([(0, 0), (0, 250)], "reaches past"),
        ([(0, -1), (0, 128)], "reaches past"),
        ([(0, 0), (64, 32)], "destinations overlap"),
    ]:
        with pytest.raises(ShapeError, match=match):
            gather(src, dst, template, bases)
        assert (dst == FILL).all()
    with pytest.raises(ShapeError, match="contiguous 1-D uint8"):
        gather(src.view(torch.int16), dst, template, [(0, 0), (0, 128)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU and none is visible; run `pytest -m cuda` on a GPU machine")
def test_gather_on_the_gpu_without_syncs():
    """Compiled: every word size, runs across chunks, a request of 3,000 runs; no host sync."""
    dev = "cuda"
    rng = np.random.default_rng(3)
    count, length = 3000, 192
    frm = rng.permutation(2 * count)[:count].astype(np.int64) * length
    recurrent = np.stack([frm, np.arange(count) * length, np.full(count, length)], axis=1)
    kv = np.array([[0, 0, 5 * _CHUNK + 3]])
    template = prepare_gather([recurrent, kv], dev)
    src = random_bytes(2 * count * length + 8 * _CHUNK, 4, dev)
    for bases in [[(0, 0), (0, count * length)], [(1, 2), (3, count * length + 5)],
                  [(2, 4), (6, count * length + 2)], [(4, 8), (12, count * length + 4)]]:
        dst = torch.full((count * length + 6 * _CHUNK,), FILL, dtype=torch.uint8, device=dev)
        want = naive(src.cpu(), dst.cpu(), [recurrent, kv], bases)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            gather(src, dst, template, bases)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(dst.cpu(), want), bases
