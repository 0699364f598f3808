"""Prefill and decode groups as separate processes, real UCX, real zmq: byte-exact transfers
between heterogeneous TP groups, zero-copy where the layout allows."""

from __future__ import annotations

import itertools
import time
import uuid

import numpy as np
import pytest

from statebridge.connector.decode import DecodeCoordinator
from statebridge.connector.prefill import PrefillServer
from statebridge.testing import stable_seed
from statebridge.testing.hosts import RankHostPool

from ._helpers import (
    FAST,
    SPECS,
    expected_checksum,
    log_to_stderr,
    random_prompt,
    wait_until,
)

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 8)]
LAYOUTS = ["LDS", "DLS", "LSD"]
REQUESTS = 16


@pytest.fixture(scope="module")
def pools():
    with RankHostPool(4, initializer=log_to_stderr) as prefill_hosts, \
            RankHostPool(8, initializer=log_to_stderr) as decode_hosts:
        yield prefill_hosts, decode_hosts


def transfer_round(pools, spec_name, src_tp, dst_tp, src_layout, dst_layout, config=FAST):
    prefill_hosts, decode_hosts = pools
    spec = SPECS[spec_name]
    rng = np.random.default_rng(stable_seed(spec_name, src_tp, dst_tp, src_layout, dst_layout))
    with PrefillServer(spec, src_tp, src_layout, num_pages=REQUESTS + 2, config=config,
                       launcher=prefill_hosts.launcher()) as server, \
            DecodeCoordinator(spec, dst_tp, dst_layout, num_pages=REQUESTS + 2, config=config,
                              launcher=decode_hosts.launcher(), checksums=True) as decode:
        server.wait_ready()
        decode.connect(server.address)
        for group in (server, decode):           # the ranks' channel is the one configured
            channel = group.local if config.local_ranks else group.router
            assert all(r.sock is channel for r in group.ranks)
        ids = [f"req-{i}-{uuid.uuid4().hex[:6]}" for i in range(REQUESTS)]
        submitted = time.monotonic()
        futures = [decode.submit(rid, random_prompt(rng)) for rid in ids]
        results = [f.result(timeout=60) for f in futures]
        # Rank timestamps, one clock for the machine: submitted < state final on the prefill
        # ranks < held by every decode rank < now.
        # (The prefill side records a request once its sends completed: just after the
        # decode side holds it.)
        wait_until(lambda: len(server.state_final_times(decode.node_id, ids)) == len(ids), 10,
                   "state-final times recorded")
        finals = server.state_final_times(decode.node_id, ids + ["never-sent"])
        assert set(finals) == set(ids)
        now = time.monotonic()
        for r in results:
            assert submitted < finals[r.request_id] < r.held_at < now, \
                (submitted, finals[r.request_id], r.held_at, now)
        for rid, result in zip(ids, results):
            assert result.request_id == rid
            expected = tuple(expected_checksum(decode.geometry, rid, r) for r in range(dst_tp))
            assert result.checksums == expected, f"{rid}: decode pages differ from the oracle"
        pages = {r.page for r in results}
        assert len(pages) == REQUESTS                      # every request its own page
        for result in results:
            decode.release(result)
        wait_until(lambda: server.stats()["pages_used"] == 0, 10, "prefill pages freed")
        assert decode.stats()["pages_used"] == 0
        return results, server.stats(), decode.stats()


CASES = [pytest.param(spec, p, d, layout, layout, id=f"{spec}-{p}x{d}-{layout}")
         for spec in SPECS for (p, d) in TP_PAIRS for layout in LAYOUTS]
CASES += [pytest.param("mamba2-g1", 2, 4, "LSD", "DLS", id="mamba2-g1-2x4-LSD-to-DLS"),
          pytest.param("shortconv", 4, 1, "DLS", "LDS", id="shortconv-4x1-DLS-to-LDS")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec_name,src_tp,dst_tp,src_layout,dst_layout", CASES)
def test_transfers_are_byte_exact(pools, spec_name, src_tp, dst_tp, src_layout, dst_layout):
    results, prefill_stats, decode_stats = transfer_round(pools, spec_name, src_tp, dst_tp,
                                                          src_layout, dst_layout)
    assert prefill_stats["requests"] == REQUESTS
    assert decode_stats["transfers_ok"] == REQUESTS
    staged = src_layout != dst_layout
    staging = [b for r in results for b in r.rank_staging_bytes] + \
        prefill_stats["rank_staging_bytes"]
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


@pytest.mark.timeout(180)
def test_transfers_with_ranks_on_zmq(pools):
    """``local_ranks=False``: ranks reach their coordinators over zmq (the path CurveZMQ
    covers) and move the same bytes."""
    results, prefill_stats, decode_stats = transfer_round(
        pools, "mamba2-g1", 2, 4, "DLS", "DLS", config=FAST.replace(local_ranks=False))
    assert len(results) == REQUESTS and decode_stats["transfers_ok"] == REQUESTS
