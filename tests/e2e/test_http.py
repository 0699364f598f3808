"""The OpenAI-compatible HTTP front door against a live prefill node (TP 1) and decode node
(TP 2) serving a tiny LFM2 checkpoint with attention layers and its tokenizer, driven by the
official ``openai`` client (and httpx for raw SSE and disconnects)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

from statebridge.config import HttpConfig, NodeConfig
from statebridge.models.checkpoint import make_checkpoint
from statebridge.net import free_port
from statebridge.node.client import Client
from statebridge.node.decode_node import DecodeNode
from statebridge.node.text import TextTokenizer

from tests.connector._helpers import wait_until

from ._helpers import FAST

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

KEY = "sk-statebridge-test"
PAGES = 16
MAX_NEW = 256


class Served:
    def __init__(self, model, tok, server, node):
        self.model, self.tok, self.server, self.node = model, tok, server, node
        self.url = node.http.url
        self.name = node.http.model_name

    def client(self, key=KEY, **kwargs) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0,
                             timeout=60, **kwargs)

    def generate_cli(self, prompt_ids, **kwargs) -> list[int]:
        """What `statebridge generate --json` returns for these ids."""
        args = [sys.executable, "-m", "statebridge", "generate", "--decode", self.node.address,
                "--prompt-ids", ",".join(map(str, prompt_ids)), "--json"]
        for name, value in kwargs.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n"))
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])["tokens"]

    def expected(self, tokens: list[int]) -> tuple[str, str, int]:
        """(text, finish_reason, completion tokens) the API must give for ``tokens``."""
        eos = [i for i, t in enumerate(tokens) if t in self.tok.eos_token_ids]
        if eos:
            return self.tok.decode(tokens[:eos[0]]), "stop", eos[0] + 1
        return self.tok.decode(tokens), "length", len(tokens)

    def idle(self) -> bool:
        co = self.node.stats()["coordinator"]
        return co["pages_used"] == 0 and co["blocks_used"] == 0


@pytest.fixture(scope="module")
def served(live_pair, tmp_path_factory):
    model = str(make_checkpoint("lfm2-hybrid", tmp_path_factory.mktemp("http") / "lfm2h-tiny"))
    with live_pair(model, num_pages=PAGES, kv_blocks=128, max_prompt_len=64,
                   max_new_tokens=MAX_NEW,
                   # The zmq door too (these tests compare both doors): with an API key and
                   # no CURVE keys it is off unless asked for.
                   node=NodeConfig(front_door="on"),
                   http=HttpConfig(port=0, api_key=KEY)) as (server, node):
        yield Served(model, TextTokenizer.from_dir(model), server, node)


PROMPT = "The old man rowed down the river"


def test_models_and_health(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [served.name] == ["lfm2h-tiny"]
    health = httpx.get(f"{served.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_text_equals_the_decoded_tokens_of_generate(served):
    ids = served.tok.encode(PROMPT)
    sampled = dict(temperature=0.8, top_p=0.9, seed=1234)
    tokens = served.generate_cli(ids, max_new_tokens=24, **sampled)
    text, finish, count = served.expected(tokens)
    out = served.client().completions.create(model=served.name, prompt=PROMPT, max_tokens=24,
                                             **sampled)
    (choice,) = out.choices
    assert (choice.text, choice.finish_reason) == (text, finish)
    assert text                                   # a real check, not "" == ""
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == count
    assert out.usage.total_tokens == len(ids) + count
    # The same prompt as token ids, and a batch of both: the same text.
    batch = served.client().completions.create(model=served.name, prompt=[PROMPT, PROMPT],
                                               max_tokens=24, **sampled)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [text, text]
    by_ids = served.client().completions.create(model=served.name, prompt=ids, max_tokens=24,
                                                **sampled)
    assert by_ids.choices[0].text == text
    wait_until(served.idle, 10, "page and blocks freed")   # the answer can beat the free


def test_chat_completion_uses_the_chat_template(served):
    messages = [{"role": "user", "content": "How many days are there in a week?"}]
    ids = served.tok.encode(served.tok.apply_chat_template(messages))
    tokens = served.generate_cli(ids, max_new_tokens=20, seed=7)         # greedy
    text, finish, count = served.expected(tokens)
    out = served.client().chat.completions.create(model=served.name, messages=messages,
                                                  max_tokens=20, temperature=0, seed=7)
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert (choice.message.content, choice.finish_reason) == (text, finish)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == count


def test_streaming_yields_the_same_text_chunk_by_chunk(served):
    client = served.client()
    full = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=30,
                                     temperature=0).choices[0]
    chunks = list(client.completions.create(model=served.name, prompt=PROMPT, max_tokens=30,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 3                       # really chunk by chunk
    assert "".join(texts) == full.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.finish_reason
    assert chunks[-1].usage.completion_tokens == 30 or full.finish_reason == "stop"

    messages = [{"role": "user", "content": "Hello! How are you today?"}]
    whole = client.chat.completions.create(model=served.name, messages=messages,
                                           max_tokens=25, temperature=0).choices[0]
    deltas = list(client.chat.completions.create(model=served.name, messages=messages,
                                                 max_tokens=25, temperature=0, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == whole.message.content
    assert deltas[-1].choices[0].finish_reason == whole.finish_reason

    # The raw stream: server-sent events ending in data: [DONE].
    with httpx.stream("POST", f"{served.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": PROMPT, "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    wait_until(served.idle, 10, "page and blocks freed")   # the answer can beat the free


def test_eight_concurrent_streaming_clients(served):
    prompts = ["Good morning", "The river", "How many hours are there in a day?", "Hello!",
               "The library of the town", "Numbers: 1 2 3", "Spring came back", "Yes, that"]

    def expected(prompt):
        with Client(served.node.address) as c:
            tokens = c.generate(served.tok.encode(prompt), max_new_tokens=16).tokens
        return served.expected(tokens)[:2]

    def stream(prompt):
        chunks = served.client().completions.create(model=served.name, prompt=prompt,
                                                    max_tokens=16, temperature=0, stream=True)
        pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks]
        return "".join(t for t, _ in pieces), pieces[-1][1]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(stream, prompts))
    assert got == [expected(p) for p in prompts]
    wait_until(served.idle, 10, "page and blocks freed")   # the answer can beat the free


def _error(call):
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def test_bad_requests_are_400_in_the_openai_shape(served):
    client = served.client()
    cases = [
        (dict(prompt=PROMPT, max_tokens=MAX_NEW + 1), "max_tokens"),
        (dict(prompt=PROMPT, max_tokens=4, extra_body={"temperature": "hot"}), "temperature"),
        (dict(prompt="word " * 100, max_tokens=4), "prompt"),
        (dict(prompt=[1, 2, 10 ** 6], max_tokens=4), "prompt"),
        (dict(prompt=PROMPT, max_tokens=4, n=2), "n"),
        (dict(prompt=PROMPT, max_tokens=4, echo=True), "echo"),
    ]
    for kwargs, param in cases:
        e = _error(lambda: client.completions.create(model=served.name, **kwargs))
        assert e.status_code == 400, kwargs
        assert isinstance(e, openai.BadRequestError)
        assert e.body["type"] == "invalid_request_error" and e.body["param"] == param, e.body
        assert e.body["message"]
    e = _error(lambda: client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4))
    assert e.status_code == 400 and e.body["code"] == "model_not_found"
    raw = httpx.post(f"{served.url}/v1/completions", content=b"{not json", timeout=10,
                     headers={"Authorization": f"Bearer {KEY}"})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param",
                                                                  "code"}
    wait_until(served.idle, 10, "page and blocks freed")   # the answer can beat the free


def test_a_missing_or_wrong_api_key_is_401(served):
    e = _error(lambda: served.client(key="sk-wrong").completions.create(
        model=served.name, prompt=PROMPT, max_tokens=2))
    assert isinstance(e, openai.AuthenticationError) and e.status_code == 401
    assert e.body["type"] == "authentication_error"
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=10,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200   # open


def test_a_stop_string_ends_the_text_and_frees_the_page(served):
    full = served.client().completions.create(model=served.name, prompt=PROMPT,
                                              max_tokens=40, temperature=0).choices[0].text
    assert len(full) > 12
    stop = full[8:11]
    before = served.node.stats().get("finished_aborted", 0)
    out = served.client().completions.create(model=served.name, prompt=PROMPT, max_tokens=40,
                                             temperature=0, stop=[stop]).choices[0]
    assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
    wait_until(served.idle, 10, "page and blocks freed after a stop string")
    assert served.node.stats().get("finished_aborted", 0) == before + 1     # cut at the node


def test_a_client_disconnect_mid_stream_aborts_and_leaks_no_page(served, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    before = served.node.stats().get("finished_aborted", 0)
    with httpx.stream("POST", f"{served.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0,
                            "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or not line for line in got)
        assert served.node.stats()["coordinator"]["pages_used"] == 1      # still generating
    wait_until(served.idle, 10, "page and blocks freed after the client left")
    stats = served.node.stats()
    assert stats["finished_aborted"] == before + 1
    assert stats["running"] == 0 and stats["waiting"] == 0
    # A client that leaves is routine: one DEBUG line, no ERROR traceback.
    http_side = [r for r in caplog.records if r.name.startswith(("statebridge.node", "uvicorn",
                                                                 "asyncio", "starlette"))]
    assert [r for r in http_side if r.levelno >= logging.WARNING] == []
    assert len([r for r in http_side if "disconnect" in r.getMessage()]) == 1


def test_only_the_door_that_sent_a_request_can_abort_it(served):
    """An HTTP request and a zmq client meet in one front door: the zmq client's abort of the
    HTTP request's id is refused (counted) and the stream runs to its end."""
    import zmq

    from statebridge.connector import control as c
    from statebridge.connector import messages as m
    from statebridge.node import messages as nm

    node = served.node
    before = node.stats().get("abort_unknown", 0)
    with httpx.stream("POST", f"{served.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0,
                            "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        (request_id,) = node.loop.call(lambda: list(node.scheduler.gens))
        sock = c.connect_dealer(zmq.Context.instance(), node.address)
        try:
            sock.send(m.encode(nm.AbortRequest(request_id=request_id, reason="not mine")))
            wait_until(lambda: node.stats().get("abort_unknown", 0) == before + 1, 10,
                       "the foreign abort refused")
        finally:
            sock.close(0)
        assert node.loop.call(lambda: request_id in node.scheduler.gens)      # still generating
        rest = [line for line in lines if line.startswith("data: {")]
    assert json.loads(rest[-1][6:])["usage"]["completion_tokens"] == MAX_NEW
    wait_until(served.idle, 10, "page and blocks freed")


def _scrape(served) -> dict:
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_counters_move_by_exactly_the_requests_sent(served):
    before = _scrape(served)
    client = served.client()
    for prompt in ("Good morning", "Hello!", "The river"):
        client.completions.create(model=served.name, prompt=prompt, max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    client.chat.completions.create(model=served.name, max_tokens=3, temperature=0,
                                   messages=[{"role": "user", "content": "Hi"}],
                                   extra_body={"ignore_eos": True})
    _error(lambda: client.completions.create(model=served.name, prompt=PROMPT,
                                             max_tokens=MAX_NEW + 1))
    _error(lambda: served.client(key="nope").completions.create(model=served.name,
                                                                prompt=PROMPT, max_tokens=1))
    after = _scrape(served)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("statebridge_requests_total", endpoint="completions", outcome="ok") == 3
    assert delta("statebridge_requests_total", endpoint="chat_completions", outcome="ok") == 1
    assert delta("statebridge_requests_total", endpoint="completions",
                 outcome="invalid_request") == 1
    assert delta("statebridge_requests_total", endpoint="completions",
                 outcome="unauthorized") == 1
    assert delta("statebridge_generation_tokens_total") == 3 * 5 + 3
    assert delta("statebridge_prompt_tokens_total") == sum(
        len(served.tok.encode(p)) for p in ("Good morning", "Hello!", "The river")) + len(
        served.tok.encode(served.tok.apply_chat_template([{"role": "user", "content": "Hi"}])))
    assert delta("statebridge_time_to_first_token_seconds_count") == 4
    assert delta("statebridge_inter_token_latency_seconds_count") == 3 * 4 + 2
    # (The node's transfer timing joins the prefill side's report, which may come a little
    # after the answer.)
    wait_until(lambda: _scrape(served).get(("statebridge_transfer_seconds_count", ()), 0) -
               before.get(("statebridge_transfer_seconds_count", ()), 0) == 4, 10,
               "four transfers timed")
    after = _scrape(served)
    assert delta("statebridge_transfer_bytes_count") == 4
    assert delta("statebridge_transfer_seconds_count") == 4
    assert after[("statebridge_pages_used", ())] == 0
    assert after[("statebridge_pages_free", ())] == PAGES
    assert after[("statebridge_kv_blocks_used", ())] == 0
    assert after[("statebridge_kv_blocks_free", ())] == 128
    assert after[("statebridge_prefill_peers_connected", ())] == 1
    assert after[("statebridge_refused_peers_total", ())] == 0
    assert after[("statebridge_node_ready", ())] == 1


def test_before_any_prefill_node_is_up_health_and_requests_are_503(pools, served):
    _, decode_hosts = pools
    nowhere = f"127.0.0.1:{free_port()}"
    with DecodeNode(served.model, 2, [nowhere], num_pages=4, config=FAST, kv_blocks=32,
                    launcher=decode_hosts.launcher(), wait_prefill=0,
                    http=HttpConfig(port=0)) as node:
        health = httpx.get(f"{node.http.url}/health", timeout=10)
        assert health.status_code == 503 and "Retry-After" in health.headers
        assert "prefill" in health.json()["error"]["message"]
        client = openai.OpenAI(base_url=f"{node.http.url}/v1", api_key="none", max_retries=0)
        e = _error(lambda: client.completions.create(model=node.http.model_name, prompt=PROMPT,
                                                     max_tokens=2))
        assert e.status_code == 503 and e.response.headers["Retry-After"]
        assert e.body["type"] == "service_unavailable_error" and e.body["code"] == "not_ready"
        assert node.stats()["coordinator"]["pages_used"] == 0
