"""The rank's side of the prefix cache (issue 41): page and KV block copies in every layout, the
prefill steps a checkpoint cuts, the typed refusals of bad RankPrefill fields, and -- with real
tiny models run in process on the rank's compute thread -- that a request restored from a
checkpoint ends in exactly the bytes (state and KV) of the same prompt run from scratch with
the same step boundaries, and that a checkpoint holds exactly the state of its prefix."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from statebridge.connector import messages as m
from statebridge.connector.rank import KVBlocks, RankModel, RankSetup
from statebridge.connector.rank.compute import ComputeThread, PrefillBatcher, PrefillJob
from statebridge.connector.rank.model import kv_checksum
from statebridge.connector.rank.prefix import copy_blocks, copy_page, prefix_plan
from statebridge.connector.stats import Counters
from statebridge.errors import ConfigError
from statebridge.state import PageGeometry, StateCache, StateSpec
from statebridge.state.kv import KV_LAYOUT_PRESETS, BlockGeometry, blocks_for

from ._helpers import SPECS

BS = 16

#: Two attention layers between conv layers (the KV copy covers every layer).
HYBRID = StateSpec.from_config(
    {"model_type": "lfm2", "hidden_size": 40, "conv_L_cache": 3, "torch_dtype": "bfloat16",
     "num_attention_heads": 4, "num_key_value_heads": 2,
     "layer_types": ["conv", "full_attention", "conv", "full_attention"]})


def _random(nbytes: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (random bytes hold NaNs, which never compare equal)."""
    return t.contiguous().view(torch.uint8)


# -- the copies ------------------------------------------------------------------------------

DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                         reason="needs a CUDA GPU and none is visible; run "
                                                "`pytest -m cuda` on a GPU machine")])])


@DEVICES
@pytest.mark.parametrize("spec", ["shortconv", "mamba2-g1"])
@pytest.mark.parametrize("layout", ["LSD", "LDS", "DLS"])
def test_a_page_copy_moves_every_segment_and_nothing_else(spec, layout, device):
    cache = StateCache(PageGeometry(SPECS[spec], 2, layout), 5, device=device)
    cache.buffer.copy_(_random(cache.nbytes, 1))
    before = cache.buffer.clone()
    copy_page(cache, 1, 3)
    ps = cache.page_size
    assert torch.equal(cache.page_bytes(3), before[ps:2 * ps])
    for page in (0, 1, 2, 4):
        assert torch.equal(cache.page_bytes(page), before[page * ps:(page + 1) * ps])
    for region in cache.geometry:                       # through the kernels' views too
        view = cache.view(region.group, region.tensor.name)
        assert torch.equal(_raw(view[3]), _raw(view[1]))


@DEVICES
@pytest.mark.parametrize("layout", sorted(KV_LAYOUT_PRESETS) + ["LTBHCE"])
def test_a_block_copy_moves_every_layer_k_and_v_in_any_layout(layout, device):
    geo = BlockGeometry(HYBRID.kv, 1, layout, 4, 8)
    pool = _random(geo.nbytes + 64, 2).to(device)
    kv = KVBlocks(geo, pool[32:32 + geo.nbytes], 0)                 # not at offset 0

    def blocks() -> list[torch.Tensor]:
        return [t.clone() for layer in range(geo.kv.num_layers) for t in kv.view(layer)]

    before = blocks()
    copy_blocks(kv, (2, 5, 6, 1), (7, 1, 6, 2))      # 6 -> 6 is skipped; 1 <-> 2 at once
    moved = {7: 2, 1: 5, 2: 1}
    for old, new in zip(before, blocks()):
        for b in range(geo.num_blocks):
            assert torch.equal(_raw(new[b]), _raw(old[moved.get(b, b)])), f"block {b}"
    with pytest.raises(ConfigError, match="twice"):
        copy_blocks(kv, (1, 2), (3, 3))


# -- the steps a checkpoint cuts ---------------------------------------------------------------

