"""benchmarks/bench_prefix_cache.py --quick: real nodes on 127.0.0.1 through the HTTP API, cache
off and on; the JSON's structure, the ideal hit count from the prompts, and that the cache
changes no answer while it serves hits."""

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
