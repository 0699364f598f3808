"""A decode coordinator re-dials a prefill server it lost: after a freeze, after a restart on the
same port, past a peer that accepts the connection but never answers the handshake."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import zmq

from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.prefill import PrefillServer
from statebridge.errors import PeerLostError
from statebridge.testing.hosts import RankHostPool
from statebridge.testing.probes import instrumented, probes_of

from ._helpers import FAST, SPECS, SYNTHETIC, expected_checksum, log_to_stderr, wait_until

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

SPEC = SPECS["mamba2-g1"]
SLOW = "tests.connector._helpers:SlowModel"          # requests in flight during a freeze
SLOW_S = 2.0                                         # its seconds per prefill (rank hosts' env)
# The decode side declares the prefill server lost after 1 s of silence; the prefill group
# itself (its ranks, its watch of the decode peer) is more patient, so a 2.5 s freeze of its
# coordinator loses the connection without breaking the group.
DECODE = FAST.replace(handshake_timeout=1.5)
PREFILL = FAST.replace(peer_timeout=4.0)
BOUND = DECODE.peer_timeout * 3 + 5                 # a lost peer fails its requests within this


@pytest.fixture(scope="module")
def hosts():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", str(SLOW_S))   # read by the host processes
        with RankHostPool(2, initializer=log_to_stderr) as prefill_hosts, \
                RankHostPool(2, initializer=log_to_stderr) as decode_hosts:
            yield prefill_hosts, decode_hosts


def rid() -> str:
    return f"r-{uuid.uuid4().hex[:8]}"


def transfer_ok(decode: DecodeCoordinator, timeout: float = 30) -> None:
    """One request end to end; the decode pages hold exactly the oracle's state."""
    request_id = rid()
    result = decode.submit(request_id, [3, 1, 4]).result(timeout=timeout)
    assert probes_of(decode).checksums(result) == tuple(
        expected_checksum(decode.group.geometry, request_id, r)
        for r in range(decode.group.tp_size))
    decode.release(result)


def fail_all_peer_lost(futures, since: float) -> float:
    for f in futures:
        with pytest.raises(PeerLostError):
            f.result(timeout=BOUND + 5)
    return time.monotonic() - since


@pytest.mark.timeout(90)
def test_frozen_prefill_coordinator_is_lost_then_redialed(hosts):
    prefill_hosts, decode_hosts = hosts
    with PrefillServer(SPEC, 2, "DLS", num_pages=8, config=PREFILL, model=SLOW,
                       launcher=prefill_hosts.launcher()) as server, \
            instrumented(DecodeCoordinator(SPEC, 2, "DLS", num_pages=8, config=DECODE,
                                           probes="checksums",
                                           launcher=decode_hosts.launcher())) as decode:
        server.wait_ready()
        node = decode.connect(server.address)
        transfer_ok(decode)
        # Each prefill takes SLOW_S on the ranks, one after the other: all three are in flight
        # when the decode side gives up on the server (peer_timeout < SLOW_S).
        futures = [decode.submit(rid(), [5, 6, 7]) for _ in range(3)]
        # Freeze the prefill coordinator's event loop (as SIGSTOP would): no heartbeats, no
        # answers. Its ranks keep working (their own timeout is 4 s).
        server.group.loop.call_soon(time.sleep, 2.5)
        frozen_at = time.monotonic()
        elapsed = fail_all_peer_lost(futures, frozen_at)
        assert elapsed < BOUND, f"requests failed {elapsed:.1f} s after the freeze"
        # Nothing can land in their pages any more: every decode rank confirmed the cancel.
        wait_until(lambda: decode.stats()["pages_used"] == 0, 10, "decode pages reclaimed")
        if time.monotonic() - frozen_at < 2.0:      # still frozen: no server to send to
            with pytest.raises(PeerLostError, match="no prefill server connected"):
                decode.submit(rid(), [1]).result(timeout=5)
        # The coordinator re-dials on its own; the thawed server takes the same decode node
        # back on the new connection and drops the old one.
        wait_until(lambda: node in decode.prefill_nodes(), 20, "prefill re-dialed")
        # The server dropped the old connection of the same decode node BEFORE it connected
        # the new one (its own watch would only expire it PREFILL.peer_timeout later, and
        # then fail the new connection's endpoints on its ranks).
        server_stats = server.stats()
        assert server_stats["peers"] == 1 and server_stats["peers_lost"] == 1, server_stats
        for _ in range(2):
            transfer_ok(decode)
        stats = decode.stats()
        assert stats["prefills_lost"] == 1 and stats["prefills_reconnected"] == 1, stats
        assert stats["failed_peer_lost"] >= 3, stats
        wait_until(lambda: server.stats()["pages_used"] == 0, 15, "prefill pages reclaimed")
        server_stats = server.stats()
        assert server_stats["peers"] == 1 and server_stats["peers_lost"] == 1, server_stats
        assert server_stats["healthy"]


