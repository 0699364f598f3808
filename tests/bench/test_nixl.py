"""NixlPool (``statebridge bench``'s NIXL figures): NIXL moves exactly the plan's bytes.

Every run checks each byte the destinations read against the sources' pattern (``verify``);
the checker itself is shown to fail on a wrong byte. No timing thresholds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from statebridge.bench import _nixl, _nixl_reads
from statebridge.bench._nixl import NixlOptions, NixlPool, pattern_block
from statebridge.bench.hetero_tp import preset_spec
from statebridge.errors import ConfigError
from statebridge.state.plan import TransferPlan

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

if _nixl.nixl_available() is not None:        # nixl-cu12 is a test dependency; say so loudly
    pytest.fail(f"NIXL is not importable: {_nixl.nixl_available()}", pytrace=False)


@pytest.fixture(scope="module")
def pool():
    with NixlPool(2, 2) as p:
        procs = [w.proc for w in p.src + p.dst]
        yield p
    p.close()                                         # idempotent
    assert p.src == [] and p.dst == []
    assert [proc.exitcode for proc in procs] == [0] * 4   # each exited cleanly, none killed


def _plan(src_tp: int, layout: str, dst_tp: int) -> TransferPlan:
    return TransferPlan.build(preset_spec("tiny"), src_tp, layout, dst_tp)


def _run_bytes(plan: TransferPlan) -> int:
    return sum(int(p.runs[:, 2].sum()) for p in plan)


# (src_tp, layout, dst_tp, pages, requests, concurrency): odd request counts, fewer requests
# than slots, a layout whose runs are many and short (LSD), and vLLM's per-layer layout (LDS).
CASES = [
    pytest.param(1, "DLS", 2, 3, 7, 3, id="1x2-DLS"),
    pytest.param(2, "DLS", 1, 2, 5, 2, id="2x1-DLS"),
    pytest.param(2, "LSD", 2, 2, 3, 2, id="2x2-LSD"),
    pytest.param(1, "LDS", 2, 4, 2, 4, id="1x2-LDS-fewer-requests-than-slots"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("src_tp, layout, dst_tp, pages, requests, concurrency", CASES)
def test_run_cell_moves_exactly_the_runs(pool, src_tp, layout, dst_tp, pages, requests,
                                         concurrency):
    plan = _plan(src_tp, layout, dst_tp)
    r = pool.run_cell(plan, pages=pages, requests=requests, concurrency=concurrency,
                      timeout=60, verify=True)
    slots = min(pages, requests, concurrency)
    assert r["verified_bytes"] == slots * _run_bytes(plan)
    assert r["descriptors_per_request"] == sum(len(p.runs) for p in plan)
    assert r["gbps"] > 0 and r["requests_per_s"] > 0
    assert 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
    assert r["options"] == NixlOptions().to_dict()


OPTION_CASES = [
    pytest.param(NixlOptions.first_cut(), id="first-cut"),
    pytest.param(NixlOptions(reuse_handles=True, wait="spin"), id="reuse-handles-spin"),
    pytest.param(NixlOptions(warmup=False, error_handling=True, huge_pages=False),
                 id="eh-4k-no-warmup"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", OPTION_CASES)
def test_every_option_set_moves_exactly_the_runs(pool, options):
    plan = _plan(2, "DLS", 2)
    r = pool.run_cell(plan, pages=2, requests=5, concurrency=2, timeout=60, verify=True,
                      options=options)
    assert r["verified_bytes"] == 2 * _run_bytes(plan)
    assert r["options"] == options.to_dict()


@pytest.mark.timeout(60)
def test_untouched_sources_run_but_cannot_be_verified(pool):
    plan = _plan(1, "DLS", 2)
    r = pool.run_cell(plan, pages=1, requests=2, concurrency=1, timeout=60,
                      options=NixlOptions(touch=False))
    assert r["verified_bytes"] is None and r["gbps"] > 0
    with pytest.raises(ConfigError, match="touch is False"):
        pool.run_cell(plan, pages=1, requests=1, concurrency=1, verify=True,
                      options=NixlOptions(touch=False))


def _pattern_buffer(seed: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, dtype=np.uint8)
    _nixl._fill_pattern(out, seed)
    return out


def test_pattern_is_periodic_and_seeded():
    a = _pattern_buffer(0, 3 * _nixl.PATTERN_PERIOD + 5)
    assert np.array_equal(a[:_nixl.PATTERN_PERIOD], pattern_block(0))
    assert np.array_equal(a[_nixl.PATTERN_PERIOD:2 * _nixl.PATTERN_PERIOD], pattern_block(0))
    assert not np.array_equal(pattern_block(0), pattern_block(1))


def test_verify_reports_a_wrong_byte_and_a_shifted_run():
    """The byte check can fail: one flipped byte, and a run read from 1 byte off."""
    src_page, dst_page, pages = 300, 200, 2
    runs = np.array([[10, 0, 50], [100, 60, 40]], dtype=np.int64)
    src = _pattern_buffer(3, src_page * pages)
    dst = np.zeros(dst_page * pages, dtype=np.uint8)
    for p in range(pages):
        for s, d, n in runs:
            dst[p * dst_page + d:p * dst_page + d + n] = src[p * src_page + s:p * src_page + s + n]
    state = {"buf": torch.from_numpy(dst)}
    kw = dict(sources=[(3, runs)], src_page=src_page, dst_page=dst_page, pages=pages)
    assert _nixl._verify(state, **kw) == {"bytes": 2 * 90, "bad_runs": []}

    dst[dst_page + 60 + 7] ^= 0xFF                   # page 1, second run
    assert _nixl._verify(state, **kw)["bad_runs"] == [{"source": 3, "page": 1,
                                                       "run": [100, 60, 40]}]
    dst[dst_page + 60 + 7] ^= 0xFF
    dst[0:50] = src[11:61]                           # page 0, first run read one byte late
    assert _nixl._verify(state, **kw)["bad_runs"] == [{"source": 3, "page": 0,
                                                       "run": [10, 0, 50]}]
    assert _nixl._verify(state, **{**kw, "sources": [(4, runs)]})["bad_runs"]   # wrong source


def test_options_reject_an_unknown_wait_mode():
    with pytest.raises(ConfigError, match="'sleepy'"):
        NixlOptions(wait="sleepy")


@pytest.mark.timeout(60)
def test_run_cell_rejects_bad_arguments_naming_the_value(pool):
    big = TransferPlan.build(preset_spec("mamba2-2.7b"), 4, "DLS", 2)
    with pytest.raises(ConfigError, match="4x2"):
        pool.run_cell(big, pages=1, requests=1, concurrency=1)
    with pytest.raises(ConfigError, match="requests must be >= 1, got 0"):
        pool.run_cell(_plan(1, "DLS", 1), pages=1, requests=0, concurrency=1)


HYBRID = {"model_type": "lfm2", "hidden_size": 40, "conv_L_cache": 3, "torch_dtype": "bfloat16",
          "num_attention_heads": 4, "num_key_value_heads": 2,
          "layer_types": ["conv", "full_attention", "conv", "full_attention"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("src_tp, dst_tp, kv_layout, tokens", [
    (1, 2, "HB", 9), (2, 1, "BH", 4), (2, 2, "LH", 1)])
def test_slot_plan_reads_state_and_kv_exactly(pool, src_tp, dst_tp, kv_layout, tokens):
    """State plus the KV of a prompt: every slot's page runs and its blocks' KV runs, each byte
    compared with the sources' pattern."""
    from statebridge.bench._nixl_reads import SlotPlan
    from statebridge.state.spec import StateSpec

    spec = StateSpec.from_config(HYBRID)
    plan = SlotPlan(TransferPlan.build(spec, src_tp, "DLS", dst_tp), (kv_layout, kv_layout),
                    block_size=4, tokens=tokens, pages=3)
    blocks = -(-tokens // 4)
    # 2 attention layers x K,V x 2 KV heads x head_dim 10 x bf16 per token, whole blocks.
    kv_bytes = blocks * 4 * 2 * 2 * 2 * 10 * 2
    assert plan.bytes_per_request == spec.bytes_per_request() + kv_bytes
    r = pool.run_cell(plan, pages=3, requests=5, concurrency=3, timeout=60, verify=True)
    assert r["verified_bytes"] == 3 * plan.bytes_per_request          # 3 slots read


class _FakeAgent:
    """``check_xfer_state`` answers from a script: handle -> states, one per poll."""

    def __init__(self, states: dict) -> None:
        self.states = {h: list(s) for h, s in states.items()}

    def check_xfer_state(self, h):
        return self.states[h].pop(0) if len(self.states[h]) > 1 else self.states[h][0]


def test_poll_finishes_a_request_only_when_all_its_handles_are_done():
    agent = _FakeAgent({"a": ["PROC", "DONE"], "b": ["DONE"], "c": ["PROC", "PROC", "DONE"]})
    active = {0: (7, 0.0, ["a", "b"]), 1: (8, 0.0, ["c"])}
    calls, finished = {"check_xfer_state": 0}, []

    def done(slot, req, latency, handles):
        assert slot not in active                   # out of the window before the callback
        finished.append((slot, req, handles))
        assert latency > 0
    far = 1e18
    _nixl_reads.poll_reads(agent, active, calls, done, far, 1.0, yield_cpu=True)
    assert finished == [] and set(active) == {0, 1} and calls["check_xfer_state"] == 3
    _nixl_reads.poll_reads(agent, active, calls, done, far, 1.0, yield_cpu=False)
    assert finished == [(0, 7, ["a", "b"])] and set(active) == {1}
    _nixl_reads.poll_reads(agent, active, calls, done, far, 1.0, yield_cpu=True)
    assert finished[1:] == [(1, 8, ["c"])] and active == {}
    assert calls["check_xfer_state"] == 3 + 3 + 1


def test_poll_raises_on_a_failed_read_and_past_the_deadline():
    with pytest.raises(RuntimeError, match="READ of request 5 failed"):
        _nixl_reads.poll_reads(_FakeAgent({"a": ["DONE"], "b": ["ERR"]}),
                               {2: (5, 0.0, ["a", "b"])}, {"check_xfer_state": 0},
                               lambda *a: None, 1e18, 1.0, True)
    with pytest.raises(RuntimeError, match=r"not done after 3.5 s \(1 in flight\)"):
        _nixl_reads.poll_reads(_FakeAgent({"a": ["PROC"]}), {0: (0, 0.0, ["a"])},
                               {"check_xfer_state": 0}, lambda *a: None, 0.0, 3.5, True)
