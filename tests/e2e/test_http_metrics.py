"""/metrics of a live pair, parsed with ``prometheus_client``'s own parser: names and types,
and that each histogram moves by exactly the requests sent, by amounts that respect the order
of a request's events (queue, then prefill compute, then the transfer, then the first token).

The prefill ranks run the real model with a fixed delay added to every prefill
(:class:`tests.e2e._helpers.SlowPrefillModel`), so prefill compute is long and known: the
transfer time, measured from the first byte posted, must not contain it (it once counted
from submit to every decode rank ready)."""

from __future__ import annotations

import pytest

from statebridge.config import HttpConfig, NodeConfig
from statebridge.models.checkpoint import make_checkpoint
from statebridge.net import free_port
from statebridge.node.client import Client
from statebridge.node.decode_node import DecodeNode
from statebridge.node.text import TextTokenizer
from statebridge.testing.hosts import RankHostPool

from tests.connector._helpers import log_to_stderr, wait_until

from ._helpers import FAST

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

DELAY_S = 0.4                       # added to every prefill (the prefill ranks' env)
PROMPT = "The old man rowed down the river"

HISTOGRAMS = {
    # HTTP server, from the request's arrival there
    "statebridge_time_to_first_token_seconds", "statebridge_inter_token_latency_seconds",
    "statebridge_request_time_per_output_token_seconds", "statebridge_e2e_request_latency_seconds",
    "statebridge_request_decode_time_seconds",
    # decode node, from where each event happened
    "statebridge_request_queue_time_seconds", "statebridge_request_prefill_time_seconds",
    "statebridge_transfer_seconds", "statebridge_transfer_bytes",
}
COUNTERS = {"statebridge_requests", "statebridge_request_success", "statebridge_prompt_tokens",
            "statebridge_generation_tokens"}


@pytest.fixture(scope="module")
def pools():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", str(DELAY_S))   # read by the host processes
        with RankHostPool(1, initializer=log_to_stderr) as prefill_hosts, \
                RankHostPool(2, initializer=log_to_stderr) as decode_hosts:
            yield prefill_hosts, decode_hosts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_checkpoint("lfm2-hybrid", tmp_path_factory.mktemp("metrics") / "m"))


@pytest.fixture(scope="module")
def node(live_pair, model):
    with live_pair(model, num_pages=8, kv_blocks=64,
                   prefill_model="tests.e2e._helpers:SlowPrefillModel", max_prompt_len=64,
                   max_new_tokens=32, node=NodeConfig(front_door="on"),
                   http=HttpConfig(port=0)) as (_, node):
        node.tok = TextTokenizer.from_dir(model)
        yield node


def scrape(node) -> tuple[dict, dict]:
    """({(sample name, labels): value}, {family name: type})."""
    text = httpx.get(f"{node.http.url}/metrics", timeout=10).text
    samples, types = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


