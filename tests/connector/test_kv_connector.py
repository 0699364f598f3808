"""Attention KV moves with the recurrent state: hybrid (LFM2-like) specs between heterogeneous
TP groups as separate processes over real UCX, byte-exact against an oracle computed here, with
every page and KV block freed on both sides once nothing can land in them."""

from __future__ import annotations

import hashlib
import os
import signal
import time
import uuid

import pytest
import torch

from statebridge.bench.ab import with_switches
from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.prefill import PrefillServer
from statebridge.errors import (
    CacheFullError,
    IncompatiblePeerError,
    PeerLostError,
    TransferError,
)
from statebridge.state.kv import BlockGeometry, KVPlan, blocks_for
from statebridge.state.sharding import kv_heads
from statebridge.state.plan import TransferPlan
from statebridge.state.spec import StateSpec
from statebridge.testing.hosts import RankHostPool
from statebridge.testing.synthetic import global_kv, request_seed
from statebridge.testing.probes import Probes, instrumented, probes_of

from ._inprocess import check_kv, check_pages
from ._helpers import (FAST, SYNTHETIC, expected_checksum, log_to_stderr, steady, thaw,
                       wait_until)

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

BS = 16


def _lfm2(kv_heads_: int) -> StateSpec:
    return StateSpec.from_config(
        {"model_type": "lfm2", "hidden_size": 40, "conv_L_cache": 3, "torch_dtype": "bfloat16",
         "num_attention_heads": 4, "num_key_value_heads": kv_heads_,
         "layer_types": ["conv", "full_attention", "conv", "full_attention", "conv"]})


KV_SPECS = {"hybrid-kv2": _lfm2(2), "hybrid-kv4": _lfm2(4)}
#: Prompt lengths (the N-1 prefix) around block boundaries; 16 concurrent requests.
LENGTHS = [1, BS - 1, BS, BS + 1, 5 * BS + 3, 2, 2 * BS, 2 * BS + 1, 3 * BS - 1, 7, 4 * BS,
           BS + 8, 1, 3 * BS, 6 * BS + 5, 9]
SLOW = "tests.connector._helpers:SlowModel"


