"""The benchmark's stand-in prefill model moves real memory, as the yardsticks' sources do."""

from __future__ import annotations

import torch

from statebridge.bench._model import PageOnceModel
from statebridge.bench.hetero_tp import preset_spec
from statebridge.connector.rank import KVBlocks, RankSetup
from statebridge.state.cache import StateCache
from statebridge.state.kv import BlockGeometry
from statebridge.state.layout import PageGeometry


def _model(role: str) -> tuple[PageOnceModel, KVBlocks]:
    spec = preset_spec("tiny-hybrid")
    cache = StateCache(PageGeometry(spec, 1, "DLS"), 2)
    geo = BlockGeometry(spec.kv, 1, "HB", 16, 8)
    kv = KVBlocks(geo, torch.zeros(geo.nbytes, dtype=torch.uint8), 0)
    setup = RankSetup(role=role, coordinator="", tp_rank=0, tp_size=1, spec_json=spec.to_json(),
                      layout="DLS", num_pages=2, node_id="n")
    return PageOnceModel(setup, cache, kv), kv


def test_a_prefill_ranks_kv_pool_is_written_before_any_request():
    # Timed requests move whatever their blocks hold; a block never written would be read
    # from the kernel's zero page (cache-hot), unlike the NIXL yardstick's written sources.
    model, kv = _model("prefill")
    assert int((kv.buffer == 0).sum()) == 0
    before = kv.buffer.clone()
    model.prefill_kv((0, 1, 2), 40, "timed-7")       # timed: moves what the blocks hold
    assert torch.equal(kv.buffer, before)


def test_a_decode_ranks_kv_pool_is_left_to_the_transfers():
    _, kv = _model("decode")
    assert int(kv.buffer.count_nonzero()) == 0


def test_a_page_after_its_first_request_gets_only_the_next_requests_seed():
    model, _ = _model("prefill")
    cache = model.cache
    model.prefill(1, (1, 2, 3), "timed-first")              # first use: the full state
    full = cache.page_bytes(1).clone()
    model.prefill(1, (1, 2, 3), "timed-00000042")
    at = model._stamp_at
    page = cache.page_bytes(1)
    assert bytes(page[at:at + 8].numpy()) == b"00000042"
    assert torch.equal(page[:at], full[:at]) and torch.equal(page[at + 8:], full[at + 8:])
    assert int(cache.page_bytes(0).count_nonzero()) == 0     # the other page untouched


def test_a_prompt_in_chunks_is_written_once_as_a_whole_prompt():
    # With the prefix cache on, steps end at its checkpoints: a check request's page and KV
    # are those of its whole prompt, written by its last chunk (earlier chunks write nothing).
    from statebridge.connector.rank.model import PrefillChunk

    whole, kv_whole = _model("prefill")
    assert whole.chunked_prefill
    assert whole.prefill_chunks([PrefillChunk("chk-1", 1, (7,) * 40, 0, True, (0, 1, 2))]) \
        == [None]
    cut, kv_cut = _model("prefill")
    first = PrefillChunk("chk-1", 1, (7,) * 20, 0, False, (0, 1, 2))
    assert cut.prefill_chunks([first]) == [None]
    assert int(cut.cache.page_bytes(1).count_nonzero()) == 0          # nothing yet
    assert cut.prefill_chunks([PrefillChunk("chk-1", 1, (7,) * 20, 20, True, (0, 1, 2))]) \
        == [None]
    assert torch.equal(cut.cache.buffer, whole.cache.buffer)
    assert torch.equal(kv_cut.buffer, kv_whole.buffer)
