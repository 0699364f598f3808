"""The runner's device paths on CPU: the Triton kernels (interpreted) give transformers' tokens,
and block tables kept on the device and updated in place equal the tables the host holds."""

from __future__ import annotations

import pytest
import torch

from statebridge.connector.rank import KVBlocks
from statebridge.models import ModelRunner
from statebridge.models.runner import _DeviceBlockTables
from statebridge.state.kv import BlockGeometry
from tests.models._helpers import KV_BLOCK, KV_PROMPTS, NEW_TOKENS, PROMPTS, make_cache


STEPS = 3  # decode steps compared (a prefix of the reference); block boundaries are crossed


def _greedy(runner: ModelRunner, prompts, tables) -> list[list[int]]:
    pages = list(range(len(prompts)))
    runner.prefill([p[:-1] for p in prompts], pages, blocks=tables)
    tokens, positions = [p[-1] for p in prompts], [len(p) - 1 for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(STEPS):
        logits = runner.decode(tokens, pages, blocks=tables, positions=positions)
        assert bool(torch.isfinite(logits).all())
        tokens = logits.argmax(-1).tolist()
        positions = [x + 1 for x in positions]
        for o, t in zip(out, tokens):
            o.append(t)
    return out


@pytest.mark.parametrize("name", ["lfm2-hybrid", "granite-hybrid"])
def test_triton_path_matches_transformers(hf_models, name):
    """Interpreted Triton end to end: varlen conv prefill, the SSD scan on the pages (Granite's
    Mamba2 layers), conv and SSM decode, varlen prefill attention and split-K decode attention
    through block tables that live on the device (scattered, in reverse order)."""
    hf_model = hf_models[name]
    cache = make_cache(hf_model.path, 1, "DLS")
    tables, nxt = [], 0
    for p in KV_PROMPTS:
        n = -(-(len(p) + NEW_TOKENS) // KV_BLOCK)
        tables.append(list(range(nxt + n - 1, nxt - 1, -1)))
        nxt += n
    geo = BlockGeometry(cache.geometry.spec.kv, 1, "HB", KV_BLOCK, nxt)
    kv = KVBlocks(geo, torch.full((geo.nbytes,), 255, dtype=torch.uint8), 0)  # NaN garbage
    runner = ModelRunner(hf_model.path, 1, 0, cache, kv=kv, provider="triton")
    got = _greedy(runner, KV_PROMPTS, tables)
    assert [tuple(g) for g in got] == [r[:STEPS] for r in hf_model.kv_reference]


def test_device_block_tables_track_the_host_tables():
    tables = _DeviceBlockTables(num_rows=4, device=torch.device("cpu"))
    rows = tables.rows([2, 0], torch.tensor([2, 0]), [[5, 1], [7]])
    assert rows.tolist() == [[5, 1], [7, -1]]
    assert tables.entries_sent == 3

    # a decode step that changes nothing sends nothing; a new block sends one entry
    assert tables.rows([2, 0], torch.tensor([2, 0]), [[5, 1], [7]]).tolist() == [[5, 1], [7, -1]]
    assert tables.entries_sent == 3
    assert tables.rows([0, 2], torch.tensor([0, 2]), [[7, 9], [5, 1]]).tolist() == [[7, 9], [5, 1]]
    assert tables.entries_sent == 4

    # the width grows; a page reused by a request with a shorter table is padded with -1 again
    long = list(range(10, 19))
    assert tables.rows([2], torch.tensor([2]), [long]).tolist() == [long]
    assert tables.rows([2, 3], torch.tensor([2, 3]), [[3], [4, 6]]).tolist() == [[3, -1], [4, 6]]
    assert tables.table[2].tolist() == [3] + [-1] * 8  # the whole row, width 9
    assert tables.rows([], torch.tensor([], dtype=torch.int64), []).shape == (0, 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU and none is visible; run `pytest -m cuda` on a GPU machine")
@pytest.mark.parametrize("name", ["lfm2-hybrid", "granite-hybrid", "mamba2-g1"])
def test_cuda_runner_matches_transformers_without_syncs(hf_models, name):
    """Pages, KV pool and weights on the GPU, the compiled kernels (provider auto): transformers'
    tokens, and every decode step runs with CUDA sync debug mode 'error' (no host
    synchronisation anywhere in a step; the host reads the logits after it)."""
    from statebridge.state import PageGeometry, StateCache, StateSpec

    hf_model = hf_models[name]
    spec = StateSpec.from_pretrained(hf_model.path)
    cache = StateCache(PageGeometry(spec, 1, "DLS"), 8, device="cuda")
    prompts = KV_PROMPTS if spec.kv is not None else tuple(PROMPTS)
    reference = hf_model.kv_reference if spec.kv is not None else hf_model.reference
    kv, tables = None, None
    if spec.kv is not None:
        tables, nxt = [], 0
        for p in prompts:
            n = -(-(len(p) + NEW_TOKENS) // KV_BLOCK)
            tables.append(list(range(nxt + n - 1, nxt - 1, -1)))
            nxt += n
        geo = BlockGeometry(spec.kv, 1, "HB", KV_BLOCK, nxt)
        kv = KVBlocks(geo, torch.full((geo.nbytes,), 255, dtype=torch.uint8, device="cuda"), 0)
    runner = ModelRunner(hf_model.path, 1, 0, cache, kv=kv)
    pages = list(range(len(prompts)))
    runner.prefill([p[:-1] for p in prompts], pages, blocks=tables)
    tokens, positions = [p[-1] for p in prompts], [len(p) - 1 for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(NEW_TOKENS):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = runner.decode(tokens, pages, blocks=tables, positions=positions if tables else None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        tokens = logits.argmax(-1).tolist()
        positions = [x + 1 for x in positions]
        for o, t in zip(out, tokens):
            o.append(t)
    assert [tuple(o) for o in out] == list(reference)
