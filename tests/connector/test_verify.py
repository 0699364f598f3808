"""End-to-end transfer verification (``ConnectorConfig.verify_transfers``): the digest each
prefill rank computes of what it sends each decode rank, checked against an independent
computation from the prefill page; a byte flipped in what landed fails exactly that request,
named and counted, while the others succeed and nothing is held; off, nothing is computed; a
decode node that verifies refuses a prefill node that does not send digests."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import torch

from statebridge.connector import messages as m
from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.prefill import PrefillServer
from statebridge.connector.rank import KVBlocks
from statebridge.connector.rank.digest import StreamDigest, total
from statebridge.errors import FailureKind, IncompatiblePeerError, TransferError
from statebridge.state.cache import StateCache
from statebridge.state.kv import BlockGeometry, KVPlan, range_start
from statebridge.state.layout import PageGeometry
from statebridge.state.plan import TransferPlan
from statebridge.testing.hosts import RankHostPool
from statebridge.testing.probes import Probes
from statebridge.testing.synthetic import fill_kv, fill_page, global_kv, global_state, \
    request_seed

from ._helpers import FAST, SPECS, SYNTHETIC, expected_checksum, wait_until

VERIFY = FAST.replace(verify_transfers=True)
CORRUPTING = "tests.connector._helpers:CorruptingModel"
BS = 16
KV_BLOCKS = 64


# -- the digest itself ---------------------------------------------------------------------------
def reference_digest(stream: bytes) -> int:
    """The definition in plain numpy: the stream's little-endian 64-bit words (the last one
    zero-padded), word k weighted by 2 * (k // 16) + 1 (its 128-byte chunk), summed mod
    2**64."""
    raw = np.frombuffer(stream, dtype=np.uint8)
    raw = np.concatenate([raw, np.zeros(-len(raw) % 8, dtype=np.uint8)])
    words = raw.view("<u8")
    chunk = np.arange(len(words), dtype=np.uint64) // np.uint64(16)
    with np.errstate(over="ignore"):
        return int((words * (2 * chunk + 1)).sum(dtype=np.uint64))


RUN_CASES = [
    pytest.param([0], [8], id="one-word"),
    pytest.param([0], [128], id="one-chunk"),
    pytest.param([8, 264, 520, 776], [256, 256, 256, 256], id="strided-chunks"),
    pytest.param([0, 1024, 128], [128, 384, 128], id="whole-chunks-mixed"),
    pytest.param([8, 40, 72, 104], [16, 16, 16, 16], id="strided-words"),
    pytest.param([0], [8 * 5000 + 24], id="long-run"),
    pytest.param([16, 4096, 64], [24, 800, 8], id="mixed"),
    pytest.param([3, 11], [5, 9], id="unaligned"),
    pytest.param([0, 8, 1000, 1010], [8, 8 * 700, 6, 2], id="aligned-then-odd"),
    pytest.param([], [], id="empty"),
]


@pytest.mark.parametrize("offsets,lengths", RUN_CASES)
@pytest.mark.parametrize("base", [0, 8, 5, 4096])
def test_stream_digest_is_the_definition(offsets, lengths, base):
    buf = torch.from_numpy(np.random.default_rng(7).integers(0, 256, size=1 << 16,
                                                             dtype=np.uint8))
    raw = buf.numpy()
    stream = b"".join(raw[base + o:base + o + n].tobytes() for o, n in zip(offsets, lengths))
    assert total([StreamDigest(offsets, lengths).of(buf, base)]) == reference_digest(stream)


def test_long_streams_are_cut_into_bounded_reductions(monkeypatch):
    """Runs longer than one reduction covers, and groups of many runs, are cut into several
    blocks: the value stays the definition's."""
    from statebridge.connector.rank import digest

    monkeypatch.setattr(digest, "_MAX_ROWS", 3)
    buf = torch.from_numpy(np.random.default_rng(9).integers(0, 256, size=1 << 14,
                                                             dtype=np.uint8))
    raw = buf.numpy()
    for offsets, lengths in (([0], [128 * 10]), ([0, 256, 512, 768, 1024], [128] * 5),
                             ([5], [1000])):
        plan = StreamDigest(offsets, lengths)
        assert len(plan.blocks) > 1 or not plan.whole
        stream = b"".join(raw[o:o + n].tobytes() for o, n in zip(offsets, lengths))
        assert total([plan.of(buf, 0)]) == reference_digest(stream)


def test_stream_digest_sees_a_flipped_byte_and_a_swap():
    buf = torch.from_numpy(np.random.default_rng(8).integers(0, 256, size=4096, dtype=np.uint8))
    plan = StreamDigest([0, 1024], [1024, 1024])
    before = total([plan.of(buf, 0)])
    buf[1500] ^= 1
    assert total([plan.of(buf, 0)]) != before
    buf[1500] ^= 1
    assert total([plan.of(buf, 0)]) == before
    swapped = StreamDigest([1024, 0], [1024, 1024])        # the two runs landed swapped
    assert total([swapped.of(buf, 0)]) != before


# -- the independent expectation ------------------------------------------------------------------
def _stream(page: np.ndarray, table: np.ndarray, col: int) -> bytes:
    return b"".join(page[o:o + n].tobytes() for o, n in zip(table[:, col], table[:, 2]))


def expected_digests(spec, src_tp: int, src_layout: str, dst_tp: int, dst_layout: str,
                     rid: str, tokens: int = 0, dst_blocks=()) -> list[tuple[int, ...]]:
    """Per prefill rank, what it must report sending each decode rank: the digest of every
    pair's bytes in wire order (zero-copy runs in plan order, a staged pair's pack runs in
    staging order), read out of a prefill page (and KV blocks) filled here from the
    synthetic state."""
    src_geo = PageGeometry(spec, src_tp, src_layout, region_align=16)
    dst_geo = PageGeometry(spec, dst_tp, dst_layout, region_align=16)
    plan = TransferPlan(src_geo, dst_geo)
    state = global_state(spec, request_seed(rid))
    out = []
    for s in range(src_tp):
        cache = StateCache(src_geo, 1)
        fill_page(cache, 0, state, s)
        page = cache.page_bytes(0).numpy()
        sums = [0] * dst_tp
        for pair in plan.for_source(s):
            if pair.staged:
                table = pair.pack[np.argsort(pair.pack[:, 1], kind="stable")]
            else:
                table = pair.runs
            sums[pair.dst_rank] += reference_digest(_stream(page, table, 0))
        if dst_blocks:
            n = len(dst_blocks)
            src_kv = BlockGeometry(spec.kv, src_tp, "HB", BS, KV_BLOCKS)
            dst_kv = BlockGeometry(spec.kv, dst_tp, "HB", BS, KV_BLOCKS)
            pool = KVBlocks(src_kv, torch.zeros(src_kv.nbytes, dtype=torch.uint8), 0)
            fill_kv(pool, range(n), global_kv(spec.kv, request_seed(rid), tokens), s)
            raw = pool.buffer.numpy()
            for pair in KVPlan(src_kv, dst_kv).for_source(s):
                table = pair.contiguous_runs(n) if range_start(dst_blocks) is not None \
                    else pair.runs(range(n), dst_blocks)
                sums[pair.dst_rank] += reference_digest(_stream(raw, table, 0))
        out.append(tuple(x & ((1 << 64) - 1) for x in sums))
    return out


class _DigestSpy:
    """Every RankDigest the prefill server receives, by (request id, rank), passed on."""

    def __init__(self, server: PrefillServer) -> None:
        self.seen: dict[tuple[str, int], tuple[int, ...]] = {}
        self._lock = threading.Lock()
        forward = server.group._rank_handlers[m.RankDigest]

        def spy(rank: int, msg: m.RankDigest) -> None:
            with self._lock:
                self.seen[(msg.request_id, rank)] = msg.digests
            forward(rank, msg)
        server.group.on_rank_message(m.RankDigest, spy)


@pytest.fixture(scope="module")
def pools(shared_pools):
    """The session's rank hosts (tests/conftest.py)."""
    return shared_pools


def _digest_passes(*pools_: RankHostPool) -> int:
    return sum(c.get("transfer_digests", 0) for pool in pools_ for c in pool.ops())


def _prompt(n: int) -> tuple[int, ...]:
    return tuple((5 * i + 1) % 1000 for i in range(n))


PAIRS = [
    pytest.param("mamba2-g1", 1, 2, "DLS", "DLS", id="mamba2-1x2-DLS-DLS"),
    pytest.param("mamba2-g1", 2, 1, "LSD", "DLS", id="mamba2-2x1-LSD-DLS"),
    pytest.param("mamba2-g8", 2, 4, "LDS", "LSD", id="mamba2g8-2x4-LDS-LSD"),
    pytest.param("mamba2-g8", 4, 2, "DLS", "LDS", id="mamba2g8-4x2-DLS-LDS"),
    pytest.param("shortconv", 1, 2, "DLS", "LSD", id="hybrid-1x2-DLS-LSD"),
    pytest.param("shortconv", 2, 1, "LSD", "DLS", id="hybrid-2x1-LSD-DLS"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec_name,src_tp,dst_tp,src_layout,dst_layout", PAIRS)
def test_digests_match_an_independent_computation(pools, spec_name, src_tp, dst_tp,
                                                  src_layout, dst_layout):
    """Every prefill rank's digests are those of the bytes it sends each decode rank, computed
    here from a prefill page of our own; every decode rank found the same in what landed
    (the requests succeed, byte-exact); each request costs one digest pass per rank."""
    prefill_hosts, decode_hosts = pools
    spec = SPECS[spec_name]
    kv = spec.kv is not None
    lengths = [1, BS - 1, BS + 1, 3 * BS] if kv else [2, 3, 4, 5]
    before = _digest_passes(prefill_hosts, decode_hosts)
    with PrefillServer(spec, src_tp, src_layout, num_pages=6, config=VERIFY, model=SYNTHETIC,
                       block_size=BS, num_blocks=KV_BLOCKS,
                       launcher=prefill_hosts.launcher()) as server, \
            DecodeCoordinator(spec, dst_tp, dst_layout, num_pages=6, config=VERIFY,
                              block_size=BS, num_blocks=KV_BLOCKS, probes="checksums",
                              launcher=decode_hosts.launcher()) as decode:
        spy = _DigestSpy(server)
        probes = Probes(decode)
        server.wait_ready()
        decode.connect(server.address)
        rids = [f"v{i}-{uuid.uuid4().hex[:6]}" for i in range(len(lengths))]
        futures = [decode.submit(rid, _prompt(n)) for rid, n in zip(rids, lengths)]
        results = [f.result(timeout=60) for f in futures]
        for rid, n, result in zip(rids, lengths, results):
            assert probes.checksums(result) == tuple(
                expected_checksum(decode.group.geometry, rid, r) for r in range(dst_tp))
            want = expected_digests(spec, src_tp, src_layout, dst_tp, dst_layout, rid,
                                    tokens=n if kv else 0, dst_blocks=result.blocks)
            got = [spy.seen[(rid, s)] for s in range(src_tp)]
            assert got == want, f"{rid}: prefill digests differ from the independent ones"
        for result in results:
            decode.release(result)
        stats = decode.stats()
        assert stats["transfer_digests_checked"] == dst_tp * len(lengths)
        assert stats.get("transfer_digest_mismatches", 0) == 0
        assert server.stats()["transfer_digests"] == src_tp * len(lengths)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
    assert _digest_passes(prefill_hosts, decode_hosts) - before == \
        (src_tp + dst_tp) * len(lengths)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec_name", ["mamba2-g1", "shortconv"])
def test_a_corrupted_landing_fails_that_request_only(pools, spec_name):
    """Decode rank 0 flips a byte of what landed for one request of eight in flight: that
    request fails with ``transfer_error`` naming it, the rank and both digests (the expected
    one the independent one), the mismatch is counted, the others succeed byte-exact, and
    every page and block is free afterwards."""
    prefill_hosts, decode_hosts = pools
    spec = SPECS[spec_name]
    kv = spec.kv is not None
    n = 8
    with PrefillServer(spec, 1, "DLS", num_pages=n + 2, config=VERIFY, model=SYNTHETIC,
                       block_size=BS, num_blocks=KV_BLOCKS,
                       launcher=prefill_hosts.launcher()) as server, \
            DecodeCoordinator(spec, 2, "DLS", num_pages=n + 2, config=VERIFY,
                              model=CORRUPTING, block_size=BS, num_blocks=KV_BLOCKS,
                              probes="checksums", launcher=decode_hosts.launcher()) as decode:
        probes = Probes(decode)
        server.wait_ready()
        decode.connect(server.address)
        tag = uuid.uuid4().hex[:6]
        rids = [f"ok{i}-{tag}" for i in range(n)]
        rids[3] = f"corrupt-{tag}"
        futures = [decode.submit(rid, _prompt(2 * BS + 1 if kv else 3)) for rid in rids]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(timeout=60))
            except TransferError as e:
                outcomes.append(e)
        bad = outcomes[3]
        assert isinstance(bad, TransferError) and bad.kind is FailureKind.TRANSFER_ERROR, bad
        assert bad.request_id == rids[3]
        want = expected_digests(spec, 1, "DLS", 2, "DLS", rids[3], tokens=2 * BS + 1 if kv else 0,
                                dst_blocks=tuple(range(3)) if kv else ())[0][0]
        text = str(bad)
        assert f"request {rids[3]!r}" in text and "decode rank 0:" in text, text
        assert f"expected {want:#018x}, got 0x" in text, text
        assert "decode rank 1" not in text                  # rank 1's landing was intact
        for rid, result in zip(rids, outcomes):
            if rid == rids[3]:
                continue
            assert not isinstance(result, Exception), (rid, result)
            assert probes.checksums(result) == tuple(
                expected_checksum(decode.group.geometry, rid, r) for r in range(2))
            decode.release(result)
        stats = decode.stats()
        assert stats["transfer_digest_mismatches"] == 1
        assert stats["failed_transfer_error"] == 1
        assert stats["pages_used"] == 0 and stats.get("blocks_used", 0) == 0
        gauges = decode.group.loop.call(decode.gauges)
        assert gauges.transfer_mismatches == 1 and gauges.transfers_verified == 2 * n
        # The same id again, not corrupted now: served (nothing of the failure is held).
        again = decode.submit(f"ok-again-{tag}", _prompt(3)).result(timeout=30)
        decode.release(again)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")


@pytest.mark.timeout(120)
def test_off_by_default_computes_nothing(pools):
    """Without verify_transfers (the default) no rank makes a digest pass, no RankDigest or
    TransferDigest is sent, and the decode side compares nothing."""
    prefill_hosts, decode_hosts = pools
    spec = SPECS["shortconv"]
    before = _digest_passes(prefill_hosts, decode_hosts)
    with PrefillServer(spec, 1, "DLS", num_pages=4, config=FAST, model=SYNTHETIC,
                       block_size=BS, num_blocks=KV_BLOCKS,
                       launcher=prefill_hosts.launcher()) as server, \
            DecodeCoordinator(spec, 2, "DLS", num_pages=4, config=FAST, block_size=BS,
                              num_blocks=KV_BLOCKS, launcher=decode_hosts.launcher()) as decode:
        assert not server.group.config.verify_transfers
        assert not server.group.group_info().verify_transfers
        server.wait_ready()
        decode.connect(server.address)
        results = [f.result(timeout=30) for f in
                   [decode.submit(f"off{i}-{uuid.uuid4().hex[:6]}", _prompt(BS + 2))
                    for i in range(4)]]
        for result in results:
            decode.release(result)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
        assert server.stats().get("transfer_digests", 0) == 0
        assert decode.stats().get("transfer_digests_checked", 0) == 0
    assert _digest_passes(prefill_hosts, decode_hosts) == before


@pytest.mark.timeout(120)
def test_a_verifying_decode_node_refuses_a_prefill_node_without_digests(pools):
    prefill_hosts, decode_hosts = pools
    spec = SPECS["mamba2-g1"]
    with PrefillServer(spec, 1, "DLS", num_pages=2, config=FAST, model=SYNTHETIC,
                       launcher=prefill_hosts.launcher()) as server, \
            DecodeCoordinator(spec, 1, "DLS", num_pages=2, config=VERIFY,
                              launcher=decode_hosts.launcher()) as decode:
        server.wait_ready()
        with pytest.raises(IncompatiblePeerError,
                           match=r"verifies transfers \(--verify-transfers\) but prefill node "
                                 r".* does not send transfer digests: start the prefill node "
                                 r"with --verify-transfers"):
            decode.connect(server.address)
        assert decode.stats()["refused_peers"] == 1
        assert server.stats()["incompatible_peers"] == 1


@pytest.mark.timeout(120)
def test_a_prefill_node_with_digests_serves_a_decode_node_without(pools):
    """A prefill node that sends digests computes none for a decode node that does not ask."""
    prefill_hosts, decode_hosts = pools
    spec = SPECS["mamba2-g1"]
    before = _digest_passes(prefill_hosts, decode_hosts)
    with PrefillServer(spec, 1, "DLS", num_pages=2, config=VERIFY, model=SYNTHETIC,
                       launcher=prefill_hosts.launcher()) as server, \
            DecodeCoordinator(spec, 1, "DLS", num_pages=2, config=FAST,
                              launcher=decode_hosts.launcher()) as decode:
        server.wait_ready()
        decode.connect(server.address)
        result = decode.submit(f"plain-{uuid.uuid4().hex[:6]}", _prompt(3)).result(timeout=30)
        decode.release(result)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
        assert server.stats().get("transfer_digests", 0) == 0
    assert _digest_passes(prefill_hosts, decode_hosts) == before


@pytest.mark.timeout(120)
def test_a_digest_pass_that_fails_fails_its_request_not_the_rank(pools):
    prefill_hosts, decode_hosts = pools
    spec = SPECS["mamba2-g1"]
    with PrefillServer(spec, 1, "DLS", num_pages=4, config=VERIFY, model=SYNTHETIC,
                       launcher=prefill_hosts.launcher()) as server, \
            DecodeCoordinator(spec, 2, "DLS", num_pages=4, config=VERIFY,
                              model="tests.connector._helpers:DigestFailsModel",
                              launcher=decode_hosts.launcher()) as decode:
        server.wait_ready()
        decode.connect(server.address)
        tag = uuid.uuid4().hex[:6]
        with pytest.raises(TransferError, match="decode rank 1: transfer digest failed: "
                                                "digest pass broke") as failed:
            decode.submit(f"raise-{tag}", _prompt(3)).result(timeout=30)
        assert failed.value.kind is FailureKind.TRANSFER_ERROR
        result = decode.submit(f"fine-{tag}", _prompt(3)).result(timeout=30)   # rank serves on
        decode.release(result)
        assert decode.stats()["pages_used"] == 0 and decode.stats()["healthy"]
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