def expected_kv_checksum(spec: StateSpec, request_id: str, tokens: int, tp_size: int,
                         tp_rank: int) -> str:
    """What decode rank ``tp_rank`` must hold of the request's KV: per attention layer, K then
    V of its heads for every prompt token, token-major -- from the global KV and the head
    sharding rule only (no block views, no layouts)."""
    kv = spec.kv
    state = global_kv(kv, request_seed(request_id), tokens)
    first, count = kv_heads(kv, tp_size, tp_rank)
    h = hashlib.blake2b(digest_size=16)
    for layer in range(kv.num_layers):
        for c in range(2):
            h.update(state[layer, c, :, first:first + count].contiguous()
                     .view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def prompt_of(n: int) -> tuple[int, ...]:
    return tuple((7 * i + 3) % 1000 for i in range(n))


def ids(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:6]
    return [f"kv{i}-{tag}" for i in range(n)]


@pytest.fixture(scope="module")
def pools():
    # Own hosts (tests here SIGKILL and SIGSTOP them), started as groups first need them: the
    # first test's ops() then does not wait on twelve hosts still importing.
    with RankHostPool(4, initializer=log_to_stderr, lazy=True) as prefill_hosts, \
            RankHostPool(8, initializer=log_to_stderr, lazy=True) as decode_hosts:
        yield prefill_hosts, decode_hosts


def check_result(decode, spec, result, rid, tokens):
    assert result.request_id == rid
    assert len(result.blocks) == blocks_for(tokens, BS)
    assert probes_of(decode).checksums(result) == tuple(
        expected_checksum(decode.group.geometry, rid, r) for r in range(decode.group.tp_size)), \
        f"{rid}: pages differ"
    assert probes_of(decode).kv_checksums(result) == tuple(
        expected_kv_checksum(spec, rid, tokens, decode.group.tp_size, r)
        for r in range(decode.group.tp_size)), \
        f"{rid} ({tokens} tokens): KV differs from the oracle"


def serve_one(decode, spec, rid, tokens, timeout=30):
    """Submit one request of ``tokens`` prompt tokens, check its pages and KV against the
    oracle, release it."""
    result = decode.submit(rid, prompt_of(tokens)).result(timeout=timeout)
    check_result(decode, spec, result, rid, tokens)
    decode.release(result)


def kv_round(pools, spec_name, src_tp, dst_tp, src_kv="HB", dst_kv="HB", config=FAST,
             src_layout="DLS"):
    prefill_hosts, decode_hosts = pools
    config = steady(config)           # a round loses no rank
    spec = KV_SPECS[spec_name]
    n = len(LENGTHS)
    with PrefillServer(spec, src_tp, src_layout, num_pages=n + 2, config=config,
                       kv_layout=src_kv, block_size=BS, probes="timing",
                       launcher=prefill_hosts.launcher(), model=SYNTHETIC) as server, \
            DecodeCoordinator(spec, dst_tp, "DLS", num_pages=n + 2, config=config,
                              kv_layout=dst_kv, block_size=BS, num_blocks=160,
                              launcher=decode_hosts.launcher(), probes="checksums") as decode:
        probes = Probes(decode, server)
        server.wait_ready()
        decode.connect(server.address)
        rids = ids(n)
        futures = [decode.submit(rid, prompt_of(t)) for rid, t in zip(rids, LENGTHS)]
        results = [f.result(timeout=60) for f in futures]
        for rid, t, result in zip(rids, LENGTHS, results):
            check_result(decode, spec, result, rid, t)
        used = {b for r in results for b in r.blocks}
        assert len(used) == sum(len(r.blocks) for r in results)     # no block shared
        assert decode.stats()["blocks_used"] == len(used)
        for result in results:
            decode.release(result)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
        p_stats = dict(server.stats(), rank_staging_bytes=probes.staging_bytes(server))
        d_stats = dict(decode.stats(), rank_staging_bytes=probes.staging_bytes(decode))
        assert p_stats["blocks_used"] == 0 and p_stats["blocks_free"] == p_stats["blocks_total"]
        assert d_stats["pages_used"] == 0 and d_stats["blocks_used"] == 0
        return results, p_stats, d_stats


TP_PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2), (1, 8)]
CASES = [pytest.param("hybrid-kv2", p, d, "HB", "HB", id=f"kv2-{p}x{d}") for p, d in TP_PAIRS]
CASES += [pytest.param("hybrid-kv4", p, d, "HB", "HB", id=f"kv4-{p}x{d}")
          for p, d in [(1, 2), (4, 2), (2, 8)]]
CASES += [pytest.param("hybrid-kv2", 2, 4, "HB", "LH", id="kv2-2x4-HB-to-LH"),
          pytest.param("hybrid-kv4", 4, 1, "BH", "HB", id="kv4-4x1-BH-to-HB")]


#: On one host (the default) a hybrid link reads pages and KV out of the prefill rank's
#: shared map; with ``shared_map`` off every byte goes over UCX.
UCX = with_switches(FAST, shared_map=False)
CASES += [pytest.param("hybrid-kv2", p, d, "HB", "HB", UCX, id=f"kv2-{p}x{d}-ucx")
          for p, d in [(2, 4), (1, 8)]]
CASES += [pytest.param("hybrid-kv4", 4, 1, "HB", "HB", UCX, id="kv4-4x1-ucx"),
          pytest.param("hybrid-kv2", 2, 4, "HB", "LH", UCX, id="kv2-2x4-HB-to-LH-ucx"),
          pytest.param("hybrid-kv4", 4, 1, "BH", "HB", UCX, id="kv4-4x1-BH-to-HB-ucx")]


#: Through real rank processes by default (the rest under ``-m exhaustive``): equal TP, fan-out,
#: fan-in, each KV layout (HB, LH, BH), both specs, the shared map and UCX. Every case runs in
#: process against the byte oracles (test_kv_matrix_moves_the_oracle_bytes_in_process).
REAL = {"kv2-2x2", "kv2-2x4", "kv4-4x2", "kv2-2x4-HB-to-LH", "kv4-4x1-BH-to-HB",
        "kv2-1x8-ucx", "kv4-4x1-ucx"}
assert REAL <= {c.id for c in CASES}


@pytest.mark.parametrize("spec_name,src_tp,dst_tp,src_kv,dst_kv",
                         [pytest.param(*c.values[:5], id=c.id) for c in CASES
                          if not c.id.endswith("-ucx")])
