"""The HTTP app without processes: a fake node link answers in place of the decode node; and
the in-process NodeLink against a stand-in node with a real event loop thread."""

from __future__ import annotations

import json
import threading

import pytest

from statebridge.config import HttpConfig
from statebridge.connector import control as c
from statebridge.models.checkpoint import make_checkpoint
from statebridge.node import messages as nm
from statebridge.node.http import NodeLink, build_app
from statebridge.node.text import TextTokenizer

from tests.connector._helpers import wait_until

testclient = pytest.importorskip("starlette.testclient")


class FakeStream:
    def __init__(self, link, request):
        self.link, self.request, self.done = link, request, False
        self.left = list(link.tokens[:request.max_new_tokens])

    async def next(self, timeout):
        if self.link.kind:
            self.done = True
            return self._msg((), True, self.link.kind)
        token = self.left.pop(0)
        self.done = not self.left
        return self._msg((token,), self.done, "")

    def _msg(self, tokens, done, kind):
        return nm.GenerateTokens(request_id=self.request.request_id, tokens=tokens, done=done,
                                 kind=kind, message=f"{kind} says the fake", ttft=0.0,
                                 transfer_seconds=0.001, transfer_bytes=100, recomputed=False,
                                 cached_tokens=self.link.cached if done else 0)

    def close(self, reason=""):
        if not self.done:
            self.link.aborted.append(self.request.request_id)
        self.done = True


class FakeLink:
    def __init__(self, tokens, kind="", cached=0):
        self.tokens, self.kind, self.aborted, self.requests = tokens, kind, [], []
        self.cached = cached                # the last message's cached_tokens

    async def start(self):
        pass

    async def close(self):
        pass

    async def stats(self, timeout):
        return nm.NodeStats(node_id="fake", ready=not self.kind, reason=self.kind,
                            prefill_nodes=("p",), pages_used=0, pages_free=4, blocks_used=0,
                            blocks_free=8, running=0, waiting=0, refused_peers=0, aborted=0)

    def open(self, request):
        self.requests.append(request)
        return FakeStream(self, request)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("http") / "m"
    make_checkpoint("lfm2", out, preset="tiny")
    return TextTokenizer.from_dir(out)


def client(tok, link, **config):
    app = build_app(link, tok, HttpConfig(port=0, **config), model_name="m",
                    max_prompt_len=32, max_new_tokens=8, max_inflight=2)
    return testclient.TestClient(app)


def test_text_usage_and_stop_abort_at_the_node(tok):
    tokens = tok.encode(" and the river ran on")
    link = FakeLink(tokens)
    with client(tok, link) as http:
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == tok.decode(tokens[:8])
        assert body["usage"]["completion_tokens"] == min(8, len(tokens))
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8,
                                               "stop": "river"})
        assert r.json()["choices"][0] == {"index": 0, "text": " and the ", "logprobs": None,
                                          "finish_reason": "stop"}
        assert link.aborted == [link.requests[-1].request_id]     # the rest cut at the node


def test_cached_tokens_in_usage_through_the_openai_client(tok):
    """The node's cached_tokens (its last message's) is usage.prompt_tokens_details
    .cached_tokens (OpenAI's field) of both endpoints, streamed in the usage chunk too."""
    openai = pytest.importorskip("openai")
    link = FakeLink(tok.encode(" and the river ran on"), cached=256)
    with client(tok, link) as http:
        api = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        out = api.completions.create(model="m", prompt="Hi", max_tokens=3)
        assert out.usage.prompt_tokens_details.cached_tokens == 256
        out = api.chat.completions.create(model="m", max_tokens=3, messages=[
            {"role": "user", "content": "Hi"}])
        assert out.usage.prompt_tokens_details.cached_tokens == 256
        chunks = list(api.chat.completions.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "Hi"}], stream=True,
            stream_options={"include_usage": True}))
        assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 256
        # Two prompts (n=2 or a prompt list): the sum of theirs.
        out = api.completions.create(model="m", prompt=["Hi", "Ho"], max_tokens=3)
        assert out.usage.prompt_tokens_details.cached_tokens == 512
        link.cached = 0
        out = api.completions.create(model="m", prompt="Hi", max_tokens=3)
        assert out.usage.prompt_tokens_details.cached_tokens == 0


def _events(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_every_token_gets_a_chunk_even_without_text(tok):
    """Special tokens decode to nothing, the first byte of a multi-byte character to nothing
    yet: each still gets its chunk (the token count never drops), and the texts add up."""
    specials = [i for i in range(tok.vocab_size) if not tok.decode([i])][:2]
    split = [t for t in tok.encode("é") if not tok.decode([t])]
    tokens = tok.encode(" a") + specials + tok.encode(" b") + tok.encode("é") + specials[:1]
    assert len(specials) == 2 and split, "the tokenizer has tokens without text of their own"
    link = FakeLink(tokens)
    with client(tok, link) as http:
        with http.stream("POST", "/v1/completions", json={
                "prompt": "Hi", "max_tokens": 8, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}) as r:
            events = _events(r)
        chunks = [e["choices"][0] for e in events if e["choices"]]
        assert len(chunks) == events[-1]["usage"]["completion_tokens"] == len(tokens)
        assert [c["token_ids"] for c in chunks] == [[t] for t in tokens]
        assert "".join(c["text"] for c in chunks) == tok.decode(tokens)
        assert [c["text"] for c in chunks if c["token_ids"][0] in specials] == ["", "", ""]
        assert [c["finish_reason"] for c in chunks] == [None] * (len(tokens) - 1) + ["length"]
        with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                "stream": True}) as r:
            events = _events(r)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        deltas = [e["choices"][0]["delta"] for e in events[1:]]
        assert len(deltas) == len(tokens) and all("content" in d for d in deltas)
        assert "".join(d["content"] for d in deltas) == tok.decode(tokens)


