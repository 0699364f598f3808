"""Broken on purpose: dead ranks, vanished peers, aborts, bad messages, stale completions."""

from __future__ import annotations

import os
import signal
import time
import uuid

import msgpack
import pytest
import zmq

from statebridge.connector import control as c
from statebridge.connector import messages as m
from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.prefill import PrefillServer
from statebridge.errors import (
    AbortedError,
    IncompatiblePeerError,
    PeerLostError,
    TransferError,
    TransferTimeoutError,
)
from statebridge.state.spec import StateSpec
from statebridge.testing.hosts import RankHostPool
from statebridge.testing.probes import instrumented, probes_of

from ._helpers import FAST, SPECS, SYNTHETIC, expected_checksum, log_to_stderr, thaw, wait_until

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

SPEC = SPECS["mamba2-g1"]
SLOW = "tests.connector._helpers:SlowModel"


@pytest.fixture(scope="module")
def decode_hosts():
    with RankHostPool(2, initializer=log_to_stderr) as pool:
        yield pool


@pytest.fixture(scope="module")
def prefill_hosts():
    with RankHostPool(2, initializer=log_to_stderr) as pool:
        yield pool


def ids(n):
    tag = uuid.uuid4().hex[:6]
    return [f"r{i}-{tag}" for i in range(n)]


def check_ok(decode, future, rid, timeout=30):
    result = future.result(timeout=timeout)
    assert probes_of(decode).checksums(result) == tuple(
        expected_checksum(decode.group.geometry, rid, r) for r in range(decode.group.tp_size))
    decode.release(result)


@pytest.mark.timeout(120)
def test_sigkill_prefill_rank_fails_its_requests_then_fresh_group_serves(decode_hosts,
                                                                         monkeypatch):
    """on_rank_loss=exit: the group fails for good (its node exits) and a fresh one serves."""
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.3")
    decode = instrumented(DecodeCoordinator(SPEC, 2, "DLS", num_pages=16, config=FAST,
                                            launcher=decode_hosts.launcher(), probes="checksums"))
    server = PrefillServer(SPEC, 2, "DLS", num_pages=16, config=FAST.replace(on_rank_loss="exit"),
                           model=SLOW)  # spawned
    try:
        server.wait_ready()
        decode.connect(server.address)
        first = ids(1)[0]
        check_ok(decode, decode.submit(first, [1, 2, 3]), first)
        rids = ids(6)
        futures = [decode.submit(rid, [4, 5]) for rid in rids]
        time.sleep(0.1)
        killed_at = time.monotonic()
        os.kill(server.group.handles[1].pid, signal.SIGKILL)
        failed = 0
        for f in futures:
            try:
                f.result(timeout=FAST.peer_timeout + 5)
            except PeerLostError as e:
                failed += 1
                assert e.request_id in rids
        elapsed = time.monotonic() - killed_at
        assert failed >= 1
        assert elapsed < FAST.peer_timeout + 3, f"failures took {elapsed:.1f} s"
        wait_until(lambda: decode.stats()["pages_used"] == 0, 10, "decode pages reclaimed")
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages reclaimed")
        assert not server.stats()["healthy"]
        assert "rank 1 lost (its process exited with code -9)" in server.fatal
        with pytest.raises(PeerLostError):                  # broken group refuses new work
            decode.submit(ids(1)[0], [1]).result(timeout=10)
    finally:
        server.close()
    # A fresh prefill group serves the same decode group.
    fresh = PrefillServer(SPEC, 2, "DLS", num_pages=16, config=FAST, model=SYNTHETIC)
    try:
        fresh.wait_ready()
        node = decode.connect(fresh.address)
        rid = ids(1)[0]
        check_ok(decode, decode.submit(rid, [7, 8], prefill=node), rid)
    finally:
        fresh.close()
        decode.close()
    for h in server.group.handles + fresh.group.handles:
        assert not h.is_alive()


