"""Fuzzing live nodes: random and mutated bytes at every control-plane socket a peer can reach.

A prefill server, a decode coordinator and a decode node front door run for real (rank
processes, zmq, UCX). Hypothesis sends each one random bytes, mutated valid encodings (bit
flips, truncations, wrong versions, wrong type ids, huge length prefixes, frames over
``max_message_bytes``) and wrong frame counts, from a fresh peer and from one that completed a
Hello. For every input: ``messages.decode`` raises ProtocolError and nothing else (or returns a
message); when the input is not a message the node answers a typed ``Error`` naming the error
class and counts one protocol error; and the node keeps serving -- a valid Hello / Heartbeat
gets its reply after every example and real transfers complete byte-exact at the end.
(tests/connector/test_messages.py fuzzes the codec alone, without sockets.)
"""

from __future__ import annotations

import collections
import json
import time
import uuid

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.node import messages as nm
from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.prefill import PrefillServer
from statebridge.errors import ProtocolError
from statebridge.node.decode_node import DecodeNode
from statebridge.state.spec import StateSpec
from statebridge.testing.hosts import RankHostPool
from statebridge.testing.probes import instrumented, probes_of

from ._helpers import FAST, SYNTHETIC, expected_checksum, log_to_stderr
from .test_messages import ALL_TYPES, example

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

LIMIT = 64 * 1024                     # max_message_bytes of every node here: oversize is cheap
CONFIG = FAST.replace(max_message_bytes=LIMIT, peer_timeout=3.0)   # a loaded box stalls ~1 s
CONFIG_JSON = {"model_type": "mamba2", "hidden_size": 16, "expand": 2, "head_dim": 4,
               "state_size": 6, "n_groups": 1, "conv_kernel": 4, "num_hidden_layers": 3,
               "torch_dtype": "bfloat16", "vocab_size": 32}
REPLY_TIMEOUT_MS = 5000
EXAMPLES = 40
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("model")
    (model_dir / "config.json").write_text(json.dumps(CONFIG_JSON))
    spec = StateSpec.from_pretrained(str(model_dir))
    with RankHostPool(1, initializer=log_to_stderr) as hosts, \
            PrefillServer(spec, 1, "DLS", num_pages=4, config=CONFIG,
                          launcher=hosts.launcher(), model=SYNTHETIC) as server, \
            instrumented(DecodeCoordinator(spec, 1, "LDS", num_pages=4, config=CONFIG,
                                           probes="checksums",
                                           launcher=hosts.launcher())) as decode:
        server.wait_ready()
        decode.connect(server.address)
        node = DecodeNode(str(model_dir), 1, [server.address], num_pages=4, config=CONFIG,
                          launcher=hosts.launcher(), max_prompt_len=16,
                          rank_model="statebridge.testing.models:SyntheticModel")
        try:
            yield spec, server, decode, node
        finally:
            node.close()


# -- inputs -------------------------------------------------------------------------------------

def _flip(raw: bytes, positions: list[int], bits: list[int]) -> bytes:
    out = bytearray(raw)
    for p, b in zip(positions, bits):
        out[p % len(out)] ^= 1 << b
    return bytes(out)


def _envelope(version, type_name, body) -> bytes:
    return msgpack.packb({"v": version, "t": type_name, "b": body}, use_bin_type=True)


def _body(message: m.Message) -> dict:
    return msgpack.unpackb(m.encode(message), raw=False)["b"]


valid = st.sampled_from(ALL_TYPES).map(lambda cls: m.encode(example(cls)))
payloads = st.one_of(
    st.binary(max_size=256),                                                    # random bytes
    st.builds(_flip, valid, st.lists(st.integers(0, 1 << 16), min_size=1, max_size=4),
              st.lists(st.integers(0, 7), min_size=4, max_size=4)),             # bit flips
    st.builds(lambda raw, n: raw[:n % max(1, len(raw))], valid, st.integers(0, 1 << 16)),
    st.builds(lambda cls, v: _envelope(v, cls.TYPE, _body(example(cls))),      # wrong version
              st.sampled_from(ALL_TYPES),
              st.one_of(st.integers(-(1 << 63), (1 << 64) - 1).filter(
                  lambda v: v != m.PROTOCOL_VERSION), st.text(max_size=8), st.none())),
    st.builds(lambda cls, t: _envelope(m.PROTOCOL_VERSION, t, _body(example(cls))),
              st.sampled_from(ALL_TYPES),                                       # wrong type id
              st.one_of(st.text(max_size=12), st.integers(-(1 << 63), (1 << 64) - 1),
                        st.binary(max_size=8))),          # (ints msgpack can encode)
    st.builds(lambda head, n, tail: head + n.to_bytes(4, "big") + tail,         # huge lengths
              st.sampled_from([b"\xc6", b"\xdb", b"\xdd", b"\xdf",
                               b"\x83\xa1v\x01\xa1t\xa5Hello\xa1b\xdf"]),
              st.integers(1 << 20, (1 << 32) - 1), st.binary(max_size=16)),
    st.builds(lambda raw, extra: raw + b"\x00" * (LIMIT - len(raw) + extra),    # oversized
              valid, st.integers(1, 512)),
)
# A zmq message of several frames is a batch (one message per frame); each bad frame gets its
# own Error.
frame_lists = st.lists(payloads, min_size=1, max_size=3)


