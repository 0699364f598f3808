"""The soak in its short form (benchmarks/soak.py): a few hundred requests through real rank
processes with random aborts, an abort storm, a SIGKILLed prefill rank and a closed prefill
server -- every request ends, only with the expected kinds, and nothing is leaked.

Also the bugs the soak found, each pinned without processes (a coordinator with no ranks and
the rank messages fed in by hand):

- a prefill rank lost with requests in flight freed their pages twice (``rank_lost`` ran
  ``_maybe_free`` after ``_fail`` had freed) -- the DoubleFreeError stopped the loop over the
  requests, so the rest hung until the server was closed -- and a freed page restarted a
  waiting request on the broken group;
- a decode rank reporting the failure that settled a request settled it twice: DoubleFreeError,
  and the request id stayed "in flight" forever;
- a closing prefill server (Goodbye sent, its ranks still stopping) answered the decode node's
  re-dial and was connected again, then vanished without a word: requests sent to it hung
  until ``peer_timeout`` (seen in a 2x4 soak as 24 requests failing peer_lost 10 s late).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from statebridge.connector import messages as m
from statebridge.connector.group import RankHandle
from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.prefill import PrefillServer, _Peer
from statebridge.errors import TransferTimeoutError
from statebridge.testing.hosts import RankHostPool

from tests.connector._helpers import FAST, SPECS, log_to_stderr

ROOT = Path(__file__).resolve().parents[2]
SPEC = SPECS["mamba2-g1"]


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("soak", module)          # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    soak = load_soak()
    argv = ["--requests", "400", "--seconds", "120", "--drain-seconds", "60",
            "--concurrency", "16", "--pair", "1x2", "--layout", "DLS", "--model", "lfm2",
            "--faults", "kill,storm,close", "--abort-rate", "0.1", "--warmup", "100",
            "--check-every", "2", "--peer-timeout", "5", "--progress-seconds", "5",
            "--seed", "7", "--json", str(out)]
    rc = soak.main(argv)
    data = json.loads(out.read_text())
    data["rc"] = rc
    return data


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_short_soak_passes_every_check(report):
    failed = {k: c["detail"] for k, c in report["checks"].items() if not c["ok"]}
    assert not failed
    assert report["ok"] and report["rc"] == 0


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_short_soak_every_request_ended_and_counts_add_up(report):
    assert report["submitted"] == report["requests"] == 400
    assert report["ok_requests"] + report["failed"] == report["requests"]
    assert sum(report["failed_by_kind"].values()) == report["failed"]
    by_gen = report["by_prefill_generation"]
    assert sum(g["ok"] + sum(g["failed"].values()) for g in by_gen.values()) == 400
    assert report["checks"]["every_request_ended"]["detail"]["hung_count"] == 0


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_short_soak_failures_only_of_expected_kinds(report):
    assert set(report["failed_by_kind"]) <= {"aborted", "peer_lost"}
    assert report["failed_by_kind"].get("aborted", 0) > 0


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_short_soak_faults_were_injected(report):
    faults = report["faults_injected"]
    assert faults.get("restart_kill") == 1 and faults.get("restart_close") == 1
    assert faults.get("abort_before_start", 0) > 0 and faults.get("abort_after_done", 0) > 0
    assert report["aborts"] > 0
    assert [r["how"] for r in report["restarts"]] == ["kill", "close"]
    kill = report["restarts"][0]
    assert kill["in_flight_at_close"] == 0          # failed by the kill itself, not the close
    # Three prefill generations served requests; the last one after both restarts.
    assert sorted(report["by_prefill_generation"]) == ["0", "1", "2"]
    assert report["by_prefill_generation"]["2"]["ok"] > 0


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_short_soak_leaks_nothing(report):
    """With a hybrid spec (LFM2 conv + attention layers): no page and no KV block leaks, and
    the byte-exact checks covered the attention KV too."""
    assert report["kv"] and report["pages_leaked"] == 0 and report["blocks_leaked"] == 0
    for side in ("decode", "prefill"):
        assert report["end_state"][side]["blocks_free"] == \
            report["end_state"][side]["blocks_total"] > 0
    end = report["end_state"]
    for side in ("decode", "prefill"):
        assert end[side]["pages_free"] == end[side]["pages_total"] > 0
        assert end[side]["rank_pages_busy"] == [0] * len(end[side]["rank_pages_busy"])
        for rank in end["ranks"][side]:
            assert rank is not None
            assert rank["pending"] == rank["computing"] == rank["handles_outstanding"] == 0
    assert report["checked_byte_exact"] > 0
    checked = [p for p in report["rss"] if p["checked"]]
    assert {p["name"] for p in checked} >= {"coordinator (this process)", "decode rank 0",
                                            "decode rank 1", "prefill host 0"}
    assert all(p["growth_kb"] <= p["bound_kb"] for p in checked)


# -- the bugs the soak found -------------------------------------------------------------------

def _server_with_requests(started: int, waiting: int) -> tuple[PrefillServer, _Peer]:
    """A prefill server of one (absent) rank with ``started`` requests on its pages and
    ``waiting`` more waiting for a page."""
    server = PrefillServer(SPEC, 1, "DLS", num_pages=started, config=FAST, launcher=None)

    def setup() -> _Peer:
        server.group._ready.set()        # its (absent) rank counts as up: the server serves
        peer = _Peer(b"decode-peer", "decode-x")
        peer.hello = peer.connected = True
        server.peers[peer.identity] = peer
        for i in range(started + waiting):
            server._on_transfer_request(peer, m.TransferRequest(
                request_id=f"r{i}", generation=i + 1, prompt=m.pack_tokens((1, 2))))
        return peer
    return server, server.group.loop.call(setup)


def _lose_rank(server: PrefillServer, rank: int) -> None:
    server.group._rank_lost(rank)        # what a silent or exited rank process leads to


@pytest.mark.timeout(60)
def test_lost_prefill_rank_fails_every_request_once_and_starts_no_waiting_one():
    server, peer = _server_with_requests(started=2, waiting=2)
    try:
        before = server.stats()
        assert (before["requests_in_flight"], before["waiting"], before["pages_free"]) == (2, 2, 0)
        server.group.loop.call(_lose_rank, server, 0)         # raised DoubleFreeError before
        stats = server.stats()
        assert stats["pages_free"] == stats["pages_total"] == 2
        assert stats["requests_in_flight"] == 0 and stats["waiting"] == 0
        assert stats["failed_peer_lost"] == 2 and stats["rejected_peer_lost"] == 2
        assert stats.get("requests") == 2                     # no waiting one was started
        assert server.group.loop.call(lambda: peer.inflight) == 0
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_decode_rank_failure_settles_the_request_once():
    decode = DecodeCoordinator(SPEC, 1, "DLS", num_pages=2, config=FAST, launcher=None)
    decode.group._ready.set()            # its (absent) rank counts as up: the group serves
    try:
        future = decode.submit_local("r0", [1, 2])
        generation = decode.group.loop.call(lambda: decode.current["r0"].generation)
        done = m.RankDone(tp_rank=0, peer_node="", request_id="r0", generation=generation,
                          kind="timeout", message="transfer not done after 1 s")
        decode.group.loop.call(decode.group._on_rank_done, 0, done)  # raised DoubleFreeError before
        with pytest.raises(TransferTimeoutError, match="decode rank 0"):
            future.result(timeout=5)
        stats = decode.stats()
        assert stats["pages_free"] == 2 and stats["requests_in_flight"] == 0
        assert decode.group.loop.call(lambda: dict(decode.current)) == {}
        again = decode.submit_local("r0", [1, 2])            # the id is free again
        assert not again.done()
    finally:
        decode.close()


class _SlowStop(RankHandle):
    """A rank that takes ``seconds`` to stop (a busy machine): the server's loop runs on
    meanwhile, after its Goodbye."""

    def __init__(self, inner: RankHandle, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def is_alive(self) -> bool:
        return self.inner.is_alive()

    def stop(self, timeout: float) -> None:
        time.sleep(self.seconds)
        self.inner.stop(timeout)


@pytest.mark.ucx
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_closing_prefill_server_refuses_a_redial():
    with RankHostPool(1, initializer=log_to_stderr) as pool:
        def slow(setups):
            return [_SlowStop(h, 2.0) for h in pool.launcher()(setups)]

        # A zombie connection would outlive the close: silence is noticed only after 5 s.
        config = FAST.replace(peer_timeout=5.0)
        decode = DecodeCoordinator(SPEC, 1, "DLS", num_pages=4, config=config,
                                   launcher=pool.launcher())
        server = PrefillServer(SPEC, 1, "DLS", num_pages=4, config=config, launcher=slow)
        try:
            server.wait_ready()
            decode.connect(server.address)                   # kept: re-dialed when lost
            assert decode.prefill_nodes() == [server.node_id]
            server.close()          # Goodbye; the decode re-dials while the ranks stop
            # Before: the re-dial was answered and connected to the closing server, which then
            # vanished without a Goodbye; requests sent to it hung until peer_timeout.
            assert decode.prefill_nodes() == []
            assert decode.stats().get("rejected_handshakes", 0) >= 1
        finally:
            server.close()
            decode.close()