def test_kv_matrix_moves_the_oracle_bytes_in_process(spec_name, src_tp, dst_tp, src_kv, dst_kv):
    """The matrix of test_kv_moves_byte_exact_and_blocks_are_freed without processes: the
    pages (DLS both sides: zero-copy) and the KV blocks each decode rank must receive, byte for
    byte (the ``-ucx`` cases move the same bytes by another transport)."""
    plan = check_pages(KV_SPECS[spec_name], src_tp, dst_tp, "DLS", "DLS")
    assert not any(p.staged for p in plan)
    check_kv(KV_SPECS[spec_name], src_tp, dst_tp, src_kv, dst_kv)


def rank_pairs(spec_name: str, src_tp: int, dst_tp: int) -> int:
    """(prefill rank, decode rank) pairs that move recurrent state or KV: one shared-map read
    each per request."""
    spec = KV_SPECS[spec_name]
    state = TransferPlan.build(spec, src_tp, "DLS", dst_tp, "DLS").pairs
    kv = KVPlan(BlockGeometry(spec.kv, src_tp, "HB", BS, 1),
                BlockGeometry(spec.kv, dst_tp, "HB", BS, 1))
    return len(set(state) | set(kv.pairs))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec_name,src_tp,dst_tp,src_kv,dst_kv,config",
                         [pytest.param(*c.values, *([FAST] if len(c.values) == 5 else []),
                                       id=c.id, marks=() if c.id in REAL else pytest.mark.exhaustive)
                          for c in CASES])
def test_kv_moves_byte_exact_and_blocks_are_freed(pools, spec_name, src_tp, dst_tp, src_kv,
                                                   dst_kv, config):
    reads = sum(c.get("shared_map_reads", 0) for c in pools[1].ops(dst_tp))
    results, p_stats, d_stats = kv_round(pools, spec_name, src_tp, dst_tp, src_kv, dst_kv,
                                         config)
    reads = sum(c.get("shared_map_reads", 0) for c in pools[1].ops(dst_tp)) - reads
    # Through the shared map every request is one read per rank pair; over UCX none.
    assert reads == (len(LENGTHS) * rank_pairs(spec_name, src_tp, dst_tp)
                     if config.shared_map else 0)
    assert p_stats["requests"] == len(LENGTHS) and d_stats["transfers_ok"] == len(LENGTHS)
    # Page layouts pair (DLS both sides) and KV runs are always zero-copy: no staging at all.
    staging = d_stats["rank_staging_bytes"] + p_stats["rank_staging_bytes"]
    assert max(staging) == 0
    spec = KV_SPECS[spec_name]
    # Every decode rank received whole blocks of its heads besides the (constant) page bytes.
    recurrent = set()
    for t, r in zip(LENGTHS, results):
        kv_bytes = sum(kv_heads(spec.kv, dst_tp, d)[1] for d in range(dst_tp)) \
            * blocks_for(t, BS) * BS * spec.kv.num_layers * 2 * spec.kv.head_dim \
            * spec.kv.itemsize
        recurrent.add(r.nbytes - kv_bytes)
    assert len(recurrent) == 1 and recurrent.pop() > 0


@pytest.mark.timeout(120)
def test_staged_pages_go_over_ucx_while_kv_reads_the_shared_map(pools):
    """Page layouts that differ (LSD -> DLS) stage the recurrent pairs: those go over UCX as
    packed messages, while the KV of the same rank pairs is read out of the shared map --
    one read per rank pair with KV, byte-exact, everything freed."""
    spec_name, src_tp, dst_tp = "hybrid-kv2", 2, 4
    reads = sum(c.get("shared_map_reads", 0) for c in pools[1].ops(dst_tp))
    _, p_stats, d_stats = kv_round(pools, spec_name, src_tp, dst_tp, src_layout="LSD")
    reads = sum(c.get("shared_map_reads", 0) for c in pools[1].ops(dst_tp)) - reads
    spec = KV_SPECS[spec_name]
    kv = KVPlan(BlockGeometry(spec.kv, src_tp, "HB", BS, 1),
                BlockGeometry(spec.kv, dst_tp, "HB", BS, 1))
    assert reads == len(LENGTHS) * len(kv.pairs)
    assert max(d_stats["rank_staging_bytes"]) > 0                      # pages were staged


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec_name,src_tp,dst_tp,config", [
    ("hybrid-kv2", 2, 4, FAST), ("hybrid-kv4", 4, 1, FAST), ("hybrid-kv2", 1, 1, FAST),
    ("hybrid-kv2", 2, 4, UCX), ("hybrid-kv4", 4, 1, UCX)])
