"""The ranks' local control channel (connector/local.py): framing, routing by identity,
writes the kernel cannot take at once, oversized frames, peers that go away, other users."""

from __future__ import annotations

import os
import socket
import time

import pytest
import zmq

from statebridge.connector import control as c
from statebridge.connector import frames as wire
from statebridge.connector import messages as m
from statebridge.connector.local import LocalDealer, LocalRouter
from statebridge.errors import ConfigError

CAP = 1 << 20


def pump(*channels, until, timeout: float = 10.0) -> list:
    """Serve ``channels`` (one thread plays every process) until ``until(got)`` is true;
    ``got``: (channel, frames) in arrival order."""
    got: list = []
    deadline = time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"gave up after {got!r}"
        for ch in channels:
            while (frames := ch.recv_frames()) is not None:
                got.append((ch, frames))
    return got


@pytest.fixture
def router():
    r = LocalRouter("test", max_frame=CAP, max_queued=8 << 20)
    yield r
    r.close()


def test_frames_both_ways_and_replies_reach_the_right_dealer(router):
    a = LocalDealer(router.address, max_frame=CAP)
    b = LocalDealer(router.address, max_frame=CAP)
    a.send_frames([b"a1", b"", b"a3"])        # one message of three frames, one empty
    b.send_frames([b"b1"])
    got = pump(router, until=lambda g: len(g) == 2)
    by_payload = {tuple(frames[1:]): frames[0] for _, frames in got}
    assert set(by_payload) == {(b"a1", b"", b"a3"), (b"b1",)}
    ida, idb = by_payload[(b"a1", b"", b"a3")], by_payload[(b"b1",)]
    # zmq never gives out (nor lets a peer pick) a 10-byte identity starting with NUL.
    assert ida != idb and all(len(i) == 10 and i.startswith(b"\0L") for i in (ida, idb))
    router.send_frames([idb, b"to-b"])
    router.send_frames([ida, b"to-a", b"x"])
    got = pump(a, b, until=lambda g: len(g) == 2)
    assert sorted((ch is a, frames) for ch, frames in got) == [
        (False, [b"to-b"]), (True, [b"to-a", b"x"])]
    a.close()
    b.close()
    a.close()                                 # idempotent


def test_control_helpers_and_event_loop_polling(router):
    """statebridge's own send/recv helpers on the channel, and the loop's poll on fileno()."""
    dealer = LocalDealer(router.address, max_frame=CAP)
    c.send_dealer(dealer, m.Heartbeat(node_id="r0", seq=7))
    poller = zmq.Poller()
    poller.register(router.fileno(), zmq.POLLIN)
    assert dict(poller.poll(5000)).get(router.fileno()), "the epoll fd did not become readable"
    identity = pump(router, until=lambda g: len(g) == 1)[0][1][0]
    router.send_frames([identity, m.encode(m.Heartbeat(node_id="coord", seq=8))])
    got = pump(dealer, until=lambda g: len(g) == 1)
    msg = wire._decode_batch(got[0][1], CAP)[0]
    assert msg == m.Heartbeat(node_id="coord", seq=8)
    dealer.close()


def test_a_message_larger_than_the_kernel_buffer_arrives_whole(router):
    dealer = LocalDealer(router.address, max_frame=CAP)
    big = bytes(range(256)) * (3 * 1024)      # 768 KiB, more than a Unix socket buffer holds
    dealer.send_frames([b"head", big])
    assert dealer._conn.out, "expected the kernel to take only part of it"
    got = pump(router, dealer, until=lambda g: len(g) == 1)
    assert got[0][1][1:] == [b"head", big]
    assert not dealer._conn.out and dealer._conn.out_bytes == 0
    dealer.close()


def test_queue_full_is_zmq_again_and_nothing_is_half_sent(router):
    dealer = LocalDealer(router.address, max_frame=CAP, max_queued=1 << 20)
    frame = b"x" * (256 << 10)
    sent = 0
    with pytest.raises(zmq.Again):
        for _ in range(64):                   # the router does not read meanwhile
            dealer.send_frames([frame])
            sent += 1
    assert 0 < sent < 64
    got = pump(router, dealer, until=lambda g: len(g) == sent)
    assert all(frames[1:] == [frame] for _, frames in got)
    dealer.close()


def test_oversized_frame_drops_the_connection_and_nothing_of_it_is_delivered():
    router = LocalRouter("small", max_frame=1000)
    try:
        bad = LocalDealer(router.address, max_frame=CAP)
        good = LocalDealer(router.address, max_frame=CAP)
        bad.send_frames([b"y" * 1001])
        good.send_frames([b"fine"])
        got = pump(router, until=lambda g: len(g) == 1 and router.refused == 1)
        assert got[0][1][1:] == [b"fine"]
        # The dropped peer sees its connection end; what it sends later goes nowhere.
        pump(bad, until=lambda g: bad._conn.fd not in bad._conns)
        bad.send_frames([b"after"])
        time.sleep(0.05)
        assert router.recv_frames() is None
        bad.close()
        good.close()
    finally:
        router.close()