def garbage_kinds(frames: list[bytes]) -> list[str]:
    """The Error kind a node must answer for each frame that is not a message, in order.
    ``messages.decode`` must raise ProtocolError (or a subclass) and nothing else."""
    kinds = []
    for frame in frames:
        try:
            msg = m.decode(frame, max_bytes=LIMIT)
        except ProtocolError as e:
            kinds.append(type(e).__name__)
        else:
            assert isinstance(msg, m.Message)
    return kinds


# -- talking to a node ----------------------------------------------------------------------------

class Peer:
    """A raw DEALER: what a buggy or hostile peer can do."""

    def __init__(self, address: str) -> None:
        self.sock = c.connect_dealer(zmq.Context.instance(), address)
        self.sock.setsockopt(zmq.RCVTIMEO, REPLY_TIMEOUT_MS)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def replies_until(self, last) -> list[m.Message]:
        """Every message received up to and including the first one ``last`` accepts (the
        node's own heartbeats left out). zmq.Again after REPLY_TIMEOUT_MS means a hang."""
        out = []
        while True:
            for frame in self.sock.recv_multipart():
                msg = m.decode(frame)
                if isinstance(msg, m.Heartbeat) and not last(msg):
                    continue
                out.append(msg)
                if last(msg):
                    return out

    def hello(self, spec: StateSpec) -> None:
        self.send([m.encode(m.Hello(compat_hash=m.compat_hash(spec.to_json()),
                                    node_id=f"fuzz-{uuid.uuid4().hex[:6]}", role="decode"))])
        self.replies_until(lambda msg: isinstance(msg, m.Hello))


class Target:
    """A node's socket under fuzz: its address, its protocol-error counter, and a request
    with a reply of its own that is sent after the fuzz frames (everything the node answers
    before that reply belongs to the fuzz frames: one socket, in order)."""

    def __init__(self, address, counters, sentinel: m.Message, is_reply, sentinel_errors=0,
                 before=None) -> None:
        self.address, self.counters = address, counters
        self.sentinel, self.is_reply = sentinel, is_reply
        self.sentinel_errors, self.before = sentinel_errors, before

    def fuzz(self, frames: list[bytes]) -> None:
        kinds = garbage_kinds(frames)
        peer = Peer(self.address)
        try:
            if self.before is not None:
                self.before(peer)
            errors_before = self.counters()
            peer.send(frames)
            peer.send([m.encode(self.sentinel)])
            replies = peer.replies_until(self.is_reply)
            errors = self.counters() - errors_before - self.sentinel_errors
        finally:
            peer.sock.close(0)
        got = [r.kind for r in replies[:-1] if isinstance(r, m.Error)]
        assert not collections.Counter(kinds) - collections.Counter(got), (kinds, replies)
        assert errors >= len(kinds)
        if len(kinds) == len(frames):             # nothing but garbage: exactly one each
            assert got == kinds, (kinds, replies)
            assert errors == len(kinds)
        # Every well-formed reply is a typed message; the node answered the sentinel.
        assert all(isinstance(r, m.Message) for r in replies)


def prefill_target(spec, server, *, greeted: bool) -> Target:
    return Target(server.address, lambda: server.stats().get("protocol_errors", 0),
                  m.Hello(compat_hash=m.compat_hash(spec.to_json()), node_id="sentinel",
                          role="decode"),
                  lambda msg: isinstance(msg, m.Hello),
                  before=(lambda p: p.hello(spec)) if greeted else None)


