"""The prefill group's prefix cache: which recurrent-state checkpoints and KV blocks it keeps, in
its own page and block pools, and what it tells routers.

Runs on the group coordinator's loop thread only (no locks, no I/O): the ranks copy bytes,
this module only decides ids. Keys and hashes come from :mod:`statebridge.state.prefix`.

Units
-----
A **unit** is what is reused and evicted together: one checkpoint page (the state after the
first ``n`` tokens) + the full KV blocks ``[0, n//bs)`` + a private **tail** block when ``n``
is not a block multiple (a copy of KV block ``n//bs``, first ``n % bs`` slots valid). A
checkpoint without its blocks is useless and vice versa, so a unit is indexed only while it
holds all of them.

::

    pages (PagePool, shared with requests)     blocks (BlockPool, shared with requests)
    | req | unit A | req | unit B | free |      | h0 h1 h2 (A,B) | h3 h4 (B) | tail A | req ...
                                                  refcounted by hash    private to A

Full blocks are deduplicated by chain hash and reference counted by the units (and, for a
block a request handed over, by that request until it ends). Cached objects are never
written: a request that hits copies the checkpoint page into its own page and the tail block
into its own first fresh block, and reads the shared full blocks.

Lifecycle of one request (the integration calls, in order)
----------------------------------------------------------
0. ``cache.skip(raw)``: True when an idle cache (``idle_after``) can tell from the prompt's
   first full block that it neither hits nor branches: nothing else to call for it.
1. ``hit = cache.lookup(prompt)``: the longest usable ready prefix (``hit.tokens``, capped at
   ``len - 1``), and ``hit.pending``: an in-flight unit worth waiting for (it would save at
   least ``wait_tokens`` more); the caller may queue the request until that key is committed
   or aborted, then look up again.
2. ``lease = cache.acquire(hit)``: pins the hit's unit (never evicted while pinned).
3. ``cache.make_room(pages=1, contiguous=k)``: a running request's needs win; evicts unpinned
   units (the cheapest contiguous window first) until the request's page and its ``k`` fresh
   blocks fit. Then the caller allocates them from the pools as today.
4. ``units = cache.reserve(prompt, lease, start=hit.tokens, page=page, table=table)``:
   pending units (a page, and a tail block where needed) for the checkpoint positions the
   prefill passes. When the prefill passes ``unit.tokens`` a rank copies the state into
   ``unit.page`` (and KV block ``table[n//bs]`` into ``unit.tail``), then the caller calls
   ``cache.commit(unit.key, lease, table)``: the unit's full blocks are the cached ones of
   equal hash, else the request's own, which the cache adopts (``lease.adopted``). The unit
   at the prompt's end is the request's own ``page`` and partial block (``unit.own``: no
   copy; the cache takes them at commit, ``lease.page``). ``cache.abort(key)`` drops a unit
   whose prefill failed (an own unit's page and block stay the request's).
5. ``cache.release(lease)`` when the request ends (its transfer read the shared blocks): the
   request frees only ``lease.private(table)`` of its block table itself, and its page
   unless ``lease.page`` took it.

Where checkpoints go: the prompt's end, every ``hasher.stride`` tokens when the stride is not
0, and with ``branch_points`` (the prefill node's policy) the point where the prompt stops
sharing full blocks with an earlier prompt (:meth:`PrefixCache.shared_prefix`): of the
prompts that share a system prompt, the second keeps a checkpoint at the system prompt's last
full block, which every later one hits (the first knows of no branch yet). A checkpoint
inside a prompt ends a prefill step and copies a page; one at its end costs neither. With
``idle_after`` (the prefill node: 64) a stream of unrelated prompts keeps none at all until a
prompt shares a block with an earlier one or hits, and costs one block's hash a prompt
(:meth:`PrefixCache.skip`).

Budget and eviction: units live under a budget (default half of the pages and half of the
blocks), evicted least recently used first (a hit refreshes its unit); ``make_room`` evicts
below the budget when a request needs it. Announcements: :meth:`PrefixCache.drain_changes`
and :meth:`PrefixCache.snapshot` tell routers which checkpoints are ready.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from statebridge.connector.eviction_window import cheapest_window
from statebridge.errors import ConfigError
from statebridge.state.cache import PagePool
from statebridge.state.kv import BlockPool
from statebridge.state.prefix import Checkpoint, HashedPrompt, PrefixHasher, PrefixIndex

__all__ = ["Unit", "Hit", "Lease", "Changes", "Snapshot", "PrefixCache"]


_NO_BLOCKS = np.zeros(0, dtype=np.int64)             # what a unit holds before it holds any


@dataclass(eq=False, slots=True)
class Unit:
    """One checkpoint and the KV blocks it needs. ``blocks``: full blocks ``[0, n//bs)``
    (shared, set at commit); ``tail``: the private partial block or None; ``final``: the
    checkpoint ends a prompt (not a stride multiple inside it); ``own``: the page (and tail)
    are the request's own, which the cache takes at commit (no copy)."""

    checkpoint: Checkpoint
    page: int
    tail: int | None = None
    blocks: tuple[int, ...] = ()
    ready: bool = False
    pins: int = 0
    final: bool = False
    own: bool = False
    tick: int = 0                                   # last use (LRU; window cost)
    hashes: tuple[bytes, ...] = ()                  # pending only: chain hashes of its blocks
    first: bytes = b""                              # h[0] of its prompt (the root: < 1 block)
    key: bytes = field(init=False)                  # the checkpoint's key and token count
    tokens: int = field(init=False)
    #: The blocks it holds a reference on (its full blocks, then its tail): the tail from
    #: :meth:`PrefixCache.reserve` (own: from commit), the full blocks from commit.
    held: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.key, self.tokens = self.checkpoint.key, self.checkpoint.tokens
        self.held = _NO_BLOCKS


@dataclass(frozen=True, slots=True)
class Hit:
    """What :meth:`PrefixCache.lookup` found: ``unit`` (ready; None for a miss) covering the
    first ``tokens`` tokens, and ``pending``: a longer in-flight unit worth waiting for."""

    tokens: int = 0
    unit: Unit | None = None
    pending: Unit | None = None

    @property
    def page(self) -> int | None:
        """Checkpoint page to copy into the request's page."""
        return None if self.unit is None else self.unit.page

    @property
    def blocks(self) -> tuple[int, ...]:
        """Shared full blocks: the request's block table starts with them."""
        return () if self.unit is None else self.unit.blocks

    @property
    def tail(self) -> int | None:
        """Block to copy into the request's first fresh block (None: ``tokens`` is a block
        multiple, or no KV)."""
        return None if self.unit is None else self.unit.tail


@dataclass(eq=False)
class Lease:
    """One request's hold on the cache: pinned units, units it is filling, blocks it handed
    over (the cache owns them; the request still reads them until :meth:`PrefixCache.release`).
    """

    units: list[Unit] = field(default_factory=list)
    pending: list[Unit] = field(default_factory=list)
    adopted: set[int] = field(default_factory=set)
    #: The request's page, when the cache took it as a checkpoint (the request must not free it).
    page: int | None = None
    released: bool = False

    def private(self, table: Sequence[int]) -> list[int]:
        """The blocks of ``table`` the request owns and frees itself: neither a hit's shared
        block nor one it handed to the cache."""
        if not self.units:                     # a miss: no copy of what it handed over
            return list(itertools.filterfalse(self.adopted.__contains__, table)) \
                if self.adopted else list(table)
        cached = self.adopted.union(*(u.blocks for u in self.units))
        return list(itertools.filterfalse(cached.__contains__, table))


@dataclass(frozen=True, slots=True)
class Changes:
    """Checkpoints that became ready (``added``) or went (``removed`` keys) since the last
    drain. A router applies a :class:`Snapshot`, then every Changes of larger ``seq`` in order
    (they are idempotent on top of a snapshot: set semantics)."""

    seq: int
    added: tuple[Checkpoint, ...]
    removed: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every ready checkpoint now; ``seq`` of the last drained Changes."""

    seq: int
    checkpoints: tuple[Checkpoint, ...]


class PrefixCache:
    """Prefix cache bookkeeping of one rank group over its ``pages`` and ``blocks`` pools
    (``blocks`` None for a model without attention).

    ``page_budget`` / ``block_budget``: the most pages / blocks the cache holds (default half
    of each pool). ``wait_tokens``: how much longer an in-flight unit must be than the ready
    hit for :meth:`lookup` to offer it (default one checkpoint stride). ``cold_intermediate``
    (default): units that do not end a prompt enter the LRU order as least recently used
    (evicted first until a hit refreshes them) -- on the interleaved multi-turn replay
    (``benchmarks/replay_prefix_cache.py``) this keeps 0.92-0.97 of the ideal hits where plain
    LRU keeps 0.72 at the same pool size, and is never worse.

    ``branch_points``: :meth:`reserve` also keeps a checkpoint where a prompt stops sharing
    full blocks with an earlier prompt (:meth:`shared_prefix`: a prefix two prompts began with,
    such as a system prompt, is likely to come again), remembering the block hashes of the
    last ``seen_blocks`` full blocks it reserved for.

    ``idle_after``: once that many prompts in a row shared not even their first full block
    with an earlier prompt (:meth:`shared_prefix`) nor hit, a prompt that does not either keeps
    no checkpoint at all until one does -- a stream of unrelated prompts (the transfer
    benchmark's) takes no unit that no later prompt can hit, and costs the hash of its first
    block only (:meth:`skip`: a prompt that begins with neither a unit's nor a remembered
    prompt's first block, the only hash remembered of it); the first prompts of a fresh
    cache, and every prompt while prompts share prefixes, keep theirs (a chat's first turn:
    the next conversation hits its system prompt at a stride multiple). What it costs: a
    conversation that begins on an idle cache (after that many unrelated prompts) with a
    system prompt never seen misses its whole second turn (which keeps a checkpoint at its
    first block -- the branch point it can tell -- at stride multiples and at its end: the
    third hits); of two prompts that share a prefix unseen before, the first after idling
    finds the branch at their first block, the next one the real branch point. None
    (default): every prompt keeps its checkpoints.
    """

    def __init__(self, pages: PagePool, blocks: BlockPool | None, hasher: PrefixHasher, *,
                 page_budget: int | None = None, block_budget: int | None = None,
                 wait_tokens: int | None = None, cold_intermediate: bool = True,
                 branch_points: bool = False, seen_blocks: int = 1 << 16,
                 idle_after: int | None = None) -> None:
        self.pages = pages
        self.blocks = blocks
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.page_budget = pages.num_pages // 2 if page_budget is None else page_budget
        num_blocks = blocks.num_blocks if blocks is not None else 0
        self.block_budget = num_blocks // 2 if block_budget is None else block_budget
        for name in ("page_budget", "block_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        self.wait_tokens = hasher.stride if wait_tokens is None else wait_tokens
        self.cold_intermediate = cold_intermediate
        if isinstance(seen_blocks, bool) or not isinstance(seen_blocks, int) or seen_blocks < 0:
            raise ConfigError(f"seen_blocks must be an integer >= 0, got {seen_blocks!r}")
        self.branch_points = bool(branch_points)
        self.seen_blocks = seen_blocks
        if idle_after is not None and (isinstance(idle_after, bool) or not
                                              isinstance(idle_after, int)
                                              or idle_after < 0):
            raise ConfigError(f"idle_after must be an integer >= 0 or None, got "
                              f"{idle_after!r}")
        self.idle_after = idle_after
        self._unshared = 0          # prompts in a row that shared no block and had no hit
        # the units by the first block hash of their prompt (the root for a unit of fewer
        # tokens than a block): what an idle cache's skip asks (can this prompt hit at all?)
        self._firsts: dict[bytes, int] = {}
        self._remembers = self.branch_points or idle_after is not None
        # chain hashes of the full blocks of recent prompts, where a new prompt branches off an
        # earlier one: two generations of at most seen_blocks // 2 (a hash seen again moves
        # to the newer; the older is dropped whole when the newer fills) -- LRU-like, in bulk.
        # A prompt's hashes go in together and a chain hash names every block before it, so
        # where the two hold a prompt's h[i] they hold its h[0..i-1] too (shared_prefix)
        self._seen: set[bytes] = set()
        self._seen_old: set[bytes] = set()
        self.index: PrefixIndex[Unit] = PrefixIndex()
        self._lru: collections.OrderedDict[bytes, Unit] = collections.OrderedDict()  # ready
        # The block table, flat, indexed by the pool's block ids. A block is the cache's while
        # something holds it: each unit whose ``held`` names it, and the running request that
        # handed it over (``_pinned``; at most one: only an uncached block is adopted), until
        # it ends. Full blocks are found by chain hash (``_by_hash``, and back: ``_hash_of``);
        # a tail block has none. Which units hold a block is asked only when choosing an
        # eviction window (cheapest_window), which builds that from the units.
        self._holders = np.zeros(num_blocks, dtype=np.int32)
        self._pinned = np.zeros(num_blocks, dtype=bool)
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._num_blocks = 0
        self._tick = 0
        self._seq = 0
        self._dirty: dict[bytes, None] = {}             # ordered set
        self._announced: dict[bytes, Checkpoint] = {}
        self.evictions = 0

    # -- what it holds -----------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        """Units, ready and pending (one page each)."""
        return len(self.index)

    @property
    def idle(self) -> bool:
        """``idle_after`` unrelated prompts came in a row: the next unrelated one keeps no
        checkpoint (see the class docstring)."""
        return self.idle_after is not None and self._unshared >= self.idle_after

    @property
    def num_ready(self) -> int:
        """Ready units (what eviction may take, unless pinned)."""
        return len(self._lru)

    @property
    def num_blocks(self) -> int:
        """Blocks the cache owns (full, tail, and handed over by running requests)."""
        return self._num_blocks

    def cached_blocks(self) -> list[int]:
        """The ids of the blocks the cache owns (:attr:`num_blocks` of them), ascending."""
        return np.flatnonzero(self._holders).tolist()

    def handed_over(self) -> list[int]:
        """The cached blocks that running requests handed over (adopted at :meth:`commit`)
        and still read: the cache keeps them until :meth:`release`, whatever is evicted."""
        return np.flatnonzero(self._pinned).tolist()

    def stats(self) -> dict[str, int]:
        pending = sum(1 for c in self.index if not self.index.get(c.key).ready)
        return {"units": self.num_units, "pending": pending,
                "pinned": sum(1 for u in self._lru.values() if u.pins), "pages": self.num_units,
                "blocks": self.num_blocks, "page_budget": self.page_budget,
                "block_budget": self.block_budget, "evictions": self.evictions}

    # -- 0. an idle cache's shortcut -----------------------------------------------------------
    def skip(self, raw: bytes) -> bool:
        """Whether the prompt of token ids ``raw`` (little-endian int32, as on the wire) has
        nothing to do with an idle cache (``idle_after``), judged by its first full block's
        hash alone: neither a unit nor a remembered prompt began with that block (a hit and a
        branch point need one that did), and no unit covers less than a block. Then it counts
        as one more unrelated prompt, only that hash is remembered (a later prompt that shares
        the block wakes the cache), and the caller does nothing else for it: no lookup, lease
        or checkpoint, as :meth:`lookup` and :meth:`reserve` would decide, without hashing the
        rest of the prompt. False (go the whole way) when the cache is not idle."""
        if not self.idle:
            return False
        firsts = self._firsts
        if self.hasher.root in firsts:
            return False
        h0 = self.hasher.first_hash(raw)
        if h0 is not None and (h0 in firsts or h0 in self._seen or h0 in self._seen_old):
            return False
        self._unshared += 1
        if h0 is not None:
            self._remember((h0,))
        return True

    # -- 1-2. lookup and pin -----------------------------------------------------------------
    def lookup(self, prompt: HashedPrompt, *, cap: int | None = None) -> Hit:
        """The longest ready unit for ``prompt`` (at most ``cap`` tokens, default
        ``len - 1``), and the longest pending one if it would save ``wait_tokens`` more."""
        ready, pending = None, None
        for match in self.index.matches(prompt, cap=cap):      # longest first
            if match.entry.ready:
                ready = match
                break
            if pending is None:                     # the longest pending, longer than ready
                pending = match
        tokens = ready.tokens if ready is not None else 0
        wait = pending.entry if pending is not None and \
            pending.tokens >= tokens + max(self.wait_tokens, 1) else None
        return Hit(tokens, ready.entry if ready is not None else None, wait)

    def acquire(self, hit: Hit | None = None) -> Lease:
        """A lease for one request, pinning ``hit``'s unit (refreshed in the LRU order)."""
        lease = Lease()
        if hit is not None and hit.unit is not None:
            unit = hit.unit
            if not unit.ready or self.index.get(unit.key) is not unit:
                raise ConfigError(f"hit unit {unit.key.hex()} is no longer cached")
            unit.pins += 1
            self._touch(unit)
            lease.units.append(unit)
        return lease

    def release(self, lease: Lease) -> None:
        """The request ended: unpin its units, drop its hold on blocks it handed over, abort
        units it never committed; then trim to the budget. Idempotent."""
        if lease.released:
            return
        lease.released = True
        if not (lease.pending or lease.units or lease.adopted):
            return                # it held nothing (an idle cache's miss): nothing to trim
        for unit in lease.pending:
            if not unit.ready and self.index.get(unit.key) is unit:
                self.abort(unit.key)
        for unit in lease.units:
            unit.pins -= 1
        if lease.adopted:
            held = np.fromiter(lease.adopted, dtype=np.int64, count=len(lease.adopted))
            self._pinned[held] = False
            self._let_go(held)
        self._trim()

    # -- 3. room for a running request -------------------------------------------------------
    def make_room(self, *, pages: int = 0, blocks: int = 0, contiguous: int = 0) -> bool:
        """Evict unpinned units until ``pages`` pages, ``blocks`` blocks and one range of
        ``contiguous`` consecutive blocks are free; False when even evicting every unpinned
        unit cannot (what was evicted stays evicted). The window is chosen to evict the fewest
        units (then the least recently used) -- see :meth:`cheapest_window`."""
        if not self._lru:            # nothing ready, nothing to evict (a full pool's retries)
            blocks_pool = self.blocks
            return self.pages.num_free >= pages and (blocks_pool is None or (
                blocks_pool.num_free >= blocks and (
                    not contiguous or blocks_pool.largest_free_range() >= contiguous)))
        if contiguous and self.blocks is not None:
            if contiguous > self.blocks.num_blocks:
                return False
            if self.blocks.largest_free_range() < contiguous:
                window = self.cheapest_window(contiguous)
                if window is None:
                    return False
                for unit in window[1]:
                    self._evict(unit)
        while self.pages.num_free < pages:
            if not self._evict_lru():
                return False
        while blocks and self.blocks is not None and self.blocks.num_free < blocks:
            if not self._evict_lru():
                return False
        return True

    def cheapest_window(self, count: int) -> tuple[int, list[Unit]] | None:
        """The start of ``count`` consecutive block ids that evicting units can free, and those
        units: fewest units, then the least recently used (smallest sum of last uses), then the
        lowest start. None when every such range holds a block a request or a pinned or
        pending unit needs."""
        if count < 1 or count > self.blocks.num_blocks:
            return None
        units_of: dict[int, list[Unit]] = {}           # block -> the units that hold it
        for checkpoint in self.index:
            unit = self.index.get(checkpoint.key)
            for b in unit.held.tolist():
                units_of.setdefault(b, []).append(unit)
        blocked = self.blocks.used_mask()              # (a copy)
        for b, units in units_of.items():
            if not self._pinned[b] and all(self._evictable(u) for u in units):
                blocked[b] = False
        return cheapest_window(blocked, units_of, lambda u: u.tick, count)

    # -- 4. checkpoints a prefill produces ---------------------------------------------------
    def shared_prefix(self, prompt: HashedPrompt) -> int:
        """Tokens of the longest block-aligned prefix of ``prompt`` that a prompt reserved for
        earlier began with (0: none; ``branch_points`` only)."""
        hashes, seen, old = prompt.hashes, self._seen, self._seen_old
        # the remembered hashes of a prompt are a prefix of its hashes (see __init__): bisect
        # its end (a few probes of the large sets, each likely a cache miss)
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in seen or hashes[mid] in old:
                lo = mid + 1
            else:
                hi = mid
        return lo * self.block_size

    def _remember(self, hashes: Sequence[bytes]) -> None:
        """The block hashes a prompt began with (all of them, or an idle cache's skipped
        prompt's first), for :meth:`shared_prefix`."""
        self._seen.update(hashes)
        if 2 * len(self._seen) > self.seen_blocks:
            self._seen_old, self._seen = self._seen, set()

    def reserve(self, prompt: HashedPrompt, lease: Lease, *, start: int = 0,
                positions: Sequence[int] | None = None, page: int | None = None,
                table: Sequence[int] = ()) -> list[Unit]:
        """Pending units for the checkpoints a prefill of ``prompt`` from token ``start`` passes
        (default: :meth:`PrefixHasher.checkpoint_positions` -- none when ``idle_after`` says
        the cache idles -- and, with ``branch_points``, the
        :meth:`shared_prefix` when it lies in ``(start, len)``), skipping those already cached
        or in flight. Each takes a page (and a tail block) within the budget, evicting least
        recently used units for it. ``page``: the request's own page (and ``table`` its block
        table): the unit at the prompt's end takes them instead (``unit.own``; nothing to
        copy: the cache owns them from :meth:`commit` on). Positions are taken from the last
        down (the prompt's end is what the next turn of a chat hits) and stop at the first
        that does not fit (best effort: a request never waits for its checkpoints). Returned
        in token order."""
        if positions is None:
            positions = self.hasher.checkpoint_positions(len(prompt), start)
            if self._remembers:
                branch = self.shared_prefix(prompt)
                if self.idle_after is not None:
                    if not (start or branch) and self.idle:
                        positions = []
                    self._unshared = 0 if start or branch else self._unshared + 1
                if self.branch_points and start < branch < len(prompt) \
                        and branch not in positions:
                    positions = sorted(positions + [branch])
        if self._remembers:
            self._remember(prompt.hashes)
        bs = self.block_size
        out: list[Unit] = []
        for n in sorted(positions, reverse=True):   # the prompt's end first: the next turn's
            checkpoint = prompt.checkpoint(n)
            key = checkpoint.key
            if key in self.index:
                continue
            needs_tail = self.blocks is not None and n % bs != 0
            if page is not None and n == len(prompt):
                if needs_tail and len(table) <= n // bs:
                    raise ConfigError(f"the block table {tuple(table)[:8]} ({len(table)} "
                                      f"blocks) does not hold {n} tokens in blocks of {bs}")
                while self.num_units >= self.page_budget:
                    if not self._evict_lru():
                        return sorted(out, key=lambda u: u.tokens)
                unit = Unit(checkpoint, page, table[n // bs] if needs_tail else None,
                            final=True, own=True)
            else:
                while self.num_units >= self.page_budget or not self.pages.num_free or (
                        needs_tail and (self.num_blocks >= self.block_budget
                                        or not self.blocks.num_free)):
                    if not self._evict_lru():
                        return sorted(out, key=lambda u: u.tokens)
                unit = Unit(checkpoint, self.pages.allocate(),
                            self.blocks.allocate(1)[0] if needs_tail else None,
                            final=n == len(prompt))
                if unit.tail is not None:
                    unit.held = np.array([unit.tail], dtype=np.int64)
                    self._hold(unit.held)
            if self.blocks is not None:
                unit.hashes = tuple(prompt.hashes[:n // bs])
            self.index.add(unit.checkpoint, unit)
            unit.first = prompt.hashes[0] if n >= bs else self.hasher.root
            self._firsts[unit.first] = self._firsts.get(unit.first, 0) + 1
            lease.pending.append(unit)
            out.append(unit)
        return sorted(out, key=lambda u: u.tokens)

    def commit(self, key: bytes, lease: Lease, table: Sequence[int] = ()) -> list[int]:
        """The checkpoint ``key`` (and its tail copy) is written: the unit becomes ready. Its
        full blocks are the cached blocks of equal chain hash, else the request's own blocks
        ``table[i]``, which the cache adopts (returned; also in ``lease.adopted``: the request
        no longer frees them). A unit on the request's own page takes the page
        (``lease.page``) and its tail block (adopted like a full block)."""
        unit = self.index.get(key)
        if unit is None or unit.ready or unit not in lease.pending:
            raise ConfigError(f"checkpoint {key.hex()} is not pending under this lease")
        if len(table) < len(unit.hashes):
            raise ConfigError(f"checkpoint at {unit.tokens} tokens needs {len(unit.hashes)} "
                              f"full blocks, the block table has {len(table)}")
        own_tail = unit.own and unit.tail is not None
        if own_tail and self._holders[unit.tail]:
            raise ConfigError(f"block {unit.tail} is cached already; the request must not "
                              f"write a cached block")
        hashes, n = unit.hashes, len(unit.hashes)
        ids = list(map(self._by_hash.get, hashes))      # the cached block of each hash, or None
        adopted: list[int] = []
        new: Sequence[bytes] = ()
        if None in ids:                                  # the request's own blocks, adopted
            own = list(table[:n])
            first = ids.index(None)
            if ids.count(None) == n - first:             # cached up to a point, then none
                ids[first:] = adopted = own[first:]
                new = hashes[first:]
            else:
                new = [h for h, b in zip(hashes, ids) if b is None]
                adopted = [o for o, b in zip(own, ids) if b is None]
                ids = [o if b is None else b for o, b in zip(own, ids)]
        if unit.tail is not None:
            ids.append(unit.tail)
            if own_tail:                    # the request's partial block: handed over too
                adopted.append(unit.tail)   # (last: it gets no hash)
        if adopted:
            self._adopt(adopted, new)
        held = np.array(ids, dtype=np.int64)
        # the unit's references: its full blocks, and its own tail (another tail it has held
        # since reserve)
        self._holders[held if own_tail or unit.tail is None else held[:-1]] += 1
        lease.adopted.update(adopted)
        if unit.own:
            lease.page = unit.page
        unit.held, unit.ready, unit.hashes = held, True, ()
        unit.blocks = tuple(ids[:n])
        lease.pending.remove(unit)
        self._touch(unit)
        if self.cold_intermediate and not unit.final:
            self._lru.move_to_end(key, last=False)
        self._dirty[key] = None
        self._trim()
        return adopted

    def abort(self, key: bytes) -> None:
        """Drop the pending unit ``key`` (its prefill failed or was cancelled)."""
        unit = self.index.get(key)
        if unit is None or unit.ready:
            raise ConfigError(f"checkpoint {key.hex()} is not pending")
        self._unindex(unit)
        if unit.own:                           # the request's page and tail: it frees them
            return
        self.pages.free(unit.page)
        self._let_go(unit.held)

    # -- announcements -----------------------------------------------------------------------
    def drain_changes(self, limit: int | None = None) -> Changes:
        """Checkpoints that became ready or went since the last drain (at most ``limit``; the
        rest come in the next)."""
        added, removed = [], []
        while self._dirty and (limit is None or len(added) + len(removed) < limit):
            key = next(iter(self._dirty))
            del self._dirty[key]
            unit = self.index.get(key)
            ready = unit is not None and unit.ready
            if ready and key not in self._announced:
                self._announced[key] = unit.checkpoint
                added.append(unit.checkpoint)
            elif not ready and key in self._announced:
                del self._announced[key]
                removed.append(key)
        self._seq += 1
        return Changes(self._seq, tuple(added), tuple(removed))

    def snapshot(self) -> Snapshot:
        """Every ready checkpoint now, with the seq of the last drain."""
        return Snapshot(self._seq, tuple(u.checkpoint for u in self._lru.values()))

    def clear(self) -> int:
        """Evict every unpinned unit (e.g. ``--no-enable-prefix-caching`` at run time); the
        number evicted."""
        n = 0
        while self._evict_lru():
            n += 1
        return n

    # -- inside --------------------------------------------------------------------------------
    def _touch(self, unit: Unit) -> None:
        self._tick += 1
        unit.tick = self._tick
        self._lru[unit.key] = unit
        self._lru.move_to_end(unit.key)

    @staticmethod
    def _evictable(unit: Unit | None) -> bool:
        return unit is not None and unit.ready and not unit.pins

    def _evict_lru(self) -> bool:
        for unit in self._lru.values():
            if not unit.pins:
                self._evict(unit)
                return True
        return False

    def _evict(self, unit: Unit) -> None:
        if not self._evictable(unit):
            raise ConfigError(f"unit {unit.key.hex()} is pinned or pending")
        key = unit.key
        self._unindex(unit)
        del self._lru[key]
        self.pages.free(unit.page)
        self._let_go(unit.held)
        self._dirty[key] = None
        self.evictions += 1

    def _unindex(self, unit: Unit) -> None:
        self.index.remove(unit.key)
        left = self._firsts[unit.first] - 1
        if left:
            self._firsts[unit.first] = left
        else:
            del self._firsts[unit.first]

    def _hold(self, held: np.ndarray) -> None:
        """Uncached blocks ``held`` become the cache's, with one holder each."""
        self._holders[held] += 1
        self._num_blocks += len(held)

    def _adopt(self, adopted: list[int], hashes: Sequence[bytes]) -> None:
        """A request hands over its blocks ``adopted``: cached from now on under ``hashes``
        (the first ``len(hashes)``; a tail has none), pinned until it ends. ConfigError, and
        nothing changed, when one is cached already."""
        held = np.array(adopted, dtype=np.int64)
        taken = self._holders[held]
        if np.count_nonzero(taken):                  # (ndarray.any() costs 5 times more)
            bad = adopted[int(np.flatnonzero(taken)[0])]
            raise ConfigError(f"block {bad} is cached under another hash; the request must "
                              f"not write a cached block")
        self._hold(held)
        self._pinned[held] = True
        self._by_hash.update(zip(hashes, adopted))
        self._hash_of.update(zip(adopted, hashes))

    def _let_go(self, held: np.ndarray) -> None:
        """One holder fewer for each block of ``held`` (a unit went, or the request that
        handed them over ended; pins already cleared): the blocks left without any go back
        to the pool."""
        if not len(held):
            return
        left = self._holders[held] - 1
        self._holders[held] = left
        gone = held[left == 0].tolist()
        if not gone:
            return
        # their hashes are forgotten (a tail has none: None, popped from nothing), in C loops:
        # an evicted prompt frees all its blocks at once
        hashes = map(self._hash_of.pop, gone, itertools.repeat(None))
        collections.deque(map(self._by_hash.pop, hashes, itertools.repeat(None)), maxlen=0)
        self._num_blocks -= len(gone)
        self.blocks.free(gone)

    def _trim(self) -> None:
        """Evict least recently used units while the cache is over its budget."""
        while self.num_units > self.page_budget or self.num_blocks > self.block_budget:
            if not self._evict_lru():
                return

