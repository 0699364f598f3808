"""Prefill and decode groups as separate processes, real UCX, real zmq: byte-exact transfers
between heterogeneous TP groups, zero-copy where the layout allows."""

from __future__ import annotations

import itertools
import time
import uuid

import numpy as np
import pytest

from statebridge.bench.ab import with_switches
from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.prefill import PrefillServer
from statebridge.state.plan import TransferPlan
from statebridge.state.spec import StateSpec
from statebridge.testing import stable_seed
from statebridge.errors import ConfigError
from statebridge.testing.probes import Probes

from ._helpers import (
    FAST,
    SPECS,
    SYNTHETIC,
    expected_checksum,
    random_prompt,
    steady,
    wait_until,
)
from ._inprocess import check_pages

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

# Runs of 16-64 KiB (UCX rendezvous: the receiver reads them out of the sender's memory).
WIDE = StateSpec.from_config(
    {"model_type": "mamba2", "hidden_size": 256, "expand": 2, "head_dim": 16, "state_size": 32,
     "n_groups": 4, "conv_kernel": 4, "num_hidden_layers": 4, "torch_dtype": "bfloat16"},
    ssm_dtype="float32")
WAVES = 10
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 8)]
LAYOUTS = ["LDS", "DLS", "LSD"]
REQUESTS = 16


@pytest.fixture(scope="module")
def pools(shared_pools):
    """The session's rank hosts (tests/conftest.py)."""
    return shared_pools


def transfer_round(pools, spec_name, src_tp, dst_tp, src_layout, dst_layout, config=FAST,
                   rounds=1):
    """``rounds`` waves of REQUESTS requests in flight together, each checked byte for byte;
    the last wave's results, the prefill server's stats (plus the prefill ranks'
    ``unattended_sleeps`` over all waves) and the decode coordinator's."""
    prefill_hosts, decode_hosts = pools
    config = steady(config)           # a round loses no rank
    spec = {**SPECS, "mamba2-wide": WIDE}[spec_name]
    rng = np.random.default_rng(stable_seed(spec_name, src_tp, dst_tp, src_layout, dst_layout))
    with PrefillServer(spec, src_tp, src_layout, num_pages=REQUESTS + 2, config=config,
                       launcher=prefill_hosts.launcher(), model=SYNTHETIC,
                       probes="timing") as server, \
            DecodeCoordinator(spec, dst_tp, dst_layout, num_pages=REQUESTS + 2, config=config,
                              launcher=decode_hosts.launcher(), probes="checksums") as decode:
        probes = Probes(decode, server)
        server.wait_ready()
        decode.connect(server.address)
        for group in (server.group, decode.group):   # the ranks' channel: the configured one
            channel = group.local if config.local_ranks else group.router
            assert all(r.sock is channel for r in group.ranks)
        sleeps = unattended_sleeps(prefill_hosts, src_tp)
        for _ in range(rounds):
            results = _wave(server, decode, probes, rng, dst_tp)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
        assert decode.stats()["pages_used"] == 0
        prefill_stats = dict(server.stats(),
                             unattended_sleeps=unattended_sleeps(prefill_hosts, src_tp) - sleeps,
                             rank_staging_bytes=probes.staging_bytes(server))
        decode_stats = dict(decode.stats(), rank_staging_bytes=probes.staging_bytes(decode))
        return results, prefill_stats, decode_stats


def _wave(server, decode, probes, rng, dst_tp):
    ids = [f"req-{i}-{uuid.uuid4().hex[:6]}" for i in range(REQUESTS)]
    submitted = time.monotonic()
    futures = [decode.submit(rid, random_prompt(rng)) for rid in ids]
    results = [f.result(timeout=60) for f in futures]
    # Rank timestamps, one clock for the machine: submitted < state final on the prefill
    # ranks < held by every decode rank < now.
    # (A prefill rank settles a request once its sends completed: just after the decode side
    # holds it; its probe comes a moment after the result.)
    wait_until(lambda: all(_has_probes(probes, r, server) for r in results), 10,
               "prefill-side probes")
    now = time.monotonic()
    for r in results:
        final, held = probes.state_final_at(r, server), probes.held_at(r, decode)
        assert submitted < final < held < now, (submitted, final, held, now)
    for rid, result in zip(ids, results):
        assert result.request_id == rid
        expected = tuple(expected_checksum(decode.group.geometry, rid, r) for r in range(dst_tp))
        assert probes.checksums(result, decode) == expected, \
            f"{rid}: decode pages differ from the oracle"
    pages = {r.page for r in results}
    assert len(pages) == REQUESTS                      # every request its own page
    for result in results:
        decode.release(result)
    return results