def _job(name: str, n: int, *, start: int = 0, stops: tuple[int, ...] = ()) -> PrefillJob:
    return PrefillJob(msg=name, key=name, page=0, tokens=tuple(range(n)), start=start,
                      stops=stops)


def _run(batcher: PrefillBatcher) -> list[list[tuple[str, int, int]]]:
    steps = []
    while batcher:
        plan = batcher.plan()
        steps.append([(job.msg, start, end) for job, start, end in plan])
        batcher.ran(plan)
    return steps


def test_steps_end_at_every_checkpoint_and_other_jobs_share_them():
    b = PrefillBatcher(64, chunked=True)
    b.add(_job("a", 60, stops=(16, 40, 60)))
    b.add(_job("b", 10))
    assert _run(b) == [[("a", 0, 16), ("b", 0, 10)], [("a", 16, 40)], [("a", 40, 60)]]
    # a begun job's extension stops at its checkpoint too
    b = PrefillBatcher(20, chunked=True)
    b.add(_job("a", 30, stops=(25, 30)))
    b.ran(b.plan())
    b.add(_job("b", 2))
    assert _run(b) == [[("a", 20, 25), ("b", 0, 2)], [("a", 25, 30)]]
    # batching off: one job per step, still cut
    b = PrefillBatcher(None, chunked=True)
    b.add(_job("a", 60, stops=(16, 40, 60)))
    assert _run(b) == [[("a", 0, 16)], [("a", 16, 40)], [("a", 40, 60)]]


def test_a_restored_job_begins_at_its_cached_tokens_as_a_new_job():
    b = PrefillBatcher(16, chunked=True)
    b.add(_job("long", 64))
    b.ran(b.plan())
    b.add(_job("hit", 50, start=40, stops=(44, 50)))
    # the hit is new (the long one gets half the step, then what the hit left), from token
    # 40, cut at its checkpoint
    assert _run(b)[0] == [("long", 16, 28), ("hit", 40, 44)]
    b = PrefillBatcher(16, chunked=True)
    b.add(_job("hit", 41, start=40))                  # one token left: a step of one token
    assert _run(b) == [[("hit", 40, 41)]]


# -- the checked fields ------------------------------------------------------------------------

def _msg(n: int = 40, **fields) -> m.RankPrefill:
    base = dict(request_id="r", generation=1, prompt=m.pack_tokens(range(n)), src_page=0,
                peer_node="d")
    return m.RankPrefill(**{**base, **fields})


@pytest.fixture
def pools() -> tuple[StateCache, KVBlocks]:
    cache = StateCache(PageGeometry(HYBRID, 1, "DLS"), 6)
    geo = BlockGeometry(HYBRID.kv, 1, "HB", BS, 12)
    return cache, KVBlocks(geo, torch.zeros(geo.nbytes, dtype=torch.uint8), 0)


def test_a_plan_says_what_to_copy(pools):
    cache, kv = pools
    assert prefix_plan(_msg(src_blocks=(0, 1, 2)), 40, cache, kv, chunked=False) is None
    plan = prefix_plan(_msg(src_blocks=(3, 4, 5), cached_tokens=20, restore_page=1,
                            restore_blocks=(3, 9), checkpoint_at=(32, 36, 40),
                            checkpoint_pages=(2, 3, 4), checkpoint_tails=(-1, 10, 11)),
                       40, cache, kv, chunked=True)
    assert (plan.cached, plan.restore_page, plan.restore_blocks) == (20, 1, ((3, 3), (9, 4)))
    assert plan.checkpoints == ((32, 2, -1, -1), (36, 3, 5, 10), (40, 4, 5, 11))
    assert plan.stops == (32, 36, 40)
    # a non-chunked model may checkpoint the end of a prompt; without KV, no tails needed
    plan = prefix_plan(_msg(checkpoint_at=(40,), checkpoint_pages=(5,)), 40, cache, None,
                       chunked=False)
    assert plan.checkpoints == ((40, 5, -1, -1),) and plan.cached == 0


