"""The prefill server's prefix cache part (issue 41): which cached prefix a request starts from,
which checkpoints it keeps, and what the decode nodes hear of it.

:class:`PrefillPrefix` is a part the :class:`~statebridge.connector.prefill.PrefillServer`
*has* (``server.prefix``). It runs on the group's loop thread and keeps the bookkeeping of
:class:`~statebridge.connector.prefix_cache.PrefixCache` over the group's own page and block
pools; the ranks copy the bytes (:mod:`statebridge.connector.rank.prefix`). One request::

    admit(msg, blocks)    room for the page and the contiguous block range (evicting
                          unpinned units: a running request's needs win)
    plan(key, msg, record) after the ledger allocated them: nothing when an idle cache skips
                          the prompt (PrefixCache.skip); else lookup (capped at len - 1),
                          pin the hit, reserve checkpoint units for the positions the prefill
                          passes (the prompt's end on the request's own page, not sent); the
                          RankPrefill fields (restore / checkpoint)
    settle(record)        every rank answered: on success commit the units (the request's
                          full blocks are adopted where not cached yet, its page by the end's
                          unit: ``record.page`` -1); the request keeps only
                          ``lease.private(table)`` to free
    release(record)       after the ledger freed the record: unpin, abort what was never
                          committed; returns the cached tokens (TransferTimes.cached_tokens)

The cache is on when the server was asked for it (``prefix_cache``) and every rank said its
model prefills from a state (``RankHello.chunked_prefill``); else it stays off (logged once).

Announcements (:meth:`snapshot`, :meth:`changes`): a decode node gets every ready checkpoint
right after its handshake (``reset``), then the changes as soon as a request's checkpoints are
ready (at the end of that loop iteration, one message for every request that ended in it: the
next turn of a chat is routed by them) and with each heartbeat that has any (evictions), at
most ``ANNOUNCE_CAP`` keys a message (more: a capped reset snapshot of the most recently used). Nothing of the cache is on the wire to the decode
ranks: a key covers the tokens, the model, spec, page and block layout and TP
(:class:`~statebridge.state.prefix.PrefixSalt`), and a cached page or block is never written
after its commit, so a stale or wrong checkpoint cannot be found by a prompt it does not
belong to.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from statebridge.connector import messages as m
from statebridge.connector.prefix_cache import Lease, PrefixCache
from statebridge.errors import ConfigError
from statebridge.state.prefix import DEFAULT_CHECKPOINT_TOKENS, PrefixHasher, PrefixSalt

if TYPE_CHECKING:
    from statebridge.connector.group import RankGroup
    from statebridge.connector.ledger import Record, RequestKey

log = logging.getLogger("statebridge.connector.prefill")

__all__ = ["PrefillPrefix", "ANNOUNCE_CAP", "IDLE_AFTER"]

#: Most checkpoint keys in one PrefixAnnounce.
ANNOUNCE_CAP = 4096

#: Prompts in a row that share no full block with an earlier prompt (and hit nothing) after
#: which a prompt that does not either keeps no checkpoint (PrefixCache ``idle_after``): a
#: stream of unrelated prompts, such as the transfer benchmark's, costs one block's hash a
#: prompt (PrefixCache.skip) -- no lookup, no unit adopted and evicted a request, no page
#: copied, that nothing can hit; a chat's prompts share their system prompt and keep theirs.
IDLE_AFTER = 64


@dataclass(eq=False)
class _Held:
    """One request's hold on the cache."""

    lease: Lease
    cached_tokens: int


