"""The instrumentation switch: probes only from instrumented ranks, before their RankDone, and
what the collector makes of them."""

from __future__ import annotations

import uuid

import pytest

from statebridge.connector import messages as m
from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.prefill import PrefillServer
from statebridge.errors import ConfigError
from statebridge.testing.hosts import RankHostPool
from statebridge.testing.probes import Probes, instrumented, probes_of

from ._helpers import FAST, SPECS, SYNTHETIC, expected_checksum, log_to_stderr, wait_until


class _Group:
    """What Probes needs of a group: its id, its size and the rank-message hook."""

    def __init__(self, node_id: str, tp_size: int) -> None:
        self.node_id, self.tp_size = node_id, tp_size
        self.handlers: dict = {}

    def on_rank_message(self, msg_type, handler) -> None:
        self.handlers[msg_type] = handler

    def probe(self, rank: int, request_id: str, generation: int = 1, **fields) -> None:
        values = dict(seconds=0.0, messages=0, staging_bytes=0)
        values.update(fields)
        self.handlers[m.RankProbe](rank, m.RankProbe(
            tp_rank=rank, peer_node="p", request_id=request_id, generation=generation,
            **values))


class _Result:
    def __init__(self, request_id: str, generation: int) -> None:
        self.request_id, self.generation = request_id, generation


def test_the_collector_reads_each_rank_of_an_attempt():
    decode, prefill = _Group("decode-x", 2), _Group("prefill-x", 1)
    probes = Probes(decode, prefill)
    assert probes_of(decode) is probes and probes_of(prefill) is probes
    for rank in (1, 0):
        decode.probe(rank, "a", seconds=0.1 * (rank + 1), messages=3 + rank,
                     staging_bytes=10 * rank, held_at=5.0 + rank, checksum=f"c{rank}")
    prefill.probe(0, "a", state_final_at=4.5, staging_bytes=7)
    assert probes.checksums("a") == ("c0", "c1")
    assert probes.rank_seconds("a") == pytest.approx((0.1, 0.2))
    assert probes.messages("a") == 7
    assert probes.held_at("a") == 6.0
    assert probes.state_final_at("a", prefill) == 4.5
    assert probes.staging_bytes(decode) == [0, 10] and probes.staging_bytes("prefill-x") == [7]
    assert probes.received == 3


def test_an_attempt_is_named_by_its_result_and_an_id_means_the_newest():
    decode = _Group("decode-y", 1)
    probes = Probes(decode)
    decode.probe(0, "a", generation=1, checksum="old")
    decode.probe(0, "a", generation=2, checksum="new")
    assert probes.checksums("a") == ("new",)
    assert probes.checksums(_Result("a", 1)) == ("old",)


def test_a_missing_probe_or_group_is_a_typed_error_naming_it():
    decode = _Group("decode-z", 2)
    probes = Probes(decode)
    decode.probe(0, "half")
    with pytest.raises(ConfigError, match=r"no probe of 'half' from ranks \[1\] of decode-z"):
        probes.of("half")
    with pytest.raises(ConfigError, match="no probes kept of group 'elsewhere'"):
        probes.of("half", "elsewhere")
    with pytest.raises(ConfigError, match="at least one group"):
        Probes()
    with pytest.raises(ConfigError, match="keep must be a positive"):
        Probes(decode, keep=0)


def test_only_the_newest_requests_are_kept():
    decode = _Group("decode-k", 1)
    probes = Probes(decode, keep=3)
    for i in range(5):
        decode.probe(0, f"r{i}")
    with pytest.raises(ConfigError, match="'r1'"):
        probes.of("r1")
    assert [p.request_id for i in (2, 3, 4) for p in probes.of(f"r{i}")] == ["r2", "r3", "r4"]


def test_the_switch_takes_only_its_documented_values():
    with pytest.raises(ConfigError, match=r"probes must be one of \('', 'timing', 'checksums'\)"
                                          r".*got 'yes'"):
        DecodeCoordinator(SPECS["mamba2-g1"], 1, "DLS", num_pages=2, config=FAST,
                          launcher=None, probes="yes")


@pytest.fixture(scope="module")
def hosts():
    with RankHostPool(2, initializer=log_to_stderr) as prefill_hosts, \
            RankHostPool(2, initializer=log_to_stderr) as decode_hosts:
        yield prefill_hosts, decode_hosts


def _probes_sent(pool: RankHostPool) -> int:
    return sum(c.get("probes_sent", 0) for c in pool.ops())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", ["", "timing", "checksums"])
def test_ranks_send_probes_only_when_instrumented(hosts, level):
    """Off (the product): not one RankProbe leaves a rank. On: one per rank and request, each
    in before its request is reported; checksums only at that level, and then the oracle's."""
    prefill_hosts, decode_hosts = hosts
    spec, n = SPECS["mamba2-g1"], 4
    before = _probes_sent(prefill_hosts) + _probes_sent(decode_hosts)
    with PrefillServer(spec, 2, "DLS", num_pages=n, config=FAST, model=SYNTHETIC,
                       launcher=prefill_hosts.launcher(), probes=level) as server, \
            DecodeCoordinator(spec, 2, "LDS", num_pages=n, config=FAST,
                              launcher=decode_hosts.launcher(), probes=level) as decode:
        probes = Probes(decode, server)
        server.wait_ready()
        decode.connect(server.address)
        ids = [f"probe-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
        results = [f.result(timeout=30) for f in [decode.submit(rid, (1, 2)) for rid in ids]]
        if level:
            for rid, result in zip(ids, results):
                got = probes.of(result)                     # in already: before the RankDone
                assert all(p.held_at > 0 and p.seconds > 0 and p.messages > 0 for p in got)
                want = tuple(expected_checksum(decode.group.geometry, rid, r) for r in range(2)) \
                    if level == "checksums" else ("", "")
                assert probes.checksums(result) == want
        for result in results:
            decode.release(result)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
        expected = 4 * n if level else 0                        # 2 prefill + 2 decode ranks
        assert probes.received == expected
        assert _probes_sent(prefill_hosts) + _probes_sent(decode_hosts) - before == expected
        # A probe is never a message the coordinators did not expect.
        assert decode.stats().get("unexpected_messages", 0) == 0
        assert server.stats().get("unexpected_messages", 0) == 0


def test_instrumented_returns_the_group_with_probes_attached():
    group = _Group("decode-i", 1)
    assert instrumented(group) is group
    group.probe(0, "x", checksum="c")
    assert probes_of(group).checksums("x") == ("c",)
