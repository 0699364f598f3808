"""Limits, each a typed error naming the value: message size, prompt length, requests in flight
per peer, and page exhaustion (back-pressure on both sides, never a crash).

Message size at live sockets is fuzzed in test_fuzz_live.py (frames over max_message_bytes get
a typed Error); here the codec and config halves. One prefill server (ONE page, a slow
synthetic model, at most 2 requests in flight or queued per peer) and one decode node (3 pages,
prompts of at most 8 tokens) serve every test of the module.
"""

from __future__ import annotations

import json
import re
import uuid

import pytest

from statebridge.config import ConnectorConfig
from statebridge.connector import messages as m
from statebridge.connector.prefill import PrefillServer
from statebridge.errors import BusyError, CacheFullError, ConfigError, ProtocolError
from statebridge.node.client import Client
from statebridge.node.decode_node import DecodeNode
from statebridge.state.spec import StateSpec
from statebridge.testing.hosts import RankHostPool

from ._helpers import FAST, log_to_stderr, wait_until

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

SLOW = "tests.connector._helpers:SlowModel"           # 0.5 s per prefill
CONFIG_JSON = {"model_type": "lfm2", "hidden_size": 24, "conv_L_cache": 3,
               "torch_dtype": "bfloat16", "layer_types": ["conv", "conv"], "vocab_size": 32}
DECODE_PAGES = 3
MAX_INFLIGHT = 2
MAX_PROMPT = 8


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("model")
    (model_dir / "config.json").write_text(json.dumps(CONFIG_JSON))
    spec = StateSpec.from_pretrained(str(model_dir))
    config = FAST.replace(peer_timeout=3.0, max_inflight_per_peer=MAX_INFLIGHT)
    with RankHostPool(1, initializer=log_to_stderr) as hosts, \
            PrefillServer(spec, 1, "DLS", num_pages=1, config=config, model=SLOW,
                          launcher=hosts.launcher()) as server:
        server.wait_ready()
        node = DecodeNode(str(model_dir), 1, [server.address], num_pages=DECODE_PAGES,
                          config=config, launcher=hosts.launcher(), max_prompt_len=MAX_PROMPT,
                          rank_model="statebridge.testing.models:SyntheticModel")
        try:
            yield server, node.coordinator, node
        finally:
            node.close()


def rid() -> str:
    return f"lim-{uuid.uuid4().hex[:6]}"


def check(decode, future, request_id):
    result = future.result(timeout=30)
    assert result.request_id == request_id and result.nbytes > 0
    return result


def test_message_size_limit_names_both_sizes():
    data = m.encode(m.Heartbeat(node_id="n" * 200, seq=1))
    with pytest.raises(ProtocolError, match=f"message of {len(data)} bytes exceeds the limit "
                                            f"of {len(data) - 1}"):
        m.decode(data, max_bytes=len(data) - 1)
    assert m.decode(data, max_bytes=len(data)) == m.Heartbeat(node_id="n" * 200, seq=1)
    for bad in (0, -5, True, 1.5):
        with pytest.raises(ConfigError, match=f"max_message_bytes must be a positive integer, "
                                              f"got {bad!r}"):
            ConnectorConfig(max_message_bytes=bad)
    with pytest.raises(ConfigError, match="max_inflight_per_peer .* got 0"):
        ConnectorConfig(max_inflight_per_peer=0)
    for bad in (-0.001, 0.6, True, "5ms"):
        with pytest.raises(ConfigError, match=f"send_reap_interval must be 0 to "
                                              f"heartbeat_interval \\(0.5\\) seconds, got "
                                              f"{re.escape(repr(bad))}"):
            ConnectorConfig(send_reap_interval=bad)
    assert ConnectorConfig(send_reap_interval=0).send_reap_interval == 0
    assert ConnectorConfig.from_env({"STATEBRIDGE_SEND_REAP_INTERVAL": "0.002"}) \
        .send_reap_interval == 0.002


@pytest.mark.timeout(60)
def test_prompt_over_max_prompt_len_is_refused_with_the_numbers(nodes):
    _, _, node = nodes
    with Client(node.address, timeout=30) as client:
        with pytest.raises(ConfigError, match=f"prompt of {MAX_PROMPT + 1} tokens exceeds the "
                                              f"limit of {MAX_PROMPT}"):
            client.generate(list(range(MAX_PROMPT + 1)), max_new_tokens=1)
    assert node.counters.get("rejected") >= 1
    assert node.coordinator.stats()["pages_used"] == 0          # refused before any page


@pytest.mark.timeout(60)
def test_a_token_id_beyond_int32_is_refused_with_the_value(nodes):
    """Prompts travel as int32 token bytes: an id that does not fit (here also beyond the
    vocabulary, which the node checks first) is the caller's error, named, and nothing is
    held."""
    _, _, node = nodes
    with Client(node.address, timeout=30) as client:
        with pytest.raises(ConfigError, match=r"token id 2147483648 is outside"):
            client.generate([1, 2**31, 3], max_new_tokens=1)
    assert node.coordinator.stats()["pages_used"] == 0


@pytest.mark.timeout(90)
def test_prefill_page_exhaustion_queues_then_serves(nodes):
    server, decode, _ = nodes
    before = server.stats().get("waiting_for_pages", 0)
    ids = [rid(), rid()]
    futures = [decode.submit(i, [1, 2, 3]) for i in ids]       # one prefill page: 2nd waits
    wait_until(lambda: server.stats().get("waiting_for_pages", 0) == before + 1, 10,
               "second request queued for a prefill page")
    for i, f in zip(ids, futures):
        decode.release(check(decode, f, i))
    wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill page freed")
    assert server.stats()["waiting"] == 0 and server.stats()["healthy"]


@pytest.mark.timeout(90)
def test_inflight_limit_per_peer_counts_queued_requests(nodes):
    server, decode, _ = nodes
    ids = [rid() for _ in range(MAX_INFLIGHT + 1)]
    futures = [decode.submit(i, [4, 5]) for i in ids]   # 1 computing + 1 queued = the limit
    # The prefill peer's refusal reaches the caller as its own kind: back-pressure, retry.
    with pytest.raises(BusyError, match=f"1 requests in flight and 1 queued from "
                                            f"{decode.node_id} \\(limit {MAX_INFLIGHT}\\)"):
        futures[-1].result(timeout=30)
    assert server.stats()["rejected_busy"] >= 1
    for i, f in zip(ids, futures[:-1]):
        decode.release(check(decode, f, i))
    # The peer is below its limit again: served.
    i = rid()
    decode.release(check(decode, decode.submit(i, [6]), i))
    wait_until(lambda: decode.stats()["pages_used"] == 0, 10, "decode pages freed")


@pytest.mark.timeout(90)
def test_decode_page_exhaustion_is_back_pressure(nodes):
    server, decode, _ = nodes
    held = []
    for _ in range(DECODE_PAGES):
        i = rid()
        held.append(check(decode, decode.submit(i, [7, 8]), i))
    with pytest.raises(CacheFullError, match=f"all {DECODE_PAGES} pages are in use"):
        decode.submit(rid(), [9])
    assert decode.stats()["healthy"]
    decode.release(held.pop())
    i = rid()
    held.append(check(decode, decode.submit(i, [9]), i))       # a page came back: served
    for result in held:
        decode.release(result)
    wait_until(lambda: decode.stats()["pages_used"] == 0, 10, "decode pages freed")
    assert server.stats()["pages_used"] == 0
