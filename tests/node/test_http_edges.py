"""The HTTP front door's edges on a real uvicorn server (its own thread, as in the decode node)
in front of a stand-in node loop: limits enforced before any work (body size while reading,
prompt characters before tokenizing, batches that can never fit), malformed JSON, slow and
vanishing clients."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time

import pytest

from statebridge.config import HttpConfig
from statebridge.models.checkpoint import make_checkpoint
from statebridge.node.http import MAX_CHARS_PER_TOKEN, HttpServer, NodeLink, build_app
from statebridge.node.text import TextTokenizer

from tests.connector._helpers import wait_until
from tests.node.test_http import LoopNode, _tokens_of

MAX_PROMPT = 32
MAX_INFLIGHT = 4
BODY_CAP = 64 * 1024


class SpyTokenizer(TextTokenizer):
    """Records every text it encodes and the thread that encoded it."""

    def __init__(self, tok: TextTokenizer) -> None:
        super().__init__(tok.tokenizer, eos_token_ids=tok.eos_token_ids, bos_token=tok.bos_token,
                         eos_token=tok.eos_token, chat_template=tok.chat_template)
        self.seen: list[tuple[int, str]] = []

    def encode(self, text):
        self.seen.append((len(text), threading.current_thread().name))
        return super().encode(text)

    def encode_many(self, texts):
        self.seen.extend((len(t), threading.current_thread().name) for t in texts)
        return super().encode_many(texts)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("edges") / "m"
    make_checkpoint("lfm2", out, preset="tiny")
    return TextTokenizer.from_dir(out)


class Server:
    def __init__(self, tok, gap=0.0, max_prompt_len=MAX_PROMPT, **config):
        self.node = LoopNode(_tokens_of, gap=gap)
        self.tok = SpyTokenizer(tok)
        self.config = HttpConfig(port=0, **config)
        app = build_app(NodeLink(self.node), self.tok, self.config, model_name="m",
                        max_prompt_len=max_prompt_len, max_new_tokens=8,
                        max_inflight=MAX_INFLIGHT)
        self.http = HttpServer(app, "127.0.0.1", 0)
        self.port = self.http.port

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def close(self):
        self.http.close()
        self.node.close()


@pytest.fixture
def server(tok):
    s = Server(tok, max_body_bytes=BODY_CAP, header_timeout=1.0, body_timeout=1.0)
    yield s
    s.close()


def _post(conn, body: bytes, path="/v1/completions"):
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r, r.read()


def _openai_error(data: bytes) -> dict:
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def _until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (a refused request's connection is
    closed after the answer)."""
    data = b""
    while more := s.recv(65536):
        data += more
    return data


def _health_on_the_same_connection(conn) -> None:
    """The server kept the connection: the next request goes over the same socket."""
    sock = conn.sock
    assert sock is not None, "the server closed the keep-alive connection"
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    assert r.status == 200 and conn.sock is sock


# -- bodies --------------------------------------------------------------------------------------
def test_a_body_over_the_cap_is_413_before_it_is_read(server):
    """Content-Length over the cap: refused from the header, the body never sent."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 52428800\r\n\r\n")
        head = _until_closed(s)
    finally:
        s.close()
    status, _, rest = head.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413"), head
    error = _openai_error(rest.partition(b"\r\n\r\n")[2])
    assert str(BODY_CAP) in error["message"] and error["code"] == "body_too_large"


def test_a_chunked_body_over_the_cap_is_413_while_reading(server):
    """No Content-Length: the server stops reading at the cap and answers; the client never
    gets to send the rest."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    chunk = b"x" * 16384
    sent = 0
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        s.settimeout(0.05)
        head = b""
        while sent < 64 << 20 and not head:
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            except OSError:
                break
            try:
                head = s.recv(65536)
            except (socket.timeout, BlockingIOError):
                pass
        s.settimeout(10)
        while b"\r\n\r\n" not in head:
            more = s.recv(65536)
            if not more:
                break
            head += more
    finally:
        s.close()
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert sent < 64 << 20                       # refused long before the client was done
    assert server.tok.seen == []


def test_a_prompt_over_the_character_cap_is_never_tokenized(server):
    limit = MAX_PROMPT * MAX_CHARS_PER_TOKEN
    conn = server.conn()
    for prompt in ("w" * (limit + 1), ["ok", "w" * (limit + 1)]):
        r, data = _post(conn, json.dumps({"prompt": prompt}).encode())
        assert r.status == 400, data
        error = _openai_error(data)
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert str(limit) in error["message"] and str(limit + 1) in error["message"]
    r, data = _post(conn, json.dumps({"messages": [{"role": "user", "content": "w" * limit}]
                                      }).encode(), "/v1/chat/completions")
    assert r.status == 400 and _openai_error(data)["code"] == "context_length_exceeded"
    assert server.tok.seen == []                 # refused from its length alone
    _health_on_the_same_connection(conn)


