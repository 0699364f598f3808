"""The HTTP app without processes: a fake node link answers in place of the decode node."""

from __future__ import annotations

import json

import pytest

from statebridge.config import HttpConfig
from statebridge.models.checkpoint import make_checkpoint
from statebridge.node import messages as nm
from statebridge.node.http import build_app
from statebridge.node.text import TextTokenizer

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
                                 transfer_seconds=0.001, transfer_bytes=100, recomputed=False)

    def close(self, reason=""):
        if not self.done:
            self.link.aborted.append(self.request.request_id)
        self.done = True


class FakeLink:
    def __init__(self, tokens, kind=""):
        self.tokens, self.kind, self.aborted, self.requests = tokens, kind, [], []

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


def test_too_many_in_flight_is_429_with_retry_after(tok):
    with client(tok, FakeLink([5, 6])) as http:
        r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"


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