def test_a_scattered_decode_block_table_moves_byte_exact(pools, spec_name, src_tp, dst_tp,
                                                         config):
    """Requests whose decode blocks are one range post each pair's runs from a template (the
    base added per request); a table with holes builds its runs per request. The prefill side
    must take the same path for the tags to pair: a fragmented decode pool forces one."""
    prefill_hosts, decode_hosts = pools
    spec = KV_SPECS[spec_name]
    with PrefillServer(spec, src_tp, "DLS", num_pages=6, config=config, block_size=BS,
                       num_blocks=16, launcher=prefill_hosts.launcher(),
                       model=SYNTHETIC) as server, \
            instrumented(DecodeCoordinator(spec, dst_tp, "DLS", num_pages=6, config=config,
                                           block_size=BS,
                                           num_blocks=6, launcher=decode_hosts.launcher(),
                                           probes="checksums")) as decode:
        server.wait_ready()
        decode.connect(server.address)
        rids = ids(4)
        first = [decode.submit(rid, prompt_of(2 * BS)).result(timeout=30) for rid in rids[:3]]
        for rid, result in zip(rids, first):
            check_result(decode, spec, result, rid, 2 * BS)
            assert list(result.blocks) == list(range(result.blocks[0], result.blocks[0] + 2))
        decode.release(first[0])
        decode.release(first[2])
        result = decode.submit(rids[3], prompt_of(4 * BS - 3)).result(timeout=30)
        # the only free blocks are the two holes: 4 blocks that are not one range
        assert sorted(result.blocks) == sorted([*first[0].blocks, *first[2].blocks])
        assert list(result.blocks) != list(range(result.blocks[0], result.blocks[0] + 4))
        check_result(decode, spec, result, rids[3], 4 * BS - 3)
        decode.release(first[1])
        decode.release(result)
        wait_until(lambda: server.stats()["blocks_used"] == 0, 10, "prefill blocks freed")
        assert decode.stats()["blocks_used"] == 0


@pytest.mark.timeout(120)
def test_decode_block_exhaustion_is_cache_full_with_numbers_and_leaks_nothing(pools):
    prefill_hosts, decode_hosts = pools
    spec = KV_SPECS["hybrid-kv2"]
    with PrefillServer(spec, 1, "DLS", num_pages=4, config=FAST, block_size=BS,
                       launcher=prefill_hosts.launcher(), model=SYNTHETIC) as server, \
            instrumented(DecodeCoordinator(spec, 2, "DLS", num_pages=4, config=FAST, block_size=BS,
                                           num_blocks=8, launcher=decode_hosts.launcher(),
                                           probes="checksums")) as decode:
        server.wait_ready()
        decode.connect(server.address)
        big, other = ids(2)
        first = decode.submit(big, prompt_of(6 * BS - 2)).result(timeout=30)    # 6 blocks
        check_result(decode, spec, first, big, 6 * BS - 2)
        with pytest.raises(CacheFullError, match="3 KV blocks wanted, 2 free of 8"):
            decode.submit(other, prompt_of(2 * BS + 1))
        stats = decode.stats()
        assert (stats["pages_used"], stats["blocks_used"]) == (1, 6)      # nothing held
        # Decoding grows the table right after its last block, then runs out.
        grown = decode.group.loop.call(decode.grow, big, 7 * BS)
        assert grown == (*first.blocks, first.blocks[-1] + 1)
        with pytest.raises(CacheFullError, match="2 KV blocks wanted, 1 free of 8"):
            decode.group.loop.call(decode.grow, big, 9 * BS)
        assert decode.stats()["blocks_used"] == 7
        decode.release(first)
        stats = decode.stats()
        assert (stats["pages_used"], stats["blocks_used"]) == (0, 0)
        second = decode.submit(other, prompt_of(2 * BS + 1)).result(timeout=30)
        check_result(decode, spec, second, other, 2 * BS + 1)
        decode.release(second)
        wait_until(lambda: server.stats()["blocks_used"] == 0, 10, "prefill blocks freed")


