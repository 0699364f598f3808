"""Prefix caching as users see it, on a live pair (prefill TP 1 -> decode TP 2, the cache on by
default): a second prompt sharing a prefix longer than one checkpoint stride reports the
checkpoint's tokens as ``cached_tokens`` through the zmq client, and keeps one where it
branches off the first, which a third prompt reports; the next turn of a chat starts from the
previous prompt's end through the HTTP API (the official ``openai`` client); /metrics'
prefix-cache counters move by the prompt and cached tokens."""

from __future__ import annotations

import random

import pytest

from statebridge.config import HttpConfig, NodeConfig
from statebridge.models.checkpoint import make_checkpoint
from statebridge.node.client import Client

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

STRIDE = 256                                  # --prefix-checkpoint-tokens' default
BLOCK = 16                                    # NodeConfig's default --block-size


@pytest.fixture(scope="module")
def node(live_pair, tmp_path_factory):
    model = str(make_checkpoint("lfm2-hybrid", tmp_path_factory.mktemp("prefix") / "m"))
    # 16 pages: the cache's half holds every checkpoint these prompts leave (nothing evicted)
    with live_pair(model, num_pages=16, kv_blocks=192, max_prompt_len=512, max_new_tokens=8,
                   node=NodeConfig(front_door="on"), http=HttpConfig(port=0)) as (_, node):
        yield node


def counters(node) -> tuple[float, float]:
    text = httpx.get(f"{node.http.url}/metrics", timeout=10).text
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return got["statebridge_prefix_cache_queries_total"], got["statebridge_prefix_cache_hits_total"]


def test_a_shared_prefix_reports_its_checkpoint_as_cached_tokens(node):
    rng = random.Random(41)
    shared = [rng.randrange(3, 256) for _ in range(STRIDE + 40)]
    first = shared + [rng.randrange(3, 256) for _ in range(8)]
    second = shared[:STRIDE + 20] + [rng.randrange(3, 256) for _ in range(12)]
    third = shared[:STRIDE + 20] + [rng.randrange(3, 256) for _ in range(10)]
    branch = (STRIDE + 20) // BLOCK * BLOCK           # the full blocks second shares with first
    queries, hits = counters(node)
    with Client(node.address, timeout=60) as client:
        a = client.generate(first, max_new_tokens=4)
        assert a.cached_tokens == 0                       # nothing cached before it
        b = client.generate(second, max_new_tokens=4)
        # The shared part holds one stride checkpoint: the hit ends there, not where the
        # prompts part (inside the next stride); second keeps a checkpoint there.
        assert b.cached_tokens == STRIDE
        c = client.generate(third, max_new_tokens=4)
        assert c.cached_tokens == branch
        reference = client.generate(third, max_new_tokens=4)      # the same prompt again
    assert c.tokens == reference.tokens
    assert counters(node) == (queries + len(first) + len(second) + 2 * len(third),
                              hits + STRIDE + branch + reference.cached_tokens)

    # HTTP, the official client: turn 2 of a chat repeats turn 1's prompt and goes on; its
    # hit ends at turn 1's end checkpoint (all but its last token) or a stride before.
    api = openai.OpenAI(base_url=f"{node.http.url}/v1", api_key="none", max_retries=0)
    turn2 = first + a.tokens + [rng.randrange(3, 256) for _ in range(5)]
    queries, hits = counters(node)
    out = api.completions.create(model=node.http.model_name, prompt=turn2, max_tokens=3,
                                 temperature=0)
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached in (STRIDE, len(first) - 1), cached
    chunks = list(api.completions.create(model=node.http.model_name, prompt=turn2,
                                         max_tokens=3, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    streamed = chunks[-1].usage.prompt_tokens_details.cached_tokens
    # The same prompt again: the prefill node computes prompt[:-1] (the decode node runs the
    # last token) and at least one token of that, so the checkpoint at its end is not usable
    # and the hit is the one before it -- the first's again.
    assert streamed == cached
    assert counters(node) == (queries + 2 * len(turn2), hits + cached + streamed)
