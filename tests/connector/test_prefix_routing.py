"""Decode-side routing by prefix (connector/prefix_router.py) and the prefill server's
announcements (connector/prefill_cache.py), without processes: a router fed by a prefill
group's announcements finds the hits that group's cache would, picks the node with the lowest
cost (queued prefill tokens + prompt - hit), breaks ties round robin, and with no cache anywhere
is exactly the round robin of before."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from statebridge.connector import messages as m
from statebridge.connector import prefill_cache
from statebridge.connector.handshake import RankAnnouncement
from statebridge.connector.ledger import Ledger, RequestKey
from statebridge.connector.prefill_cache import PrefillPrefix
from statebridge.connector.prefix_router import PrefixRouter
from statebridge.connector.stats import Counters
from statebridge.state.cache import PagePool
from statebridge.state.kv import BlockGeometry, BlockPool, blocks_for
from statebridge.state.layout import PageGeometry

from ._helpers import SPECS

BS, STRIDE = 4, 8


def _group(node_id: str, *, chunked: bool = True, pages: int = 16, blocks: int = 64):
    """What PrefillPrefix uses of a rank group (a spec without KV: blocks are not needed to
    test what is announced and routed)."""
    spec = SPECS["mamba2-g1"]
    return SimpleNamespace(
        node_id=node_id, spec=spec, geometry=PageGeometry(spec, 1, "LDS"), kv_geometry=None,
        block_size=BS, pool=PagePool(pages), blocks=None, num_pages=pages, num_blocks=0,
        counters=Counters(),
        announcements=lambda: [RankAnnouncement(address=b"a", chunked_prefill=chunked)])


def _info(prefix: PrefillPrefix) -> m.GroupInfo:
    info = m.GroupInfo(node_id=prefix.group.node_id, role="prefill", tp_size=1, layout="LDS",
                       page_size=prefix.group.geometry.page_size, region_align=16,
                       num_pages=prefix.group.num_pages,
                       spec_json=prefix.group.spec.to_json(), rank_addresses=(b"a",),
                       block_size=BS)
    return prefix.group_info(info)


def _prefill(prefix: PrefillPrefix, tokens, ledger_key: str = "r") -> int:
    """One request through the server's part, as if every rank succeeded; its hit."""
    group = prefix.group
    msg = m.TransferRequest(request_id=ledger_key, generation=1, prompt=m.pack_tokens(tokens))
    ledger = Ledger(1, group.pool)
    record = ledger.open(RequestKey("d", ledger_key, 1), 0.0)
    fields = prefix.plan(msg, record)
    prefix.settle(record, True)
    ledger.free(record)
    assert prefix.release(record) == fields.get("cached_tokens", 0)
    return fields.get("cached_tokens", 0)


def _peers(*names):
    return [SimpleNamespace(node_id=n) for n in names]


def test_without_any_cache_it_is_the_old_round_robin():
    router = PrefixRouter()
    ledger = Ledger(1, PagePool(4))
    peers = _peers("a", "b", "c")
    prompt = m.pack_tokens(range(20))
    assert [router.pick(peers, prompt, ledger).node_id for _ in range(7)] == \
        list(itertools.islice(itertools.cycle("abc"), 7))


def test_a_router_fed_by_announcements_finds_what_the_cache_holds():
    prefix = PrefillPrefix(_group("p1"), enabled=True, stride=STRIDE)
    router = PrefixRouter()
    router.connected(_info(prefix))
    router.announced("p1", prefix.snapshot())
    a = tuple(range(1, 30))
    assert _prefill(prefix, a) == 0
    router.announced("p1", prefix.changes())
    assert prefix.changes() is None                      # nothing changed since
    node = router.nodes["p1"]
    for tokens, hit in [(a, 24), (a[:20] + (99,) * 5, 16), (a + (5, 6), 29), (a[:7], 0)]:
        assert node.longest(node.hasher.prompt(tokens)) == hit
        assert _prefill(prefix, tokens, f"r{len(tokens)}{hit}") == hit
    # eviction: the changes remove what went
    prefix.cache.clear()
    router.announced("p1", prefix.changes())
    assert not node.keys and node.pages_cached == 0 and node.evictions > 0
    # a restarted (re-connected) node starts empty, a lost one is forgotten
    router.connected(_info(prefix))
    assert not router.nodes["p1"].keys
    router.lost("p1")
    assert "p1" not in router.nodes