@pytest.mark.timeout(120)
def test_prefill_block_shortage_waits_then_serves(pools):
    prefill_hosts, decode_hosts = pools
    spec = KV_SPECS["hybrid-kv4"]
    with PrefillServer(spec, 2, "DLS", num_pages=8, config=FAST, block_size=BS, num_blocks=8,
                       launcher=prefill_hosts.launcher(), model=SYNTHETIC) as server, \
            instrumented(DecodeCoordinator(spec, 1, "DLS", num_pages=8, config=FAST, block_size=BS,
                                           num_blocks=64, launcher=decode_hosts.launcher(),
                                           probes="checksums")) as decode:
        server.wait_ready()
        decode.connect(server.address)
        rids = ids(3)
        lengths = [5 * BS, 4 * BS + 1, 9 * BS]          # 5 + 5 blocks of 8; 9 never fit
        futures = [decode.submit(rid, prompt_of(t)) for rid, t in zip(rids, lengths)]
        for rid, t, f in zip(rids[:2], lengths, futures):
            result = f.result(timeout=30)
            check_result(decode, spec, result, rid, t)
            decode.release(result)
        with pytest.raises(Exception, match="9 KV blocks wanted"):
            futures[2].result(timeout=30)
        wait_until(lambda: server.stats()["blocks_used"] == 0, 10, "prefill blocks freed")
        assert server.stats()["waiting_for_blocks"] >= 1
        assert decode.stats()["blocks_used"] == 0


@pytest.mark.timeout(60)
def test_peers_with_different_block_sizes_are_refused(pools):
    prefill_hosts, decode_hosts = pools
    spec = KV_SPECS["hybrid-kv2"]
    with PrefillServer(spec, 1, "DLS", num_pages=2, config=FAST, block_size=16,
                       launcher=prefill_hosts.launcher(), model=SYNTHETIC) as server, \
            DecodeCoordinator(spec, 1, "DLS", num_pages=2, config=FAST, block_size=32,
                              launcher=decode_hosts.launcher()) as decode:
        server.wait_ready()
        with pytest.raises(IncompatiblePeerError, match="16 tokens, we have 32|32 tokens, we "
                                                        "have 16"):
            decode.connect(server.address)


@pytest.mark.timeout(150)
def test_sigkill_decode_rank_during_shared_map_reads_frees_prefill_pages_and_blocks(pools,
                                                                                   monkeypatch):
    """A decode rank killed while the prefill ranks wait for its shared-map answers (words in
    their own memory: no message, no failed UCX handle tells them): its requests fail, and the
    prefill pages and blocks come back without waiting for a transfer timeout."""
    prefill_hosts, _ = pools
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.3")
    spec = KV_SPECS["hybrid-kv2"]
    config = FAST.replace(transfer_timeout=120.0)
    server = PrefillServer(spec, 2, "DLS", num_pages=16, config=config, block_size=BS,
                           model=SLOW, launcher=prefill_hosts.launcher())
    # (on_rank_loss=exit: the lost rank's requests and the prefill side's pages are the point
    # here; the group's restart is test_supervision's, and needs no second group spawned)
    decode = instrumented(DecodeCoordinator(spec, 2, "DLS", num_pages=16,
                                            config=config.replace(on_rank_loss="exit"),
                                            block_size=BS,
                                            probes="checksums"))  # spawned: killable
    try:
        server.wait_ready()
        decode.connect(server.address)
        serve_one(decode, spec, ids(1)[0], 2 * BS)
        lengths = [BS + 1, 4 * BS, 1, 2 * BS + 3, 5 * BS, BS]
        futures = [decode.submit(rid, prompt_of(t)) for rid, t in zip(ids(6), lengths)]
        time.sleep(0.1)
        os.kill(decode.group.handles[0].pid, signal.SIGSTOP)  # reads nothing, answers nothing
        time.sleep(0.8)                 # the first prefills are done: their pages wait for it
        killed_at = time.monotonic()
        os.kill(decode.group.handles[0].pid, signal.SIGKILL)
        for f in futures:
            with pytest.raises(PeerLostError, match="decode rank 0"):
                f.result(timeout=config.peer_timeout + 5)
        wait_until(lambda: server.stats()["pages_used"] == 0
                   and server.stats()["blocks_used"] == 0, 15, "prefill pages and blocks")
        assert time.monotonic() - killed_at < config.peer_timeout + 10 < config.transfer_timeout
        assert decode.stats()["pages_used"] == 0 and decode.stats()["blocks_used"] == 0
        assert server.stats()["healthy"]
    finally:
        decode.close()
        server.close()


