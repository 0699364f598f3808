"""``statebridge bench`` on the tiny preset and one TP pair: every JSON field, sane values.

No timing thresholds: only that the figures exist, are positive, and that message counts and
staging bytes match the transfer plan.
"""

from __future__ import annotations

import json
import math

import pytest

from statebridge.bench import hetero_tp
from statebridge.state.plan import TransferPlan

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

LAYOUTS = ("DLS", "LSD")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--preset", "tiny", "--pairs", "1x2", "--layouts", ",".join(LAYOUTS),
            "--requests", "16", "--concurrency", "4", "--check-requests", "2",
            "--json", str(out), "--quiet"]
    assert hetero_tp.main(argv) == 0
    return json.loads(out.read_text())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.timeout(120)
def test_every_cell_has_every_field(report):
    assert {c["layout"] for c in report["cells"]} == set(LAYOUTS)
    assert report["machine"]["transport"] == "sm"
    assert report["machine"]["ucx_error_handling"] is False
    for cell in report["cells"]:
        missing = [f for f in hetero_tp.CELL_FIELDS if f not in cell]
        assert not missing, f"{cell['layout']}: missing {missing}"
        assert cell["pair"] == "1x2" and cell["preset"] == "tiny"
        assert cell["checked_requests"] == 2
        for name in ("gbps", "requests_per_s", "latency_p50_ms", "latency_p99_ms"):
            assert _positive(cell[name]), (name, cell[name])
        assert cell["latency_p99_ms"] >= cell["latency_p50_ms"]


@pytest.mark.timeout(120)
def test_message_counts_and_staging_match_the_plan(report):
    spec = hetero_tp.preset_spec("tiny")
    for cell in report["cells"]:
        plan = TransferPlan.build(spec, 1, cell["layout"], 2)
        assert cell["messages_per_request"] == plan.messages_per_request
        assert cell["plan_messages_per_request"] == plan.messages_per_request
        assert cell["staging_bytes_per_request"] >= 0
        if cell["layout"] in ("DLS", "LDS"):
            assert cell["staging_bytes_per_request"] == 0


@pytest.mark.timeout(120)
def test_comparison_figures_are_measured_or_explained(report):
    for cell in report["cells"]:
        for value, ratio, note in (("line_rate_gbps", "ratio_to_line_rate", "line_rate_note"),
                                   ("nixl_gbps", "ratio_to_nixl", "nixl_note"),
                                   ("nixl_lds_gbps", "ratio_to_nixl_lds", "nixl_note")):
            if cell[value] is None:
                assert cell[ratio] is None and cell[note], f"{value} null without a reason"
            else:
                assert _positive(cell[value]) and _positive(cell[ratio])


@pytest.mark.timeout(120)
def test_nixl_and_line_rate_are_measured_here(report):
    """nixl-cu12 and ucx_perftest come with the test install: the comparisons must be real."""
    assert report["nixl"]["available"], report["nixl"]
    for cell in report["cells"]:
        assert _positive(cell["nixl_gbps"]) and _positive(cell["nixl_lds_gbps"]), cell
        assert _positive(cell["line_rate_gbps"]), cell.get("line_rate_note")


@pytest.mark.timeout(120)
def test_cpu_per_request_is_split_by_process_group(report):
    for cell in report["cells"]:
        cpu = cell["cpu_us_per_request"]
        assert set(cpu) == {"bench_process", "prefill_ranks", "decode_ranks", "total"}
        assert all(v >= 0 for v in cpu.values())
        parts = cpu["bench_process"] + cpu["prefill_ranks"] + cpu["decode_ranks"]
        assert math.isclose(cpu["total"], parts, rel_tol=1e-9)


@pytest.mark.timeout(180)
def test_append_adds_a_run_to_an_existing_file(tmp_path):
    out = tmp_path / "bench.json"
    base = ["--preset", "tiny", "--layouts", "DLS", "--requests", "4", "--concurrency", "2",
            "--check-requests", "1", "--no-nixl", "--no-line-rate", "--json", str(out),
            "--quiet"]
    assert hetero_tp.main(base + ["--pairs", "1x2"]) == 0
    assert hetero_tp.main(base + ["--pairs", "2x1", "--append"]) == 0
    merged = json.loads(out.read_text())
    assert [c["pair"] for c in merged["cells"]] == ["1x2", "2x1"]
    assert len(merged["runs"]) == 2 and "--append" in merged["runs"][1]["argv"]
    (tmp_path / "other.json").write_text('{"benchmark": "something else"}')
    with pytest.raises(Exception, match="not a hetero_tp result file"):
        hetero_tp.main(base[:-3] + ["--pairs", "1x2", "--append", "--json",
                                    str(tmp_path / "other.json"), "--quiet"])
