"""StateCache: allocator errors and views."""

from __future__ import annotations

import threading

import pytest
import torch

from statebridge.errors import CacheFullError, ConfigError, DoubleFreeError, UnknownPageError
from statebridge.state.cache import StateCache
from statebridge.state.layout import PageGeometry
from statebridge.state.spec import StateSpec

SPEC = StateSpec.from_config({"model_type": "lfm2", "hidden_size": 6, "conv_L_cache": 4,
                              "num_attention_heads": 2, "num_key_value_heads": 1,
                              "layer_types": ["conv", "full_attention", "conv"]})


def make(pages=4, layout="DLS"):
    return StateCache(PageGeometry(SPEC, 2, layout), pages)


def test_allocate_until_full_then_free():
    cache = make(3)
    pages = [cache.allocate() for _ in range(3)]
    assert sorted(pages) == [0, 1, 2] and cache.num_free == 0
    with pytest.raises(CacheFullError, match="all 3 pages"):
        cache.allocate()
    cache.free(pages[1])
    assert cache.allocate() == pages[1]


def test_freed_pages_are_reused_last():
    cache = make(4)
    a = cache.allocate()
    cache.free(a)
    assert [cache.allocate() for _ in range(4)] == [1, 2, 3, a]


def test_double_free_and_unknown_pages():
    cache = make(2)
    page = cache.allocate()
    cache.free(page)
    with pytest.raises(DoubleFreeError, match=f"page {page}"):
        cache.free(page)
    for bad in (2, -1, "0", True):
        with pytest.raises(UnknownPageError, match=repr(bad)):
            cache.free(bad)
    assert cache.num_free == 2 and cache.num_used == 0


def test_allocate_many_is_all_or_nothing():
    cache = make(4)
    cache.allocate()
    with pytest.raises(CacheFullError, match="asked for 4 pages, 3 of 4 free"):
        cache.allocate_many(4)
    assert cache.num_free == 3
    assert len(set(cache.allocate_many(3))) == 3 and cache.num_free == 0


def test_concurrent_allocate_free_loses_nothing():
    cache = make(64)

    def churn():
        for _ in range(500):
            page = cache.allocate()
            cache.free(page)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.num_free == 64 and cache.num_used == 0


@pytest.mark.parametrize("layout", ["LSD", "LDS", "DLS"])
def test_views_address_one_page_only(layout):
    cache = make(3, layout)
    view = cache.view(0, "conv", layer=1)                   # [B, D, S]
    assert tuple(view.shape) == (3, 3, 3)
    view[1].fill_(1.5)
    nonzero = cache.buffer.nonzero().flatten()
    assert nonzero.min() >= cache.page_offset(1) and nonzero.max() < cache.page_offset(2)
    assert torch.equal(cache.view(0, "conv")[1, 1], torch.full((3, 3), 1.5))
    assert cache.page_bytes(1).count_nonzero() > 0 and cache.page_bytes(0).count_nonzero() == 0


def test_bad_construction():
    geo = PageGeometry(SPEC, 1, "DLS")
    with pytest.raises(ConfigError, match="0"):
        StateCache(geo, 0)
    with pytest.raises(ConfigError, match="bytes"):
        StateCache(geo, 2, buffer=torch.zeros(geo.page_size, dtype=torch.uint8))