class Delta:
    def __init__(self, before: dict, after: dict) -> None:
        self.before, self.after = before, after

    def __call__(self, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self.after.get(key, 0) - self.before.get(key, 0)


def test_names_and_types(node):
    Client(node.address).generate(node.tok.encode(PROMPT), max_new_tokens=2)
    _, types = scrape(node)
    assert {n for n in HISTOGRAMS if types.get(n) == "histogram"} == HISTOGRAMS
    assert {n for n in COUNTERS if types.get(n) == "counter"} == COUNTERS
    assert types["statebridge_pages_used"] == "gauge"


def test_an_http_request_moves_every_histogram_by_one(node):
    before, _ = scrape(node)
    client = openai.OpenAI(base_url=f"{node.http.url}/v1", api_key="none", max_retries=0)
    out = client.completions.create(model=node.http.model_name, prompt=PROMPT, max_tokens=6,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6
    wait_until(lambda: Delta(before, scrape(node)[0])(
        "statebridge_transfer_seconds_count") == 1, 10, "the transfer timing joined")
    d = Delta(before, scrape(node)[0])
    for name in HISTOGRAMS - {"statebridge_inter_token_latency_seconds"}:
        assert d(f"{name}_count") == 1, name
    assert d("statebridge_inter_token_latency_seconds_count") == 5
    assert d("statebridge_request_success_total", finished_reason="length") == 1
    assert d("statebridge_generation_tokens_total") == 6
    assert d("statebridge_prompt_tokens_total") == out.usage.prompt_tokens
    ttft = d("statebridge_time_to_first_token_seconds_sum")
    queue = d("statebridge_request_queue_time_seconds_sum")
    prefill = d("statebridge_request_prefill_time_seconds_sum")
    transfer = d("statebridge_transfer_seconds_sum")
    # The events happen one after the other, each timed where it happens.
    assert prefill >= DELAY_S
    assert queue + prefill + transfer <= ttft
    assert transfer < DELAY_S                  # no prefill compute in it
    assert d("statebridge_e2e_request_latency_seconds_sum") >= ttft + d(
        "statebridge_request_decode_time_seconds_sum") - 1e-3
    # The buckets are cumulative and end in +Inf = count.
    after = scrape(node)[0]
    le = sorted(((float(dict(k[1])["le"]), v) for k, v in after.items()
                 if k[0] == "statebridge_transfer_seconds_bucket"))
    assert [v for _, v in le] == sorted(v for _, v in le)
    assert le[-1] == (float("inf"), after[("statebridge_transfer_seconds_count", ())])


def test_a_zmq_request_is_timed_too_and_its_bytes_match(node):
    before, _ = scrape(node)
    with Client(node.address) as c:
        gen = c.generate(node.tok.encode(PROMPT), max_new_tokens=3)
    wait_until(lambda: Delta(before, scrape(node)[0])(
        "statebridge_transfer_seconds_count") == 1, 10, "the transfer timing joined")
    d = Delta(before, scrape(node)[0])
    assert d("statebridge_transfer_bytes_sum") == gen.transfer_bytes > 0
    assert d("statebridge_request_queue_time_seconds_count") == 1
    # The node's own TTFT (from its arrival) holds all three; the submit-to-ready span the
    # client reports holds the prefill compute, the transfer metric does not.
    transfer = d("statebridge_transfer_seconds_sum")
    prefill = d("statebridge_request_prefill_time_seconds_sum")
    assert d("statebridge_request_queue_time_seconds_sum") + prefill + transfer <= gen.ttft
    assert gen.transfer_seconds >= prefill + transfer
    # HTTP histograms count HTTP requests only.
    assert d("statebridge_time_to_first_token_seconds_count") == 0


def test_a_local_recompute_is_timed_without_a_transfer(pools, model, node):
    """With no prefill node, the recompute policy prefills on the decode ranks: queue and
    prefill times come from them, and no transfer is counted."""
    _, decode_hosts = pools
    nowhere = f"127.0.0.1:{free_port()}"
    with DecodeNode(model, 2, [nowhere], num_pages=4, config=FAST, kv_blocks=32,
                    launcher=decode_hosts.launcher(), wait_prefill=0, policy="recompute",
                    max_prompt_len=64, max_new_tokens=8, node=NodeConfig(front_door="on"),
                    http=HttpConfig(port=0)) as local:
        local.wait_ready(30)
        before, _ = scrape(local)
        with Client(local.address) as c:
            gen = c.generate(node.tok.encode(PROMPT), max_new_tokens=2)
        assert gen.recomputed
        d = Delta(before, scrape(local)[0])
        assert d("statebridge_request_queue_time_seconds_count") == 1
        assert d("statebridge_request_prefill_time_seconds_count") == 1
        assert 0 < d("statebridge_request_prefill_time_seconds_sum") <= gen.ttft
        assert d("statebridge_transfer_seconds_count") == 0
        assert d("statebridge_transfer_bytes_count") == 0
