"""Heal or exit, never linger: a loop does not blame its peers for its own stall; ranks wait for
a coordinator that is merely frozen; a group that loses a rank restarts it (a prefill server
refuses handshakes meanwhile) or fails for good, saying why; a rank group's start is bounded."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import zmq

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.prefill import PrefillServer
from statebridge.errors import NotReadyError, PeerLostError, StartupError
from statebridge.testing.hosts import RankHostPool
from statebridge.testing.probes import instrumented, probes_of
from statebridge.testing.sockets import alive

from ._helpers import FAST, SPECS, expected_checksum, log_to_stderr, wait_until

SPEC = SPECS["mamba2-g1"]
SLOW = "tests.connector._helpers:SlowModel"


# -- the loop's own stalls (no processes) ----------------------------------------------------

@pytest.mark.timeout(60)
def test_a_stalled_loop_forgives_its_own_stall_but_still_loses_a_dead_peer():
    """A loop blocked for twice a watch's timeout (as SIGSTOP or a handler holding it would)
    does not declare its peer lost for that silence; the peer, silent on, is lost after the
    timeout of the loop's running time. A watch not given the loop counts wall time."""
    loop = c.EventLoop("stall-test")
    watch, wall = c.PeerWatch(1.0, loop), c.PeerWatch(1.0)
    lost: dict[str, float] = {}

    def check() -> None:
        for name, w in (("loop", watch), ("wall", wall)):
            for _ in w.expired():
                lost[name] = time.monotonic()
    loop.call_every(0.05, check)
    loop.start()
    try:
        loop.call(lambda: (watch.heard("peer"), wall.heard("peer")))
        loop.call_soon(time.sleep, 2.0)                     # the loop stalls 2 s
        stalled_at = time.monotonic()
        time.sleep(2.3)
        assert "wall" in lost and "loop" not in lost, lost
        wait_until(lambda: "loop" in lost, 5, "the silent peer lost")
        assert lost["loop"] - stalled_at >= 2.0 + 1.0 - 0.15   # stall + timeout of running
        assert loop.stalls >= 1 and loop.stalled_seconds >= 1.8
    finally:
        loop.stop()


# -- rank groups (processes) -----------------------------------------------------------------



@pytest.fixture(scope="module")
def hosts():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.5")     # read by the host processes
        with RankHostPool(2, initializer=log_to_stderr) as prefill_hosts, \
                RankHostPool(2, initializer=log_to_stderr) as decode_hosts:
            yield prefill_hosts, decode_hosts


def rid() -> str:
    return f"r-{uuid.uuid4().hex[:8]}"


def transfer_ok(decode: DecodeCoordinator, timeout: float = 30.0) -> None:
    """One request end to end (retrying typed refusals while the pair heals); the decode
    pages hold exactly the oracle's state."""
    deadline = time.monotonic() + timeout
    while True:
        request_id = rid()
        try:
            result = decode.submit(request_id, [3, 1, 4]).result(timeout=timeout)
            break
        except PeerLostError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert probes_of(decode).checksums(result) == tuple(
        expected_checksum(decode.group.geometry, request_id, r)
        for r in range(decode.group.tp_size))
    decode.release(result)


def no_leaks(*groups) -> None:
    for g in groups:
        wait_until(lambda: g.stats()["pages_used"] == 0, 15, f"{g.node_id} pages back")


@pytest.fixture(scope="module")
def prefill(hosts):
    prefill_hosts, _ = hosts
    with PrefillServer(SPEC, 2, "DLS", num_pages=8, config=FAST, model=SLOW,
                       launcher=prefill_hosts.launcher()) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="module")