@pytest.mark.timeout(150)
def test_frozen_decode_ranks_hold_prefill_pages_until_the_lease_and_late_answers_harm_nothing(
        pools, monkeypatch):
    """Decode ranks frozen (SIGSTOP) before they read: no answer comes, so the prefill ranks
    hold their pages and blocks (a reader may still be copying them) until the lease ends the
    requests. Thawed, the ranks answer requests that are gone; the prefill side serves the
    next requests out of the same pages and slots, byte-exact, and frees everything."""
    prefill_hosts, _ = pools
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.5")
    spec = KV_SPECS["hybrid-kv2"]
    config = FAST.replace(lease_timeout=2.0, peer_timeout=60.0, transfer_timeout=60.0)
    server = PrefillServer(spec, 2, "DLS", num_pages=3, config=config, block_size=BS,
                           num_blocks=16, model=SLOW, launcher=prefill_hosts.launcher())
    decode = instrumented(DecodeCoordinator(spec, 2, "DLS", num_pages=4, config=config,
                                            block_size=BS,
                                            probes="checksums"))  # spawned: stoppable
    frozen = [h.pid for h in decode.group.handles]
    try:
        server.wait_ready()
        decode.wait_ready()
        decode.connect(server.address)
        futures = [decode.submit(rid, prompt_of(2 * BS + 1)) for rid in ids(3)]
        time.sleep(0.2)                               # every receive posted; prefills running
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: server.stats()["pages_used"] == 3, 5, "prefill pages held")
        time.sleep(0.8)                               # notices sent: waiting for answers
        assert server.stats()["pages_used"] == 3 and server.stats()["blocks_used"] == 9
        took = wait_until(lambda: server.stats()["pages_used"] == 0
                          and server.stats()["blocks_used"] == 0, 20, "lease expiry")
        assert server.stats()["leases_expired"] == 3
        assert took < config.lease_timeout + 10
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        for f in futures:
            with pytest.raises(TransferError):
                f.result(timeout=30)
        rids = ids(6)                                 # the same 3 pages and slots, twice over
        for rid in rids:
            serve_one(decode, spec, rid, 3 * BS)
        wait_until(lambda: server.stats()["pages_used"] == 0
                   and server.stats()["blocks_used"] == 0, 10, "prefill pages and blocks")
    finally:
        thaw(*frozen)
        decode.close()
        server.close()


@pytest.mark.timeout(150)
def test_sigkill_prefill_rank_during_kv_fails_its_requests_and_leaks_no_block(pools,
                                                                              monkeypatch):
    _, decode_hosts = pools
    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.3")
    spec = KV_SPECS["hybrid-kv2"]
    decode = instrumented(DecodeCoordinator(spec, 4, "DLS", num_pages=16, config=FAST,
                                            block_size=BS,
                                            launcher=decode_hosts.launcher(), probes="checksums"))
    server = PrefillServer(spec, 2, "DLS", num_pages=16, config=FAST.replace(
        on_rank_loss="exit"), block_size=BS, model=SLOW)                 # spawned: killable
    try:
        server.wait_ready()
        decode.connect(server.address)
        serve_one(decode, spec, ids(1)[0], 3 * BS + 2)
        rids = ids(6)
        lengths = [BS + 1, 4 * BS, 1, 2 * BS + 3, 5 * BS, BS]
        futures = [decode.submit(rid, prompt_of(t)) for rid, t in zip(rids, lengths)]
        assert decode.stats()["blocks_used"] == sum(blocks_for(t, BS) for t in lengths)
        time.sleep(0.1)
        killed_at = time.monotonic()
        os.kill(server.group.handles[1].pid, signal.SIGKILL)
        failed = 0
        for rid, t, f in zip(rids, lengths, futures):
            try:
                result = f.result(timeout=FAST.peer_timeout + 5)
            except PeerLostError as e:
                failed += 1
                assert e.request_id == rid
            else:                                      # finished before the kill: intact
                check_result(decode, spec, result, rid, t)
                decode.release(result)
        assert failed >= 1
        assert time.monotonic() - killed_at < FAST.peer_timeout + 3
        wait_until(lambda: decode.stats()["blocks_used"] == 0, 10, "decode blocks reclaimed")
        wait_until(lambda: server.stats()["blocks_used"] == 0, 10, "prefill blocks reclaimed")
        assert decode.stats()["pages_used"] == 0 and server.stats()["pages_used"] == 0
        assert decode.stats()["healthy"]
    finally:
        server.close()
        decode.close()
    for h in server.group.handles:
        assert not h.is_alive()