def test_logprobs_asked_of_a_node_that_gives_none_are_empty_not_an_error(tok):
    tokens = tok.encode(" and the river")
    link = FakeLink(tokens)
    with client(tok, link) as http:
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "logprobs": 2})
        assert r.status_code == 200, r.text
        assert link.requests[-1].logprobs == 2                 # asked of the node
        assert r.json()["choices"][0]["logprobs"] == {"tokens": [], "token_logprobs": [],
                                                      "top_logprobs": [], "text_offset": []}
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert link.requests[-1].logprobs == -1 and r.json()["choices"][0]["logprobs"] is None


def test_too_many_in_flight_is_429_with_retry_after(tok):
    with client(tok, FakeLink([5, 6])) as http:
        http.app.state.api.inflight = 1               # one of the limit of 2 already taken
        r = http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        # More prompts than can ever be in flight is no reason to retry (400).
        http.app.state.api.inflight = 0
        r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert r.status_code == 400 and "Retry-After" not in r.headers


@pytest.mark.parametrize("kind,status,retry", [("not_ready", 503, True), ("busy", 429, True),
                                               ("cache_full", 429, True),
                                               ("invalid_request", 400, False),
                                               ("peer_lost", 503, True)])
def test_node_refusals_map_to_status_codes(tok, kind, status, retry):
    with client(tok, FakeLink([5], kind=kind)) as http:
        for stream in (False, True):
            r = http.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
            assert r.status_code == status, r.text
            assert ("Retry-After" in r.headers) == retry
            assert r.json()["error"]["code"] == kind


def test_no_chat_template_is_a_clear_400(tok):
    bare = TextTokenizer(tok.tokenizer, eos_token_ids=tok.eos_token_ids)
    with client(bare, FakeLink([5])) as http:
        r = http.post("/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "no_chat_template"
        assert "chat template" in r.json()["error"]["message"]


def test_unknown_routes_and_methods_keep_the_error_shape(tok):
    with client(tok, FakeLink([5]), api_key="k") as http:
        r = http.get("/v1/nothing")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param",
                                                                 "code"}
        assert http.get("/v1/completions").status_code == 405
        assert http.get("/v1/models").status_code == 401
        models = http.get("/v1/models", headers={"Authorization": "Bearer k"}).json()
        assert [m["id"] for m in models["data"]] == ["m"]


def test_health_is_503_with_the_reason_while_not_ready(tok):
    with client(tok, FakeLink([5], kind="no prefill node connected")) as http:
        r = http.get("/health")
        assert r.status_code == 503 and "no prefill node" in r.json()["error"]["message"]
        assert json.loads(r.text)["error"]["code"] == "not_ready"


# -- the in-process link ------------------------------------------------------------------------
class LoopNode:
    """A stand-in decode node: front-door messages come through ``post`` into a real
    EventLoop's inbox; ``serve`` answers on the loop thread, one token per ``gap`` seconds
    (``tokens_of(request)``), so answers cross from the loop thread to the server's."""

    def __init__(self, tokens_of, gap=0.0):
        self.tokens_of, self.gap = tokens_of, gap
        self.loop = c.EventLoop("fake-decode-node")
        self.loop.start()
        self.aborted: list[tuple[object, str]] = []
        self.served_on: set[str] = set()
        self.open: dict[str, object] = {}

    def post(self, client, msg):
        self.loop.call_soon(self.serve, client, msg)

    def serve(self, client, msg):
        self.served_on.add(threading.current_thread().name)
        if isinstance(msg, nm.GenerateRequest):
            self.open[msg.request_id] = client
            self._token(client, msg, 0)
        elif isinstance(msg, nm.AbortRequest):
            if self.open.get(msg.request_id) is client:
                del self.open[msg.request_id]
                self.aborted.append((client, msg.request_id))
        elif isinstance(msg, nm.StatsQuery):
            client.deliver(nm.NodeStats(node_id="loop", ready=True, reason="",
                                        prefill_nodes=("p",), pages_used=len(self.open),
                                        pages_free=4, blocks_used=0, blocks_free=0, running=0,
                                        waiting=0, refused_peers=0, aborted=len(self.aborted)))

    def _token(self, client, msg, i):
        if self.open.get(msg.request_id) is not client:
            return                                         # aborted meanwhile
        tokens = self.tokens_of(msg)
        done = i + 1 == min(msg.max_new_tokens, len(tokens))
        if done:
            del self.open[msg.request_id]
        client.deliver(nm.GenerateTokens(
            request_id=msg.request_id, tokens=(tokens[i],), done=done, kind="", message="",
            ttft=0.0, transfer_seconds=0.0, transfer_bytes=0, recomputed=False))
        if not done:
            self.loop.call_later(self.gap, self._token, client, msg, i + 1)

    def close(self):
        self.loop.stop()


