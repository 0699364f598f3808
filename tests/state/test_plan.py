"""The transfer plan, executed with plain memory copies against an independent oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from statebridge.errors import ConfigError
from statebridge.state.layout import PageGeometry
from statebridge.state.plan import TransferPlan
from statebridge.state.spec import StateSpec

from ._oracle import copy_runs, global_state, page_of_rank

TPS = (1, 2, 4, 8)
LAYOUTS = ("LSD", "LDS", "DLS")

# Small, odd-sized configs that still divide by TP 8. ShortConv: 40 channels (5 per rank at
# TP 8), one attention layer between conv layers. Mamba2: I = 24 (3 per rank), 8 heads of
# head_dim 3, d_state 5; n_groups 8 (split) or 1 (replicated B/C).
SPEC_CONFIGS = {
    "shortconv": ({"model_type": "lfm2", "hidden_size": 40, "conv_L_cache": 3,
                   "num_attention_heads": 4, "num_key_value_heads": 2,
                   "layer_types": ["conv", "conv", "full_attention", "conv"],
                   "torch_dtype": "bfloat16"}, {}),
    "mamba2-g8": ({"model_type": "mamba2", "hidden_size": 12, "expand": 2, "head_dim": 3,
                   "state_size": 5, "n_groups": 8, "conv_kernel": 4, "num_hidden_layers": 3,
                   "torch_dtype": "float32"}, {}),
    "mamba2-g1": ({"model_type": "mamba2", "hidden_size": 16, "expand": 2, "head_dim": 4,
                   "state_size": 6, "n_groups": 1, "conv_kernel": 3, "num_hidden_layers": 2,
                   "torch_dtype": "float16"}, {}),
    "mamba2-bf16conv-fp32ssm": ({"model_type": "mamba2", "hidden_size": 20, "expand": 2,
                                 "head_dim": 5, "state_size": 3, "n_groups": 8,
                                 "conv_kernel": 2, "num_hidden_layers": 2,
                                 "torch_dtype": "bfloat16"}, {"ssm_dtype": "float32"}),
}


def make_spec(name: str, **overrides) -> StateSpec:
    config, kwargs = SPEC_CONFIGS[name]
    return StateSpec.from_config({**config, **overrides}, **kwargs)


def execute(plan: TransferPlan, state) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Run every pair of ``plan`` with memory copies; staged pairs through a staging buffer."""
    src_pages = {s: page_of_rank(plan.src, state, s)[0] for s in range(plan.src.tp_size)}
    return run_pairs(plan, src_pages)


def run_pairs(plan: TransferPlan, src_pages) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Every pair of ``plan`` as memory copies out of ``src_pages`` (by prefill rank): the
    decode ranks' pages (0xEE where nothing landed) and how often each byte was written."""
    dst_pages = {d: np.full(plan.dst.page_size, 0xEE, dtype=np.uint8)
                 for d in range(plan.dst.tp_size)}
    writes = {d: np.zeros(plan.dst.page_size, dtype=np.int64) for d in range(plan.dst.tp_size)}
    for pair in plan:
        src, dst = src_pages[pair.src_rank], dst_pages[pair.dst_rank]
        if pair.staged:
            staging = np.zeros(int(pair.pack[:, 2].sum()), dtype=np.uint8)
            copy_runs(src, staging, pair.pack)
            copy_runs(staging, dst, pair.unpack, writes[pair.dst_rank])
        else:
            copy_runs(src, dst, pair.runs, writes[pair.dst_rank])
    return dst_pages, writes


CASES = [
    pytest.param(spec, p, d, sl, dl, id=f"{spec}-{p}x{d}-{sl}-{dl}")
    for spec in SPEC_CONFIGS
    for p, d in itertools.product(TPS, TPS)
    for sl, dl in itertools.product(LAYOUTS, LAYOUTS)
]


@pytest.mark.parametrize("spec_name,src_tp,dst_tp,src_layout,dst_layout", CASES)
def test_plan_moves_every_byte_exactly_once(spec_name, src_tp, dst_tp, src_layout, dst_layout):
    spec = make_spec(spec_name)
    plan = TransferPlan.build(spec, src_tp, src_layout, dst_tp, dst_layout)
    state = global_state(spec)
    dst_pages, writes = execute(plan, state)
    for d in range(dst_tp):
        expected, data = page_of_rank(plan.dst, state, d)
        np.testing.assert_array_equal(dst_pages[d][data], expected[data],
                                      err_msg=f"decode rank {d} holds wrong bytes")
        assert (writes[d][data] == 1).all(), (
            f"decode rank {d}: data bytes written {np.unique(writes[d][data])} times")
        assert (writes[d][~data] <= 1).all(), f"decode rank {d}: padding written twice"
    # Replicated segments come from ONE source: payload = what the destinations hold.
    assert plan.bytes_per_request == dst_tp * plan.dst.data_bytes
    if src_layout == dst_layout:
        assert not any(p.staged for p in plan), "same axis order must never stage"
        assert plan.staging_bytes_per_request == 0