@pytest.mark.timeout(120)
def test_abort_during_the_prefill_frees_kv_blocks_on_both_sides_only_once_quiet(pools,
                                                                              monkeypatch):
    """Requests aborted while the (slow) prefill computes: the callers get AbortedError, the
    blocks come back on both sides once every rank confirmed, and the next requests -- on the
    same blocks -- are byte-exact (nothing of the aborted attempts landed in them)."""
    from statebridge.errors import AbortedError

    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.6")
    prefill_hosts, decode_hosts = pools
    spec = KV_SPECS["hybrid-kv2"]
    with PrefillServer(spec, 2, "DLS", num_pages=6, config=FAST, block_size=BS, num_blocks=24,
                       launcher=prefill_hosts.launcher(), model=SLOW) as server, \
            instrumented(DecodeCoordinator(spec, 4, "DLS", num_pages=6, config=FAST, block_size=BS,
                                           num_blocks=24, launcher=decode_hosts.launcher(),
                                           probes="checksums")) as decode:
        server.wait_ready()
        decode.connect(server.address)
        doomed = ids(3)
        futures = [decode.submit(rid, prompt_of(3 * BS + 1)) for rid in doomed]   # 4 blocks
        assert decode.stats()["blocks_used"] == 12
        time.sleep(0.2)                                  # all in their slow prefill
        for rid in doomed:
            decode.abort(rid, "caller gave up")
        for f in futures:
            with pytest.raises(AbortedError, match="caller gave up"):
                f.result(timeout=10)
        wait_until(lambda: decode.stats()["blocks_used"] == 0, 15, "decode blocks freed")
        wait_until(lambda: server.stats()["blocks_used"] == 0, 15, "prefill blocks freed")
        assert decode.stats()["pages_used"] == 0 and server.stats()["pages_used"] == 0
        again = ids(3)
        futures = [decode.submit(rid, prompt_of(3 * BS + 1)) for rid in again]
        for rid, f in zip(again, futures):
            result = f.result(timeout=30)
            check_result(decode, spec, result, rid, 3 * BS + 1)
            decode.release(result)
        wait_until(lambda: server.stats()["blocks_used"] == 0, 10, "prefill blocks freed")


