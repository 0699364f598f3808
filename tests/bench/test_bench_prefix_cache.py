"""benchmarks/bench_prefix_cache.py --quick: real nodes on 127.0.0.1 through the HTTP API, cache
off and on; the JSON's structure, the ideal hit count from the prompts, that the cache
changes no answer while it serves hits, and the miss requests' record (both arms, none cached)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_prefix_cache.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ideal_hits_are_the_longest_prefix_seen_before_but_the_last_token():
    ideal = _bench().ideal_hits
    assert ideal([[1, 2, 3], [1, 2, 3, 4], [1, 9], [1, 2, 3, 4], [7]]) == [0, 3, 1, 3, 0]


def test_quick_run_off_and_on(tmp_path):
    out = tmp_path / "prefix.json"
    assert _bench().main(["--quick", "--arms", "off,on", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "prefix_cache" and result["config"]["quick"]
    assert set(result["plan"]) >= {"checkpoint_bytes_per_rank", "kv_bytes_per_token_per_rank"}
    off, on = result["arms"]
    assert (off["arm"], on["arm"]) == ("off", "on")
    for arm in (off, on):
        assert set(arm["ttft_per_turn"]) == {"1", "2", "3"}
        assert all(t["p50_s"] > 0 and t["p90_s"] >= t["p50_s"]
                   for t in arm["ttft_per_turn"].values())
        assert arm["prefilled_tokens"] == arm["prompt_tokens"] - arm["cached_tokens"]
        assert arm["answers_equal_first_arm"]                 # greedy: the cache changes none
        # /metrics counts what the responses said.
        assert (arm["metrics_queries"], arm["metrics_hits"]) == (arm["prompt_tokens"],
                                                                 arm["cached_tokens"])
    assert off["prompt_tokens"] == on["prompt_tokens"] and off["cached_tokens"] == 0
    # 2 conversations x 3 turns: the second shares the 300-token system prompt (a checkpoint at
    # 256), every later turn its own previous prompt (its end's checkpoint).
    assert 0 < on["cached_tokens"] <= on["ideal_cached_tokens"]
    assert on["cache_pages_per_rank"] > 0 and on["cache_bytes_per_rank"] > 0
    # Misses: the same fresh prompts (a turn-1 prompt's 312 tokens) on both arms, none cached.
    miss = result["miss"]
    assert (miss["requests"], miss["prompt_tokens"]) == (3, 312)
    for arm in ("off", "on"):
        assert miss[arm]["cached_tokens"] == [0, 0, 0]
        assert len(miss[arm]["ttft_s"]) == 3 and all(t > 0 for t in miss[arm]["ttft_s"])
        assert min(miss[arm]["ttft_s"]) <= miss[arm]["ttft_p50_s"] <= max(miss[arm]["ttft_s"])
    assert miss["ttft_p50_on_over_off"] == pytest.approx(miss["on"]["ttft_p50_s"]
                                                         / miss["off"]["ttft_p50_s"])


def test_fresh_prompts_share_no_prefix_with_each_other():
    prompts = _bench().fresh_prompts(4, 50, 8, seed=0, avoid=(3,))
    assert [len(p) for p in prompts] == [50] * 4 and min(min(p) for p in prompts) >= 3
    assert _bench().ideal_hits(prompts + [[3, 4]]) == [0, 0, 0, 0, 0]