@pytest.mark.parametrize("fields,chunked,match", [
    (dict(cached_tokens=16, restore_page=1, restore_blocks=(0,)), False,
     r"cached_tokens=16 needs a model that prefills from a state"),
    (dict(checkpoint_at=(16, 40), checkpoint_pages=(1, 2)), False,
     r"checkpoint_at \(16, 40\): a checkpoint inside the prompt of 40 tokens"),
    (dict(cached_tokens=40, restore_page=1, restore_blocks=(0, 1, 2)), True,
     r"cached_tokens=40 must be below the prompt's 40 tokens"),
    (dict(cached_tokens=-1), True, r"cached_tokens must be an integer >= 0, got -1"),
    (dict(cached_tokens=16, restore_page=6, restore_blocks=(0,)), True,
     r"restore_page \(6,\): 6 is not a page of this rank \(0..5\)"),
    (dict(cached_tokens=16, restore_page=1, restore_blocks=(0, 12)), True,
     r"restore_blocks \(0, 12\) \(2 blocks\) do not hold cached_tokens=16"),
    (dict(cached_tokens=20, restore_page=1, restore_blocks=(0, 12)), True,
     r"restore_blocks \(0, 12\): 12 is not a KV block"),
    (dict(cached_tokens=16, restore_page=1), True, r"cached_tokens=16 with KV blocks"),
    (dict(restore_page=1), True, r"restore_page=1, restore_blocks=\(\) without cached_tokens"),
    (dict(checkpoint_at=(16, 16), checkpoint_pages=(1, 2)), True,
     r"checkpoint_at \(16, 16\) must increase strictly within \(cached_tokens=0, 40\]"),
    (dict(checkpoint_at=(41,), checkpoint_pages=(1,)), True, r"checkpoint_at \(41,\) must"),
    (dict(cached_tokens=16, restore_page=1, restore_blocks=(0,), checkpoint_at=(16,),
          checkpoint_pages=(2,)), True, r"within \(cached_tokens=16, 40\]"),
    (dict(checkpoint_at=(16, 40), checkpoint_pages=(1,)), True, r"differ in length"),
    (dict(checkpoint_at=(16,), checkpoint_pages=(1,), checkpoint_tails=(-1, 3)), True,
     r"differ in length"),
    (dict(checkpoint_at=(16,), checkpoint_pages=(7,)), True, r"7 is not a page"),
    (dict(checkpoint_at=(16, 40), checkpoint_pages=(0, 2)), True,
     r"checkpoint_pages \(0, 2\) must be distinct and not the request's page 0"),
    (dict(checkpoint_at=(16,), checkpoint_pages=(1,), checkpoint_tails=(5,)), True,
     r"checkpoint at 16 tokens: a tail block needs a count inside a block"),
    (dict(checkpoint_at=(20,), checkpoint_pages=(1,), checkpoint_tails=(2,)), True,
     r"tail block 2 is one of the request's own blocks"),
    (dict(checkpoint_at=(20, 24), checkpoint_pages=(1, 2), checkpoint_tails=(5, 5)), True,
     r"checkpoint_tails \(5, 5\) repeat a block"),
])
def test_bad_fields_are_refused_naming_the_values(pools, fields, chunked, match):
    cache, kv = pools
    with pytest.raises(ConfigError, match=match):
        prefix_plan(_msg(src_blocks=(0, 1, 2), kv_tokens=40, **fields), 40, cache, kv,
                    chunked=chunked)


# -- on the compute thread, with a stand-in model ----------------------------------------------

class _Loop:
    def call_soon(self, fn, *args):
        fn(*args)