@pytest.mark.timeout(120)
def test_decode_node_requests_waiting_for_kv_blocks_wait_in_order(pools, tmp_path,
                                                                  monkeypatch):
    """A decode node with free pages but too few free KV blocks: the waiting request neither
    spins the loop nor is lost -- it starts once the first one's blocks come back."""
    import concurrent.futures
    import json

    from statebridge.errors import TransferError
    from statebridge.node.client import Client
    from statebridge.node.decode_node import DecodeNode

    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "0.5")    # the first holds its blocks
    prefill_hosts, decode_hosts = pools
    config = {"model_type": "lfm2", "hidden_size": 40, "conv_L_cache": 3,
              "torch_dtype": "bfloat16", "num_attention_heads": 4, "num_key_value_heads": 2,
              "layer_types": ["conv", "full_attention", "conv", "full_attention", "conv"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = StateSpec.from_pretrained(tmp_path)
    with PrefillServer(spec, 1, "DLS", num_pages=4, config=FAST, block_size=BS,
                       launcher=prefill_hosts.launcher(), model=SLOW) as server:
        server.wait_ready()
        # 2 pages -> 16 KV blocks of 16 tokens; each 200-token prompt needs 13 of them.
        with DecodeNode(str(tmp_path), 1, [server.address], num_pages=2, config=FAST,
                        launcher=decode_hosts.launcher(),
                        rank_model="statebridge.testing.models:SyntheticModel") as node:
            def one(i: int):
                with Client(node.address, timeout=60) as client:
                    try:
                        return client.generate(prompt_of(201), max_new_tokens=1)
                    except TransferError as e:
                        return e
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                outcomes = list(pool.map(one, range(2)))
            # The synthetic model cannot decode: each request fails typed AFTER its transfer.
            assert all(isinstance(o, TransferError) and "cannot decode" in str(o)
                       for o in outcomes), outcomes
            stats = node.stats()
            assert stats["coordinator"]["transfers_ok"] == 2 and stats["waiting"] == 0
            assert stats["coordinator"]["requests"] == 2          # the second one waited
            assert stats["coordinator"]["blocks_used"] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", [UCX, FAST], ids=["ucx", "shared-map"])
def test_frozen_prefill_rank_resumed_cannot_write_into_a_reused_page_or_blocks(pools,
                                                                              monkeypatch,
                                                                              config):
    """The receiver stays in control of its memory: a prefill rank SIGSTOPped while it
    computes a request is declared lost, the decode side fails the request and reuses its page
    and KV blocks (the pools hold exactly one request) for another request, then the rank is
    SIGCONTed and sends what it computed. The other request's state and KV are byte for byte
    what they were, checked on every decode rank long after the thaw."""
    from tests.connector._helpers import PageQuery, PageReport

    monkeypatch.setenv("STATEBRIDGE_TEST_PREFILL_DELAY", "1.0")
    _, decode_hosts = pools
    spec = KV_SPECS["hybrid-kv2"]
    tokens = 3 * BS + 1                                   # 4 blocks: the decode pool's all
    server = PrefillServer(spec, 2, "DLS", num_pages=2, config=config, block_size=BS,
                           num_blocks=8, model=SLOW)      # spawned ranks: real processes
    decode = instrumented(DecodeCoordinator(spec, 2, "DLS", num_pages=1, config=config,
                                            block_size=BS,
                                            num_blocks=4, launcher=decode_hosts.launcher(),
                                            probes="checksums",
                                            model="tests.connector._helpers:QueryModel"))
    reports: dict[int, list] = {}
    decode.group.on_rank_message(PageReport, lambda rank, msg: reports.setdefault(
        msg.query, []).append(msg))
    frozen = server.group.handles[1].pid
    try:
        server.wait_ready()
        decode.wait_ready()
        decode.connect(server.address)
        doomed, other = ids(2)
        future = decode.submit(doomed, prompt_of(tokens))
        time.sleep(0.3)                                   # rank 1 is inside its 1 s prefill
        os.kill(frozen, signal.SIGSTOP)
        with pytest.raises(PeerLostError):
            future.result(timeout=FAST.peer_timeout + 10)
        wait_until(lambda: decode.stats()["pages_used"] == 0
                   and decode.stats()["blocks_used"] == 0, 10, "decode page and blocks freed")
        # The only page and the only four blocks, now another request's (computed by the
        # decode ranks themselves: the frozen group cannot serve).
        result = decode.submit_local(other, prompt_of(tokens)).result(timeout=30)
        assert result.page == 0 and sorted(result.blocks) == [0, 1, 2, 3]
        want = [(expected_checksum(decode.group.geometry, other, r),
                 expected_kv_checksum(spec, other, tokens, decode.group.tp_size, r))
                for r in range(decode.group.tp_size)]

        def held(query: int) -> list[tuple[str, str]]:
            decode.group.loop.call(lambda: decode.group.to_ranks(PageQuery(
                query=query, page=result.page, blocks=result.blocks, tokens=tokens)))
            wait_until(lambda: len(reports.get(query, [])) == 2, 10, "decode ranks report")
            return [(r.checksum, r.kv_checksum)
                    for r in sorted(reports[query], key=lambda r: r.tp_rank)]

        assert held(0) == want                            # the other request, before the thaw
        os.kill(frozen, signal.SIGCONT)
        time.sleep(2.5)              # the rank finishes its prefill and sends what it has
        assert held(1) == want, "a page or KV block was written after the decode side freed it"
        decode.release(result)
    finally:
        thaw(frozen)
        server.close()
        decode.close()
