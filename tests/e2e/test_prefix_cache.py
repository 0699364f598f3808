"""The prefill node's prefix cache (issue 41) with real tiny models made by transformers: greedy
tokens of requests that start from a cached checkpoint equal transformers' own (fp32), for LFM2
conv-only, LFM2 hybrid, Mamba2 and Granite hybrid at TP pairs that differ and in the DS layout;
hits at a stride checkpoint, at a prompt end inside a KV block, a prompt equal to a cached one,
a prompt shorter than one stride, concurrent requests sharing a prefix, eviction under a tiny
budget; the server reports the hit tokens and leaks nothing; a corrupted cached checkpoint is not
hidden by ``verify_transfers``.

How a stale or wrong checkpoint is ruled out (the cache is not on the wire, so the transfer's
digest cannot see it): a checkpoint's key is a chained hash of every token before it, salted
with the model (its checkpoint directory), the state spec with its dtypes, the page layout and
size, the KV block layout and size and the TP degree (``state/prefix.py`` PrefixSalt), so only
the prompt prefix it was computed for, on a group whose bytes mean the same, can find it; and a
cached page or block is never written after its commit (a hit copies it into the request's own
page and blocks). A group that restarts starts with an empty cache.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np
import pytest
import torch

from statebridge.connector.prefill import PrefillServer
from statebridge.node import prefill_node
from statebridge.node.client import Client
from statebridge.node.decode_node import DecodeNode
from statebridge.node.prefill_node import start_prefill_node
from statebridge.testing.hosts import RankHostPool

from tests.connector._helpers import log_to_stderr, wait_until
from tests.models._helpers import KV_BLOCK

from ._helpers import FAST

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

NEW = 4
STRIDE = 8


@pytest.fixture(scope="module")
def pools():
    with RankHostPool(2, initializer=log_to_stderr) as prefill_hosts, \
            RankHostPool(2, initializer=log_to_stderr) as decode_hosts:
        yield prefill_hosts, decode_hosts


@pytest.fixture(scope="module")
def references(hf_models, transformers_module):
    """Greedy continuation by transformers itself, per model, memoized by prompt."""
    from tests.models.conftest import reference_greedy

    loaded: dict[str, torch.nn.Module] = {}
    memo: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def reference(name: str, prompt: tuple[int, ...]) -> list[int]:
        if (name, prompt) not in memo:
            if name not in loaded:
                loaded[name] = transformers_module.AutoModelForCausalLM.from_pretrained(
                    hf_models[name].path).eval()
            memo[name, prompt] = reference_greedy(loaded[name], prompt, NEW)[0]
        return memo[name, prompt]
    return reference


def start_cached(monkeypatch, path: str, tp: int, hosts, **kwargs) -> PrefillServer:
    """A prefill node with its prefix cache on (its start helper takes the server's options
    as the node will)."""
    options = {k: kwargs.pop(k) for k in ("prefix_stride", "prefix_cache_bytes") if k in kwargs}
    def server(*args, **kw):          # the test's options over the node config's
        kw.update(prefix_cache=True, prefix_stride=options.get("prefix_stride", STRIDE),
                  prefix_cache_bytes=options.get("prefix_cache_bytes"))
        return PrefillServer(*args, **kw)
    monkeypatch.setattr(prefill_node, "PrefillServer", server)
    kwargs.setdefault("config", FAST)
    return start_prefill_node(path, tp, launcher=hosts.launcher(), **kwargs)


def _rng_tokens(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, 128, n))


def run_all(address: str, prompts) -> list:
    """Every prompt from its own client, all in flight at once."""
    def one(prompt):
        with Client(address, timeout=120) as client:
            return client.generate(prompt, max_new_tokens=NEW)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def assert_no_leak(server: PrefillServer) -> None:
    """Pool counts are the cache's holdings once no request is in flight."""
    group = server.group

    def check():
        cache = server.prefix.cache
        units = cache.num_units if cache else 0
        blocks = cache.num_blocks if cache else 0
        return (len(group.ledger) == 0 and group.pool.num_used == units
                and (group.blocks is None or group.blocks.num_used == blocks))
    wait_until(lambda: group.loop.call(check), 10, "the pools back to the cache's holdings")
    stats = server.stats()
    assert stats["pages_used"] == 0 and stats["blocks_used"] == 0, stats