class PrefillPrefix:
    """The prefill server's prefix cache (module docstring). ``enabled``: asked for;
    ``stride``: tokens between checkpoints; ``cache_bytes``: per rank, the most bytes of
    pages and blocks the cache holds (None: half of each pool); ``model``: what names the
    weights in the keys' salt."""

    def __init__(self, group: "RankGroup", *, enabled: bool = False,
                 stride: int = DEFAULT_CHECKPOINT_TOKENS, cache_bytes: int | None = None,
                 model: str = "") -> None:
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
            raise ConfigError(f"prefix_stride must be an integer >= 0 (0: no periodic "
                              f"checkpoints), got {stride!r}")
        if cache_bytes is not None and (isinstance(cache_bytes, bool)
                                        or not isinstance(cache_bytes, int) or cache_bytes < 0):
            raise ConfigError(f"prefix_cache_bytes must be an integer >= 0 or None, got "
                              f"{cache_bytes!r}")
        self.group = group
        self.enabled = bool(enabled)
        self.stride = stride
        self.cache_bytes = cache_bytes
        self.salt = PrefixSalt.of(group.spec, group.geometry, group.kv_geometry, model=model)
        self.hasher = PrefixHasher(self.salt, group.block_size, stride=stride)
        self.cache: PrefixCache | None = None
        self._held: dict["RequestKey", _Held] = {}
        self._why_off = ""

    # -- on or off -----------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Loop thread: the cache serves (asked for, every rank prefills in chunks)."""
        return self._ensure() is not None

    def _ensure(self) -> PrefixCache | None:
        if not self.enabled:
            return None
        if self.cache is not None:
            return self.cache
        group = self.group
        announced = group.announcements()
        if any(not a.address for a in announced):
            return None                             # ranks not all up: decided later
        if not all(a.chunked_prefill for a in announced):
            why = (f"{group.node_id}: prefix cache off: the ranks' model does not prefill "
                   f"from a state (chunked_prefill)")
            if why != self._why_off:
                log.warning("%s", why)
                self._why_off = why
            return None
        self.cache = PrefixCache(group.pool, group.blocks, self.hasher, branch_points=True,
                                 idle_after=IDLE_AFTER, **self._budgets())
        log.info("%s: prefix cache on: checkpoints at prompt ends, where prompts branch%s "
                 "(none after %d unrelated prompts in a row); up to %d pages and %d KV blocks",
                 group.node_id, f" and every {self.stride} tokens" if self.stride else "",
                 IDLE_AFTER, self.cache.page_budget, self.cache.block_budget)
        return self.cache

    def _budgets(self) -> dict[str, int]:
        group = self.group
        if self.cache_bytes is None:
            return {}
        page_bytes = group.geometry.page_size
        block_bytes = group.kv_geometry.bytes_per_block if group.kv_geometry else 0
        pool_pages = page_bytes * group.num_pages
        pool_blocks = block_bytes * group.num_blocks
        share = pool_pages / (pool_pages + pool_blocks)       # split like the pools
        pages = int(self.cache_bytes * share) // page_bytes
        blocks = int(self.cache_bytes * (1 - share)) // block_bytes if block_bytes else 0
        return {"page_budget": min(pages, group.num_pages),
                "block_budget": min(blocks, group.num_blocks)}

    def group_info(self, info: m.GroupInfo) -> m.GroupInfo:
        """The group's handshake record with the cache's fields."""
        if not self.active:
            return info
        return replace(info, prefix_cache=True, prefix_salt=self.salt.digest(),
                       prefix_stride=self.stride)

    def reset(self) -> None:
        """The group restarted (fresh pools and ledger): the cache starts empty."""
        self.cache = None
        self._held.clear()

    # -- one request ---------------------------------------------------------------------------
    def admit(self, blocks: int) -> bool:
        """Whether a page and ``blocks`` contiguous blocks are free, evicting unpinned units
        for them when the cache is on."""
        group = self.group

        def free() -> bool:
            return bool(group.pool.num_free) and (
                not blocks or blocks <= group.blocks.largest_free_range())
        if free():
            return True
        cache = self._ensure()
        return cache is not None and cache.make_room(pages=1, contiguous=blocks) and free()

    def plan(self, msg: m.TransferRequest, record: "Record") -> dict:
        """The request's page and blocks are allocated: its hit and checkpoints, as
        RankPrefill fields ({} without the cache)."""
        cache = self._ensure()
        if cache is None or not msg.prefix_cache:
            return {}
        group = self.group
        if cache.skip(msg.prompt):          # an idle cache's unrelated prompt: nothing to keep
            group.counters.add("prefix_queries", len(msg.prompt) // 4)
            return {}
        try:
            prompt = self.hasher.prompt(np.frombuffer(msg.prompt, dtype="<i4"))
        except ConfigError:
            return {}
        hit = cache.lookup(prompt)
        lease = cache.acquire(hit if hit.unit is not None else None)
        cached = hit.tokens if hit.unit is not None else 0
        group.counters.add("prefix_queries", len(prompt))
        group.counters.add("prefix_hits", cached)
        units = [u for u in cache.reserve(prompt, lease, start=cached, page=record.page,
                                          table=record.blocks) if not u.own]
        self._held[record.key] = _Held(lease, cached)
        fields: dict = {}
        if cached:
            fields.update(cached_tokens=cached, restore_page=hit.page)
            if group.spec.kv is not None:
                fields["restore_blocks"] = hit.blocks + ((hit.tail,) if hit.tail is not None
                                                         else ())
        if units:
            fields.update(checkpoint_at=tuple(u.tokens for u in units),
                          checkpoint_pages=tuple(u.page for u in units))
            if group.spec.kv is not None and any(u.tail is not None for u in units):
                fields["checkpoint_tails"] = tuple(-1 if u.tail is None else u.tail
                                                   for u in units)
        return fields

    def settle(self, record: "Record", ok: bool) -> bool:
        """Every rank answered ``record`` (before the ledger frees it): on success its
        checkpoints are ready and the blocks the cache adopted leave its table. Whether
        checkpoints became ready (worth announcing now)."""
        held = self._held.get(record.key)
        if held is None or self.cache is None:
            return False
        committed = bool(ok and held.lease.pending)
        if ok:
            for unit in list(held.lease.pending):
                try:
                    self.cache.commit(unit.key, held.lease, record.blocks)
                except ConfigError as e:       # never expected: keep serving, uncached
                    log.error("%s: prefix checkpoint of %s not kept: %s", self.group.node_id,
                              record.key, e)
        record.blocks = held.lease.private(record.blocks)
        if held.lease.page is not None:
            record.page = -1                   # the cache took it: the ledger frees no page
        return committed

    def release(self, record: "Record") -> int:
        """The ledger freed ``record``: drop its hold; its cached tokens."""
        held = self._held.pop(record.key, None)
        if held is None:
            return 0
        if self.cache is not None:
            self.cache.release(held.lease)
        return held.cached_tokens

    # -- what decode nodes hear ----------------------------------------------------------------
    def _announce(self, seq: int, reset: bool, added, removed=()) -> m.PrefixAnnounce:
        cache = self.cache
        return m.PrefixAnnounce(node_id=self.group.node_id, seq=seq, reset=reset,
                                added_keys=tuple(c.key for c in added),
                                added_tokens=tuple(c.tokens for c in added),
                                removed_keys=tuple(removed),
                                pages_cached=cache.num_units if cache else 0,
                                blocks_cached=cache.num_blocks if cache else 0,
                                evictions=cache.evictions if cache else 0)

    def snapshot(self) -> m.PrefixAnnounce | None:
        """Every ready checkpoint (the most recently used ``ANNOUNCE_CAP``), as a reset."""
        if not self.active:
            return None
        snap = self.cache.snapshot()
        return self._announce(snap.seq, True, snap.checkpoints[-ANNOUNCE_CAP:])

    def changes(self) -> m.PrefixAnnounce | None:
        """What changed since the last call (None: nothing); a capped reset snapshot when
        more than ``ANNOUNCE_CAP`` keys changed."""
        if self.cache is None:
            return None
        changes = self.cache.drain_changes()
        if not changes.added and not changes.removed:
            return None
        if len(changes.added) + len(changes.removed) > ANNOUNCE_CAP:
            return self.snapshot()
        return self._announce(changes.seq, False, changes.added, changes.removed)

    # -- what it holds ---------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        cache = self.cache
        counters = self.group.counters
        return {"prefix_cache": cache is not None,
                "pages_cached": cache.num_units if cache else 0,
                "blocks_cached": cache.num_blocks if cache else 0,
                "prefix_evictions": cache.evictions if cache else 0,
                "prefix_queries": int(counters.get("prefix_queries")),
                "prefix_hits": int(counters.get("prefix_hits"))}