@pytest.mark.parametrize("spec_name", list(SPEC_CONFIGS))
@pytest.mark.parametrize("layout", LAYOUTS + ("LDS+HLPN", "LSD+HLPN", "DLS+LHPN"))
@pytest.mark.parametrize("tp", TPS)
def test_equal_tp_equal_layout_is_one_run_per_rank(spec_name, layout, tp):
    plan = TransferPlan.build(make_spec(spec_name), tp, layout, tp)
    assert sorted(plan.pairs) == [(r, r) for r in range(tp)]
    for pair in plan:
        assert len(pair.runs) == 1 and not pair.staged
        assert pair.runs[0].tolist() == [0, 0, plan.src.page_size] or (
            pair.runs[0, 0] == 0 and pair.runs[0, 1] == 0
            and pair.runs[0, 2] >= plan.src.data_bytes)


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 1)])
@pytest.mark.parametrize("num_layers", [1, 2, 5])
def test_shortconv_run_counts_by_layout(src_tp, dst_tp, num_layers):
    """ShortConv, one split segment: per rank pair DLS moves 1 run, LDS one per layer, LSD one
    per layer and state slot -- whatever the TP ratio."""
    spec = make_spec("shortconv", layer_types=["conv"] * num_layers, conv_L_cache=4)
    state_len = 3
    expected = {"DLS": 1, "LDS": num_layers, "LSD": num_layers * state_len}
    for layout, runs in expected.items():
        plan = TransferPlan.build(spec, src_tp, layout, dst_tp)
        assert len(plan.pairs) == max(src_tp, dst_tp)
        for pair in plan:
            assert len(pair.runs) == runs, (layout, pair.src_rank, pair.dst_rank)
        assert plan.messages_per_request == runs * max(src_tp, dst_tp)


HETERO = [(p, d) for p, d in itertools.product(TPS, TPS) if p != d]


@pytest.mark.parametrize("src_tp,dst_tp", HETERO)
def test_dim_first_runs_are_segments_not_layers(src_tp, dst_tp):
    """Mamba2 with split groups, DLS + HLPN: one run per (tensor, segment) piece involved, the
    same for 1, 3 and 7 layers."""
    counts = set()
    for layers in (1, 3, 7):
        plan = TransferPlan.build(make_spec("mamba2-g8", num_hidden_layers=layers),
                                  src_tp, "DLS", dst_tp)
        for pair in plan:
            assert len(pair.runs) == len(pair.boxes)
            assert {b.segment for b in pair.boxes} == {"x", "B", "C", "heads"}
        counts.add(tuple(len(p.runs) for p in plan))
    assert len(counts) == 1


@pytest.mark.parametrize("spec_name", ["mamba2-g8", "mamba2-g1"])
@pytest.mark.parametrize("src_tp,dst_tp", HETERO)
def test_run_counts_grow_with_layers_and_state_len(spec_name, src_tp, dst_tp):
    """DLS: independent of layers. LDS: linear in layers. LSD: linear in layers and more runs
    than LDS by the state length (conv pieces are cut per state slot)."""
    def runs(layout, layers):
        plan = TransferPlan.build(make_spec(spec_name, num_hidden_layers=layers),
                                  src_tp, layout, dst_tp)
        return plan.messages_per_request

    dls = [runs("DLS", n) for n in (1, 2, 4)]
    assert dls[0] == dls[1] == dls[2]
    for layout in ("LDS", "LSD"):
        r1, r2, r4 = (runs(layout, n) for n in (1, 2, 4))
        assert r2 - r1 > 0 and r4 - r2 == 2 * (r2 - r1), (layout, r1, r2, r4)
    assert runs("LSD", 4) > runs("LDS", 4) > runs("DLS", 4)


