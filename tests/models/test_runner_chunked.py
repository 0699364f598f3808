"""Batched and chunked prefill equal one prompt at a time: the prefill steps a rank's compute
thread plans (:class:`~statebridge.connector.rank.compute.PrefillBatcher`, a small token budget
so prompts are cut) run through the rank's model (:meth:`ModelRankModel.prefill_chunks`) end in
the same recurrent state, the same attention K/V and the same greedy tokens as each prompt
prefilled alone; a bad prompt in a step fails alone."""

from __future__ import annotations

import pytest
import torch

from statebridge.connector.rank import KVBlocks, PrefillChunk, RankSetup
from statebridge.connector.rank.compute import PrefillBatcher, PrefillJob
from statebridge.models import ModelRunner
from statebridge.node.rank_model import ModelRankModel
from statebridge.state import StateSpec
from statebridge.state.kv import BlockGeometry, blocks_for
from tests.models._helpers import KV_BLOCK, make_cache

#: Mixed lengths: empty (the N-1 prefill of a 1-token prompt), shorter than a KV block, one
#: block, several blocks, and two longer than the budget (run in 3 and 5 chunks).
PROMPTS: tuple[tuple[int, ...], ...] = (
    tuple((i * 29 + 3) % 127 for i in range(19)),
    (),
    (5, 66, 12),
    (9, 33, 77, 2),
    tuple((i * 37 + 5) % 120 for i in range(11)),
    tuple((i * 53 + 17) % 127 for i in range(34)),
    (44, 1),
)
BUDGET = 8
DECODE_STEPS = 4
NUM_PAGES = len(PROMPTS) + 1


def _tables() -> list[list[int]]:
    """Each prompt's block table (room for the decode steps), scattered and reversed."""
    tables, nxt = [], 0
    for p in PROMPTS:
        n = blocks_for(len(p) + DECODE_STEPS + 1, KV_BLOCK)
        tables.append(list(range(nxt + n - 1, nxt - 1, -1)))
        nxt += n
    return tables


def _rank_model(path: str, provider: str) -> ModelRankModel:
    """A TP 1 rank's model over a fresh cache and (hybrid) a KV pool full of NaN bytes."""
    spec = StateSpec.from_pretrained(path)
    cache = make_cache(path, 1, "DLS", num_pages=NUM_PAGES)
    kv = None
    if spec.kv is not None:
        geo = BlockGeometry(spec.kv, 1, "HB", KV_BLOCK, sum(len(t) for t in _tables()))
        kv = KVBlocks(geo, torch.full((geo.nbytes,), 255, dtype=torch.uint8), 0)
    setup = RankSetup(role="prefill", coordinator="127.0.0.1:9", tp_rank=0, tp_size=1,
                      spec_json=spec.to_json(), layout="DLS", num_pages=NUM_PAGES,
                      node_id="chunked", model_dir=path)
    model = ModelRankModel(setup, cache, kv)
    model.runner = ModelRunner(path, 1, 0, cache, kv=kv, provider=provider)
    return model