def test_a_gone_peer_is_forgotten_and_sends_to_it_are_dropped(router):
    dealer = LocalDealer(router.address, max_frame=CAP)
    dealer.send_frames([b"hello"])
    identity = pump(router, until=lambda g: len(g) == 1)[0][1][0]
    dealer.close()
    deadline = time.monotonic() + 5
    while identity in router._by_identity:
        assert time.monotonic() < deadline
        router.recv_frames()
    router.send_frames([identity, b"into the void"])        # no error, nothing held
    assert not router._conns


def test_a_connection_from_another_user_is_refused(router):
    """Only processes of the coordinator's own user may speak as its ranks (SO_PEERCRED)."""
    if os.getuid() != 0:
        pytest.fail("this test switches a child to another uid: run it as root (CI does)")
    pid = os.fork()
    if pid == 0:                                  # child: become nobody, connect, say hello
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(router.address)
            s.sendall(b"\x05\x00\x00\x00hello")
            time.sleep(0.5)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 10
    while router.refused == 0:
        assert time.monotonic() < deadline, "the other user's connection was not refused"
        assert router.recv_frames() is None
        time.sleep(0.01)
    os.waitpid(pid, 0)
    assert not router._by_identity and router.recv_frames() is None


def test_nobody_listening_is_a_config_error_naming_the_address():
    router = LocalRouter("gone", max_frame=CAP)
    address = router.address
    router.close()
    with pytest.raises(ConfigError, match="statebridge/gone/"):
        LocalDealer(address, max_frame=CAP)


def test_a_group_gives_rank_slots_only_over_its_local_channel():
    """A network peer cannot take a rank slot (before the rank connects) when ranks use the
    local channel; the same hello over the local channel is taken."""
    from statebridge.connector.prefill import PrefillServer

    from ._helpers import FAST, SPECS

    hello = m.RankHello(tp_rank=0, address=b"ucx-address", pid=os.getpid())
    with PrefillServer(SPECS["mamba2-g1"], 2, "DLS", num_pages=2, config=FAST,
                       launcher=None) as server:
        tcp = c.connect_dealer(zmq.Context.instance(), server.address)
        try:
            tcp.send(m.encode(hello))
            assert tcp.poll(5000), "no answer to a network RankHello"
            reply = wire._decode_batch(tcp.recv_multipart(), CAP)[0]
            assert isinstance(reply, m.Error) and "over the network" in reply.message
        finally:
            tcp.close(0)
        assert server.group.ranks[0].identity is None
        local = LocalDealer(server.group.local.address, max_frame=CAP)
        try:
            local.send_frames([m.encode(hello)])
            deadline = time.monotonic() + 5
            while server.group.ranks[0].identity is None:
                assert time.monotonic() < deadline, "the local RankHello was not taken"
                time.sleep(0.01)
            rank = server.group.ranks[0]
            assert rank.sock is server.group.local and rank.announced.pid == os.getpid()
        finally:
            local.close()


def test_a_group_takes_rank_failed_only_from_its_own_ranks():
    """A RankFailed from a network peer cannot fail a group whose ranks use the local channel:
    refused with an Error and counted, the start goes on. The same report over the local
    channel (where a failing rank sends it) fails the start with its message."""
    from statebridge.connector.prefill import PrefillServer
    from statebridge.errors import StartupError

    from ._helpers import FAST, SPECS

    failed = m.RankFailed(tp_rank=1, message="forged: no such weight file")
    with PrefillServer(SPECS["mamba2-g1"], 2, "DLS", num_pages=2, config=FAST,
                       launcher=None) as server:
        tcp = c.connect_dealer(zmq.Context.instance(), server.address)
        try:
            tcp.send(m.encode(failed))
            assert tcp.poll(5000), "no answer to a network RankFailed"
            reply = wire._decode_batch(tcp.recv_multipart(), CAP)[0]
            assert isinstance(reply, m.Error) and "RankFailed for rank 1 over the network" \
                in reply.message
        finally:
            tcp.close(0)
        assert server.stats()["protocol_errors"] == 1
        assert server.group.healthy and not server.group.ranks[1].lost
        with pytest.raises(StartupError, match="did not start within"):
            server.wait_ready(timeout=0.5)                   # not failed: still starting

        local = LocalDealer(server.group.local.address, max_frame=CAP)
        try:
            local.send_frames([m.encode(m.RankFailed(tp_rank=1, message="no such file"))])
            with pytest.raises(StartupError, match="rank 1 failed to start: no such file"):
                server.wait_ready(timeout=5)
        finally:
            local.close()
        assert server.group.ranks[1].lost and not server.group.healthy
        assert server.stats()["protocol_errors"] == 1