def _has_probes(probes, result, group) -> bool:
    try:
        probes.of(result, group)
    except ConfigError:
        return False
    return True


def unattended_sleeps(hosts, ranks: int) -> int:
    """Loop sleeps of the first ``ranks`` hosts' ranks with UCX's events left unpolled."""
    return sum(c.get("unattended_sleeps", 0) for c in hosts.ops(ranks))


def shared_map_reads(hosts, ranks: int) -> int:
    """Shared-map reads (one request from one prefill rank) of the first ``ranks`` hosts."""
    return sum(c.get("shared_map_reads", 0) for c in hosts.ops(ranks))


#: Every zero-copy pair reads out of the prefill rank's shared map, however small.
SHM = FAST.replace(shared_map_min_bytes=0)
SHM_CASES = [pytest.param(spec, p, d, sl, dl, id=f"{spec}-{p}x{d}-{sl}-{dl}")
             for spec, p, d, sl, dl in [
                 ("mamba2-wide", 2, 4, "DLS", "DLS"), ("mamba2-wide", 4, 1, "DLS", "DLS"),
                 ("mamba2-g1", 1, 2, "LDS", "LDS"), ("mamba2-g1", 2, 4, "LSD", "DLS"),
                 ("shortconv", 4, 2, "LSD", "LSD"), ("shortconv", 1, 8, "DLS", "DLS")]]


#: Every spec x TP pair x layout (and two layout changes): all of them in process against the
#: byte oracle (test_matrix_moves_the_oracle_bytes_in_process), through real rank processes
#: a covering subset (REAL: each TP ratio kind, each layout, each spec, both layout changes)
#: by default and all of them under ``-m exhaustive``.
MATRIX = [(spec, p, d, layout, layout, f"{spec}-{p}x{d}-{layout}")
          for spec in SPECS for (p, d) in TP_PAIRS for layout in LAYOUTS]
MATRIX += [("mamba2-g1", 2, 4, "LSD", "DLS", "mamba2-g1-2x4-LSD-to-DLS"),
           ("shortconv", 4, 1, "DLS", "LDS", "shortconv-4x1-DLS-to-LDS")]
REAL = {"mamba2-g8-1x1-LDS",            # equal TP, zero-copy
        "shortconv-2x4-DLS",            # fan-out, zero-copy
        "mamba2-g1-4x1-LSD",            # fan-in, LSD
        "mamba2-g8-2x8-DLS",            # fan-out over all 8 decode hosts
        "mamba2-g1-2x4-LSD-to-DLS",     # layout changes: staged
        "shortconv-4x1-DLS-to-LDS"}
CASES = [pytest.param(*c[:5], id=c[5],
                      marks=() if c[5] in REAL else pytest.mark.exhaustive) for c in MATRIX]
assert REAL <= {c[5] for c in MATRIX}


@pytest.mark.parametrize("spec_name,src_tp,dst_tp,src_layout,dst_layout",
                         [pytest.param(*c[:5], id=c[5]) for c in MATRIX])
def test_matrix_moves_the_oracle_bytes_in_process(spec_name, src_tp, dst_tp, src_layout,
                                                  dst_layout):
    """The matrix of test_transfers_are_byte_exact without processes: each prefill rank's page
    filled as SyntheticModel fills it, the groups' plan executed with plain copies (staged
    pairs through a staging buffer), and each decode rank's page checksum equal to what the
    oracle says it must receive (the checksum the real test compares); zero-copy exactly where
    the real test asserts it."""
    plan = check_pages(SPECS[spec_name], src_tp, dst_tp, src_layout, dst_layout)
    staged = src_layout != dst_layout
    if src_layout in ("LDS", "DLS") and not staged:
        assert not any(p.staged for p in plan)
    if staged:
        assert any(p.staged for p in plan)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec_name,src_tp,dst_tp,src_layout,dst_layout", CASES)
