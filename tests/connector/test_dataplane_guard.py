"""The data plane accepts only transfers the control plane announced.

A rogue UCX worker sends a decode rank messages of generations it was never told about, of
finished attempts, of a pending attempt with tags no receive has, and of the right tag with the
wrong size. Checked: the rank's sweep (run from its heartbeat) rejects them into scratch memory
and counts them, the page buffer is byte-for-byte unchanged, a message longer than its posted
receive fails that transfer with a TransferError and is counted, and the next legitimate
transfer is byte-exact.

The first tests drive a real :class:`RankWorker` in this process (its loop is not started: the
test calls its handlers and pumps progress itself, so every step is deterministic); the last one
runs real prefill and decode groups in rank processes and a rogue worker beside them.
"""

from __future__ import annotations

import hashlib
import time
import uuid

import numpy as np
import pytest

from statebridge.config import ConnectorConfig
from statebridge.connector import messages as m
from statebridge.connector.ledger import RequestKey
from statebridge.connector.rank import RankSetup, RankWorker
from statebridge.connector.rank.worker import generation_after
from statebridge.connector.data import STAGED_INDEX, Transport, alloc_buffer, make_tag
from statebridge.errors import ConfigError
from statebridge.state.layout import PageGeometry
from statebridge.state.plan import TransferPlan
from statebridge.testing.probes import instrumented, probes_of

from ._helpers import FAST, SPECS, SYNTHETIC, expected_checksum, log_to_stderr, wait_until

pytestmark = [pytest.mark.ucx]

SPEC = SPECS["mamba2-g1"]
NUM_PAGES = 4
GRACE = 1.0                                 # the rank's peer_timeout: its sweep's grace period
CONFIG = ConnectorConfig(heartbeat_interval=0.1, peer_timeout=GRACE, transfer_timeout=10.0)


def sha(data: np.ndarray) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()