def test_the_node_holding_the_longest_prefix_wins_balanced_by_queued_tokens():
    holders = {}
    for name in ("p1", "p2"):
        prefix = PrefillPrefix(_group(name), enabled=True, stride=STRIDE)
        holders[name] = prefix
    router = PrefixRouter()
    for prefix in holders.values():
        router.connected(_info(prefix))
    base = tuple(range(1, 26))
    _prefill(holders["p2"], base)                       # p2 holds 8, 16, 24, 25 of base
    router.announced("p2", holders["p2"].changes())
    peers = _peers("p1", "p2")
    ledger = Ledger(1, PagePool(8))
    prompt = m.pack_tokens(base + (7, 7, 7))
    assert [router.pick(peers, prompt, ledger).node_id for _ in range(4)] == ["p2"] * 4
    assert router.routed == 4 and router.routed_tokens == 4 * 25
    # 30 prefill tokens queued on p2: p1 costs 28, p2 30 + 28 - 25 = 33
    key = RequestKey("p2", "busy", 1)
    ledger.open(key, 0.0)
    router.sent(key, 30)
    assert router.pick(peers, prompt, ledger).node_id == "p1"
    ledger.free(ledger.get(key))                          # it landed: not queued any more
    assert router.pick(peers, prompt, ledger).node_id == "p2"
    # no hit anywhere: equal costs, round robin
    other = m.pack_tokens((100,) * 12)
    assert {router.pick(peers, other, ledger).node_id for _ in range(4)} == {"p1", "p2"}


@pytest.mark.parametrize("enabled,routing", [(False, True), (True, False)])
def test_routing_off_is_round_robin(enabled, routing):
    prefix = PrefillPrefix(_group("p2"), enabled=True, stride=STRIDE)
    router = PrefixRouter(enabled=enabled, routing=routing)
    router.connected(_info(_group_prefix("p1")))
    router.connected(_info(prefix))
    base = tuple(range(1, 26))
    _prefill(prefix, base)
    router.announced("p2", prefix.changes())
    prompt = m.pack_tokens(base + (7,))
    picks = [router.pick(_peers("p1", "p2"), prompt, Ledger(1, PagePool(2))).node_id
             for _ in range(4)]
    assert picks == ["p1", "p2", "p1", "p2"]


def _group_prefix(name):
    return PrefillPrefix(_group(name), enabled=True, stride=STRIDE)


def test_announcements_are_bounded_and_a_large_change_is_a_capped_reset(monkeypatch):
    monkeypatch.setattr(prefill_cache, "ANNOUNCE_CAP", 3)
    prefix = PrefillPrefix(_group("p1", pages=32), enabled=True, stride=STRIDE)
    router = PrefixRouter()
    router.connected(_info(prefix))
    _prefill(prefix, tuple(range(1, 34)))             # 8, 16, 24, 32, 33: 5 > 3
    msg = prefix.changes()
    assert msg.reset and len(msg.added_keys) == 3
    router.announced("p1", msg)
    node = router.nodes["p1"]
    assert len(node.keys) == 3 and 33 in node.keys.values()     # the prompt's end is kept
    _prefill(prefix, (50,) * 10, "small")               # 8, 10: within the cap
    msg = prefix.changes()
    assert not msg.reset and len(msg.added_keys) == 2
    router.announced("p1", msg)
    assert len(node.keys) == 5


def test_the_cache_is_off_without_chunked_ranks_or_when_not_asked(caplog):
    off = PrefillPrefix(_group("p1", chunked=False), enabled=True)
    assert not off.active and off.snapshot() is None
    assert "chunked_prefill" in caplog.text
    assert _info(off).prefix_cache is False
    assert PrefillPrefix(_group("p2")).plan(
        m.TransferRequest(request_id="r", generation=1, prompt=m.pack_tokens((1, 2, 3))),
        None) == {}
    info = _info(_group_prefix("p3"))
    assert info.prefix_cache and info.prefix_stride == STRIDE and len(info.prefix_salt) == 16


def test_a_request_that_asks_for_no_cache_neither_hits_nor_keeps_checkpoints():
    prefix = _group_prefix("p1")
    _prefill(prefix, tuple(range(1, 20)))
    group = prefix.group
    record = Ledger(1, group.pool).open(RequestKey("d", "x", 1), 0.0)
    msg = m.TransferRequest(request_id="x", generation=1, prompt=m.pack_tokens(range(1, 20)),
                            prefix_cache=False)
    assert prefix.plan(msg, record) == {}