def _kv_of(model: ModelRankModel, table: list[int], tokens: int) -> torch.Tensor:
    """K and V of a request's first ``tokens`` positions, every attention layer, as fp32."""
    bs, out = KV_BLOCK, []
    for layer in range(len(model.runner.spec.kv.layer_ids)):
        for cache in model.kv.view(layer):
            rows = [cache[table[t // bs], :, t % bs] for t in range(tokens)]
            out.append(torch.stack(rows).float() if rows else cache.new_zeros(0).float())
    return torch.cat([t.flatten() for t in out])


def _greedy(model: ModelRankModel, last_tokens, tables, positions) -> list[list[int]]:
    runner, pages = model.runner, list(range(len(last_tokens)))
    blocks = tables if runner.has_attention else None
    tokens, positions = list(last_tokens), list(positions)
    out: list[list[int]] = [[] for _ in pages]
    for _ in range(DECODE_STEPS):
        with torch.inference_mode():                  # as the rank's decode step runs
            logits = runner.decode(tokens, pages, blocks=blocks, positions=positions)
        tokens = logits.argmax(-1).tolist()
        positions = [x + 1 for x in positions]
        for o, t in zip(out, tokens):
            o.append(t)
    return out


def _batched(model: ModelRankModel, tables,
             budget: int = BUDGET) -> tuple[list[list[tuple[int, int, int]]], int]:
    """Run PROMPTS as the compute thread would: planned steps of ``budget`` tokens."""
    batcher = PrefillBatcher(budget, chunked=model.chunked_prefill)
    for b, prompt in enumerate(PROMPTS):
        batcher.add(PrefillJob(msg=None, key=None, page=b, tokens=prompt,
                               blocks=tuple(tables[b]) if model.runner.has_attention else ()))
    steps = []
    while batcher:
        plan = batcher.plan()
        assert sum(end - start for _, start, end in plan) <= budget
        errors = model.prefill_chunks([
            PrefillChunk(request_id=f"r{job.page}", page=job.page, tokens=job.tokens[start:end],
                         start=start, last=end == len(job.tokens), blocks=job.blocks)
            for job, start, end in plan])
        assert errors == [None] * len(plan)
        steps.append([(job.page, start, end) for job, start, end in plan])
        batcher.ran(plan)
    return steps, len(steps)


@pytest.mark.parametrize("name,provider,budget", [
    ("lfm2-hybrid", "ref", BUDGET), ("mamba2-g1", "ref", BUDGET),
    ("granite-hybrid", "ref", BUDGET),
    ("lfm2-hybrid", "triton", 2 * BUDGET),      # (interpreted: half the steps)
])
def test_batched_chunked_prefill_equals_one_at_a_time(hf_models, assert_close, name, provider,
                                                      budget):
    path = hf_models[name].path
    tables = _tables()
    alone = _rank_model(path, provider)
    hybrid = alone.runner.has_attention
    for b, prompt in enumerate(PROMPTS):      # the reference: one prompt per forward, whole
        assert alone.prefill_chunks([PrefillChunk(request_id=f"r{b}", page=b, tokens=prompt,
                                                  blocks=tuple(tables[b]) if hybrid else ())]) \
            == [None]
    together = _rank_model(path, provider)
    steps, count = _batched(together, tables, budget)
    # the plan did what the test is about: several prompts per step, prompts cut in chunks
    assert max(len(step) for step in steps) >= 3
    assert any(start > 0 for step in steps for _, start, _ in step)
    assert count == -(-sum(map(len, PROMPTS)) // budget), "every step but the last is full"

    for b, prompt in enumerate(PROMPTS):
        # float sums in another order: the state within fp32 tolerance, not bit for bit
        assert_close(together.runner.cache.page_bytes(b).view(torch.float32),
                     alone.runner.cache.page_bytes(b).view(torch.float32), torch.float32)
        if hybrid:
            assert_close(_kv_of(together, tables[b], len(prompt)),
                         _kv_of(alone, tables[b], len(prompt)), torch.float32)
    last = [p[-1] if p else 7 for p in PROMPTS]       # continue every prompt by one token
    positions = [len(p) for p in PROMPTS]
    want = _greedy(alone, last, tables, positions)
    assert _greedy(together, last, tables, positions) == want


def test_a_bad_prompt_fails_alone(hf_models, assert_close):
    """A token outside the vocabulary fails its own request; the others of the step run and
    end where they would alone."""
    path = hf_models["lfm2-hybrid"].path
    tables = _tables()
    model = _rank_model(path, "ref")
    vocab = model.runner.vocab_size
    chunks = [PrefillChunk(request_id=f"r{b}", page=b, tokens=PROMPTS[b], blocks=tuple(tables[b]))
              for b in (2, 3)]
    chunks.insert(1, PrefillChunk(request_id="bad", page=4, tokens=(1, vocab + 5, 2),
                                  blocks=tuple(tables[4])))
    errors = model.prefill_chunks(chunks)
    assert errors[0] is None and errors[2] is None
    assert f"token id {vocab + 5}" in errors[1] and str(vocab) in errors[1]
    alone = _rank_model(path, "ref")
    for b in (2, 3):
        alone.prefill(b, PROMPTS[b], f"r{b}", tuple(tables[b]))
        assert_close(model.runner.cache.page_bytes(b).view(torch.float32),
                     alone.runner.cache.page_bytes(b).view(torch.float32), torch.float32)
    assert not model.runner.cache.page_bytes(4).any(), "the failed request's page is untouched"
