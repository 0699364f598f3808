"""``statebridge bench`` on the tiny preset and one TP pair: every JSON field, sane values.

No timing thresholds: only that the figures exist, are positive, and that message counts and
staging bytes match the transfer plan.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from statebridge.bench import hetero_tp
from statebridge.bench._copylimit import CANDIDATES
from statebridge.bench._nixl_reads import SlotPlan
from statebridge.bench._vllm_way import vllm_descriptors_per_request
from statebridge.state.plan import TransferPlan

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

LAYOUTS = ("DLS", "LSD")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--preset", "tiny", "--pairs", "1x2", "--layouts", ",".join(LAYOUTS),
            "--requests", "16", "--concurrency", "4", "--check-requests", "2",
            "--low-load-requests", "6", "--json", str(out), "--quiet"]
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
        assert cell["device"] == ("cuda" if torch.cuda.is_available() else "cpu")   # auto
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
                                   ("vllm_way_gbps", "ratio_to_vllm_way", "nixl_note"),
                                   ("copy_limit_gbps", "ratio_to_copy_limit",
                                    "copy_limit_note")):
            if cell[value] is None:
                assert cell[ratio] is None and cell[note], f"{value} null without a reason"
            else:
                assert _positive(cell[value]) and _positive(cell[ratio])


@pytest.mark.timeout(120)
def test_nixl_and_line_rate_are_measured_here(report):
    """nixl-cu12 and ucx_perftest come with the test install: the comparisons must be real."""
    assert report["nixl"]["available"], report["nixl"]
    for cell in report["cells"]:
        assert _positive(cell["nixl_gbps"]) and _positive(cell["vllm_way_gbps"]), cell
        assert _positive(cell["line_rate_gbps"]), cell.get("line_rate_note")


def _check_copy_limit(cell, dst_tp: int) -> None:
    """The limit is the best of every candidate, measured on the cell's bytes, and names the
    candidate it came from; the figures above it are listed (a beaten limit is wrong)."""
    candidates = cell["copy_limit_candidates"]
    assert set(candidates) == {c.name for c in CANDIDATES}
    figures = {name: c["gbps"] for name, c in candidates.items()}
    assert all(_positive(g) for g in figures.values()), candidates
    assert cell["copy_limit_gbps"] == max(figures.values())
    assert cell["copy_limit_yardstick"] == max(figures, key=figures.get)
    assert cell["ratio_to_copy_limit"] == pytest.approx(cell["gbps"] / cell["copy_limit_gbps"])
    assert cell["copy_limit_copiers"] == candidates[cell["copy_limit_yardstick"]]["copiers"]
    assert cell["copy_limit_cpu_share"] == candidates[cell["copy_limit_yardstick"]]["cpu_share"]
    per_core = __import__("os").cpu_count() or 1
    for name, c in candidates.items():
        assert c["copiers"] == (per_core if "/per_core/" in name else dst_tp), (name, c)
    assert cell["copy_limit_bytes_per_request"] == cell["bytes_per_request"]
    above = [who for who, field in (("statebridge", "gbps"), ("nixl", "nixl_gbps"),
                                    ("vllm_way", "vllm_way_gbps"))
             if cell.get(field) is not None and cell[field] > cell["copy_limit_gbps"]]
    assert cell["copy_limit_beaten_by"] == above


@pytest.mark.timeout(120)
def test_the_copy_limit_is_the_best_candidate_and_says_which(report):
    for cell in report["cells"]:
        _check_copy_limit(cell, 2)
    table = hetero_tp.format_table(report["cells"])
    assert "copy limit GB/s (yardstick)" in table.splitlines()[0]
    for cell in report["cells"]:
        assert (f"{cell['copy_limit_gbps']:.3g} ({cell['copy_limit_yardstick']}, CPU share "
                f"{cell['copy_limit_cpu_share']:.2f})") in table


def test_a_beaten_copy_limit_is_reported_as_wrong():
    cell = {"preset": "p", "pair": "2x4", "layout": "DLS", "gbps": 12.0, "nixl_gbps": 9.0,
            "copy_limit_gbps": 10.0, "copy_limit_yardstick": "shared_map/per_rank/warm",
            "copy_limit_beaten_by": ["statebridge"]}
    assert hetero_tp.limit_warnings([cell]) == [
        "copy limit beaten: p 2x4 DLS: statebridge 12 GB/s > 10 GB/s "
        "(shared_map/per_rank/warm); the limit is wrong"]
    assert hetero_tp.limit_warnings([dict(cell, copy_limit_beaten_by=[])]) == []
    assert hetero_tp.limit_warnings([dict(cell, copy_limit_beaten_by=None)]) == []


@pytest.mark.timeout(120)
def test_cpu_per_request_is_split_by_process_group(report):
    for cell in report["cells"]:
        cpu = cell["cpu_us_per_request"]
        assert set(cpu) == {"bench_process", "prefill_ranks", "decode_ranks", "total"}
        assert all(v >= 0 for v in cpu.values())
        parts = cpu["bench_process"] + cpu["prefill_ranks"] + cpu["decode_ranks"]
        assert math.isclose(cpu["total"], parts, rel_tol=1e-9)


def _check_vllm_way_counts(cell, p: int, d: int) -> None:
    """vLLM's way per request: one make_prepped_xfer + transfer + release per (source, decode)
    rank pair it reads; at least one check_xfer_state per handle; every source rank polls
    get_new_notifs at least once per request it frees (all notifs of a request may come in one
    poll, so >= 1 over the sources that serve)."""
    calls = cell["vllm_way_nixl_calls_per_request_by_call"]
    pairs = p * d                     # tiny presets: every decode rank reads every source
    for name in ("make_prepped_xfer", "transfer", "release_xfer_handle"):
        assert calls[name] == pairs, (name, calls)
    assert calls["check_xfer_state"] >= pairs
    assert calls["get_new_notifs"] > 0
    assert math.isclose(cell["vllm_way_nixl_calls_per_request"], sum(calls.values()))
    cpu = cell["vllm_way_cpu_us_per_request"]
    assert set(cpu) == {"nixl_dst", "nixl_src", "total"} and _positive(cpu["total"])
    assert math.isclose(cpu["total"], cpu["nixl_dst"] + cpu["nixl_src"])
    nixl = cell["nixl_calls_per_request_by_call"]
    assert nixl["make_prepped_xfer"] == nixl["transfer"] == nixl["release_xfer_handle"] == pairs
    for name in ("low_load_latency_p50_ms", "vllm_way_low_load_latency_p50_ms"):
        assert _positive(cell[name]), name
    assert cell["low_load_latency_p99_ms"] >= cell["low_load_latency_p50_ms"]
    assert cell["vllm_way_low_load_latency_p99_ms"] >= cell["vllm_way_low_load_latency_p50_ms"]
    # "state final -> every decode rank holds it" (rank timestamps on one clock): positive,
    # inside submit -> held (which adds the control plane and the stand-in prefill)
    final, submit = cell["low_load_final_to_held_p50_ms"], cell["low_load_latency_p50_ms"]
    assert _positive(final) and final < submit, (final, submit)
    assert cell["low_load_final_to_held_p99_ms"] >= final
    # vLLM's way on the same definition (sources announce the state final, workers post on
    # the announcement): per request it contains the READ's post -> done, so at each percentile
    vfinal = cell["vllm_way_low_load_final_to_held_p50_ms"]
    assert _positive(vfinal) and vfinal >= cell["vllm_way_low_load_latency_p50_ms"]
    assert cell["vllm_way_low_load_final_to_held_p99_ms"] >= vfinal


@pytest.mark.timeout(120)
def test_counts_per_request_match_the_plan(report):
    """UCX operations: every message posted once by the sender and once by the receiver.
    Control messages: sent + received by the coordinators (this process) and the ranks, each
    class counted; no exact figure (batching and timers may vary it), but every class talks."""
    for cell in report["cells"]:
        plan = TransferPlan.build(hetero_tp.preset_spec("tiny"), 1, cell["layout"], 2)
        assert cell["ucx_operations_per_request"] == 2 * plan.messages_per_request
        split = cell["ucx_operations_per_request_by_process"]
        assert split == {"bench_process": 0, "prefill_ranks": plan.messages_per_request,
                         "decode_ranks": plan.messages_per_request}
        ctl = cell["control_messages_per_request_by_process"]
        assert set(ctl) == {"bench_process", "prefill_ranks", "decode_ranks"}
        assert all(v > 0 for v in ctl.values()), ctl
        assert math.isclose(cell["control_messages_per_request"], sum(ctl.values()))
        assert cell["vllm_way_descriptors_per_request"] == vllm_descriptors_per_request(
            TransferPlan.build(hetero_tp.preset_spec("tiny"), 1, "LDS", 2))
        _check_vllm_way_counts(cell, 1, 2)
        assert cell["low_load_requests"] == 6
        assert cell["copy_limit_bytes_per_request"] == cell["bytes_per_request"]
        # tiny pairs are far below shared_map_min_bytes: UCX moves them
        assert cell["shared_map_reads_per_request"] == 0


@pytest.mark.timeout(180)
def test_append_adds_a_run_to_an_existing_file_and_csv_has_every_cell(tmp_path):
    out = tmp_path / "bench.json"
    base = ["--preset", "tiny", "--layouts", "DLS", "--requests", "4", "--concurrency", "2",
            "--check-requests", "1", "--no-nixl", "--no-line-rate", "--no-copy-limit",
            "--low-load-requests", "0", "--json", str(out), "--quiet"]
    assert hetero_tp.main(base + ["--pairs", "1x2"]) == 0
    table = tmp_path / "cells.csv"
    assert hetero_tp.main(base + ["--pairs", "2x1", "--append", "--csv", str(table)]) == 0
    merged = json.loads(out.read_text())
    assert [c["pair"] for c in merged["cells"]] == ["1x2", "2x1"]
    assert len(merged["runs"]) == 2 and "--append" in merged["runs"][1]["argv"]
    # the CSV: one row per cell of the merged file, numbers as in the JSON, nested figures as
    # JSON, a figure not measured (NIXL here) empty
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(hetero_tp.CSV_FIELDS)
    assert [r["pair"] for r in rows] == ["1x2", "2x1"]
    for row, cell in zip(rows, merged["cells"]):
        assert float(row["gbps"]) == pytest.approx(cell["gbps"])
        assert json.loads(row["cpu_us_per_request"]) == pytest.approx(cell["cpu_us_per_request"])
        assert row["nixl_gbps"] == "" and cell["nixl_gbps"] is None
    (tmp_path / "other.json").write_text('{"benchmark": "something else"}')
    with pytest.raises(Exception, match="not a hetero_tp result file"):
        hetero_tp.main(base[:-3] + ["--pairs", "1x2", "--append", "--json",
                                    str(tmp_path / "other.json"), "--quiet"])


@pytest.fixture(scope="module")
def hybrid_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "hybrid.json"
    argv = ["--preset", "tiny-hybrid", "--pairs", "1x2,2x1", "--layouts", "DLS",
            "--prompt-len", "9", "--block-size", "4", "--requests", "12", "--concurrency", "3",
            "--check-requests", "2", "--no-line-rate", "--low-load-requests", "6",
            "--json", str(out), "--quiet"]
    assert hetero_tp.main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_hybrid_cells_move_state_and_kv_as_planned(hybrid_report):
    """tiny-hybrid: 2 attention layers x 2 KV heads x 16 x bf16; 9 prompt tokens = 3 blocks of
    4, moved whole. With the HB block layout a rank pair moves one run per KV head it carries
    (each pair here carries one head), whatever the layers and blocks."""
    spec = hetero_tp.preset_spec("tiny-hybrid")
    kv_bytes = 3 * 4 * 2 * 2 * 2 * 16 * 2
    cells = {c["pair"]: c for c in hybrid_report["cells"]}
    assert set(cells) == {"1x2", "2x1"}
    for pair, cell in cells.items():
        p, d = map(int, pair.split("x"))
        state = TransferPlan.build(spec, p, "DLS", d)
        assert cell["prompt_tokens"] == 9 and cell["kv_layout"] == "HB"
        assert cell["checked_requests"] == 2                  # pages and KV byte-exact
        assert cell["plan_kv_runs_per_request"] == 2           # 2 pairs x 1 head each
        assert cell["messages_per_request"] == state.messages_per_request + 2
        assert cell["bytes_per_request"] == state.bytes_per_request + kv_bytes
        assert cell["staging_bytes_per_request"] == 0
        assert _positive(cell["gbps"])
        if hybrid_report["nixl"]["available"]:
            # NIXL reads exactly statebridge's runs; vLLM's way one descriptor per layer per K
            # or V per block: 2 layers x 2 x 3 blocks per pair.
            assert cell["nixl_descriptors_per_request"] == cell["messages_per_request"]
            vllm_pages = TransferPlan.build(spec, p, "LDS", d).messages_per_request
            assert cell["vllm_way_descriptors_per_request"] == vllm_pages + 2 * 2 * 2 * 3
            vllm_plan = SlotPlan(TransferPlan.build(spec, p, "LDS", d), ("LH", "LH"), 4, 9, 3)
            assert cell["vllm_way_descriptors_per_request"] == \
                vllm_descriptors_per_request(vllm_plan, 3)
            _check_vllm_way_counts(cell, p, d)
        # One host: the decode ranks read pages and KV out of the prefill ranks' shared maps,
        # one read per rank pair; UCX carries each pair's "ready" notice, posted by both sides
        # (the runs' count does not enter); the "done" answer is a word in the prefill's memory.
        assert cell["shared_map_reads_per_request"] == len(state.pairs) == 2
        assert cell["ucx_operations_per_request"] == 2 * len(state.pairs)


@pytest.mark.timeout(300)
def test_hybrid_cells_report_peak_rss_per_process(hybrid_report):
    """Each cell's peak RSS (MiB) of every process, by class: one per prefill rank, one per
    decode rank, and the NIXL workers the cell used; shown in the table."""
    for cell in hybrid_report["cells"]:
        p, d = map(int, cell["pair"].split("x"))
        rss = cell["peak_rss_mib"]
        counts = {"bench_process": 1, "prefill_ranks": p, "decode_ranks": d}
        if hybrid_report["nixl"]["available"]:
            counts.update(nixl_src=p, nixl_dst=d)
        assert {k: len(v) for k, v in rss.items()} == counts, rss
        assert all(_positive(v) for values in rss.values() for v in values), rss
        assert cell["peak_rss_scope"] in ("cell", "process")
        # a rank process imports torch and UCX: tens of MiB at least
        assert min(rss["prefill_ranks"] + rss["decode_ranks"]) > 20
    table = hetero_tp.format_table(hybrid_report["cells"])
    assert "peak RSS MiB P/D/NIXL" in table.splitlines()[0]
    cell = hybrid_report["cells"][0]
    assert f"| {max(cell['peak_rss_mib']['prefill_ranks']):.0f}/" in table


def test_peak_rss_reads_and_resets_this_process():
    import os

    pid = os.getpid()
    assert hetero_tp._peak_rss_mib(2 ** 22 + 12345) is None   # no such process
    tracker = hetero_tp._PeakRss({"me": [pid]})
    if tracker.scope != "cell":
        pytest.skip("the kernel refuses to reset VmHWM here (/proc/PID/clear_refs)")
    base = tracker.read()["me"][0]                  # just reset: the current RSS
    assert _positive(base)
    grown = bytearray(64 << 20)                     # +64 MiB resident, then freed
    grown[::4096] = b"x" * len(grown[::4096])
    del grown
    assert tracker.read()["me"][0] >= base + 60
    assert hetero_tp._PeakRss({"me": [pid]}).read()["me"][0] < base + 60   # reset again


@pytest.mark.timeout(120)
def test_wakeups_per_request_are_counted_by_process_group(report):
    """Every process sleeps and is woken at least once per request somewhere (a transfer
    wakes the decode ranks); the split adds up."""
    for cell in report["cells"]:
        wake = cell["wakeups_per_request"]
        assert set(wake) == {"bench_process", "prefill_ranks", "decode_ranks", "total"}
        assert all(v >= 0 for v in wake.values())
        assert wake["decode_ranks"] > 0 and wake["bench_process"] > 0, wake
        assert math.isclose(wake["total"], wake["bench_process"] + wake["prefill_ranks"]
                            + wake["decode_ranks"], rel_tol=1e-9)


@pytest.mark.timeout(180)
def test_shared_map_cells_count_their_reads_and_measure_the_copy_limit(tmp_path, monkeypatch):
    """Every pair through the shared map (threshold 0 from the environment, as the nodes read
    it): one read per rank pair per request, counted; UCX carries only the notices (ready and
    done, posted by both sides); the copy limit measured with every candidate."""
    monkeypatch.setenv("STATEBRIDGE_SHARED_MAP_MIN_BYTES", "0")
    out = tmp_path / "shm.json"
    assert hetero_tp.main(["--preset", "tiny", "--pairs", "2x1", "--layouts", "DLS",
                           "--requests", "16", "--concurrency", "4", "--check-requests", "2",
                           "--no-nixl", "--no-line-rate", "--low-load-requests", "0",
                           "--json", str(out), "--quiet"]) == 0
    cell = json.loads(out.read_text())["cells"][0]
    plan = TransferPlan.build(hetero_tp.preset_spec("tiny"), 2, "DLS", 1)
    assert cell["checked_requests"] == 2                       # byte-exact
    assert cell["shared_map_reads_per_request"] == len(plan.pairs) == 2
    assert cell["ucx_operations_per_request"] == 2 * len(plan.pairs)   # the notices
    assert cell["messages_per_request"] == plan.messages_per_request
    _check_copy_limit(cell, 1)


@pytest.mark.timeout(180)
def test_an_ab_switch_turned_off_by_the_harness_moves_every_byte_over_ucx(tmp_path,
                                                                        monkeypatch):
    """``--off shared_map`` (statebridge/bench/ab.py): the same cell as above, with no
    shared-map read; byte-exact, and the cell says which switch was off."""
    monkeypatch.setenv("STATEBRIDGE_SHARED_MAP_MIN_BYTES", "0")
    out = tmp_path / "off.json"
    assert hetero_tp.main(["--preset", "tiny", "--pairs", "2x1", "--layouts", "DLS",
                           "--requests", "8", "--concurrency", "4", "--check-requests", "2",
                           "--no-nixl", "--no-line-rate", "--no-copy-limit",
                           "--low-load-requests", "0", "--off", "shared_map",
                           "--json", str(out), "--quiet"]) == 0
    cell = json.loads(out.read_text())["cells"][0]
    plan = TransferPlan.build(hetero_tp.preset_spec("tiny"), 2, "DLS", 1)
    assert cell["switched_off"] == ["shared_map"] and cell["checked_requests"] == 2
    assert cell["shared_map_reads_per_request"] == 0
    assert cell["ucx_operations_per_request"] == 2 * plan.messages_per_request   # every run
    assert "(shared_map off)" in hetero_tp.format_table([cell])


@pytest.mark.timeout(120)
def test_completions_per_burst_is_reported_within_its_bounds(report):
    for cell in report["cells"]:
        assert 1.0 <= cell["completions_per_burst"] <= 16, cell["completions_per_burst"]


@pytest.mark.parametrize("times, expected", [
    ([0.0, 1.0, 2.0, 3.0, 4.0], 1.0),                              # a steady stream
    ([0.0, 0.01, 0.02, 10.0, 10.01, 10.02, 20.0, 20.01, 20.02], 3.0),   # lock step, 3 at a time
    ([5.0, 0.0, 0.01, 5.01], 2.0),                                 # order does not matter
    ([1.0, 1.0, 1.0], 3.0),                                        # all at once: one burst
    ([2.0], 1.0),
    ([], 0.0),
])
def test_completions_per_burst_counts_bunched_completions(times, expected):
    assert hetero_tp.completions_per_burst(times) == pytest.approx(expected)
