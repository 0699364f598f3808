"""benchmarks/bench_post.py on tiny rounds: both paths move their messages and the JSON holds
one row per size with the two figures and their difference (no timing thresholds)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_post_reports_both_paths(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_post", ROOT / "benchmarks/bench_post.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out_file = tmp_path / "post.json"
    out = bench.main(["--bytes", "4096", "65536", "--messages", "2", "--rounds", "30",
                      "--json", str(out_file)])
    assert json.loads(out_file.read_text()) == out
    assert [r["bytes"] for r in out["rows"]] == [4096, 65536]
    for row in out["rows"]:
        sb, raw = row["statebridge_cpu_us_per_message_side"], row["raw_ucxx_cpu_us_per_message_side"]
        assert sb > 0 and raw > 0
        assert row["overhead_us"] == sb - raw
        assert row["messages"] == 2 and row["rounds"] >= 20