@pytest.mark.timeout(120)
def test_sigkill_decode_rank_fails_its_requests_and_frees_prefill_pages(prefill_hosts,
                                                                        monkeypatch):
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.3")
    server = PrefillServer(SPEC, 2, "LDS", num_pages=16, config=FAST, model=SLOW,
                           launcher=prefill_hosts.launcher())
    # (on_rank_loss=exit: what the lost rank's requests get is the point here, not the
    # group's restart, which test_supervision covers; no second group to spawn)
    decode = instrumented(DecodeCoordinator(SPEC, 2, "LDS", num_pages=16,
                                            config=FAST.replace(on_rank_loss="exit"),
                                            probes="checksums"))
    try:
        server.wait_ready()
        decode.connect(server.address)
        first = ids(1)[0]
        check_ok(decode, decode.submit(first, [1, 2]), first)
        futures = [decode.submit(rid, [3]) for rid in ids(4)]
        killed_at = time.monotonic()
        os.kill(decode.group.handles[0].pid, signal.SIGKILL)
        for f in futures:
            with pytest.raises(PeerLostError, match="decode rank 0"):
                f.result(timeout=FAST.peer_timeout + 5)
        assert time.monotonic() - killed_at < FAST.peer_timeout + 3
        wait_until(lambda: server.stats()["pages_used"] == 0, 15, "prefill pages reclaimed")
        wait_until(lambda: decode.stats()["pages_used"] == 0, 10, "decode pages reclaimed")
        assert server.stats()["healthy"]                   # the prefill group serves on
    finally:
        decode.close()
        server.close()


@pytest.mark.timeout(120)
def test_prefill_pages_free_when_the_sends_complete_even_if_decode_vanishes(prefill_hosts,
                                                                            monkeypatch):
    """The prefill side frees a page when its own ranks' sends completed: the decode
    coordinator vanishing right after submitting (its ranks still receive) costs no lease."""
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.5")
    config = FAST.replace(lease_timeout=30.0, peer_timeout=60.0)
    server = PrefillServer(SPEC, 2, "LDS", num_pages=8, config=config, model=SLOW,
                           launcher=prefill_hosts.launcher())
    decode = DecodeCoordinator(SPEC, 2, "LDS", num_pages=8, config=config)   # spawned ranks
    try:
        server.wait_ready()
        decode.connect(server.address)
        for rid in ids(3):
            decode.submit(rid, [1, 2])
        decode.group.loop.request_stop()             # gone without a word
        wait_until(lambda: server.stats()["pages_used"] == 3, 5, "prefill pages held")
        took = wait_until(lambda: server.stats()["pages_used"] == 0, 15, "sends complete")
        assert took < 10 and server.stats().get("leases_expired", 0) == 0
    finally:
        server.close()
        decode.close()


#: Runs of 16-64 KiB: rendezvous sends, which complete only once the receiver takes them.
BIG = StateSpec.from_config(
    {"model_type": "mamba2", "hidden_size": 128, "expand": 2, "head_dim": 16, "state_size": 64,
     "n_groups": 1, "conv_kernel": 4, "num_hidden_layers": 2, "torch_dtype": "float32"})


@pytest.mark.timeout(120)
def test_lease_expiry_frees_prefill_pages_when_the_decode_ranks_freeze(prefill_hosts,
                                                                       monkeypatch):
    """Decode ranks frozen (SIGSTOP) before they take the data: the prefill sends cannot
    complete, the lease ends them, and the pages come back once every prefill rank cancelled."""
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.5")
    config = FAST.replace(lease_timeout=2.0, peer_timeout=60.0, transfer_timeout=60.0)
    server = PrefillServer(BIG, 2, "DLS", num_pages=8, config=config, model=SLOW,
                           launcher=prefill_hosts.launcher())
    decode = DecodeCoordinator(BIG, 2, "DLS", num_pages=8, config=config)   # spawned ranks
    frozen = [h.pid for h in decode.group.handles]
    try:
        server.wait_ready()
        decode.wait_ready()
        decode.connect(server.address)
        futures = [decode.submit(rid, [1, 2]) for rid in ids(3)]
        time.sleep(0.2)                              # every receive posted; prefills running
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: server.stats()["pages_used"] == 3, 5, "prefill pages held")
        took = wait_until(lambda: server.stats()["pages_used"] == 0, 20, "lease expiry")
        assert server.stats()["leases_expired"] == 3
        assert took < config.lease_timeout + 10
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        for f in futures:                            # the decode side hears the timeout
            with pytest.raises(TransferError):
                f.result(timeout=30)
    finally:
        thaw(*frozen)
        server.close()
        decode.close()


@pytest.mark.timeout(120)
def test_the_lease_counts_from_the_final_state_not_from_queueing_and_compute(monkeypatch):
    """Prefill compute (and waiting behind other prompts on the rank) longer than the lease is
    not the decode side's delay: every request is served and no lease expires."""
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "1.0")   # read by the spawned ranks
    config = FAST.replace(lease_timeout=1.5, peer_timeout=60.0, transfer_timeout=60.0)
    with PrefillServer(SPECS["shortconv"], 1, "DLS", num_pages=4, config=config, model=SLOW) as server, \
            instrumented(DecodeCoordinator(SPECS["shortconv"], 1, "DLS", num_pages=4, config=config,
                                           probes="checksums")) as decode:
        server.wait_ready()
        decode.wait_ready()
        decode.connect(server.address)
        rids = ids(3)                    # one rank computes them one after another: 3 s > lease
        futures = [decode.submit(r, [1, 2, 3]) for r in rids]
        for r, f in zip(rids, futures):
            check_ok(decode, f, r)
        assert server.stats().get("leases_expired", 0) == 0


