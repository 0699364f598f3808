"""No single request may leave a live decode node broken, through either front door: huge
bodies and prompts are refused before any work and never stall the node's loop (its ranks
would take that for a dead coordinator); one bad value fails its own request only; the zmq
front door is no side door around ``--api-key``; CURVE refusals of clients are counted.

Against a live prefill node (TP 1) and decode node (TP 2) serving a tiny LFM2 checkpoint with
attention layers (vocabulary 256) in this process, so the node process is this one."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading
import time

import pytest

from statebridge.config import HttpConfig, NodeConfig
from statebridge.errors import AuthenticationError, InvalidRequestError
from statebridge.models.checkpoint import make_checkpoint
from statebridge.net import free_port
from statebridge.node.client import Client
from statebridge.node.decode_node import DecodeNode
from statebridge.security import CurveKeys, generate_keys

from tests.connector._helpers import wait_until

from ._helpers import FAST

httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

PAGES = 16
MAX_PROMPT = 64
MAX_INFLIGHT = 4 * PAGES
SYNTHETIC = "statebridge.testing.models:SyntheticModel"


class LoopProbe:
    """The longest gap between two ticks of the node's loop (every 5 ms) while active."""

    def __init__(self, node):
        self.active, self.last, self.worst = False, 0.0, 0.0
        node.loop.call(lambda: node.loop.call_every(0.005, self._tick))

    def _tick(self):
        now = time.monotonic()
        if self.active and self.last:
            self.worst = max(self.worst, now - self.last)
        self.last = now

    def __enter__(self):
        self.worst, self.last, self.active = 0.0, 0.0, True
        return self

    def __exit__(self, *exc):
        self.active = False