def test_replicated_bc_taken_from_one_source_rank():
    """n_groups = 1: B and C are replicated; each destination reads them from exactly one source
    rank, the one that already feeds it the x channels just before B (vLLM #55208)."""
    spec = make_spec("mamba2-g1")
    for src_tp, dst_tp in [(1, 2), (2, 4), (4, 2), (8, 1), (2, 8)]:
        plan = TransferPlan.build(spec, src_tp, "DLS", dst_tp)
        for d in range(dst_tp):
            bc_sources = [p.src_rank for p in plan.for_destination(d)
                          for b in p.boxes if b.segment in ("B", "C")]
            assert len(bc_sources) == 2 and bc_sources[0] == bc_sources[1]
            x_sources = [p.src_rank for p in plan.for_destination(d)
                         for b in p.boxes if b.segment == "x"]
            assert bc_sources[0] == max(x_sources)


@pytest.mark.parametrize("src_layout,dst_layout", [("LSD", "DLS"), ("DLS", "LDS"), ("LDS", "LSD")])
def test_mixed_layouts_are_flagged_and_staged(src_layout, dst_layout):
    spec = make_spec("mamba2-g8")
    plan = TransferPlan.build(spec, 2, src_layout, 4, dst_layout)
    assert all(p.staged for p in plan)
    assert all(p.messages == 1 for p in plan)
    assert plan.staging_bytes_per_request == plan.bytes_per_request


def test_runs_at_adds_only_page_bases():
    spec = make_spec("mamba2-g1")
    plan = TransferPlan.build(spec, 2, "LDS", 4)
    src_geo, dst_geo = plan.src, plan.dst
    state = global_state(spec, seed=7)
    src_pages, dst_pages = 3, 5
    src_page, dst_page = 2, 4
    for pair in plan:
        src_buf = np.zeros(src_pages * src_geo.page_size, dtype=np.uint8)
        page, _ = page_of_rank(src_geo, state, pair.src_rank)
        src_buf[src_page * src_geo.page_size:(src_page + 1) * src_geo.page_size] = page
        dst_buf = np.zeros(dst_pages * dst_geo.page_size, dtype=np.uint8)
        runs = pair.runs_at(src_page * src_geo.page_size, dst_page * dst_geo.page_size)
        copy_runs(src_buf, dst_buf, runs)
        touched = np.zeros(len(dst_buf), dtype=bool)
        for f, t, n in runs:
            touched[t:t + n] = True
        assert touched[dst_page * dst_geo.page_size:].any()
        assert not touched[:dst_page * dst_geo.page_size].any()
        np.testing.assert_array_equal(dst_buf[touched], src_buf[np.concatenate(
            [np.arange(f, f + n) for f, _, n in runs])])


@pytest.mark.parametrize("spec_name", ["mamba2-g8", "mamba2-bf16conv-fp32ssm"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("src_tp,dst_tp", [(2, 2), (2, 4), (8, 2), (1, 1), (2, 8)])
@pytest.mark.parametrize("src_align,dst_align,dst_page", [(16, 256, None), (128, 32, None),
                                                          (64, 64, 1 << 16)])
def test_peers_with_other_alignment_and_padded_pages(spec_name, layout, src_tp, dst_tp,
                                                     src_align, dst_align, dst_page):
    """A peer may align regions or pad pages differently (vLLM unifies page sizes); runs may
    bridge padding only where both sides' gaps are padding of the same length."""
    spec = make_spec(spec_name)
    src = PageGeometry(spec, src_tp, layout, region_align=src_align)
    dst = PageGeometry(spec, dst_tp, layout, region_align=dst_align, page_size=dst_page)
    assert src.padding_intervals() or dst.padding_intervals()
    plan = TransferPlan(src, dst)
    assert not any(p.staged for p in plan), "padding must not make a same-layout pair stage"
    state = global_state(spec)
    dst_pages, writes = execute(plan, state)
    for d in range(dst_tp):
        expected, data = page_of_rank(dst, state, d)
        np.testing.assert_array_equal(dst_pages[d][data], expected[data])
        assert (writes[d][data] == 1).all()


def test_plan_rejects_different_specs():
    a = PageGeometry(make_spec("mamba2-g8"), 2, "DLS")
    b = PageGeometry(make_spec("mamba2-g8", state_size=7), 2, "DLS")
    with pytest.raises(ConfigError, match="specs differ"):
        TransferPlan(a, b)


def test_plan_rejects_indivisible_tp():
    with pytest.raises(ConfigError, match="TP size 16"):
        TransferPlan.build(make_spec("mamba2-g8"), 2, "DLS", 16)