def test_transfers_are_byte_exact(pools, spec_name, src_tp, dst_tp, src_layout, dst_layout):
    results, prefill_stats, decode_stats = transfer_round(pools, spec_name, src_tp, dst_tp,
                                                          src_layout, dst_layout)
    assert prefill_stats["requests"] == REQUESTS
    assert decode_stats["transfers_ok"] == REQUESTS
    staged = src_layout != dst_layout
    staging = decode_stats["rank_staging_bytes"] + prefill_stats["rank_staging_bytes"]
    if src_layout in ("LDS", "DLS") and not staged:
        # Zero-copy is real: no staging buffer was touched on either side.
        assert max(staging) == 0
    if staged:
        assert max(staging) > 0


@pytest.mark.timeout(180)
def test_transfers_with_ucx_endpoint_error_handling(pools):
    """The other transport choice: UCX endpoint error handling on (TCP lanes) moves the same
    bytes."""
    results, prefill_stats, _ = transfer_round(pools, "mamba2-g8", 2, 4, "DLS", "DLS",
                                               config=FAST.replace(ucx_error_handling=True))
    assert len(results) == REQUESTS and prefill_stats["requests"] == REQUESTS
    # Over TCP the sender pushes the bytes: its loop never sleeps through a send.
    assert prefill_stats["unattended_sleeps"] == 0


@pytest.mark.timeout(180)
def test_transfers_with_ranks_on_zmq(pools):
    """``local_ranks=False``: ranks reach their coordinators over zmq (the path CurveZMQ
    covers) and move the same bytes."""
    results, prefill_stats, decode_stats = transfer_round(
        pools, "mamba2-g1", 2, 4, "DLS", "DLS",
        config=with_switches(FAST, local_ranks=False))
    assert len(results) == REQUESTS and decode_stats["transfers_ok"] == REQUESTS


@pytest.mark.timeout(180)
@pytest.mark.parametrize("src_tp,dst_tp,src_layout,dst_layout",
                         [(2, 4, "DLS", "DLS"), (4, 1, "DLS", "DLS"), (2, 2, "LSD", "DLS")],
                         ids=["2x4", "4x1", "2x2-staged"])
def test_prefill_ranks_sleep_through_sends_their_receivers_read(pools, src_tp, dst_tp,
                                                                 src_layout, dst_layout):
    """Same host, shared memory: a prefill rank whose pending requests are all sends sleeps
    without polling UCX (the decode ranks read the bytes by themselves) and reaps the
    completions later -- still byte-exact, every page freed (checked in transfer_round)."""
    plan = TransferPlan.build(WIDE, src_tp, src_layout, dst_tp, dst_layout)
    # Every pair sends a message of 8 KiB or more: a rendezvous the receiver reads (smaller
    # messages are eager, and their sends complete inside the post).
    largest = [int(p.pack[:, 2].sum() if p.staged else p.runs[:, 2].max())
               for p in plan.pairs.values()]
    assert min(largest) >= 8192, largest
    # Waves of requests for long enough that the ranks see sends finish more often than
    # once per send_reap_interval (raised here: this test runs slowly, with checksums).
    results, prefill_stats, decode_stats = transfer_round(
        pools, "mamba2-wide", src_tp, dst_tp, src_layout, dst_layout, rounds=WAVES,
        config=FAST.replace(send_reap_interval=0.1))
    assert decode_stats["transfers_ok"] == WAVES * REQUESTS
    assert prefill_stats["requests"] == WAVES * REQUESTS
    assert prefill_stats["unattended_sleeps"] > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec_name,src_tp,dst_tp,src_layout,dst_layout", SHM_CASES)