def _tokens_of(msg):
    return [100 + 10 * msg.prompt[0] + k for k in range(8)]


@pytest.fixture
def loop_node():
    node = LoopNode(_tokens_of)
    yield node
    node.close()


def served(tok, link, max_new_tokens=8):
    app = build_app(link, tok, HttpConfig(port=0), model_name="m", max_prompt_len=32,
                    max_new_tokens=max_new_tokens, max_inflight=16)
    return testclient.TestClient(app)


def test_the_link_routes_each_requests_tokens_from_the_node_loop_thread(tok, loop_node):
    prompts = [[i] for i in range(1, 9)]
    with served(tok, NodeLink(loop_node)) as http:
        r = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 6,
                                               "ignore_eos": True})
        assert r.status_code == 200, r.text
        texts = {ch["index"]: ch["text"] for ch in r.json()["choices"]}
        assert texts == {i: tok.decode(_tokens_of(nm.GenerateRequest(
            request_id="", prompt=tuple(p), max_new_tokens=6, temperature=0, top_p=1,
            seed=0))[:6]) for i, p in enumerate(prompts)}
        assert r.json()["usage"]["completion_tokens"] == 8 * 6
        with http.stream("POST", "/v1/completions", json={
                "prompt": [3], "max_tokens": 5, "stream": True, "ignore_eos": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
        assert streamed == tok.decode([130 + k for k in range(5)])
        with http.stream("POST", "/v1/completions", json={
                "prompt": [[4], [5]], "max_tokens": 3, "stream": True,
                "ignore_eos": True}) as r:                        # two choices interleaved
            chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert {i: "".join(ch["text"] for ch in chunks if ch["index"] == i) for i in (0, 1)} \
            == {0: tok.decode([140, 141, 142]), 1: tok.decode([150, 151, 152])}
        assert sorted(ch["finish_reason"] for ch in chunks if ch["finish_reason"]) == \
            ["length", "length"]
        assert http.get("/health").json()["node_id"] == "loop"
    assert loop_node.served_on == {"statebridge-fake-decode-node"}    # all on the node's loop
    assert loop_node.aborted == [] and loop_node.open == {}


def test_a_stop_string_aborts_at_the_node_as_the_link_that_sent_it(tok):
    tokens = tok.encode(" and the river ran on and on")
    node = LoopNode(lambda msg: tokens, gap=0.01)
    link = NodeLink(node)
    try:
        with served(tok, link, max_new_tokens=len(tokens)) as http:
            r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": len(tokens),
                                                   "stop": "river"})
            assert r.json()["choices"][0]["text"] == " and the "
            wait_until(lambda: node.aborted, 5, "the abort reached the node")
            (client, request_id), = node.aborted
            assert client is link and request_id.startswith("cmpl-")
            assert node.open == {}
    finally:
        node.close()


def test_a_closed_node_is_503_closed_with_retry_after(tok, loop_node):
    loop_node.close()
    with served(tok, NodeLink(loop_node)) as http:
        for stream in (False, True):
            r = http.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "closed"
        health = http.get("/health")
        assert health.status_code == 503 and "closed" in health.json()["error"]["message"]


def test_prefix_cache_metrics_from_the_node_stats(tok):
    """vLLM's prefix-cache token counters under our prefix, and per prefill node the pages
    and KV blocks its cache holds and its evictions."""
    from prometheus_client.parser import text_string_to_metric_families

    link = FakeLink([1])

    async def stats(timeout):
        return nm.NodeStats(node_id="fake", ready=True, reason="", prefill_nodes=("p1", "p2"),
                            pages_used=0, pages_free=4, blocks_used=0, blocks_free=8,
                            running=0, waiting=0, refused_peers=0, aborted=0,
                            prefix_cache_queries=900, prefix_cache_hits=512,
                            cached_tokens_late=1, prefix_nodes=("p1", "p2"),
                            prefix_pages_cached=(3, 0), prefix_blocks_cached=(40, 0),
                            prefix_evictions=(2, 0))
    link.stats = stats
    with client(tok, link) as http:
        text = http.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("statebridge_prefix_cache_queries_total", ())] == 900
    assert samples[("statebridge_prefix_cache_hits_total", ())] == 512
    assert samples[("statebridge_prefix_cache_late_total", ())] == 1
    for name, values in (("statebridge_prefix_cache_pages", (3, 0)),
                         ("statebridge_prefix_cache_kv_blocks", (40, 0)),
                         ("statebridge_prefix_cache_evictions_total", (2, 0))):
        assert [samples[(name, (("prefill", p),))] for p in ("p1", "p2")] == list(values)