class _FillModel(RankModel):
    """Writes the byte ``(start + len) % 251`` over a chunk's page: a page says how many tokens
    it has seen. ``chunked``: whether it prefills from a state."""

    def __init__(self, cache: StateCache, chunked: bool) -> None:
        setup = RankSetup(role="prefill", coordinator="127.0.0.1:9", tp_rank=0, tp_size=1,
                          spec_json=cache.geometry.spec.to_json(), layout="DLS",
                          num_pages=cache.num_pages, node_id="fill")
        super().__init__(setup, cache)
        self.chunked_prefill = chunked
        self.steps: list[list[tuple[str, int, int]]] = []

    def prefill_chunks(self, chunks):
        self.steps.append([(c.request_id, c.start, c.start + len(c.tokens)) for c in chunks])
        for c in chunks:
            self.cache.page_bytes(c.page).fill_((c.start + len(c.tokens)) % 251)
        return [None] * len(chunks)


def _compute(model: RankModel, budget: int | None = 64):
    results: dict[str, str | None] = {}
    done = threading.Event()

    def computed(msg, error, final_at, started_at):
        results[msg.request_id] = error
        done.set()

    thread = ComputeThread("rank0", model, _Loop(), Counters(), on_computed=computed,
                           on_reply=lambda reply: None, max_prefill_tokens=budget)
    return thread, results