class Pair:
    def __init__(self, model, server, node):
        self.model, self.server, self.node = model, server, node
        self.url = node.http.url
        self.probe = LoopProbe(node)

    def post(self, body, path="/v1/completions", **kw):
        return httpx.post(f"{self.url}{path}", timeout=120, **kw,
                          **({"json": body} if not isinstance(body, bytes) else
                             {"content": body}))

    def serves(self) -> None:
        """The node still serves: healthy group, /health 200, a request completes."""
        assert self.node.coordinator.stats()["healthy"]
        assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200
        r = self.post({"prompt": "The river", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text

    def idle(self) -> bool:
        co = self.node.stats()["coordinator"]
        return co["pages_used"] == 0 and co["blocks_used"] == 0


@pytest.fixture(scope="module")
def pair(live_pair, tmp_path_factory):
    model = str(make_checkpoint("lfm2-hybrid", tmp_path_factory.mktemp("limits") / "lh"))
    with live_pair(model, num_pages=PAGES, kv_blocks=256, max_prompt_len=MAX_PROMPT,
                   max_new_tokens=16,
                   # Above the default (1 MiB), so the 4 MB prompt is read, parsed and refused
                   # from its length: the path that once tokenized it.
                   http=HttpConfig(port=0, max_body_bytes=8 << 20)) as (server, node):
        yield Pair(model, server, node)


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# -- limits before work ---------------------------------------------------------------------------
def test_a_4mb_prompt_is_refused_and_the_node_serves_on(pair):
    with pair.probe as probe:
        r = pair.post({"prompt": "word " * 800_000})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # The node's loop never stalled near the ranks' patience (they would have shut down).
    assert probe.worst < FAST.peer_timeout / 2, probe.worst
    pair.serves()


def _stream_body(port: int, total: int, content_length: bool) -> tuple[bytes, int]:
    """POST ``total`` bytes of a JSON prompt made on the fly (nothing held here): the answer's
    head and how many bytes went out before the server answered."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    length = (b"Content-Length: %d" % total) if content_length else \
        b"Transfer-Encoding: chunked"
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + length + b"\r\n\r\n")
    piece = b"word " * 13_107
    sent, head = 0, b""
    s.settimeout(0.01)
    try:
        while sent < total and not head:
            data = piece if content_length else b"%x\r\n%s\r\n" % (len(piece), piece)
            try:
                s.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                break
            except socket.timeout:
                pass
            sent += len(piece)
            try:
                head = s.recv(65536)
            except (socket.timeout, BlockingIOError):
                pass
        s.settimeout(60)
        while more := s.recv(65536):          # the rest of the answer, until the server closes
            head += more
    except ConnectionResetError:
        pass
    finally:
        s.close()
    return head, sent


@pytest.mark.parametrize("content_length", [True, False], ids=["content-length", "chunked"])
def test_a_50mb_body_is_413_and_the_node_does_not_grow(pair, content_length):
    before = _rss_kib()
    with pair.probe as probe:
        head, sent = _stream_body(pair.node.http.port, 50 << 20, content_length)
    grew = _rss_kib() - before
    assert head.startswith(b"HTTP/1.1 413"), head[:300]
    assert b"body_too_large" in head
    assert sent < 50 << 20                               # refused while (or before) reading
    assert grew < 32 << 10, f"RSS grew by {grew} KiB"
    assert probe.worst < FAST.peer_timeout / 2, probe.worst
    pair.serves()


def test_a_large_batch_of_strings(pair):
    with pair.probe as probe:
        r = pair.post({"prompt": ["word"] * (MAX_INFLIGHT + 1)})
        assert r.status_code == 400 and "Retry-After" not in r.headers, r.text
        assert str(MAX_INFLIGHT) in r.json()["error"]["message"]
        r = pair.post({"prompt": ["word " * 12_000] * 60})          # 3.6 MB, each too long
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert probe.worst < FAST.peer_timeout / 2, probe.worst
    r = pair.post({"prompt": [f"word {i} " * 4 for i in range(MAX_INFLIGHT)], "max_tokens": 1,
                   "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == MAX_INFLIGHT
    wait_until(pair.idle, 20, "pages and blocks freed")
    pair.serves()


# -- failure isolation ----------------------------------------------------------------------------
def test_one_bad_sampling_value_fails_only_its_request(pair):
    def one(i):
        body = {"prompt": f"The river ran {i}", "max_tokens": 8, "temperature": 0.8,
                "top_p": 1e-300 if i == 3 else 0.9, "seed": i}
        return pair.post(body)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, range(6)))
    assert [r.status_code for r in got] == [200, 200, 200, 400, 200, 200], \
        [r.text for r in got]
    assert got[3].json()["error"]["param"] == "top_p"
    wait_until(pair.idle, 20, "pages and blocks freed")


def test_an_out_of_vocabulary_token_at_the_zmq_door_fails_only_its_request(pair):
    barrier = threading.Barrier(6)

    def one(i):
        prompt = [5, 6, 7, 999 if i == 2 else 8 + i]
        with Client(pair.node.address, timeout=60) as client:
            barrier.wait()
            try:
                return client.generate(prompt, max_new_tokens=8).tokens
            except InvalidRequestError as e:
                return e

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, range(6)))
    assert isinstance(got[2], InvalidRequestError) and "999" in str(got[2])
    assert all(isinstance(t, list) and len(t) == 8 for i, t in enumerate(got) if i != 2), got
    wait_until(pair.idle, 20, "pages and blocks freed")
    pair.serves()


# -- the zmq front door next to an API key --------------------------------------------------------
def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_with_an_api_key_and_no_keys_the_zmq_door_is_off_unless_asked(pools, pair):
    _, decode_hosts = pools
    nowhere = f"127.0.0.1:{free_port()}"
    for front_door, open_ in (("auto", False), ("on", True)):
        port = free_port()
        with DecodeNode(pair.model, 1, [nowhere], port=port, config=FAST, kv_blocks=32,
                        num_pages=4, launcher=decode_hosts.launcher(), wait_prefill=0,
                        rank_model=SYNTHETIC, node=NodeConfig(front_door=front_door),
                        http=HttpConfig(port=0, api_key="sk-x")) as node:
            assert _listening(port) is open_, front_door
            assert httpx.get(f"{node.http.url}/health", timeout=10).status_code == 503


def test_curve_refusals_of_clients_are_counted_in_metrics(pools, pair, tmp_path):
    _, decode_hosts = pools
    keys_dir = str(tmp_path / "keys")
    generate_keys(keys_dir, ["node", "client"])
    nowhere = f"127.0.0.1:{free_port()}"
    with DecodeNode(pair.model, 1, [nowhere], config=FAST.replace(keys_dir=keys_dir),
                    kv_blocks=32, num_pages=4, launcher=decode_hosts.launcher(),
                    wait_prefill=0, rank_model=SYNTHETIC,
                    http=HttpConfig(port=0, api_key="sk-x")) as node:
        assert _listening(node.port)                     # keyed: the door stays open
        for _ in range(3):
            with Client(node.address, timeout=30) as client:
                with pytest.raises(AuthenticationError):
                    client.wait_ready(timeout=30)
        with Client(node.address, timeout=30, keys=CurveKeys.load(keys_dir, "client")) as c:
            assert c.status().node_id                    # an admitted client gets through

        def refused():
            text = httpx.get(f"{node.http.url}/metrics", timeout=10).text
            return {s.name: s.value for f in text_string_to_metric_families(text)
                    for s in f.samples}.get("statebridge_refused_clients_total", 0)
        wait_until(lambda: refused() >= 3, 20, "refused clients counted in /metrics")