def test_long_prompts_are_tokenized_off_the_server_loop(tok):
    """A prompt long enough to matter is encoded in the tokenizer pool (its batch encoder
    releases the GIL), not on the server's event loop thread; a short one inline."""
    server = Server(tok, max_prompt_len=8192)
    try:
        conn = server.conn()
        text = "ab " * 2000
        r, data = _post(conn, json.dumps({"prompt": text, "max_tokens": 1}).encode())
        assert r.status == 200, data
        r, data = _post(conn, json.dumps({"prompt": "Hi", "max_tokens": 2}).encode())
        assert r.status == 200, data
        chat = [{"role": "user", "content": "cd " * 2000}]
        r, data = _post(conn, json.dumps({"messages": chat, "max_tokens": 1}).encode(),
                        "/v1/chat/completions")
        assert r.status == 200, data
    finally:
        server.close()
    (long_len, long_thread), (short_len, short_thread), (chat_len, chat_thread) = \
        server.tok.seen
    assert (long_len, short_len) == (len(text), 2) and chat_len > 6000
    assert long_thread.startswith("statebridge-tokenize") and short_thread == "statebridge-http"
    assert chat_thread.startswith("statebridge-tokenize")


def test_a_body_that_stops_coming_is_408(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        started = time.monotonic()
        head = _until_closed(s)
        took = time.monotonic() - started
    finally:
        s.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert "1.0" in _openai_error(head.partition(b"\r\n\r\n")[2])["message"]
    assert took < 10


# -- malformed JSON and impossible requests: 400, connection kept ---------------------------------
@pytest.mark.parametrize("body", [
    b'{"prompt": ' + b"[" * 1200 + b"]" * 1200 + b"}",
    b'{"prompt": "hi", "x": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}",
    b"[" * 30_000 + b"]" * 30_000,
    b'{"prompt": ' + b"[" * 990 + b"1" + b"]" * 990 + b"}",
], ids=["list-1200", "object-5000", "top-30000", "prompt-990"])
def test_deep_nesting_is_400_and_keeps_the_connection(server, body):
    conn = server.conn()
    r, data = _post(conn, body)
    assert r.status == 400, data[:300]
    assert _openai_error(data)["type"] == "invalid_request_error"
    _health_on_the_same_connection(conn)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "abc\\ud800def"}'),
    ("/v1/completions", b'{"prompt": ["fine", "\\udfff"]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}'),
], ids=["prompt", "batch", "chat", "stop"])
def test_a_lone_surrogate_is_400_and_keeps_the_connection(server, path, body):
    conn = server.conn()
    r, data = _post(conn, body, path)
    assert r.status == 400, data[:300]
    error = _openai_error(data)
    assert "surrogate" in error["message"] and error["param"] in ("prompt", "messages", "stop")
    _health_on_the_same_connection(conn)
    # A proper pair (an emoji written as two escapes) is text like any other.
    r, data = _post(conn, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert r.status == 200, data


def test_a_batch_that_can_never_fit_is_400_not_429(server):
    conn = server.conn()
    r, data = _post(conn, json.dumps({"prompt": ["a"] * (MAX_INFLIGHT + 1)}).encode())
    assert r.status == 400 and r.getheader("Retry-After") is None, data
    error = _openai_error(data)
    assert error["param"] == "prompt" and str(MAX_INFLIGHT) in error["message"]
    assert server.tok.seen == []                 # counted before tokenizing
    _health_on_the_same_connection(conn)
    r, data = _post(conn, json.dumps({"prompt": ["a"] * MAX_INFLIGHT, "max_tokens": 1}).encode())
    assert r.status == 200, data


# -- clients that go away or never finish --------------------------------------------------------
def _records(caplog, level):
    return [r for r in caplog.records if r.levelno >= level]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_disconnect_is_one_debug_line(tok, caplog, stream):
    caplog.set_level(logging.DEBUG)
    server = Server(tok, gap=0.2)
    try:
        body = json.dumps({"prompt": [[5], [6]], "max_tokens": 8, "stream": stream,
                           "ignore_eos": True}).encode()
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        if stream:
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(0.3)
        s.close()
        wait_until(lambda: len(server.node.aborted) == 2, 10, "both prompts aborted at the node")
        time.sleep(0.5)                           # what would be logged late is logged by now
        gc_logged = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    finally:
        server.close()
    assert _records(caplog, logging.WARNING) == [] and gc_logged == []
    lines = [r for r in caplog.records if r.name.startswith("statebridge.node.http")
             and "disconnect" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG, \
        [(r.levelname, r.getMessage()) for r in lines]


def test_slow_clients_are_cut_at_the_header_timeout(server):
    """200 sockets that send half a request header and wait: the server keeps serving, and
    each is closed once ``header_timeout`` passed."""
    socks = []
    try:
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=20)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            socks.append(s)
        conn = server.conn()
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and r.read()
        started = time.monotonic()
        answers = []
        for s in socks:
            data = b""
            while True:
                more = s.recv(65536)
                if not more:
                    break
                data += more
            answers.append(data)
        took = time.monotonic() - started
    finally:
        for s in socks:
            s.close()
    assert all(a == b"" or a.startswith(b"HTTP/1.1 408") for a in answers), answers[:3]
    assert took < 15


def test_an_idle_keep_alive_connection_that_starts_a_header_is_cut_too(server):
    conn = server.conn()
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200 and r.read()
    sock = conn.sock
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    sock.settimeout(15)
    data = b""
    try:
        while more := sock.recv(65536):
            data += more
    except socket.timeout:
        pytest.fail("a half-sent second request held its connection past the header timeout")
    finally:
        conn.close()
    assert data == b"" or data.startswith(b"HTTP/1.1 408"), data