# -- the tests ------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("greeted", [False, True], ids=["before_hello", "after_hello"])
@FUZZ
@given(frames=frame_lists)
def test_prefill_server(nodes, greeted, frames):
    spec, server, _, _ = nodes
    prefill_target(spec, server, greeted=greeted).fuzz(frames)


@pytest.mark.timeout(120)
@FUZZ
@given(frames=frame_lists)
def test_decode_coordinator_rank_router(nodes, frames):
    """The ROUTER a decode group's rank processes connect to; the sentinel is a rank that is
    not one (refused with a typed Error, counted as a protocol error)."""
    _, _, decode, _ = nodes
    Target(decode.address, lambda: decode.stats().get("protocol_errors", 0),
           m.RankHello(tp_rank=123456, address=b"sentinel", pid=1),
           lambda msg: isinstance(msg, m.Error) and "rank 123456" in msg.message,
           sentinel_errors=1).fuzz(frames)


@pytest.mark.timeout(120)
@FUZZ
@given(frames=frame_lists)
def test_decode_node_front_door(nodes, frames):
    """The client-facing ROUTER; the sentinel is a prompt over the node's max_prompt_len."""
    _, _, _, node = nodes
    Target(node.address, lambda: node.counters.get("protocol_errors"),
           nm.GenerateRequest(request_id="sentinel", prompt=tuple(range(17)), max_new_tokens=1,
                             temperature=0.0, top_p=1.0, seed=0),
           lambda msg: isinstance(msg, nm.GenerateTokens) and msg.request_id == "sentinel"
           and msg.kind == "invalid_request").fuzz(frames)


@pytest.mark.timeout(60)
def test_too_many_frames_in_one_zmq_message_is_one_typed_error(nodes):
    spec, server, _, _ = nodes
    frames = [m.encode(m.Heartbeat(node_id="x", seq=i)) for i in range(c.MAX_BATCH_FRAMES + 1)]
    before = server.stats().get("protocol_errors", 0)
    peer = Peer(server.address)
    try:
        peer.send(frames)
        (reply,) = peer.replies_until(lambda msg: isinstance(msg, m.Error))
        assert reply.kind == "ProtocolError" and str(c.MAX_BATCH_FRAMES + 1) in reply.message
    finally:
        peer.sock.close(0)
    assert server.stats()["protocol_errors"] == before + 1


@pytest.mark.timeout(120)
def test_every_node_still_serves_after_the_fuzzing(nodes):
    spec, server, decode, node = nodes
    for _ in range(2):
        rid = f"after-fuzz-{uuid.uuid4().hex[:6]}"
        result = decode.submit(rid, [3, 1, 4]).result(timeout=30)
        assert probes_of(decode).checksums(result) == (
            expected_checksum(decode.group.geometry, rid, 0),)
        decode.release(result)
    # The decode node's own path through the prefill server: a transfer then a decode step
    # (the synthetic rank model cannot decode: a typed failure, not a hang).
    peer = Peer(node.address)
    try:
        peer.send([m.encode(nm.GenerateRequest(request_id="gen-1", prompt=(1, 2, 3),
                                              max_new_tokens=2, temperature=0.0, top_p=1.0,
                                              seed=0))])
        replies = peer.replies_until(lambda msg: isinstance(msg, nm.GenerateTokens) and msg.done)
        assert replies[-1].request_id == "gen-1" and replies[-1].transfer_bytes > 0, replies
    finally:
        peer.sock.close(0)
    assert server.stats()["healthy"] and decode.stats()["healthy"]
    assert server.stats()["healthy"] and node.coordinator.stats()["healthy"]


@pytest.mark.timeout(60)
def test_a_frame_over_the_hard_cap_is_dropped_by_zmq_unread(nodes):
    """A frame above frame_cap(max_message_bytes) never reaches the node: zmq drops the
    connection instead of buffering it whole. The node counts nothing and keeps serving."""
    spec, server, _, _ = nodes
    before = server.stats().get("protocol_errors", 0)
    rogue = Peer(server.address)
    try:
        rogue.send([b"\x00" * (c.frame_cap(LIMIT) + 1)])
        time.sleep(0.5)
    finally:
        rogue.sock.close(0)
    peer = Peer(server.address)
    try:
        peer.hello(spec)                                # still answers a proper Hello
    finally:
        peer.sock.close(0)
    assert server.stats().get("protocol_errors", 0) == before