@pytest.mark.timeout(90)
def test_prefill_restarted_on_the_same_port_past_a_silent_listener(hosts, caplog):
    prefill_hosts, decode_hosts = hosts
    caplog.set_level(logging.DEBUG, logger="statebridge.connector.decode")
    first = PrefillServer(SPEC, 2, "LDS", num_pages=8, config=PREFILL,
                          launcher=prefill_hosts.launcher(), model=SYNTHETIC)
    second = None
    silent_ctx = zmq.Context()       # its own context: term() returns once the port is free
    silent = None
    try:
        with instrumented(DecodeCoordinator(SPEC, 2, "DLS", num_pages=8, config=DECODE,
                                            probes="checksums",
                                            launcher=decode_hosts.launcher())) as decode:
            first.wait_ready()
            old = decode.connect(first.address)
            transfer_ok(decode)
            port = first.group.port
            first.close()                                  # says Goodbye: lost at once
            wait_until(lambda: not decode.prefill_nodes(), 5, "prefill lost")
            with pytest.raises(PeerLostError, match="no prefill server connected"):
                decode.submit(rid(), [1]).result(timeout=5)
            # Something takes the port that accepts connections and never answers: the
            # re-dial's handshake must time out and the next attempt must reach the real one.
            silent = silent_ctx.socket(zmq.ROUTER)
            silent.setsockopt(zmq.LINGER, 0)

            def bind() -> bool:               # zmq frees the old server's port asynchronously
                try:
                    silent.bind(f"tcp://127.0.0.1:{port}")
                    return True
                except zmq.ZMQError:
                    return False
            wait_until(bind, 10, f"port {port} free again")
            wait_until(lambda: silent.poll(0), 10, "a re-dial reached the silent listener")
            reached = time.time()
            wait_until(lambda: any("handshake did not finish" in r.getMessage()
                                   for r in caplog.records if r.created > reached), 10,
                       "hung handshake timed out")
            silent.close(0)
            silent = None
            silent_ctx.term()
            second = PrefillServer(SPEC, 2, "LDS", num_pages=8, config=PREFILL, port=port,
                                   launcher=prefill_hosts.launcher(), model=SYNTHETIC)
            second.wait_ready()
            wait_until(lambda: decode.prefill_nodes() == [second.node_id], 20,
                       "restarted prefill re-dialed")
            assert second.node_id != old
            for _ in range(3):
                transfer_ok(decode)
            stats = decode.stats()
            assert stats["prefills_reconnected"] == 1, stats
            assert stats["pages_used"] == 0
            wait_until(lambda: second.stats()["pages_used"] == 0, 10, "prefill pages freed")
            # One line when the server was lost, one when it came back; failed attempts with
            # the same reason as the one before are not logged one by one above DEBUG.
            messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
            assert sum("re-dialing every" in msg for msg in messages) == 1, messages
            assert sum("connected again" in msg for msg in messages) == 1, messages
    finally:
        if silent is not None:
            silent.close(0)
        silent_ctx.term()
        first.close()
        if second is not None:
            second.close()


@pytest.mark.timeout(60)
def test_close_stops_redialing(hosts):
    prefill_hosts, decode_hosts = hosts
    server = PrefillServer(SPEC, 1, "DLS", num_pages=4, config=PREFILL,
                           launcher=prefill_hosts.launcher(), model=SYNTHETIC)
    decode = DecodeCoordinator(SPEC, 1, "DLS", num_pages=4, config=DECODE,
                               launcher=decode_hosts.launcher())
    try:
        server.wait_ready()
        decode.connect(server.address)
        server.close()
        wait_until(lambda: decode.group.loop.call(
            lambda: decode.links._dials[server.address].attempts) >= 1, 10, "re-dialing started")
    finally:
        server.close()
        decode.close()
    assert decode.links._dials == {}
    assert decode.links._by_sock == {}              # the attempt's socket was closed too
