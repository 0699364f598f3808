"""The runtime's start-up and error paths: a decode coordinator started before its prefill
server, ranks that fail to start, two decode nodes that use the same request id, the loop's
own timeout, and the one table between failure kinds and exception classes."""

from __future__ import annotations

import threading
import time

import pytest

from statebridge.bench.ab import with_switches
from statebridge.connector import control as c
from statebridge.connector.group import spawn_launcher
from statebridge.connector.decode import DecodeCoordinator
from statebridge.testing.hosts import RankHostPool
from statebridge.connector.prefill import PrefillServer
from statebridge.errors import (
    AbortedError,
    BusyError,
    ClosedError,
    FailureKind,
    InvalidRequestError,
    LoopTimeoutError,
    NotReadyError,
    PeerLostError,
    StartupError,
    StatebridgeError,
    TransferError,
    TransferTimeoutError,
    error_for,
    kind_of,
)
from statebridge.net import free_port
from statebridge.testing.probes import instrumented, probes_of

from ._helpers import FAST, SPECS, SYNTHETIC, expected_checksum, log_to_stderr, wait_until

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

SPEC = SPECS["mamba2-g1"]


@pytest.fixture(scope="module")
def pools():
    with RankHostPool(2, initializer=log_to_stderr) as prefill_hosts, \
            RankHostPool(2, initializer=log_to_stderr) as decode_hosts, \
            RankHostPool(2, initializer=log_to_stderr) as other_hosts:
        yield prefill_hosts, decode_hosts, other_hosts


@pytest.mark.timeout(120)
def test_decode_started_before_its_prefill_server_dials_until_it_is_up(pools):
    prefill_hosts, decode_hosts, _ = pools
    port = free_port()
    address = f"127.0.0.1:{port}"
    with instrumented(DecodeCoordinator(SPEC, 2, "DLS", num_pages=4, config=FAST,
                                        launcher=decode_hosts.launcher(),
                                        probes="checksums")) as decode:
        assert decode.connect(address, wait=False) is None          # returns at once
        ready, why = decode.group.loop.call(decode.status)
        assert not ready and address in why and "no prefill server connected" in why
        with pytest.raises(NotReadyError, match="no prefill server connected") as info:
            decode.submit("early", [1, 2, 3])
        assert isinstance(info.value, PeerLostError)                # retryable, typed
        assert decode.stats()["pages_used"] == 0                    # the refusal held nothing
        time.sleep(1.5)                                             # a few failed dials
        with PrefillServer(SPEC, 2, "DLS", num_pages=4, config=FAST, port=port,
                           launcher=prefill_hosts.launcher(), model=SYNTHETIC) as server:
            server.wait_ready()
            wait_until(lambda: decode.group.loop.call(decode.status)[0], 30, "prefill dialled")
            assert decode.prefill_nodes() == [server.node_id]
            result = decode.submit("late", [1, 2, 3]).result(timeout=30)
            assert probes_of(decode).checksums(result) == tuple(
                expected_checksum(decode.group.geometry, "late", r) for r in range(2))
            decode.release(result)


@pytest.mark.timeout(120)
def test_two_decode_nodes_may_use_the_same_request_id(pools):
    prefill_hosts, decode_hosts, other_hosts = pools
    with PrefillServer(SPEC, 2, "DLS", num_pages=8, config=FAST,
                       launcher=prefill_hosts.launcher(), model=SYNTHETIC) as server, \
            instrumented(DecodeCoordinator(SPEC, 2, "DLS", num_pages=4, config=FAST,
                                           launcher=decode_hosts.launcher(),
                                           probes="checksums")) as a, \
            instrumented(DecodeCoordinator(SPEC, 2, "LDS", num_pages=4, config=FAST,
                                           launcher=other_hosts.launcher(),
                                           probes="checksums")) as b:
        server.wait_ready()
        a.connect(server.address)
        b.connect(server.address)
        for round_ in range(3):
            # Both nodes number their attempts from 1: the same (request id, generation)
            # reaches the prefill ranks twice at once.
            fa, fb = a.submit("same-id", [1, 2]), b.submit("same-id", [1, 2])
            ra, rb = fa.result(timeout=30), fb.result(timeout=30)
            assert ra.generation == rb.generation == round_ + 1
            for node, result in ((a, ra), (b, rb)):
                assert probes_of(node).checksums(result) == tuple(
                    expected_checksum(node.group.geometry, "same-id", r) for r in range(2))
                node.release(result)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
        assert server.stats()["requests"] == 6