@pytest.mark.timeout(120)
def test_a_state_that_does_not_land_in_transfer_timeout_fails_typed_and_frees_both_sides(
        monkeypatch):
    """Both sides alive, the state late (here a prefill slower than the decode side's bound):
    the request fails ``timeout`` naming the bound, and both sides free what it held."""
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "3.0")   # read by the spawned ranks
    config = FAST.replace(lease_timeout=30.0, peer_timeout=60.0, transfer_timeout=1.0)
    with PrefillServer(SPECS["shortconv"], 1, "DLS", num_pages=4, config=config,
                       model=SLOW) as server, \
            DecodeCoordinator(SPECS["shortconv"], 1, "DLS", num_pages=4, config=config) as decode:
        server.wait_ready()
        decode.wait_ready()
        decode.connect(server.address)
        rid = ids(1)[0]
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="transfer not done after 1.0 s"):
            decode.submit(rid, [1, 2, 3]).result(timeout=30)
        assert time.monotonic() - t0 < 3.0 + 2.0
        wait_until(lambda: decode.stats()["pages_used"] == 0, 10, "decode page freed")
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill page freed")


@pytest.mark.timeout(120)
def test_abort_mid_transfer(prefill_hosts, decode_hosts, monkeypatch):
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.5")
    with PrefillServer(SPEC, 2, "DLS", num_pages=8, config=FAST, model=SLOW,
                       launcher=prefill_hosts.launcher()) as server, \
            instrumented(DecodeCoordinator(SPEC, 2, "DLS", num_pages=8, config=FAST,
                                           probes="checksums",
                                           launcher=decode_hosts.launcher())) as decode:
        server.wait_ready()
        decode.connect(server.address)
        keep, drop = ids(2)
        f_keep = decode.submit(keep, [1, 2, 3])
        f_drop = decode.submit(drop, [4, 5, 6])
        decode.abort(drop, "client went away")
        with pytest.raises(AbortedError, match="client went away") as info:
            f_drop.result(timeout=10)
        assert info.value.request_id == drop
        check_ok(decode, f_keep, keep)
        wait_until(lambda: decode.stats()["pages_used"] == 0, 10, "decode pages freed")
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
        # The id can be reused with a new generation after the abort.
        check_ok(decode, decode.submit(drop, [4, 5, 6]), drop)


def raw_peer(address: str) -> zmq.Socket:
    sock = c.connect_dealer(zmq.Context.instance(), address)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    return sock


def reply_to(sock: zmq.Socket) -> m.Message:
    """The next message on a raw peer's socket that is not a heartbeat (a server heartbeats a
    peer once it said Hello, and on a loaded machine one can come before the answer)."""
    while True:
        msg = m.decode(sock.recv())
        if not isinstance(msg, m.Heartbeat):
            return msg


@pytest.mark.timeout(120)
def test_bad_messages_get_typed_errors_and_the_server_keeps_serving(prefill_hosts,
                                                                    decode_hosts):
    with PrefillServer(SPEC, 2, "DLS", num_pages=8, config=FAST,
                       launcher=prefill_hosts.launcher(), model=SYNTHETIC) as server, \
            instrumented(DecodeCoordinator(SPEC, 2, "LDS", num_pages=8, config=FAST,
                                           probes="checksums",
                                           launcher=decode_hosts.launcher())) as decode:
        server.wait_ready()
        decode.connect(server.address)
        sock = raw_peer(server.address)
        bad = [
            (b"\xc1garbage", "ProtocolError", "undecodable"),
            (m.encode(m.Heartbeat(node_id="x", seq=1))[:-2], "ProtocolError", "undecodable"),
            (msgpack.packb({"v": 99, "t": "Hello", "b": {}}), "IncompatiblePeerError",
             "version 99"),
            (b"\x00" * (FAST.max_message_bytes + 1), "ProtocolError", "exceeds the limit"),
            (m.encode(m.TransferRequest(request_id="x", generation=1, prompt=m.pack_tokens((1,)))),
             "ProtocolError", "before Hello"),
        ]
        for data, kind, needle in bad:
            sock.send(data)
            reply = reply_to(sock)
            assert isinstance(reply, m.Error) and reply.kind == kind and needle in reply.message
        sock.send(m.encode(m.Hello(compat_hash="deadbeef", node_id="evil", role="decode")))
        reply = reply_to(sock)
        assert isinstance(reply, m.Reject) and "deadbeef" in reply.reason
        sock.close(0)
        stats = server.stats()
        assert stats["protocol_errors"] == 5 and stats["incompatible_peers"] == 1
        rid = ids(1)[0]
        check_ok(decode, decode.submit(rid, [1, 2]), rid)