def _kv_group(node_id: str, pages: int = 16, blocks: int = 64):
    from statebridge.state.spec import StateSpec

    spec = StateSpec.from_config(
        {"model_type": "lfm2", "hidden_size": 40, "conv_L_cache": 3, "torch_dtype": "bfloat16",
         "num_attention_heads": 4, "num_key_value_heads": 2,
         "layer_types": ["conv", "full_attention", "conv", "full_attention"]})
    group = _group(node_id, pages=pages)
    group.spec = spec
    group.geometry = PageGeometry(spec, 1, "LDS")
    group.kv_geometry = BlockGeometry(spec.kv, 1, "HB", BS, blocks)
    group.blocks, group.num_blocks = BlockPool(blocks), blocks
    return group


def test_rank_prefill_fields_and_block_ownership_with_kv():
    """The fields follow the ranks' rules (restore_blocks: the hit's full blocks then its
    tail, blocks_for(cached) of them; a tail only off block multiples); the request's own
    range is allocated as before; the checkpoint at the prompt's end is the request's own page
    and partial block (no copy: not in the ranks' fields); after commit the request frees
    only its private blocks and not its page, and the pools come back to what the cache
    holds."""
    prefix = PrefillPrefix(_kv_group("p1"), enabled=True, stride=STRIDE)
    group = prefix.group
    ledger = Ledger(1, group.pool, group.blocks)

    def run(tokens, rid):
        msg = m.TransferRequest(request_id=rid, generation=1, prompt=m.pack_tokens(tokens),
                                kv_blocks=tuple(range(blocks_for(len(tokens), BS))))
        assert prefix.admit(len(msg.kv_blocks))
        record = ledger.open(RequestKey("d", rid, 1), 0.0, num_blocks=len(msg.kv_blocks),
                             contiguous=True)
        fields = prefix.plan(msg, record)
        own, page = list(record.blocks), record.page
        prefix.settle(record, True)
        assert set(record.blocks) <= set(own)
        ledger.free(record)
        prefix.release(record)
        cache = prefix.cache
        assert group.pool.num_used == cache.num_units
        assert group.blocks.num_used == cache.num_blocks
        end = cache.index.get(prefix.hasher.prompt(tokens).key_at(len(tokens)))
        if end is not None and end.own:
            assert end.page == page and record.page == -1
            assert end.tail == (own[len(tokens) // BS] if len(tokens) % BS else None)
        return fields

    a = tuple(range(1, 30))                             # 29: checkpoints 8, 16, 24, 29
    fields = run(a, "a")
    assert fields["checkpoint_at"] == (8, 16, 24)       # 29: the request's own page
    assert "checkpoint_tails" not in fields             # 29's tail: its own block 7
    assert "cached_tokens" not in fields
    assert prefix.cache.index.get(prefix.hasher.prompt(a).key_at(29)).own
    fields = run(a[:29] + (7, 7), "c")                  # hit at 29, inside block 7
    assert fields["cached_tokens"] == 29
    assert len(fields["restore_blocks"]) == blocks_for(29, BS) == 8
    unit = prefix.cache.index.get(prefix.hasher.prompt(a).key_at(29))
    assert fields["restore_blocks"] == unit.blocks + (unit.tail,)
    assert fields["restore_page"] == unit.page
    fields = run(a[:20] + (9,) * 6, "b")                # hit at 16, a block multiple
    assert fields["cached_tokens"] == 16 and len(fields["restore_blocks"]) == 4
    # a failed request aborts its checkpoints and leaks nothing
    msg = m.TransferRequest(request_id="f", generation=1, prompt=m.pack_tokens((3,) * 20),
                            kv_blocks=tuple(range(5)))
    record = ledger.open(RequestKey("d", "f", 1), 0.0, num_blocks=5, contiguous=True)
    assert prefix.plan(msg, record)["checkpoint_at"] == (8, 16)     # and its own page at 20
    prefix.settle(record, False)
    ledger.free(record)
    prefix.release(record)
    assert group.pool.num_used == prefix.cache.num_units
    assert group.blocks.num_used == prefix.cache.num_blocks


def test_a_restarted_group_starts_with_an_empty_cache_over_its_new_pools():
    prefix = _group_prefix("p1")
    _prefill(prefix, tuple(range(1, 20)))
    assert prefix.snapshot().added_keys
    prefix.group.pool = PagePool(16)                    # what RankGroup.reset_generation does
    prefix.reset()
    snapshot = prefix.snapshot()
    assert snapshot.reset and not snapshot.added_keys and snapshot.pages_cached == 0
    assert prefix.cache.pages is prefix.group.pool