CASES = [
    pytest.param("lfm2", 1, 2, "LDS", id="lfm2-1x2-LDS"),
    pytest.param("lfm2-hybrid", 2, 1, "DLS", id="lfm2-hybrid-2x1-DLS"),
    pytest.param("mamba2-g1", 1, 2, "DLS", id="mamba2-1x2-DLS"),
    pytest.param("granite-hybrid", 1, 2, "LDS", id="granite-hybrid-1x2-LDS"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model,prefill_tp,decode_tp,layout", CASES)
def test_tokens_with_hits_equal_transformers(pools, hf_models, references, monkeypatch, model,
                                             prefill_tp, decode_tp, layout):
    """Each request's prefill starts where the cache says (the node reports it) and its tokens
    are transformers' own. The N-1 prompt is what is prefilled and cached: ``p[:-1]``."""
    prefill_hosts, decode_hosts = pools
    path = hf_models[model].path
    hybrid = "hybrid" in model
    kv = dict(block_size=KV_BLOCK, kv_blocks=96) if hybrid else {}
    a = _rng_tokens(1, 30)                 # prefills 29: checkpoints at 8, 16, 24, 29
    short = _rng_tokens(2, 6)              # prefills 5 (< one stride): checkpoint at 5
    shared = _rng_tokens(3, 12)
    steps = [                              # (prompts sent at once, hit tokens of each)
        ([a], [0]),
        ([a], [24]),                                     # equal: capped at 28 -> stride 24
        ([a[:20] + _rng_tokens(4, 9)], [16]),            # at a stride checkpoint
        ([a[:29] + _rng_tokens(5, 3)], [29]),            # at a prompt end inside block 7
        ([short], [0]),
        ([short[:5] + (11, 12)], [5]),                   # shorter than one stride
        # concurrent requests sharing a prefix: while it is being prefilled nothing of it
        # is ready (any hits); then each starts from its checkpoint at 8
        ([shared + _rng_tokens(10 + i, 5) for i in range(3)], [None] * 3),
        # ... and where they branch, when they share full blocks (KV_BLOCK on a hybrid;
        # the node's 16 on a recurrent model: none)
        ([shared + _rng_tokens(20 + i, 5) for i in range(3)],
         [max(8, len(shared) // (KV_BLOCK if hybrid else 16) * (KV_BLOCK if hybrid else 16))]
         * 3),
    ]
    server = start_cached(monkeypatch, path, prefill_tp, prefill_hosts, layout=layout,
                          num_pages=24, **kv)
    try:
        with DecodeNode(path, decode_tp, [server.address], layout=layout, num_pages=16,
                        config=FAST, launcher=decode_hosts.launcher(), **kv) as node:
            hits = queries = 0
            for prompts, expected_hits in steps:
                before = server.stats()["prefix_hits"]
                results = run_all(node.address, prompts)
                for p, r in zip(prompts, results):
                    assert r.tokens == references(model, p), f"prompt of {len(p)} tokens"
                got = server.stats()["prefix_hits"] - before
                if None not in expected_hits:
                    assert got == sum(expected_hits), (prompts, got, expected_hits)
                hits += got
                queries += sum(len(p) - 1 for p in prompts)
            stats = server.stats()
            assert stats["prefix_hits"] == hits and stats["prefix_queries"] == queries
            assert stats["pages_cached"] > 0
            if hybrid:
                assert stats["blocks_cached"] > 0
        assert_no_leak(server)
    finally:
        server.close()


@pytest.mark.timeout(600)
def test_eviction_under_a_tiny_budget_keeps_tokens_exact_and_leaks_nothing(
        pools, hf_models, references, monkeypatch):
    """A budget of a few pages and blocks: units are evicted (LRU) while requests run, hits
    still give transformers' tokens, and the pools come back to the cache's holdings."""
    from statebridge.state import PageGeometry, StateSpec
    from statebridge.state.kv import BlockGeometry

    prefill_hosts, decode_hosts = pools
    model = "lfm2-hybrid"
    path = hf_models[model].path
    spec = StateSpec.from_pretrained(path)
    page = PageGeometry(spec, 1, "DLS").page_size
    block = BlockGeometry(spec.kv, 1, "HB", KV_BLOCK, 96).bytes_per_block
    server = start_cached(monkeypatch, path, 1, prefill_hosts, layout="DLS", num_pages=16,
                          block_size=KV_BLOCK, kv_blocks=96,
                          prefix_cache_bytes=3 * page + 20 * block)
    try:
        with DecodeNode(path, 2, [server.address], layout="DLS", num_pages=16, config=FAST,
                        block_size=KV_BLOCK, kv_blocks=96,
                        launcher=decode_hosts.launcher()) as node:
            bases = [_rng_tokens(30 + i, 18) for i in range(4)]
            for round_ in range(2):
                for i, base in enumerate(bases):
                    prompt = base + _rng_tokens(40 + 10 * round_ + i, 3)
                    [result] = run_all(node.address, [prompt])
                    assert result.tokens == references(model, prompt)
            stats = server.stats()
            cache = server.prefix.cache
            assert cache.page_budget <= 4, cache.page_budget
            assert stats["prefix_evictions"] > 0, stats
            assert stats["pages_cached"] <= cache.page_budget
            assert stats["blocks_cached"] <= cache.block_budget
        assert_no_leak(server)
    finally:
        server.close()


@pytest.mark.timeout(600)
def test_a_corrupted_checkpoint_is_not_hidden_by_verify_transfers(
        pools, hf_models, references, monkeypatch):
    """The digest covers what is sent: a cached checkpoint overwritten on the prefill ranks
    gives a request that verifies fine on the decode side and decodes other tokens. (What rules
    out a stale or wrong checkpoint is the key and that cached pages are never written: see the
    module docstring.)"""
    prefill_hosts, decode_hosts = pools
    model = "mamba2-g1"                       # an SSM state persists: a conv one is flushed
    path = hf_models[model].path
    config = FAST.replace(verify_transfers=True)
    server = start_cached(monkeypatch, path, 1, prefill_hosts, config=config, num_pages=16,
                          rank_model="tests.connector._prefix_models:CorruptibleModel")
    try:
        with DecodeNode(path, 1, [server.address], num_pages=16, config=config,
                        launcher=decode_hosts.launcher()) as node:
            a = _rng_tokens(1, 30)
            [first] = run_all(node.address, [a])
            assert first.tokens == references(model, a)
            from tests.connector._prefix_models import CorruptPage

            def corrupt():
                cache = server.prefix.cache
                unit = next(u for u in cache._lru.values() if u.tokens == 24)
                server.group.to_ranks(CorruptPage(page=unit.page))
            server.group.loop.call(corrupt)
            again = _rng_tokens(1, 30)
            [second] = run_all(node.address, [again])
            assert server.stats()["prefix_hits"] == 24
            coordinator = node.stats()["coordinator"]
            assert coordinator["transfer_digests_checked"] >= 2, coordinator
            assert not coordinator.get("transfer_digest_mismatches"), coordinator
            assert second.tokens != references(model, again), \
                "a corrupted checkpoint must change the tokens (nothing on the wire hides it)"
    finally:
        server.close()


def _held(node: DecodeNode) -> dict[str, int]:
    """Per prefill node, the checkpoints the decode node's router knows of."""
    coordinator = node.coordinator
    return coordinator.group.loop.call(
        lambda: {n: len(p.keys) for n, p in coordinator.router.nodes.items()})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("routing", [True, False], ids=["by-prefix", "round-robin"])
def test_requests_go_where_their_prefix_lives(pools, hf_models, references, monkeypatch,
                                              routing):
    """Two prefill nodes: requests that share a warm prefix go to the node that holds it (all
    hit there); round robin (``prefix_routing=False``) sends half elsewhere, where they miss.
    After an eviction the router forgets within a heartbeat; a closed prefill node's entries
    are gone."""
    prefill_hosts, decode_hosts = pools
    model = "lfm2"
    path = hf_models[model].path
    servers = [start_cached(monkeypatch, path, 1, prefill_hosts, num_pages=16)
               for _ in range(2)]
    try:
        with DecodeNode(path, 1, [s.address for s in servers], num_pages=16, config=FAST,
                        launcher=decode_hosts.launcher(), prefix_routing=routing) as node:
            wait_until(lambda: len(node.coordinator.prefill_nodes()) == 2, 30, "both prefills")
            base = _rng_tokens(50, 25)                # prefills 24+: checkpoints 8, 16, 24
            [warm] = run_all(node.address, [base + (1, 2)])
            assert warm.tokens == references(model, base + (1, 2))
            home = max(servers, key=lambda s: s.stats().get("requests", 0))
            wait_until(lambda: _held(node).get(home.node_id, 0) > 0, 5, "the announcement")
            prompts = [base + _rng_tokens(60 + i, 4) for i in range(6)]
            for p in prompts:                         # one after the other: no queue
                [r] = run_all(node.address, [p])
                assert r.tokens == references(model, p)
            hits = {s.node_id: s.stats()["prefix_hits"] for s in servers}
            if routing:
                assert hits[home.node_id] == 24 * len(prompts), hits
                assert home.stats().get("requests", 0) == 1 + len(prompts)
                assert node.stats()["coordinator"]["prefix_routed"] == len(prompts)
            else:
                assert hits[home.node_id] < 24 * len(prompts), hits
            # what the decode node shows of each prefill node's cache (its latest announcement)
            pages = home.stats()["pages_cached"]
            assert pages > 0
            wait_until(lambda: node.stats()["coordinator"]["prefill_nodes"][home.node_id]
                       ["prefix"]["pages_cached"] == pages, 5, "the announced pool use")

            # eviction: the router forgets within a heartbeat or so
            home.group.loop.call(home.prefix.cache.clear)
            wait_until(lambda: _held(node).get(home.node_id, 1) == 0, 2, "the eviction")
            # a prefill node that goes: its entries go with its link
            [r] = run_all(node.address, [base + (3, 4)])
            holder = max(servers, key=lambda s: s.stats()["pages_cached"])
            wait_until(lambda: _held(node).get(holder.node_id, 0) > 0, 5, "the announcement")
            holder.close()
            wait_until(lambda: holder.node_id not in _held(node), 10, "the node's entries gone")
            assert holder.node_id not in node.stats()["coordinator"]["prefill_nodes"]
    finally:
        for s in servers:
            s.close()


@pytest.mark.timeout(300)
def test_a_request_s_checkpoints_are_announced_when_it_ends(pools, hf_models, monkeypatch):
    """The decode node's router hears of a request's checkpoints as the request ends, not at
    the prefill node's next heartbeat (here a minute away): the next turn of a chat, sent
    right after an answer, is routed by them."""
    prefill_hosts, decode_hosts = pools
    slow = dataclasses.replace(FAST, heartbeat_interval=60.0, peer_timeout=300.0)
    path = hf_models["lfm2"].path
    server = start_cached(monkeypatch, path, 1, prefill_hosts, num_pages=16, config=slow)
    try:
        with DecodeNode(path, 1, [server.address], num_pages=16, config=slow,
                        launcher=decode_hosts.launcher()) as node:
            wait_until(lambda: server.node_id in _held(node), 30, "the handshake")
            assert _held(node)[server.node_id] == 0
            run_all(node.address, [_rng_tokens(70, 25)])
            wait_until(lambda: _held(node)[server.node_id] > 0, 2, "the announcement")
            assert _held(node)[server.node_id] == server.stats()["pages_cached"]
    finally:
        server.close()


@pytest.mark.timeout(300)
def test_request_timing_carries_the_cached_tokens(pools, hf_models, monkeypatch):
    """TransferTimes.cached_tokens reaches the decode coordinator's RequestTiming; a decode
    coordinator with ``prefix_cache=False`` neither hits nor leaves checkpoints."""
    from statebridge.connector.decode import DecodeCoordinator
    from statebridge.state import StateSpec

    prefill_hosts, decode_hosts = pools
    path = hf_models["lfm2"].path
    server = start_cached(monkeypatch, path, 1, prefill_hosts, num_pages=16)
    spec = StateSpec.from_pretrained(path)
    try:
        for cache_on, expected in [(True, [0, 24]), (False, [0, 0])]:
            timings = []
            with DecodeCoordinator(spec, 1, "LDS", 8, config=FAST, prefix_cache=cache_on,
                                   launcher=decode_hosts.launcher()) as coordinator:
                coordinator.on_timing(timings.append)
                coordinator.connect(server.address)
                prompt = _rng_tokens(70 + cache_on, 29)
                for i in range(2):
                    result = coordinator.submit(f"r{i}", prompt).result(60)
                    coordinator.release(result)
                    wait_until(lambda: len(timings) == i + 1, 10, "the request's timing")
                assert [t.cached_tokens for t in timings] == expected
            if not cache_on:
                assert server.stats()["prefix_hits"] == 24        # the first coordinator's
        assert_no_leak(server)
    finally:
        server.close()
