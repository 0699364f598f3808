"""Page geometry and kernel views: every layout, strided views over the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from statebridge.errors import LayoutError, ShapeError
from statebridge.state.layout import Layout, PageGeometry
from statebridge.state.spec import StateSpec

SPEC = StateSpec.from_config({"model_type": "mamba2", "hidden_size": 12, "expand": 2,
                              "head_dim": 3, "state_size": 5, "n_groups": 2, "conv_kernel": 3,
                              "num_hidden_layers": 3, "torch_dtype": "bfloat16"},
                             ssm_dtype="float32")


@pytest.mark.parametrize("name,conv,ssm", [("LSD", "LSD", "LHPN"), ("lds", "LDS", "LHPN"),
                                           ("DLS", "DLS", "HLPN"), ("LDS+HLPN", "LDS", "HLPN")])
def test_layout_names(name, conv, ssm):
    layout = Layout.parse(name)
    assert (layout.conv, layout.ssm) == (conv, ssm)
    assert Layout.parse(layout.name) == layout


@pytest.mark.parametrize("name", ["XYZ", "LSDX", "LDS+HPLX", "", "DDS+LHPN"])
def test_unknown_layout_names(name):
    with pytest.raises(LayoutError) as info:
        Layout.parse(name)
    assert repr(name) in str(info.value) or repr(name.upper().partition("+")[0]) in str(info.value) \
        or repr(name.upper().partition("+")[2]) in str(info.value)


@pytest.mark.parametrize("layout", ["LSD", "LDS", "DLS", "DLS+LHPN"])
@pytest.mark.parametrize("tp", [1, 2])
def test_regions_are_aligned_disjoint_and_fill_the_page(layout, tp):
    geo = PageGeometry(SPEC, tp, layout)
    spans = sorted((r.offset, r.end) for r in geo)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(r.offset % 16 == 0 for r in geo)
    assert geo.page_size % 64 == 0
    pad = sum(b - a for a, b in geo.padding_intervals())
    assert geo.data_bytes + pad == geo.page_size
    conv = geo.region(0, "conv")
    assert conv.dim == {"L": 3, "D": (24 + 2 * 10) // tp if tp == 1 else 12 + 10, "S": 2}


@pytest.mark.parametrize("layout", ["LSD", "LDS", "DLS", "LDS+HLPN"])
def test_views_read_and_write_the_physical_bytes(layout):
    """A value written through the canonical view lands where the axis order says."""
    geo = PageGeometry(SPEC, 2, layout)
    pages = 3
    buf = torch.zeros(pages * geo.page_size, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    for region in geo:
        view = geo.view(buf, 0, region.tensor.name)
        canonical = "L" + region.tensor.axes
        assert tuple(view.shape) == (pages, *(region.dim[a] for a in canonical))
        values = torch.randn(view.shape, generator=gen).to(view.dtype)
        view.copy_(values)
        raw = buf.numpy()
        for p in (0, 2):
            start = p * geo.page_size + region.offset
            stored = raw[start:start + region.nbytes].copy()
            physical = values[p].permute([canonical.index(a) for a in region.order]).contiguous()
            assert stored.tobytes() == physical.view(torch.uint8).numpy().tobytes()
        for layer in range(region.dim["L"]):
            per_layer = geo.view(buf, 0, region.tensor.name, layer)
            assert torch.equal(per_layer, view[:, layer])
            assert per_layer.data_ptr() == view[:, layer].data_ptr()


def test_views_reject_bad_buffers():
    geo = PageGeometry(SPEC, 1, "DLS")
    with pytest.raises(ShapeError, match="float32"):
        geo.view(torch.zeros(geo.page_size, dtype=torch.float32), 0, "conv")
    with pytest.raises(ShapeError, match=str(geo.page_size + 1)):
        geo.view(torch.zeros(geo.page_size + 1, dtype=torch.uint8), 0, "conv")
    with pytest.raises(ShapeError, match="layer index 3"):
        geo.view(torch.zeros(geo.page_size, dtype=torch.uint8), 0, "conv", layer=3)


def test_page_size_override_must_hold_the_state():
    geo = PageGeometry(SPEC, 1, "DLS")
    assert PageGeometry(SPEC, 1, "DLS", page_size=geo.page_size * 2).page_size == geo.page_size * 2
    with pytest.raises(Exception, match=str(geo.used_bytes)):
        PageGeometry(SPEC, 1, "DLS", page_size=geo.used_bytes - 16)


def test_describe_is_plain_data():
    desc = PageGeometry(SPEC, 2, "DLS").describe()
    assert desc["layout"] == "DLS" and desc["tp_size"] == 2
    import json
    assert json.loads(json.dumps(desc)) == desc
