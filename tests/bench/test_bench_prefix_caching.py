"""``statebridge bench --prefix-caching``: the prefill servers keep checkpoints and KV blocks
(the cell's counters say so), nothing hits (every prompt is unique), the moved pages and KV
stay byte-exact, and every per-request count -- transfer messages, bytes, UCX operations,
staging -- is the one of the same cell without the cache; control messages too, but for
timers (heartbeats, a rank's batched results), which move a class's count by a few messages a
round either way, and the cache's announcements: at most one a request (when its checkpoints
are ready; one for all that end in a loop iteration), sent and received by the two
coordinators, both in the bench process -- so at most two more per request there, none at the
ranks."""

from __future__ import annotations

import json

import pytest

from statebridge.bench import hetero_tp

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

SAME = ("messages_per_request", "bytes_per_request", "plan_messages_per_request",
        "plan_bytes_per_request", "ucx_operations_per_request",
        "ucx_operations_per_request_by_process", "staging_bytes_per_request",
        "shared_map_reads_per_request", "checked_requests", "prompt_tokens")


def _cell(tmp_path, *switch: str) -> dict:
    out = tmp_path / f"bench{len(switch)}.json"
    # 300 tokens: checkpoints at 256 (the prompt comes in 2 chunks) and at 300 (a tail block)
    assert hetero_tp.main(["--preset", "tiny-hybrid", "--pairs", "1x2", "--layouts", "DLS",
                           "--prompt-len", "300", "--requests", "12", "--concurrency", "3",
                           "--check-requests", "2", "--no-nixl", "--no-line-rate",
                           "--no-copy-limit", "--low-load-requests", "0", *switch,
                           "--json", str(out), "--quiet"]) == 0
    (cell,) = json.loads(out.read_text())["cells"]
    return cell


@pytest.mark.timeout(300)
def test_the_switch_turns_the_cache_on_and_changes_no_count(tmp_path):
    off, on = _cell(tmp_path), _cell(tmp_path, "--prefix-caching",
                                     "--prefix-checkpoint-tokens", "256")
    assert on["prefix_checkpoint_tokens"] == 256 and off["prefix_checkpoint_tokens"] is None
    assert off["prefix_caching"] is False and on["prefix_caching"] is True
    assert off["prefix_cache"]["prefix_cache"] is False
    assert off["prefix_cache"]["pages_cached"] == off["prefix_cache"]["prefix_queries"] == 0
    cache = on["prefix_cache"]
    assert cache["prefix_cache"] is True
    assert cache["pages_cached"] > 0 and cache["blocks_cached"] > 0     # checkpoints kept
    # check + warm-up + timed requests: every prompt token looked up, none found
    assert cache["prefix_queries"] == 300 * (2 + (3 + 2 + 3) + 12)
    assert cache["prefix_hits"] == 0
    assert on["checked_requests"] == 2                    # pages and KV byte-exact
    for name in SAME:
        assert on[name] == off[name], (name, on[name], off[name])
    ctl_on = on["control_messages_per_request_by_process"]
    ctl_off = off["control_messages_per_request_by_process"]
    assert set(ctl_on) == set(ctl_off)
    for group in ctl_on:
        announcements = 2 if group == "bench_process" else 0
        assert -0.5 < ctl_on[group] - ctl_off[group] < announcements + 0.5, (ctl_on, ctl_off)
    assert "(prefix cache)" in hetero_tp.format_table([on])
    assert "(prefix cache)" not in hetero_tp.format_table([off])
