"""The prefill group's prefix cache bookkeeping, driven the way a prefill coordinator would and
checked against a shadow of what every page and block holds (the tokens written into it): a
hit must hand out bytes that really are its prompt's, a cached block is never written, and the
expected hits come from a brute-force model over token lists."""

from __future__ import annotations

import random

import numpy as np
import pytest

from statebridge.errors import ConfigError
from statebridge.connector.prefix_cache import Changes, Hit, PrefixCache
from statebridge.state.cache import PagePool
from statebridge.state.kv import BlockPool, blocks_for
from statebridge.state.prefix import PrefixHasher

BS, STRIDE = 4, 8


class Shadow:
    """A prefill group: its pools, its cache, and what each page and block holds."""

    def __init__(self, pages=16, blocks=64, *, kv=True, stride=STRIDE, own=False, **kw):
        self.own = own                              # the end checkpoint takes the request's page
        self.pool = PagePool(pages)
        self.blocks = BlockPool(blocks) if kv else None
        self.hasher = PrefixHasher(b"test-salt", BS, stride=stride)
        self.cache = PrefixCache(self.pool, self.blocks, self.hasher, **kw)
        self.page_data: dict[int, tuple] = {}       # page -> the prefix its state is after
        self.block_data: dict[int, tuple] = {}      # block -> tokens in its slots
        self.prompts: dict[bytes, tuple] = {}       # checkpoint key -> its prefix tokens
        self.request_blocks: set[int] = set()       # blocks requests own now
        self.request_pages: set[int] = set()        # pages requests own now

    # one request, step by step (as the coordinator and the ranks would) ---------------------
    def start(self, tokens, *, make_room=True):
        prompt = self.hasher.prompt(tokens)
        # an idle cache may skip the prompt whole (as the prefill coordinator asks first)
        skipped = self.cache.skip(prompt.tokens.tobytes())
        hit = Hit() if skipped else self.cache.lookup(prompt)
        lease = self.cache.acquire(hit)
        n, nb = hit.tokens, hit.tokens // BS
        fresh_count = blocks_for(len(tokens), BS) - nb if self.blocks else 0
        if make_room:
            assert self.cache.make_room(pages=1, contiguous=fresh_count)
        page = self.pool.allocate()
        self.request_pages.add(page)
        fresh = self.blocks.allocate(fresh_count, contiguous=True) if fresh_count else []
        self.request_blocks.update(fresh)
        # the copies a hit makes, from cached bytes that must be this prompt's
        if hit.unit is not None:
            assert self.page_data[hit.page] == tuple(tokens[:n])
            for i, b in enumerate(hit.blocks):
                assert self.block_data[b] == tuple(tokens[i * BS:(i + 1) * BS])
            if hit.tail is not None:
                assert self.block_data[hit.tail] == tuple(tokens[nb * BS:n])
                self.block_data[fresh[0]] = self.block_data[hit.tail]
            else:
                assert n % BS == 0 or self.blocks is None
        self.page_data[page] = tuple(tokens[:n])
        table = list(hit.blocks) + fresh
        units = [] if skipped else self.cache.reserve(prompt, lease, start=n, **(
            {"page": page, "table": table} if self.own else {}))
        return {"tokens": list(tokens), "hit": hit, "lease": lease, "page": page,
                "table": table, "units": units, "fresh": fresh, "skipped": skipped}

    def prefill(self, req, *, commit=True):
        """Compute the rest of the prompt: write the fresh blocks and, at each checkpoint, copy
        the state and the tail block into the unit, then commit it."""
        tokens, table, lease = req["tokens"], req["table"], req["lease"]
        done = req["hit"].tokens // BS                 # full blocks already right
        for unit in req["units"]:
            n = unit.tokens
            self.page_data[req["page"]] = tuple(tokens[:n])
            cached = set(self.cache.cached_blocks())
            for i in range(done, blocks_for(n, BS) if self.blocks else 0):
                b = table[i]
                assert b not in cached, f"cached block {b} written"
                self.block_data[b] = tuple(tokens[i * BS:min((i + 1) * BS, n)])
            done = n // BS
            if unit.own:                               # the request's own page and block
                assert unit.page == req["page"] and n == len(tokens)
                assert unit.tail == (table[n // BS] if n % BS and self.blocks else None)
            else:
                self.page_data[unit.page] = tuple(tokens[:n])
            if unit.tail is not None and not unit.own:
                assert unit.tail not in table
                self.block_data[unit.tail] = self.block_data[table[n // BS]][:n % BS]
            self.prompts[unit.key] = tuple(tokens[:n])
            if commit:
                adopted = self.cache.commit(unit.key, lease, table)
                assert set(adopted) <= set(req["fresh"])
        return req

    def finish(self, req):
        lease = req["lease"]
        own = lease.private(req["table"])
        assert set(own) <= set(req["fresh"])
        self.cache.release(lease)
        self.request_pages.discard(req["page"])
        if lease.page is None:                     # else the cache took it
            self.pool.free(req["page"])
        else:
            assert lease.page == req["page"]
        if own:
            self.blocks.free(own)
        self.request_blocks.difference_update(req["fresh"])
        self.check()

    def serve(self, tokens):
        """One request start to end; its record (hit, units, skipped)."""
        req = self.start(tokens)
        self.prefill(req)
        self.finish(req)
        return req

    def run(self, tokens):
        return self.serve(tokens)["hit"].tokens

    # invariants --------------------------------------------------------------------------------
    def check(self):
        cache = self.cache
        held_blocks = set()
        for c in cache.index:
            unit = cache.index.get(c.key)
            if not unit.ready:
                continue
            tokens = self.prompts[c.key]
            assert len(tokens) == unit.tokens
            assert self.page_data[unit.page] == tokens
            assert self.pool.is_allocated(unit.page)
            assert len(unit.blocks) == (unit.tokens // BS if self.blocks else 0)
            for i, b in enumerate(unit.blocks):
                assert self.block_data[b] == tokens[i * BS:(i + 1) * BS]
                assert self.blocks.is_allocated(b)
            if unit.tail is not None:
                assert self.block_data[unit.tail] == tokens[unit.tokens // BS * BS:]
            held_blocks.update(unit.blocks)
            if unit.tail is not None:
                held_blocks.add(unit.tail)
        cached = set(cache.cached_blocks())
        assert held_blocks <= cached and len(cached) == cache.num_blocks
        pages = [cache.index.get(c.key).page for c in cache.index]
        assert len(set(pages)) == len(pages) == cache.num_units
        assert self.pool.num_used == len(self.request_pages | set(pages))
        if self.blocks is not None:
            assert not self.request_blocks & cached - self._adopted_live()
            assert self.blocks.num_used == len(self.request_blocks | cached)

    def _adopted_live(self):
        return set(self.cache.handed_over())


def brute_longest(cached: set[tuple], query) -> int:
    return max((len(p) for p in cached if len(p) <= len(query) - 1
                and tuple(query[:len(p)]) == p), default=0)


def chat_prompts(rng, conversations=4, turns=4, system=21):
    sys_prompt = [rng.randrange(100) for _ in range(system)]
    out, history = [], {c: list(sys_prompt) for c in range(conversations)}
    for _ in range(turns):
        for c in range(conversations):
            history[c] += [rng.randrange(100) for _ in range(rng.randrange(1, 12))]
            out.append(list(history[c]))
            history[c] += [rng.randrange(100) for _ in range(rng.randrange(1, 6))]  # answer
    return out


# -- hits without eviction equal the brute-force model ------------------------------------------
@pytest.mark.parametrize("kv", [True, False], ids=["hybrid", "recurrent-only"])
@pytest.mark.parametrize("seed", range(3))
def test_hits_equal_the_brute_force_model_when_nothing_is_evicted(seed, kv):
    rng = random.Random(seed)
    g = Shadow(pages=400, blocks=800, kv=kv)
    cached: set[tuple] = set()
    for tokens in chat_prompts(rng):
        assert g.run(tokens) == brute_longest(cached, tokens)
        cached.update(tuple(tokens[:n]) for n in g.hasher.checkpoint_positions(len(tokens)))
    assert g.cache.evictions == 0


def test_equal_prompts_short_prompts_and_hits_inside_a_block():
    g = Shadow()
    p = list(range(1, 22))                         # 21 tokens: checkpoints 8, 16, 21
    assert g.run(p) == 0
    assert g.run(p) == 16                          # equal prompt: capped at 20, rounded down
    assert g.run(p + [99]) == 21                   # inside block 5: the tail was copied
    assert g.run(p[:3]) == 0                       # shorter than a block, nothing cached at 2
    assert g.run(p[:3] + [7]) == 3                 # the 3-token prompt's end checkpoint
    assert g.run([5]) == 0                         # a one-token prompt never hits
    assert g.run([5]) == 0
    assert g.run([5, 6]) == 1


# -- refcounts -------------------------------------------------------------------------------------
def test_full_blocks_are_shared_by_hash_and_freed_with_their_last_unit():
    g = Shadow(stride=100)                         # only end checkpoints
    a = list(range(1, 9)) + [50, 51, 52, 53]       # 12 tokens: blocks 0-2
    b = list(range(1, 9)) + [60, 61, 62, 63]       # shares blocks 0-1
    g.run(a)
    g.run(b)
    ua = g.cache.index.get(g.hasher.prompt(a).key_at(12))
    ub = g.cache.index.get(g.hasher.prompt(b).key_at(12))
    assert ua.blocks[:2] == ub.blocks[:2] and ua.blocks[2] != ub.blocks[2]
    assert g.cache.num_blocks == 4                 # 2 shared + 1 + 1, no tails
    assert g.blocks.num_used == 4
    g.cache._evict(ua)
    assert g.cache.num_blocks == 3 and all(g.blocks.is_allocated(x) for x in ub.blocks)
    assert not g.blocks.is_allocated(ua.blocks[2])
    g.cache._evict(ub)
    assert g.cache.num_blocks == 0 and g.blocks.num_used == 0 and g.pool.num_used == 0
    g.check()


def test_blocks_a_running_request_handed_over_stay_until_it_ends():
    g = Shadow(pages=4, blocks=3, stride=100, page_budget=1, block_budget=3)
    req = g.prefill(g.start(list(range(1, 13))))  # 12 tokens: adopts blocks 0-2
    assert req["lease"].adopted == set(req["table"]) and req["lease"].private(req["table"]) == []
    g.cache._evict(g.cache.index.get(req["units"][0].key))
    assert all(g.blocks.is_allocated(b) for b in req["table"])   # the transfer still reads
    assert g.cache.cheapest_window(1) is None and not g.cache.make_room(blocks=1)
    g.finish(req)
    assert g.blocks.num_used == 0 and g.cache.num_blocks == 0


# -- LRU and budget ------------------------------------------------------------------------------
def test_budget_defaults_to_half_of_each_pool():
    g = Shadow(pages=10, blocks=33)
    assert (g.cache.page_budget, g.cache.block_budget) == (5, 16)
    with pytest.raises(ConfigError):
        PrefixCache(g.pool, g.blocks, g.hasher, page_budget=-1)


def test_least_recently_used_units_go_first():
    g = Shadow(stride=100, page_budget=3)
    prompts = [[k] * 8 for k in (1, 2, 3)]         # three unrelated 8-token prompts
    for p in prompts:
        g.run(p)
    assert g.run(prompts[0] + [0]) == 8           # a hit refreshes unit 1; adds a 9-token one
    keys = {k: g.hasher.prompt([k] * 8).key_at(8) for k in (1, 2, 3)}
    assert keys[1] in g.cache.index and keys[2] not in g.cache.index   # 2 was the oldest
    g.run([4] * 8)
    assert keys[3] not in g.cache.index and keys[1] in g.cache.index
    assert g.cache.num_units == 3 and g.cache.evictions == 2
    g.check()


def test_block_budget_bounds_the_cached_blocks():
    g = Shadow(stride=100, block_budget=5)
    for k in range(1, 6):
        g.run([k] * 8)                             # 2 blocks each
        assert g.cache.num_blocks <= 5
    assert [g.hasher.prompt([k] * 8).key_at(8) in g.cache.index for k in range(1, 6)] == \
        [False, False, False, True, True]


def test_reserve_keeps_the_prompt_end_first_when_pages_are_short():
    g = Shadow(page_budget=2)
    req = g.start(list(range(1, 18)))              # checkpoints 8, 16, 17 into 2 pages
    assert [u.tokens for u in req["units"]] == [16, 17]
    g.finish(g.prefill(req))


@pytest.mark.parametrize("cold", [False, True])
def test_cold_intermediate_checkpoints_go_before_prompt_ends(cold):
    g = Shadow(page_budget=4, cold_intermediate=cold)
    q = [50] * 5
    g.run(q)                                       # a prompt end: 5
    g.run(list(range(1, 18)))                      # 8 and 16 (intermediate), 17 (end)
    g.run([60] * 5)                                # one unit must go
    # LRU order before: hot 5(q) 8 16 17, cold 16 8 5(q) 17 (intermediates enter in front)
    assert sorted(c.tokens for c in g.cache.index) == ([5, 5, 8, 17] if cold else [5, 8, 16, 17])
    assert (g.hasher.prompt(q).key_at(5) in g.cache.index) == cold


# -- make_room -------------------------------------------------------------------------------------
def test_make_room_frees_enough_and_never_evicts_pinned_units():
    g = Shadow(pages=6, blocks=12, stride=100, page_budget=6, block_budget=12)
    for k in range(1, 5):
        g.run([k] * 8)                             # 4 units, 4 pages, 8 blocks
    pinned = g.cache.lookup(g.hasher.prompt([2] * 9))
    lease = g.cache.acquire(pinned)
    assert pinned.tokens == 8 and g.pool.num_free == 2
    assert g.cache.make_room(pages=4)
    assert g.pool.num_free == 4 and g.cache.num_units == 2 and pinned.unit.key in g.cache.index
    assert not g.cache.make_room(pages=6)          # only the pinned unit is left
    assert g.cache.num_units == 1 and pinned.unit.key in g.cache.index
    assert g.cache.make_room(blocks=10)
    assert not g.cache.make_room(blocks=11)
    assert not g.cache.make_room(contiguous=11)
    g.cache.release(lease)
    assert g.cache.make_room(pages=6, blocks=12, contiguous=12)
    assert g.cache.num_units == 0 and g.pool.num_free == 6 and g.blocks.num_free == 12
    # an empty cache: the room is there or not
    g.pool.allocate()
    g.blocks.allocate(2, contiguous=True)
    g.blocks.free([0])
    assert g.cache.num_ready == 0
    assert g.cache.make_room(pages=5, blocks=11, contiguous=10)
    assert not g.cache.make_room(pages=6)
    assert not g.cache.make_room(blocks=12)
    assert not g.cache.make_room(contiguous=11)


def test_requests_always_fit_under_pressure_and_hits_stay_valid():
    rng = random.Random(4)
    g = Shadow(pages=4, blocks=40, page_budget=4, block_budget=40)
    for tokens in chat_prompts(rng, conversations=5, turns=5, system=13):
        g.run(tokens)                             # start() asserts make_room succeeded
    assert g.cache.evictions > 0


# -- fragmentation -------------------------------------------------------------------------------
def fragmented():
    """Blocks 0..11 of a pool of 12 (stride 100: end checkpoints, no tails):

        0 1 | 2 3 | 4 | 5 6 | 7 8 9 | 10 11
        A     B    req  C     D       free
    A, B, C hold two blocks each; D holds blocks 7-9; a running request holds block 4. The
    units were used in the order A, B, C, D (A oldest)."""
    g = Shadow(pages=8, blocks=12, stride=100, page_budget=8, block_budget=12)
    for k in (1, 2):
        g.run([k] * 8)
    req = g.start([9] * 4, make_room=False)
    g.run([3] * 8)
    g.run([4] * 12)
    assert req["fresh"] == [4]
    units = {name: g.cache.index.get(g.hasher.prompt(p).key_at(len(p))) for name, p in
             (("A", [1] * 8), ("B", [2] * 8), ("C", [3] * 8), ("D", [4] * 12))}
    assert [units[n].blocks for n in "ABCD"] == [(0, 1), (2, 3), (5, 6), (7, 8, 9)]
    return g, units, req


def test_window_evicts_the_fewest_units_then_the_oldest():
    g, u, _ = fragmented()
    assert g.blocks.largest_free_range() == 2
    assert g.cache.cheapest_window(2) == (10, [])
    start, units = g.cache.cheapest_window(3)      # [7,10) costs D; [0,3) costs A and B
    assert (start, units) == (7, [u["D"]])
    start, units = g.cache.cheapest_window(4)      # [0,4) A+B; [5,9)/[6,10) C+D; [8,12) D
    assert (start, units) == (7, [u["D"]])
    start, units = g.cache.cheapest_window(6)      # [5,11) and [6,12): C+D; left of 4: none
    assert start == 5 and set(units) == {u["C"], u["D"]}
    assert g.cache.cheapest_window(8) is None      # block 4 belongs to a request
    g.cache.acquire(Hit(8, u["A"]))                # pinned: [0,4) is out
    start, units = g.cache.cheapest_window(2)
    assert start == 10 and units == []


def test_equal_unit_counts_prefer_the_oldest_units():
    g, u, _ = fragmented()
    g.cache.acquire(Hit(12, u["D"]))               # D pinned (and now the newest)
    # windows of 2 needing one unit: [0,2) A, [2,4) B, [5,7) C -- A is the oldest
    g.blocks.allocate(2)                           # 10, 11 taken by a request
    assert g.cache.cheapest_window(2) == (0, [u["A"]])


def test_make_room_for_a_contiguous_range_uses_the_window():
    g, u, req = fragmented()
    assert g.cache.make_room(contiguous=4)
    assert u["D"].key not in g.cache.index
    assert all(g.cache.index.get(u[n].key) is u[n] for n in "ABC")
    assert g.blocks.largest_free_range() == 5      # 7..11
    g.finish(req)


@pytest.mark.parametrize("seed", range(4))
def test_window_choice_matches_a_brute_force_search(seed):
    rng = random.Random(seed)
    g = Shadow(pages=30, blocks=48, stride=6, page_budget=30, block_budget=48)
    running = []
    for i in range(14):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        if rng.random() < 0.15 and g.pool.num_free > 4:
            running.append(g.prefill(g.start(tokens)))       # still running: its blocks held
        else:
            g.run(tokens)
    for lease_hit in rng.sample([c for c in g.cache.index], 2):
        g.cache.acquire(Hit(lease_hit.tokens, g.cache.index.get(lease_hit.key)))
    units = [g.cache.index.get(c.key) for c in g.cache.index]
    handed_over = set(g.cache.handed_over())
    holders: dict[int, set] = {}
    for unit in units:
        for b in unit.blocks + ((unit.tail,) if unit.tail is not None else ()):
            holders.setdefault(b, set()).add(unit)
    for count in range(1, 49):
        best = None
        for s in range(48 - count + 1):
            need, ok = set(), True
            for b in range(s, s + count):
                if not g.blocks.is_allocated(b):
                    continue
                if b not in holders or any(x.pins or not x.ready for x in holders[b]) \
                        or b in handed_over:
                    ok = False
                    break
                need |= holders[b]
            if ok:
                cost = (len(need), sum(x.tick for x in need), s)
                best = cost if best is None or cost < best else best
        got = g.cache.cheapest_window(count)
        if best is None:
            assert got is None, count
        else:
            assert got is not None and (len(got[1]), sum(x.tick for x in got[1]), got[0]) \
                == best, count


# -- pending units -------------------------------------------------------------------------------
def test_a_request_may_wait_for_a_prefix_still_being_prefilled():
    g = Shadow()
    p = list(range(1, 30))                         # checkpoints 8, 16, 24, 29
    first = g.start(p)
    assert [u.tokens for u in first["units"]] == [8, 16, 24, 29]
    hit = g.cache.lookup(g.hasher.prompt(p + [0]))
    assert hit.tokens == 0 and hit.pending is first["units"][-1]
    g.prefill(first)
    hit = g.cache.lookup(g.hasher.prompt(p + [0]))
    assert hit.tokens == 29 and hit.pending is None
    g.finish(first)
    # a pending unit less than wait_tokens longer than the ready hit is not offered
    second = g.start(p + [7, 7, 7])                # reserves 32 only
    assert [u.tokens for u in second["units"]] == [32]
    assert g.cache.lookup(g.hasher.prompt(p + [7, 7, 7, 0])).pending is None
    g.prefill(second)
    g.finish(second)


def test_abort_and_release_drop_pending_units():
    g = Shadow(pages=8, blocks=32)
    p = list(range(1, 22))
    req = g.start(p)
    assert g.cache.num_units == 3 and g.pool.num_used == 4 and g.cache.num_blocks == 1  # tail
    g.cache.abort(req["units"][0].key)
    assert g.cache.num_units == 2
    with pytest.raises(ConfigError):
        g.cache.abort(req["units"][0].key)
    with pytest.raises(ConfigError):
        g.cache.commit(req["units"][0].key, req["lease"], req["table"])
    g.cache.release(req["lease"])                  # the prefill failed: the rest go too
    assert g.cache.num_units == 0 and g.cache.num_blocks == 0 and g.pool.num_used == 1
    g.cache.release(req["lease"])                  # idempotent
    g.pool.free(req["page"])
    g.blocks.free(req["fresh"])
    assert g.blocks.num_used == 0


def test_commit_refuses_a_short_table_and_foreign_leases():
    g = Shadow()
    req = g.start(list(range(1, 22)))
    other = g.cache.acquire()
    with pytest.raises(ConfigError, match="not pending under this lease"):
        g.cache.commit(req["units"][0].key, other, req["table"])
    with pytest.raises(ConfigError, match="needs 2 full blocks"):
        g.cache.commit(req["units"][0].key, req["lease"], req["table"][:1])


# -- announcements -------------------------------------------------------------------------------
def test_announcements_name_what_became_ready_and_what_went():
    g = Shadow(stride=100, page_budget=2)
    assert g.cache.drain_changes() == Changes(1, (), ())
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    g.run(a)
    g.run(b)
    ka, kb, kc = (g.hasher.prompt(x).key_at(8) for x in (a, b, c))
    changes = g.cache.drain_changes()
    assert changes.seq == 2 and [x.key for x in changes.added] == [ka, kb] and not changes.removed
    assert changes.added[0] == g.hasher.prompt(a).checkpoint(8)
    g.run(c)                                       # evicts a
    changes = g.cache.drain_changes()
    assert [x.key for x in changes.added] == [kc] and changes.removed == (ka,)
    g.run([4] * 8)                                 # evicts b
    g.run([5] * 8)                                 # evicts c; 4 and 5 remain
    g.cache._evict(g.cache.index.get(g.hasher.prompt([5] * 8).key_at(8)))
    first = g.cache.drain_changes(limit=2)
    rest = g.cache.drain_changes()
    assert len(first.added) + len(first.removed) == 2 and rest.seq == first.seq + 1
    added = [x.key for x in first.added + rest.added]
    removed = set(first.removed + rest.removed)
    k4 = g.hasher.prompt([4] * 8).key_at(8)
    assert added == [k4] and removed == {kb, kc}   # 5 came and went: never announced
    snap = g.cache.snapshot()
    assert snap.seq == rest.seq and [x.key for x in snap.checkpoints] == [k4]
    assert g.cache.clear() == 1 and g.cache.drain_changes().removed == (k4,)


def test_pending_units_are_not_announced():
    g = Shadow()
    req = g.start(list(range(1, 10)))
    assert g.cache.drain_changes().added == () and g.cache.snapshot().checkpoints == ()
    g.prefill(req)
    assert {x.tokens for x in g.cache.drain_changes().added} == {8, 9}
    g.finish(req)


# -- the node's policy: prompt ends on the request's own page, branch points -------------------
def brute_branch(earlier: list[tuple], tokens) -> int:
    """Tokens of the longest run of full blocks ``tokens`` shares with an earlier prompt."""
    best = 0
    for p in earlier:
        k = 0
        while k + BS <= min(len(p), len(tokens)) and p[k:k + BS] == tuple(tokens[k:k + BS]):
            k += BS
        best = max(best, k)
    return best


@pytest.mark.parametrize("kv", [True, False], ids=["hybrid", "recurrent-only"])
@pytest.mark.parametrize("seed", range(3))
def test_branch_points_and_own_pages_equal_the_brute_force_model(seed, kv):
    """Without a stride the cache keeps each prompt's end (on the request's own page: never a
    page allocated for it) and the point where a prompt stops sharing full blocks with an
    earlier one, when that lies past the hit: a shared system prompt is cached the second
    time it is seen, and hit from the third on."""
    rng = random.Random(seed)
    g = Shadow(pages=400, blocks=800, kv=kv, stride=0, own=True, branch_points=True)
    cached: set[tuple] = set()
    earlier: list[tuple] = []
    system_hits = []
    for tokens in chat_prompts(rng, system=21):
        req = g.start(tokens)
        hit = req["hit"].tokens
        assert hit == brute_longest(cached, tokens)
        branch = brute_branch(earlier, tokens)
        expect = ({len(tokens)} | ({branch} if hit < branch < len(tokens) else set())) \
            - {n for n in range(len(tokens) + 1) if tuple(tokens[:n]) in cached}
        assert sorted(u.tokens for u in req["units"]) == sorted(expect)
        assert [u.own for u in req["units"]] == [u.tokens == len(tokens) for u in req["units"]]
        g.prefill(req)
        g.finish(req)
        cached.update(tuple(tokens[:n]) for n in expect)
        earlier.append(tuple(tokens))
        system_hits.append(hit >= 20)
    assert g.cache.evictions == 0
    # 4 conversations on a 21-token system prompt: the first two turns-1 miss it (the second
    # keeps the branch point at 20), the other two hit it
    assert system_hits[:4] == [False, False, True, True]


def test_a_failed_request_keeps_its_own_page_and_leaks_nothing():
    g = Shadow(stride=0, own=True, branch_points=True)
    req = g.prefill(g.start(list(range(1, 15))), commit=False)     # 14 tokens: tail in block 3
    [unit] = req["units"]
    assert unit.own and unit.page == req["page"] and unit.tail == req["table"][3]
    g.finish(req)                                  # aborted: the request frees page and tail
    assert g.cache.num_units == 0 and g.pool.num_used == 0 and g.blocks.num_used == 0
    assert g.run(list(range(1, 15)) + [9]) == 0
    assert g.run(list(range(1, 15)) + [9, 9]) == 15


def test_the_blocks_remembered_for_branch_points_are_bounded():
    g = Shadow(stride=0, own=True, branch_points=True, seen_blocks=8)
    rng = random.Random(5)
    for _ in range(20):                            # 5 full blocks each
        g.run([rng.randrange(100) for _ in range(21)])
        assert len(g.cache._seen) + len(g.cache._seen_old) <= 8 + 5
    # the most recent prompt is remembered: a prompt sharing its blocks branches there
    last = g.start(g.hasher.prompt([1] * 21).tokens.tolist())   # (a fresh one, for the API)
    g.prefill(last)
    g.finish(last)
    branching = g.start([1] * 12 + [2] * 9)
    assert sorted(u.tokens for u in branching["units"]) == [12, 21]
    with pytest.raises(ConfigError, match="seen_blocks"):
        PrefixCache(PagePool(2), None, PrefixHasher(b"s", BS, stride=0), seen_blocks=-1)


def _unrelated(rng, n):
    """``n`` token ids that no other prompt of a test shares (with high probability)."""
    return [rng.randrange(10_000, 20_000) for _ in range(n)]


def test_the_cache_idles_in_a_stream_of_unrelated_prompts():
    """After ``idle_after`` prompts in a row that share no full block with an earlier one, an
    unrelated prompt keeps no checkpoint (its page and blocks stay its own); a prompt that
    shares its first block keeps its checkpoints again, and so do the unrelated prompts right
    after it. A conversation that starts on an idle cache: its second turn misses, keeps its
    checkpoints (at the first block: the branch point it can tell) and its end, the third
    hits."""
    g = Shadow(pages=200, blocks=800, stride=STRIDE, own=True, branch_points=True,
               idle_after=3)
    rng = random.Random(7)

    def unrelated(n=25):
        return _unrelated(rng, n)

    def units(tokens):
        return sorted(u.tokens for u in g.serve(tokens)["units"])

    first = unrelated()
    assert units(first) == [8, 16, 24, 25]              # a fresh cache keeps them
    assert units(unrelated()) == [8, 16, 24, 25]
    assert units(unrelated()) == [8, 16, 24, 25]        # 3 in a row
    used, kept = g.pool.num_used, g.cache.num_units
    assert units(unrelated()) == []                     # the 4th: nothing
    assert units(unrelated()) == []
    assert (g.pool.num_used, g.cache.num_units) == (used, kept)
    assert g.blocks.num_used == g.cache.num_blocks      # the requests freed all of theirs
    # shares the first prompt's first full block (4 tokens), not its checkpoint at 8: a branch
    # point at 4, and its stride checkpoints again
    assert units(first[:6] + [5] * 19) == [4, 8, 16, 24, 25]
    assert units(unrelated()) == [8, 16, 24, 25]
    assert units(unrelated()) == [8, 16, 24, 25]
    assert units(unrelated()) == [8, 16, 24, 25]        # 3 in a row again
    assert units(unrelated()) == []
    hit = g.start(first[:20] + [6] * 5)                  # a hit counts as sharing
    assert hit["hit"].tokens == 16
    assert sorted(u.tokens for u in hit["units"]) == [20, 24, 25]     # branch point at 20
    g.prefill(hit)
    g.finish(hit)
    for _ in range(4):
        units(unrelated())                              # idle again
    turn1 = unrelated(21)
    assert units(turn1) == []                           # (skipped: its first block remembered)
    turn2 = turn1 + unrelated(6)
    req = g.serve(turn2)
    assert req["hit"].tokens == 0                       # misses turn 1 ...
    assert sorted(u.tokens for u in req["units"]) == [4, 8, 16, 24, 27]   # branch: 1st block
    assert g.run(turn2 + unrelated(3)) == 27            # ... the third turn hits turn 2's end
    # without the policy every prompt keeps them
    g = Shadow(pages=200, blocks=800, stride=STRIDE, own=True, branch_points=True)
    for _ in range(6):
        assert units(unrelated()) == [8, 16, 24, 25]
    with pytest.raises(ConfigError, match="idle_after"):
        PrefixCache(PagePool(2), None, PrefixHasher(b"s", BS), idle_after=-1)


def test_an_idle_cache_skips_an_unrelated_prompt_by_its_first_block():
    """``skip``: an idle cache decides from a prompt's first full block alone that it can
    neither hit nor branch (nothing else is hashed or kept; only that block's hash is
    remembered), and never skips a prompt that could hit: one beginning with a cached unit's
    first block (however long ago its hashes were remembered) or any prompt while a unit
    shorter than a block is cached."""
    g = Shadow(pages=200, blocks=800, stride=STRIDE, own=True, branch_points=True,
               idle_after=2, seen_blocks=8)
    rng = random.Random(11)

    def unrelated(n=25):
        return _unrelated(rng, n)

    def serve(tokens):
        return g.serve(tokens)

    kept = unrelated()
    assert not serve(kept)["skipped"]                       # a fresh cache: not idle
    assert not serve(unrelated())["skipped"]
    skipped = unrelated()
    req = serve(skipped)                                     # the 3rd unrelated in a row
    assert req["skipped"] and req["units"] == [] and req["hit"].tokens == 0
    assert g.cache.skip(np.asarray(unrelated(), "<i4").tobytes())   # (counts as one more)
    # it remembered the first block only: a prompt sharing three blocks with it wakes the
    # cache but finds the branch at the first block (the price); the next finds the real one
    woke = serve(skipped[:12] + unrelated(13))
    assert not woke["skipped"]
    assert sorted(u.tokens for u in woke["units"]) == [4, 8, 16, 24, 25]
    again = serve(skipped[:12] + unrelated(13))
    assert again["hit"].tokens == 8
    assert sorted(u.tokens for u in again["units"]) == [12, 16, 24, 25]
    for _ in range(8):                                       # idle again; the 8 remembered
        serve(unrelated())                                   # hashes forgot `kept`'s
    assert g.cache.skip(np.asarray(unrelated(), "<i4").tobytes())
    assert g.cache.shared_prefix(g.hasher.prompt(kept)) == 0
    # ... yet a prompt that begins like a cached unit is served the whole way, and hits
    hit = serve(kept[:20] + unrelated(5))
    assert not hit["skipped"] and hit["hit"].tokens == 16
    # a unit shorter than a block (anchored at the root) may serve any prompt: no skip
    g = Shadow(pages=50, blocks=200, stride=0, own=True, branch_points=True, idle_after=0)
    short = [7, 8, 9]
    assert serve([rng.randrange(100) for _ in range(9)])["skipped"]     # idle from the start
    assert serve([1])["skipped"]                             # less than a block: no hash
    g = Shadow(pages=50, blocks=200, stride=0, own=True, branch_points=True)
    g.run(short)                                             # (a cache that keeps it)
    g.cache.idle_after = 0                                   # now idle
    other = np.asarray(short + [1, 2], "<i4").tobytes()      # a first block never seen
    assert not g.cache.skip(other)
    assert g.run(short + [5, 6]) == 3
    # evicting every unit leaves nothing behind for skip to consult
    g.cache.clear()
    assert g.cache.skip(other)