def decode(prefill):
    """A decode group of spawned (killable) ranks, kept connected to ``prefill``."""
    with instrumented(DecodeCoordinator(SPEC, 2, "DLS", num_pages=8, config=FAST,
                                        probes="checksums")) as group:
        group.connect(prefill.address)
        yield group


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ranks_wait_for_a_frozen_coordinator_and_it_keeps_them(prefill, decode):
    """The decode coordinator's loop frozen for 3 peer timeouts: its ranks hear nothing but
    see its process alive, and wait; thawed, it does not declare them lost for its own stall
    (no restart: same processes, generation 1). The prefill server dropped it meanwhile; it
    learns so from the Goodbye to its first heartbeat and connects again."""
    transfer_ok(decode)
    pids = [h.pid for h in decode.group.handles]
    decode.group.loop.call_soon(time.sleep, 3 * FAST.peer_timeout)
    time.sleep(3 * FAST.peer_timeout + 0.5)
    transfer_ok(decode)
    assert all(alive(pid) for pid in pids)
    stats = decode.stats()
    assert stats["generation"] == 1 and stats.get("ranks_lost", 0) == 0, stats
    assert [h.pid for h in decode.group.handles] == pids
    no_leaks(prefill, decode)


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_killed_decode_rank_restarts_the_group(prefill, decode):
    """Requests in flight fail (peer_lost) at once; the node says its ranks are restarting;
    every old rank is gone before the new generation starts; the prefill server is dialled
    again and the next requests are byte-exact; nothing leaks on either side."""
    transfer_ok(decode)
    old = [h.pid for h in decode.group.handles]
    futures = [decode.submit(rid(), [5, 6, 7]) for _ in range(3)]
    time.sleep(0.2)
    killed = time.monotonic()
    os.kill(old[1], signal.SIGKILL)
    for f in futures:
        with pytest.raises(PeerLostError, match="decode rank 1"):
            f.result(timeout=10)
    assert time.monotonic() - killed < 3
    ready, why = decode.group.loop.call(decode.status)
    assert not ready and "restarting after rank 1 lost (its process exited with code -9)" in why
    with pytest.raises(NotReadyError, match="restarting"):
        decode.submit(rid(), [1])
    wait_until(lambda: decode.group.loop.call(decode.status)[0], 60, "restarted and reconnected")
    assert not any(alive(pid) for pid in old)
    assert decode.stats()["generation"] == 2 and decode.stats()["rank_restarts"] == 1
    assert decode.prefill_nodes() == [prefill.node_id]
    transfer_ok(decode)
    no_leaks(prefill, decode)


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_killed_prefill_rank_restarts_the_server_which_refuses_handshakes_meanwhile(hosts):
    """The prefill server fails the requests in flight, says Goodbye, refuses handshakes
    (``not_ready``, naming the missing ranks) until its new group is whole; the decode
    coordinator re-dials by itself and is served again."""
    _, decode_hosts = hosts
    with PrefillServer(SPEC, 2, "DLS", num_pages=8, config=FAST, model=SLOW) as server, \
            instrumented(DecodeCoordinator(SPEC, 2, "DLS", num_pages=8, config=FAST,
                                           probes="checksums",
                                           launcher=decode_hosts.launcher())) as decode:
        server.wait_ready()
        decode.connect(server.address)
        transfer_ok(decode)
        old = [h.pid for h in server.group.handles]
        futures = [decode.submit(rid(), [2, 7]) for _ in range(3)]
        time.sleep(0.2)
        os.kill(old[0], signal.SIGKILL)
        for f in futures:
            with pytest.raises(PeerLostError):
                f.result(timeout=10)
        sock = c.connect_dealer(zmq.Context.instance(), server.address)
        try:
            sock.send(m.encode(m.Hello(compat_hash=m.compat_hash(SPEC.to_json()),
                                       node_id="late", role="decode")))
            assert sock.poll(5000)
            reply = m.decode(sock.recv())
        finally:
            sock.close(0)
        assert isinstance(reply, m.Reject) and reply.code == "not_ready", reply
        assert "restarting after rank 0 lost" in reply.reason and "waiting for ranks [" in \
            reply.reason, reply.reason
        wait_until(lambda: decode.group.loop.call(decode.status)[0], 60, "prefill re-dialled")
        assert not any(alive(pid) for pid in old)
        assert server.stats()["generation"] == 2
        transfer_ok(decode)
        no_leaks(server, decode)


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_too_many_restarts_fail_the_group_for_good():
    """max_rank_restarts=1: the first loss restarts, the second fails the group: ``fatal``
    says why, the fatal handlers run, requests are refused, the ranks are stopped."""
    config = FAST.replace(max_rank_restarts=1)
    with DecodeCoordinator(SPEC, 1, "DLS", num_pages=4, config=config) as decode:
        decode.wait_ready()
        failed: list[str] = []
        decode.group.loop.call(decode.group.on_fatal, failed.append)
        os.kill(decode.group.handles[0].pid, signal.SIGKILL)
        wait_until(lambda: decode.stats()["generation"] == 2 and
                   decode.group.loop.call(decode.whole)[0], 60, "restarted once")
        second = decode.group.handles[0].pid
        os.kill(second, signal.SIGKILL)
        wait_until(lambda: decode.fatal, 10, "the group failed")
        assert "rank 0 lost (its process exited with code -9)" in decode.fatal
        assert "1 restarts within the last 600 s already" in decode.fatal
        assert failed == [decode.fatal]
        ready, why = decode.group.loop.call(decode.status)
        assert not ready and why.startswith(f"decode group {decode.node_id} failed: ")
        with pytest.raises(PeerLostError, match="failed"):
            decode.submit_local(rid(), [1, 2])
        assert decode.stats()["generation"] == 2


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_restart_that_cannot_start_fails_the_group(tmp_path, monkeypatch):
    flag = tmp_path / "broken"
    monkeypatch.setenv("STATEBRIDGE_TEST_FAIL_FLAG", str(flag))     # inherited by the ranks
    with PrefillServer(SPEC, 1, "DLS", num_pages=4, config=FAST,
                       model="tests.connector._helpers:FailsOnceFlaggedModel") as server:
        server.wait_ready()
        flag.touch()
        os.kill(server.group.handles[0].pid, signal.SIGKILL)
        wait_until(lambda: server.fatal, 60, "the group failed")
        assert "restarting the rank group failed" in server.fatal
        assert "rank 0 failed to start" in server.fatal and "says so" in server.fatal
        assert not server.stats()["ready"]


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_rank_start_timeout_bounds_the_start_and_names_the_ranks():
    config = FAST.replace(rank_start_timeout=3.0)
    server = PrefillServer(SPEC, 1, "DLS", num_pages=4, config=config,
                           model="tests.connector._helpers:HangingModel")
    try:
        start = time.monotonic()
        with pytest.raises(StartupError, match=r"ranks \[0\] did not start within 3 s"):
            server.wait_ready()
        assert time.monotonic() - start < 3.0 + 1.0
    finally:
        server.close()
    assert not any(h.is_alive() for h in server.group.handles)
