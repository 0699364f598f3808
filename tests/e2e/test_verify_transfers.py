"""``--verify-transfers`` on a live pair (prefill TP 1, decode TP 2, a tiny LFM2 checkpoint
with attention layers): a transfer whose landing was corrupted on one decode rank is caught
before the first step -- recomputed by the ``recompute`` policy to the same tokens, or failed
with ``transfer_error`` by ``fail`` -- and counted in the decode node's ``/metrics``."""

from __future__ import annotations

import pytest

from statebridge.config import HttpConfig
from statebridge.errors import TransferError
from statebridge.models.checkpoint import make_checkpoint
from statebridge.node.client import Client
from statebridge.node.decode_node import DecodeNode
from statebridge.node.prefill_node import start_prefill_node

from tests.connector._helpers import wait_until

from ._helpers import FAST

httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

VERIFY = FAST.replace(verify_transfers=True)
CORRUPT_FIRST = "tests.e2e._helpers:CorruptFirstModel"
PROMPT = [5, 17, 42, 9, 100, 3, 77, 21, 64, 8, 13, 250, 31, 7, 90, 11, 2, 19]


@pytest.fixture(scope="module")
def pools(shared_pools):
    """The session's rank hosts (tests/conftest.py)."""
    return shared_pools


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "lfm2"
    make_checkpoint("lfm2", out, preset="tiny")
    return str(out)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_corrupted_landing_follows_the_policy_and_is_counted(pools, model, policy):
    prefill_hosts, decode_hosts = pools
    server = start_prefill_node(model, 1, num_pages=8, config=VERIFY, kv_blocks=64,
                                launcher=prefill_hosts.launcher())
    try:
        with DecodeNode(model, 2, [server.address], num_pages=8, config=VERIFY, kv_blocks=64,
                        policy=policy, rank_model=CORRUPT_FIRST, http=HttpConfig(port=0),
                        launcher=decode_hosts.launcher()) as node:
            with Client(node.address, timeout=120) as client:
                if policy == "recompute":
                    first = client.generate(PROMPT, max_new_tokens=8)
                else:
                    with pytest.raises(TransferError,
                                       match=r"transfer checksum mismatch of request .* decode "
                                             r"rank 0: expected 0x[0-9a-f]{16}, got "
                                             r"0x[0-9a-f]{16}") as failed:
                        client.generate(PROMPT, max_new_tokens=8)
                    assert failed.value.kind.value == "transfer_error"
                second = client.generate(PROMPT, max_new_tokens=8)     # lands intact
            assert not second.recomputed and len(second.tokens) == 8
            if policy == "recompute":
                assert first.recomputed and first.tokens == second.tokens
            stats = node.stats()
            assert stats["coordinator"]["transfer_digest_mismatches"] == 1
            assert stats["coordinator"]["transfer_digests_checked"] == 2 * 2
            assert stats["transfer_failed_transfer_error"] == 1
            assert stats["finished_ok"] == (2 if policy == "recompute" else 1)
            wait_until(lambda: node.stats()["coordinator"]["pages_used"] == 0, 10,
                       "decode pages free")
            assert node.stats()["coordinator"]["blocks_used"] == 0
            metrics = _metrics(node.http.url)
            assert metrics["statebridge_transfer_checksum_mismatches_total"] == 1
            assert metrics["statebridge_transfers_verified_total"] == 4
    finally:
        server.close()