def _wait(pred, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _prefill(rid: str, tokens, page: int, **fields) -> m.RankPrefill:
    return m.RankPrefill(request_id=rid, generation=1, prompt=m.pack_tokens(tokens),
                         src_page=page, peer_node="d", **fields)


def test_a_non_chunked_model_refuses_a_hit_and_serves_the_rest():
    cache = StateCache(PageGeometry(SPECS["mamba2-g1"], 1, "DLS"), 6)
    model = _FillModel(cache, chunked=False)
    thread, results = _compute(model)
    try:
        thread.submit(_prefill("hit", range(30), 0, cached_tokens=20, restore_page=1))
        thread.submit(_prefill("mid", range(30), 2, checkpoint_at=(10, 30),
                               checkpoint_pages=(3, 4)))
        thread.submit(_prefill("end", range(30), 5, checkpoint_at=(30,), checkpoint_pages=(1,)))
        _wait(lambda: len(results) == 3, "three results")
    finally:
        thread.close()
    assert "ConfigError" in results["hit"] and "cached_tokens=20" in results["hit"]
    assert "ConfigError" in results["mid"] and "checkpoint_at (10, 30)" in results["mid"]
    assert results["end"] is None and model.steps == [[("end", 0, 30)]]
    assert set(cache.page_bytes(1).tolist()) == {30}, "the final checkpoint was copied"
    assert not cache.page_bytes(3).any() and not cache.page_bytes(4).any()


def test_a_hit_restores_then_checkpoints_before_its_result_leaves():
    cache = StateCache(PageGeometry(SPECS["mamba2-g1"], 1, "DLS"), 8)
    model = _FillModel(cache, chunked=True)
    cache.page_bytes(1).fill_(20)                     # the cached state after 20 tokens
    seen_at_result: dict[str, list[int]] = {}
    thread, results = _compute(model, budget=64)
    computed = thread._on_computed

    def check(msg, error, final_at, started_at):      # the checkpoints are there already
        seen_at_result[msg.request_id] = [int(cache.page_bytes(p)[0]) for p in (2, 3, 4)]
        computed(msg, error, final_at, started_at)
    thread._on_computed = check
    try:
        thread.submit(_prefill("hit", range(50), 0, cached_tokens=20, restore_page=1,
                               checkpoint_at=(32, 48, 50), checkpoint_pages=(2, 3, 4)))
        thread.submit(_prefill("other", range(5), 5))
        _wait(lambda: len(results) == 2, "two results")
    finally:
        thread.close()
    assert results == {"hit": None, "other": None}
    assert model.steps == [[("hit", 20, 32), ("other", 0, 5)], [("hit", 32, 48)],
                           [("hit", 48, 50)]]
    assert seen_at_result["hit"] == [32, 48, 50]
    assert int(cache.page_bytes(1)[0]) == 20, "the cached page is only read"


# -- real models, in process -------------------------------------------------------------------

MODELS = ("lfm2", "lfm2-hybrid", "mamba2-g1", "granite-hybrid")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Checkpoint directories of tiny random models, made by transformers (only the four the
    prefix cache serves; no reference tokens: the comparisons here are byte for byte)."""
    tf = pytest.importorskip("transformers")
    from tests.models.conftest import HF_MODELS, MODEL_CLASSES, randomize_

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for i, name in enumerate(HF_MODELS):
        if name not in MODELS:
            continue
        config_cls, kwargs, save_kwargs = HF_MODELS[name]
        config = getattr(tf, config_cls)(**kwargs)
        torch.manual_seed(i)
        model = getattr(tf, MODEL_CLASSES[config_cls])(config).eval()
        randomize_(model, seed=100 + i)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, **save_kwargs)
        out[name] = str(path)
    yield out
    torch.set_num_threads(threads)


NUM_PAGES, NUM_BLOCKS = 12, 40


def _real_model(path: str, layout: str, kv_layout: str):
    from statebridge.config import ConnectorConfig
    from statebridge.node.rank_model import ModelRankModel

    spec = StateSpec.from_pretrained(path)
    cache = StateCache(PageGeometry(spec, 1, layout), NUM_PAGES)
    kv = None
    if spec.kv is not None:
        geo = BlockGeometry(spec.kv, 1, kv_layout, BS, NUM_BLOCKS)
        kv = KVBlocks(geo, torch.full((geo.nbytes,), 255, dtype=torch.uint8), 0)  # NaN bytes
    setup = RankSetup(role="prefill", coordinator="127.0.0.1:9", tp_rank=0, tp_size=1,
                      spec_json=spec.to_json(), layout=layout, num_pages=NUM_PAGES,
                      node_id="prefix", model_dir=path, config=ConnectorConfig(torch_threads=1))
    return ModelRankModel(setup, cache, kv)


class _Rank:
    """A real model's compute thread: :meth:`run` one RankPrefill at a time (its own steps)."""

    def __init__(self, model) -> None:
        self.model = model
        self.steps: list[list[tuple[str, int, int]]] = []
        inner = model.prefill_chunks

        def record(chunks):
            self.steps.append([(c.request_id, c.start, c.start + len(c.tokens))
                               for c in chunks])
            return inner(chunks)
        model.prefill_chunks = record
        self.thread, self.results = _compute(model, budget=2048)

    def run(self, rid: str, tokens, page: int, blocks=(), **fields) -> list:
        first = len(self.steps)
        self.thread.submit(_prefill(rid, tokens, page, src_blocks=tuple(blocks),
                                    kv_tokens=len(tokens) if blocks else 0, **fields))
        _wait(lambda: rid in self.results, rid)
        assert self.results[rid] is None, self.results[rid]
        return [s for step in self.steps[first:] for s in step]

    def page(self, page: int) -> bytes:
        return self.model.cache.page_bytes(page).numpy().tobytes()

    def kv(self, blocks, tokens: int) -> str:
        return kv_checksum(self.model.kv, blocks, tokens) if self.model.kv else ""


@pytest.mark.parametrize("name,layout,kv_layout,suffix", [
    # conv only: the state after n tokens depends on the last few only, so B's suffix is
    # shorter than the model's receptive field (3 layers x 2): a missed restore shows
    ("lfm2", "LDS", "HB", 3),
    ("lfm2-hybrid", "DLS", "BH", 30),
    ("lfm2-hybrid", "LDS", "LH", 3),
    ("mamba2-g1", "LSD", "HB", 30),
    ("granite-hybrid", "DLS", "HB", 30),
])
def test_a_hit_ends_in_the_bytes_of_a_prefill_from_scratch(tiny_models, name, layout,
                                                           kv_layout, suffix):
    """Prompt A checkpoints at 16 (a block multiple), 40 (inside block 2) and its end; B shares
    A's first 40 tokens and starts from A's checkpoint at 40 (its page, A's full blocks 0 and 1
    shared, the tail block copied); it ends in the bytes of B run from scratch with the same
    step boundaries. The checkpoint at 40 holds the bytes of A[:40] run alone."""
    rank = _Rank(_real_model(tiny_models[name], layout, kv_layout))
    hybrid = rank.model.kv is not None
    rng = np.random.default_rng(7)
    a = tuple(int(t) for t in rng.integers(0, 128, 56))
    b = a[:40] + tuple(int(t) for t in rng.integers(0, 128, suffix))
    n = len(b)

    def tails(*ids):
        return dict(checkpoint_tails=ids) if hybrid else {}
    nb = blocks_for(n, BS)
    tables = {"a": (10, 11, 12, 13), "a40": (14, 15, 16), "b": tuple(range(24, 24 + nb)),
              "hit": (10, 11) + tuple(range(29, 29 + nb - 2))}
    if not hybrid:
        tables = {k: () for k in tables}
    try:
        assert rank.run("a", a, 0, tables["a"], checkpoint_at=(16, 40, 56),
                        checkpoint_pages=(1, 2, 3), **tails(-1, 20, 21)) == \
            [("a", 0, 16), ("a", 16, 40), ("a", 40, 56)]
        assert rank.page(3) == rank.page(0)
        # the checkpoints hold the state of the prefix run alone with the same boundaries
        rank.run("a40", a[:40], 4, tables["a40"], checkpoint_at=(16, 40),
                 checkpoint_pages=(5, 6), **tails(-1, 22))
        assert rank.page(2) == rank.page(4) and rank.page(1) == rank.page(5)
        if hybrid:
            assert rank.kv((10, 11, 20), 40) == rank.kv(tables["a40"], 40)
            assert rank.kv((10, 11, 12, 21), 56) == rank.kv(tables["a"], 56)
        shared = rank.kv((10, 11), 32)
        # B from scratch, a step ending at 16 and at 40 (A's boundaries)
        assert rank.run("b", b, 7, tables["b"], checkpoint_at=(16, 40),
                        checkpoint_pages=(8, 9), **tails(-1, 23)) == \
            [("b", 0, 16), ("b", 16, 40), ("b", 40, n)]
        # B from A's checkpoint at 40, checkpointing its end
        restore = dict(restore_blocks=(10, 11, 20)) if hybrid else {}
        assert rank.run("hit", b, 10, tables["hit"], cached_tokens=40, restore_page=2,
                        checkpoint_at=(n,), checkpoint_pages=(11,), **tails(32),
                        **restore) == [("hit", 40, n)]
        assert rank.page(10) == rank.page(7), "state differs from B run from scratch"
        assert rank.page(11) == rank.page(7)
        if hybrid:
            assert rank.kv(tables["hit"], n) == rank.kv(tables["b"], n)
            assert rank.kv((32,), n % BS) == rank.kv(tables["hit"][n // BS:], n % BS)
        assert rank.kv((10, 11), 32) == shared, "a shared block was written"
        assert rank.page(2) == rank.page(4), "the cached checkpoint was written"
    finally:
        rank.thread.close()


def test_empty_and_one_token_prompts_still_run_their_step(tiny_models):
    rank = _Rank(_real_model(tiny_models["lfm2-hybrid"], "DLS", "HB"))
    cache = rank.model.cache
    try:
        cache.page_bytes(0).fill_(7)                  # a stale state: the step resets it
        assert rank.run("empty", (), 0) == [("empty", 0, 0)]
        assert not cache.page_bytes(0).any()
        assert rank.run("one", (5,), 1, (3,), checkpoint_at=(1,), checkpoint_pages=(2,),
                        checkpoint_tails=(4,)) == [("one", 0, 1)]
        assert cache.page_bytes(1).any() and rank.page(2) == rank.page(1)
        assert rank.kv((4,), 1) == rank.kv((3,), 1)
    finally:
        rank.thread.close()