@pytest.mark.timeout(120)
def test_incompatible_peer_is_refused(prefill_hosts):
    other = StateSpec.from_config({"model_type": "lfm2", "hidden_size": 8, "conv_L_cache": 3,
                                   "layer_types": ["conv"]})
    with PrefillServer(SPEC, 1, "DLS", num_pages=4, config=FAST,
                       launcher=prefill_hosts.launcher(), model=SYNTHETIC) as server, \
            DecodeCoordinator(other, 1, "DLS", num_pages=4, config=FAST,
                              launcher=prefill_hosts.launcher()) as decode:
        server.wait_ready()
        with pytest.raises(IncompatiblePeerError, match="compat hash"):
            decode.connect(server.address)


@pytest.mark.timeout(120)
def test_stale_generation_messages_are_ignored(prefill_hosts, decode_hosts, monkeypatch):
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.3")
    with PrefillServer(SPEC, 2, "DLS", num_pages=8, config=FAST, model=SLOW,
                       launcher=prefill_hosts.launcher()) as server, \
            instrumented(DecodeCoordinator(SPEC, 2, "DLS", num_pages=8, config=FAST,
                                           probes="checksums",
                                           launcher=decode_hosts.launcher())) as decode:
        server.wait_ready()
        node = decode.connect(server.address)
        rid = ids(1)[0]
        first = decode.submit(rid, [1])
        check_ok(decode, first, rid)
        future = decode.submit(rid, [2])                      # same id, new generation
        generation = decode.group.loop.call(lambda: decode.current[rid].generation)
        peer = decode.group.loop.call(lambda: decode.links.prefills[node])
        # An abort and a failure for the OLD generation arrive while the new one runs.
        decode.group.loop.call(lambda: c.send_dealer(peer.sock, m.Abort(
            request_id=rid, generation=generation - 1, reason="stale")))
        identity = server.group.loop.call(lambda: next(iter(server.peers)))
        server.group.loop.call(lambda: c.send_router(
            server.group.router, identity, m.TransferFailed(
                request_id=rid, generation=generation - 1, kind="peer_lost", message="stale")))
        check_ok(decode, future, rid)
        wait_until(lambda: server.stats().get("stale_aborts", 0) == 1, 5,
                   "stale abort counted")
        assert decode.stats().get("stale_messages", 0) == 1
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fields,needle", [
    ({"rank_pids": (1,), "rank_shm_fds": (3,)}, "shared-map pids [1] / fds [3] for TP size 2"),
    ({"rank_pids": (0, 5), "rank_shm_fds": (3, 4)}, "shared-map pids [0, 5]"),
    ({"rank_pids": (7, 8), "rank_shm_fds": (3, -1)}, "fds [3, -1]"),
    ({"shared_map_min_bytes": -1}, "shared_map_min_bytes -1 < 0"),
], ids=["short", "pid-0", "negative-fd", "negative-threshold"])
def test_bad_shared_map_fields_in_group_info_are_refused(prefill_hosts, decode_hosts, fields,
                                                         needle):
    """A GroupInfo whose shared-map fields do not fit its TP size is refused naming them; the
    server keeps serving."""
    import dataclasses

    with PrefillServer(SPEC, 2, "DLS", num_pages=4, config=FAST,
                       launcher=prefill_hosts.launcher(), model=SYNTHETIC) as server, \
            instrumented(DecodeCoordinator(SPEC, 2, "DLS", num_pages=4, config=FAST,
                                           probes="checksums",
                                           launcher=decode_hosts.launcher())) as decode:
        server.wait_ready()
        decode.wait_ready()
        sock = raw_peer(server.address)
        compat = m.compat_hash(SPEC.to_json())
        sock.send(m.encode(m.Hello(compat_hash=compat, node_id="odd", role="decode")))
        assert isinstance(reply_to(sock), m.Hello)
        info = dataclasses.replace(decode.group.loop.call(decode.group.group_info),
                                   node_id="odd", **fields)
        sock.send(m.encode(info))
        reply = reply_to(sock)
        assert isinstance(reply, m.Reject) and needle in reply.reason, reply
        sock.close(0)
        assert server.stats()["incompatible_peers"] == 1
        decode.connect(server.address)
        rid = ids(1)[0]
        check_ok(decode, decode.submit(rid, [1, 2]), rid)