def test_shared_map_reads_are_byte_exact(pools, spec_name, src_tp, dst_tp, src_layout,
                                         dst_layout):
    """Same host, ``shared_map``: each decode rank copies its zero-copy pairs' runs out of a
    read-only map of the prefill rank's buffer (staged pairs still go over UCX), byte for byte,
    every page freed on both sides; one read per zero-copy pair and request, counted."""
    spec = {**SPECS, "mamba2-wide": WIDE}[spec_name]
    plan = TransferPlan.build(spec, src_tp, src_layout, dst_tp, dst_layout)
    zero_copy = sum(not p.staged for p in plan.pairs.values())
    _, decode_hosts = pools
    before = shared_map_reads(decode_hosts, dst_tp)
    results, prefill_stats, decode_stats = transfer_round(
        pools, spec_name, src_tp, dst_tp, src_layout, dst_layout, config=SHM, rounds=2)
    assert decode_stats["transfers_ok"] == 2 * REQUESTS
    assert shared_map_reads(decode_hosts, dst_tp) - before == 2 * REQUESTS * zero_copy
    if not any(p.staged for p in plan.pairs.values()):
        assert max(decode_stats["rank_staging_bytes"]) == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("config", [FAST, with_switches(SHM, shared_map=False)],
                         ids=["below-threshold", "shared-map-off"])
def test_small_pairs_or_shared_map_off_go_over_ucx(pools, config):
    """Pairs under ``shared_map_min_bytes`` (the tiny specs under the 4 MiB default), or
    ``shared_map`` off on both groups: no shared-map read, UCX carries every byte."""
    _, decode_hosts = pools
    before = shared_map_reads(decode_hosts, 4)
    transfer_round(pools, "mamba2-wide", 2, 4, "DLS", "DLS", config=config)
    assert shared_map_reads(decode_hosts, 4) == before


@pytest.mark.timeout(180)
def test_a_decode_group_without_shared_map_is_served_over_ucx(pools):
    """The two groups decide alike: a prefill group serving shared maps and a decode group
    that does not read them move everything over UCX, byte for byte."""
    prefill_hosts, decode_hosts = pools
    rng = np.random.default_rng(7)
    before = shared_map_reads(decode_hosts, 2)
    with PrefillServer(WIDE, 2, "DLS", num_pages=REQUESTS + 2, config=SHM,
                       launcher=prefill_hosts.launcher(), model=SYNTHETIC,
                       probes="timing") as server, \
            DecodeCoordinator(WIDE, 2, "DLS", num_pages=REQUESTS + 2,
                              config=with_switches(SHM, shared_map=False),
                              launcher=decode_hosts.launcher(), probes="checksums") as decode:
        probes = Probes(decode, server)
        server.wait_ready()
        decode.connect(server.address)
        _wave(server, decode, probes, rng, 2)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
    assert shared_map_reads(decode_hosts, 2) == before


def _memfd_links(pid: int) -> list[str]:
    """The prefill buffers process ``pid`` holds open (descriptors) or mapped."""
    import os

    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "memfd:statebridge-prefill" in target:
            out.append(f"fd {fd}: {target}")
    with open(f"/proc/{pid}/maps") as f:
        out += [line.strip() for line in f if "memfd:statebridge-prefill" in line]
    return out


@pytest.mark.timeout(180)
def test_shared_buffers_are_released_when_their_ranks_end(pools):
    """A prefill rank closes its memfd when it ends (a rank host outlives its ranks), and a
    decode rank unmaps the buffer of a prefill rank whose process exited (a restarted prefill
    node comes back under a new node id: nothing would ever replace the old mapping)."""
    prefill_hosts, decode_hosts = pools
    transfer_round(pools, "mamba2-wide", 2, 2, "DLS", "DLS", config=SHM)
    wait_until(lambda: not any(
        line.startswith("fd") for p in prefill_hosts.pids[:2] for line in _memfd_links(p)),
        10, "prefill rank hosts closed their memfds")
    rng = np.random.default_rng(11)
    server = PrefillServer(WIDE, 2, "DLS", num_pages=REQUESTS + 2, config=SHM,
                           model=SYNTHETIC, probes="timing")  # own processes
    try:
        with DecodeCoordinator(WIDE, 2, "DLS", num_pages=REQUESTS + 2, config=SHM,
                               launcher=decode_hosts.launcher(), probes="checksums") as decode:
            probes = Probes(decode, server)
            server.wait_ready()
            decode.connect(server.address)
            _wave(server, decode, probes, rng, 2)
            decoders = decode_hosts.pids[:2]
            assert all(_memfd_links(p) for p in decoders), "decode ranks map the buffers"
            server.close()                      # the prefill rank processes exit
            wait_until(lambda: not any(_memfd_links(p) for p in decoders), 10,
                       "decode ranks unmapped the exited prefill ranks' buffers")
    finally:
        server.close()