class Bench:
    """A decode RankWorker (TP 1), a legitimate prefill-rank transport, a rogue transport."""

    def __init__(self, src_layout: str, dst_layout: str) -> None:
        setup = RankSetup(role="decode", coordinator="127.0.0.1:9", tp_rank=0, tp_size=1,
                          spec_json=SPEC.to_json(), layout=dst_layout, num_pages=NUM_PAGES,
                          node_id="decode-guard", config=CONFIG)
        self.worker = RankWorker(setup)
        self.sent: list[m.Message] = []
        self.worker._send = self.sent.append             # RankDone / Heartbeat to the coordinator
        src_geo = PageGeometry(SPEC, 1, src_layout, region_align=16)
        self.plan = TransferPlan(src_geo, self.worker.geometry)
        self.src = Transport(alloc_buffer(src_geo.page_size * NUM_PAGES), name="prefill")
        src_page = self.src.posting.page_np
        src_page[:] = np.random.default_rng(1).integers(0, 256, src_page.size, dtype=np.uint8)
        self.rogue = Transport(alloc_buffer(1 << 20), name="rogue")
        self.rogue.posting.page_np[:] = 0xAB
        self.worker._on_connect(self.peer_info(src_layout))
        self.src.connect("dec", self.worker.transport.address)
        self.rogue.connect("dec", self.worker.transport.address)
        self.page = self.worker.cache.buffer.numpy()
        self.page[:] = np.random.default_rng(2).integers(0, 256, self.page.size, dtype=np.uint8)
        self.expected = self.page.copy()                 # what the page buffer must hold

    def peer_info(self, layout: str) -> m.GroupInfo:
        """The prefill group's GroupInfo, as its coordinator would forward it to the rank."""
        return m.GroupInfo(node_id="pf", role="prefill", tp_size=1, layout=layout,
                           page_size=self.plan.src.page_size, region_align=16,
                           num_pages=NUM_PAGES, spec_json=SPEC.to_json(),
                           rank_addresses=(self.src.address,))

    @property
    def stats(self) -> dict:
        return self.worker.transport.stats()

    def pump(self, until, timeout: float = 10.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.src.progress()
            self.rogue.progress()
            self.worker.transport.progress()
            self.worker._poll_transfers()
            if until():
                return
        raise AssertionError(f"{what or until}: not true after {timeout} s")

    def announce(self, generation: int, page: int) -> None:
        self.worker._on_recv(m.RankRecv(request_id=f"r{generation}", generation=generation,
                                        page=page, peer_node="pf"))

    def send_legit(self, generation: int, src_page: int, dst_page: int, *,
                   lands: bool = True) -> list:
        src_base = src_page * self.plan.src.page_size
        dst_base = dst_page * self.plan.dst.page_size
        handles = []
        for pair in self.plan.for_source(0):
            if pair.staged:
                pack = pair.pack + np.array([src_base, 0, 0], dtype=np.int64)
                handles.append(self.src.post_send_staged("dec", generation, 0, pack))
            else:
                handles.append(self.src.post_send("dec", generation, 0,
                                                  pair.runs_at(src_base, dst_base)))
            if lands and pair.staged:              # pack into staging, unpack into the page
                stage = np.zeros(pair.staging_bytes, np.uint8)
                for s, o, n in pair.pack.tolist():
                    stage[o:o + n] = self.src.posting.page_np[src_base + s:src_base + s + n]
                for o, d, n in pair.unpack.tolist():
                    self.expected[dst_base + d:dst_base + d + n] = stage[o:o + n]
            elif lands:
                for s, d, n in pair.runs_at(src_base, dst_base).tolist():
                    self.expected[d:d + n] = self.src.posting.page_np[s:s + n]
        return handles

    def rank_done(self, generation: int) -> m.RankDone | None:
        return next((x for x in self.sent if isinstance(x, m.RankDone)
                     and x.generation == generation), None)

    def rogue_send(self, generation: int, index: int, nbytes: int):
        """One raw tagged message (a UCX request; ``.completed`` once the rank took it)."""
        posting = self.rogue.posting
        (request,) = posting.post_one(self.rogue.endpoints.endpoint("dec").tag_send,
                                      posting.view(0, nbytes), make_tag(generation, 0, index),
                                      "dec")
        return request

    def sweep(self, grace: float = GRACE) -> int:
        return self.worker.transport.reject_unannounced(self.worker._may_arrive, grace=grace)

    def close(self) -> None:
        self.worker.close()
        self.src.close()
        self.rogue.close()


@pytest.fixture
def bench(request):
    b = Bench(*getattr(request, "param", ("DLS", "DLS")))
    yield b
    b.close()


def test_generation_order_survives_the_wrap_around():
    assert generation_after(6, 5) and not generation_after(5, 5)
    assert not generation_after(4, 5)
    assert generation_after(2, 0xFFFFFFFE)               # after 2**32 attempts
    assert not generation_after(0xFFFFFFFE, 2)


@pytest.mark.timeout(60)
def test_unannounced_messages_are_rejected_into_scratch_and_counted(bench):
    b = bench
    b.announce(5, page=1)
    # Sizes below and above the 8 KiB rendezvous threshold, and above the 64 KiB scratch.
    rogue = [b.rogue_send(2, 0, 64),             # stale: older than the announced generation
             b.rogue_send(3, 0, 100_000),        # stale, rendezvous, truncated into scratch
             b.rogue_send(5, 777, 256),          # the pending attempt, a tag it never posted
             b.rogue_send(1_000, 0, 20_000)]     # a generation not (yet) announced
    # Both stale ones go at once; the sweep stops at the pending attempt's stray message
    # (a receive might still take it within the grace period, 60 s here).
    b.pump(lambda: b.sweep(grace=60) and False or b.stats["rejected_unannounced"] >= 2,
           what="stale messages rejected")
    b.sweep(grace=60)
    assert b.stats["rejected_unannounced"] == 2
    assert b.stats["rejected_unannounced_bytes"] == 64 + 100_000

    legit = b.send_legit(5, src_page=3, dst_page=1)
    b.pump(lambda: b.rank_done(5) is not None, what="legitimate transfer done")
    assert b.rank_done(5).kind == "", b.rank_done(5).message
    assert sha(b.page) == sha(b.expected), "page buffer differs from the legitimate transfer"

    # Generation 5 is finished now: its stray message is stale and goes at once (the rank's
    # heartbeat runs the sweep); the never-announced generation goes once it has waited the
    # grace period (the rank's peer_timeout).
    b.worker._heartbeat()
    assert b.stats["rejected_unannounced"] == 3
    b.worker._heartbeat()
    assert b.stats["rejected_unannounced"] == 3
    time.sleep(GRACE)
    b.worker._heartbeat()
    stats = b.stats
    assert stats["rejected_unannounced"] == 4
    assert stats["rejected_unannounced_bytes"] == 64 + 100_000 + 256 + 20_000
    # Every rogue send completed: the rank received each one (into scratch, not pages).
    b.pump(lambda: all(r.completed for r in rogue) and all(h.done() for h in legit),
           what="rogue sends completed")
    assert [r.status for r in rogue] == [0, 0, 0, 0]
    assert sha(b.page) == sha(b.expected), "a rejected message wrote into the page buffer"
    assert b.sweep(grace=0) == 0

    b.announce(6, page=2)                       # the next legitimate transfer is byte-exact
    b.send_legit(6, src_page=0, dst_page=2)
    b.pump(lambda: b.rank_done(6) is not None, what="second transfer done")
    assert b.rank_done(6).kind == ""
    assert sha(b.page) == sha(b.expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bench", [("DLS", "DLS"), ("LSD", "DLS")], indirect=True,
                         ids=["zero-copy", "staged"])
def test_message_longer_than_its_receive_fails_the_transfer_typed(bench):
    b = bench
    (pair,) = b.plan.for_destination(0)
    assert pair.staged == (b.plan.src.layout != b.plan.dst.layout)
    posted = int(pair.pack[:, 2].sum()) if pair.staged else int(pair.runs[0, 2])
    index = STAGED_INDEX if pair.staged else 0
    b.announce(7, page=1)
    b.rogue_send(7, index, posted + 16)
    b.pump(lambda: b.rank_done(7) is not None, what="wrong-size transfer failed")
    done = b.rank_done(7)
    assert done.kind == "transfer_error"
    assert "longer than its posted receive" in done.message and "generation 7" in done.message
    assert b.stats["rejected_wrong_size"] == 1
    assert b.stats["failures"].get("transfer_error") == 1
    assert sha(b.page) == sha(b.expected), "the truncated message wrote into the page"

    # The legitimate sends of the failed attempt arrive late: stale, swept, none lands.
    late = b.send_legit(7, src_page=1, dst_page=1, lands=False)
    b.pump(lambda: (b.sweep(), all(h.done() for h in late))[1], what="late sends swept")
    assert all(h.ok for h in late)
    assert b.stats["rejected_unannounced"] == sum(h.messages for h in late)
    assert sha(b.page) == sha(b.expected)

    b.announce(8, page=2)
    b.send_legit(8, src_page=2, dst_page=2)
    b.pump(lambda: b.rank_done(8) is not None, what="next transfer done")
    assert b.rank_done(8).kind == "", b.rank_done(8).message
    assert sha(b.page) == sha(b.expected)


def test_sweep_rejects_bad_grace(bench):
    with pytest.raises(ConfigError, match="-1"):
        bench.worker.transport.reject_unannounced(lambda g, s: False, grace=-1)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_decode_rank_processes_sweep_rogue_messages_and_keep_serving():
    """Real rank processes: a rogue worker's rendezvous send to a decode rank completes only
    because the rank's heartbeat sweep received it (into scratch); transfers stay exact."""
    from statebridge.connector.decode import DecodeCoordinator
    from statebridge.testing.hosts import RankHostPool
    from statebridge.connector.prefill import PrefillServer

    with RankHostPool(1, initializer=log_to_stderr) as hosts, \
            PrefillServer(SPEC, 1, "DLS", num_pages=4, config=FAST,
                          launcher=hosts.launcher(), model=SYNTHETIC) as server, \
            instrumented(DecodeCoordinator(SPEC, 1, "LDS", num_pages=4, config=FAST,
                                           probes="checksums",
                                           launcher=hosts.launcher())) as decode, \
            Transport(alloc_buffer(1 << 20), name="rogue") as rogue:
        server.wait_ready()
        decode.connect(server.address)
        rid = f"guard-{uuid.uuid4().hex[:6]}"
        result = decode.submit(rid, [1, 2, 3]).result(timeout=30)
        assert probes_of(decode).checksums(result) == (
            expected_checksum(decode.group.geometry, rid, 0),)
        decode.release(result)
        rogue.connect("dec", decode.group.rank_addresses[0])
        runs = np.array([[0, 0, 200_000]], np.int64)     # rendezvous: needs the receiver
        stale = rogue.post_send("dec", result.generation, 0, runs)
        future = rogue.post_send("dec", result.generation + 1000, 0, runs)
        wait_until(stale.done, 10, "stale-generation send taken by the sweep")
        wait_until(future.done, 10 + FAST.peer_timeout, "unannounced send taken by the sweep")
        stale.wait(0)
        future.wait(0)
        rid = f"guard-{uuid.uuid4().hex[:6]}"
        result = decode.submit(rid, [4, 5]).result(timeout=30)
        assert probes_of(decode).checksums(result) == (
            expected_checksum(decode.group.geometry, rid, 0),)
        decode.release(result)


@pytest.mark.timeout(60)
def test_a_receive_that_cannot_be_posted_is_answered_at_once(bench):
    """Posting to a peer declared lost raises inside the rank: the rank must answer the
    coordinator right away (not leave the request to the transfer timeout)."""
    bench.worker.transport.fail_peer("pf/0", "test: declared lost")
    started = time.monotonic()
    bench.announce(7, 1)
    done = bench.rank_done(7)
    assert done is not None, "no RankDone for a receive that could not be posted"
    assert done.kind == "peer_lost", done
    assert "posting failed" in done.message and "pf/0" in done.message
    assert (done.request_id, done.generation) == ("r7", 7)
    assert RequestKey("pf", "r7", 7) not in bench.worker.pending
    assert time.monotonic() - started < CONFIG.transfer_timeout
    assert bench.worker.transport.stats()["handles_outstanding"] == 0


@pytest.mark.timeout(60)
def test_a_node_connecting_again_gets_fresh_endpoints(bench):
    """A GroupInfo for a node the rank knows (it re-dialed after a cut link) replaces the
    old endpoints: the old one is failed (a lost peer), the new one carries transfers."""
    before = bench.worker.transport.stats()
    bench.worker._on_connect(bench.peer_info("DLS"))
    after = bench.worker.transport.stats()
    assert after["peers_failed"] == before["peers_failed"] + 1
    assert after["peers"] == before["peers"]
    bench.announce(3, 2)
    handles = bench.send_legit(3, 1, 2)
    bench.pump(lambda: bench.rank_done(3) is not None and all(h.done() for h in handles),
               what="transfer over the fresh endpoint")
    assert bench.rank_done(3).kind == "", bench.rank_done(3)
    np.testing.assert_array_equal(bench.page, bench.expected)