@pytest.mark.timeout(120)
def test_a_group_without_a_model_moves_state_but_computes_none(pools):
    """Groups run no model unless one is named: a prefill group without one fails each
    request with a typed error naming the missing setting, and serves on; its pages go back."""
    prefill_hosts, decode_hosts, _ = pools
    with PrefillServer(SPEC, 2, "DLS", num_pages=4, config=FAST,
                       launcher=prefill_hosts.launcher()) as server, \
            DecodeCoordinator(SPEC, 2, "DLS", num_pages=4, config=FAST,
                              launcher=decode_hosts.launcher()) as decode:
        server.wait_ready()
        decode.connect(server.address)
        for rid in ("none-1", "none-2"):
            with pytest.raises(TransferError, match="has no model .RankSetup.model is empty"):
                decode.submit(rid, [1, 2, 3]).result(timeout=30)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
        # (The caller hears the failure at once; the page frees once the ranks confirmed.)
        wait_until(lambda: decode.stats()["pages_used"] == 0, 10, "decode pages freed")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model,needle,local_ranks", [
    ("tests.connector._helpers:FailingModel", "rank 1 failed to start: RuntimeError: no such "
                                              "weight file /nowhere/model.safetensors", True),
    ("tests.connector._helpers:FailingModel", "rank 1 failed to start: RuntimeError: no such "
                                              "weight file /nowhere/model.safetensors", False),
    ("tests.connector._helpers:ExitingModel", "rank 1 failed to start: its process exited "
                                              "(code 3)", True),
], ids=["failing-local", "failing-network", "exiting"])
def test_a_rank_failing_at_start_fails_the_group_at_once_with_its_error(model, needle,
                                                                          local_ranks):
    """The failing rank reports over the channel its group's ranks use (the local channel,
    or the network when ranks are not local), and the group takes it from there."""
    started = time.monotonic()
    server = PrefillServer(SPEC, 2, "DLS", num_pages=2,
                           config=with_switches(FAST, local_ranks=local_ranks),
                           launcher=spawn_launcher, model=model)
    try:
        with pytest.raises(StartupError) as info:
            server.wait_ready(timeout=300)
        assert needle in str(info.value)
        assert "rank 0" not in str(info.value)
        # At once: not after wait_ready's timeout (the spawn itself takes seconds here).
        assert time.monotonic() - started < 120
    finally:
        server.close()
    assert all(not h.is_alive() for h in server.group.handles)


def test_loop_call_timeout_is_a_typed_statebridge_error():
    loop = c.EventLoop("stuck")
    loop.start()
    release = threading.Event()
    try:
        loop.call_soon(release.wait, 5.0)                          # the loop is busy
        with pytest.raises(LoopTimeoutError, match="did not run") as info:
            loop.call(lambda: None, timeout=0.2)
        assert isinstance(info.value, StatebridgeError) and isinstance(info.value, TimeoutError)
    finally:
        release.set()
        loop.stop()


@pytest.mark.parametrize("kind,cls", [
    (FailureKind.TRANSFER_ERROR, TransferError), (FailureKind.PEER_LOST, PeerLostError),
    (FailureKind.TIMEOUT, TransferTimeoutError), (FailureKind.ABORTED, AbortedError),
    (FailureKind.BUSY, BusyError), (FailureKind.NOT_READY, NotReadyError),
    (FailureKind.INVALID_REQUEST, InvalidRequestError), (FailureKind.CLOSED, ClosedError),
])
def test_every_failure_kind_crosses_the_wire_as_its_own_class(kind, cls):
    error = error_for(kind.value, "why", request_id="r1", peer="p")
    assert type(error) is cls and str(error) == "why"
    assert kind_of(error) is kind
    assert FailureKind.parse(str(kind)) is kind and f"{kind}" == kind.value
    if isinstance(error, TransferError):
        assert (error.request_id, error.peer, error.kind) == ("r1", "p", kind)


def test_an_unknown_kind_from_a_newer_peer_is_a_transfer_error():
    assert type(error_for("frobnicated", "x")) is TransferError
    assert kind_of(ValueError("a model's own error")) is FailureKind.TRANSFER_ERROR
