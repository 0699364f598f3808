"""A rank's side of the prefix cache (issue 41, :mod:`statebridge.connector.prefix_cache`): the
copies of whole pages and KV blocks, and what a :class:`~statebridge.connector.messages.RankPrefill`
asks of them (:func:`prefix_plan`, checked before anything runs).

The coordinator decides every id; a rank only copies bytes, on its compute thread, in the order
of its prefill steps::

    restore (before the job's first step)     checkpoint i (after the step that ends at at[i])
    page restore_page    -> src_page           page src_page                -> checkpoint_pages[i]
    block restore_blocks[j] -> src_blocks[j]   block src_blocks[at[i] // bs] -> checkpoint_tails[i]

Both sides of a copy are pages (or blocks) of the same pool, so they share one layout: a page is
``page_size`` contiguous bytes whatever its state layout (DS included), and a block is the
slice ``b`` of the pool's block axis, whatever its KV order -- plain copies of whole pages and
blocks, on the device the pool lives on (the compute thread's current stream, so they are
ordered with the model's steps; :func:`settle` waits for them on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from statebridge.errors import ConfigError
from statebridge.state.kv import blocks_for

if TYPE_CHECKING:
    from statebridge.connector import messages as m
    from statebridge.connector.rank.model import KVBlocks
    from statebridge.state.cache import StateCache

__all__ = ["PrefixPlan", "copy_page", "copy_blocks", "settle", "prefix_plan"]


def copy_page(cache: "StateCache", src: int, dst: int) -> None:
    """Page ``src`` of ``cache`` to page ``dst`` (every state segment, the padding too)."""
    if src != dst:
        cache.page_bytes(dst).copy_(cache.page_bytes(src))


def _block_axis(kv: "KVBlocks") -> tuple[torch.Tensor, int]:
    """The pool's bytes as its physical array (``head_dim`` in bytes) and where the block
    axis is in it."""
    geo = kv.geometry
    order = geo.layout.order
    shape = [geo.dim[a] for a in order]
    shape[-1] *= geo.itemsize                         # E, innermost, as bytes
    return kv.buffer[:geo.nbytes].view(shape), order.index("B")


def copy_blocks(kv: "KVBlocks", src: Sequence[int], dst: Sequence[int]) -> None:
    """KV blocks ``src[i]`` to ``dst[i]`` of ``kv`` (every attention layer, K and V, every
    token slot), as if all at once. Pairs with ``src[i] == dst[i]`` are skipped (a shared
    block the table already holds); the other destinations must be distinct."""
    pairs = [(s, d) for s, d in zip(src, dst, strict=True) if s != d]
    if not pairs:
        return
    if len({d for _, d in pairs}) != len(pairs):
        raise ConfigError(f"KV block copy {pairs[:8]} writes a block twice")
    pool, axis = _block_axis(kv)
    device = pool.device
    s = torch.as_tensor([p[0] for p in pairs], dtype=torch.int64, device=device)
    d = torch.as_tensor([p[1] for p in pairs], dtype=torch.int64, device=device)
    pool.index_copy_(axis, d, pool.index_select(axis, s))


def settle(tensor: torch.Tensor) -> None:
    """Wait until the copies queued on ``tensor``'s device are done (a GPU's current stream;
    host copies are done when they return): a checkpoint is complete before its request's
    result leaves the rank."""
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()


@dataclass(frozen=True, slots=True)
class PrefixPlan:
    """What one request asks of the prefix cache, checked (:func:`prefix_plan`).

    ``cached``: tokens restored, not computed (0: none); ``restore_page`` (-1: none) and the
    ``restore_blocks`` ``(src, dst)`` pairs copied before the first step; ``checkpoints``:
    ``(tokens, page, tail_src, tail_dst)`` in increasing ``tokens`` (``tail_dst`` -1: no tail).
    """

    cached: int = 0
    restore_page: int = -1
    restore_blocks: tuple[tuple[int, int], ...] = ()
    checkpoints: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def stops(self) -> tuple[int, ...]:
        """Token counts a step must end at."""
        return tuple(c[0] for c in self.checkpoints)

    def restore(self, cache: "StateCache", kv: "KVBlocks | None", page: int) -> None:
        """Copy the cached state into ``page`` and the cached KV into the request's blocks."""
        if self.restore_page >= 0:
            copy_page(cache, self.restore_page, page)
        if self.restore_blocks:
            copy_blocks(kv, *zip(*self.restore_blocks))

    def checkpoint(self, cache: "StateCache", kv: "KVBlocks | None", page: int,
                   tokens: int) -> bool:
        """After a step that ended at ``tokens``: copy ``page`` (and its partial block) to the
        checkpoint at that count, if there is one; whether there was."""
        for at, dst, tail_src, tail_dst in self.checkpoints:
            if at == tokens:
                copy_page(cache, page, dst)
                if tail_dst >= 0:
                    copy_blocks(kv, (tail_src,), (tail_dst,))
                return True
        return False


def _ids(name: str, values: Sequence[int], limit: int, what: str) -> None:
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int)
           or not 0 <= v < limit]
    if bad:
        raise ConfigError(f"{name} {tuple(values)[:8]}: {bad[0]!r} is not a {what} of this "
                          f"rank (0..{limit - 1})")


def prefix_plan(msg: "m.RankPrefill", length: int, cache: "StateCache",
                kv: "KVBlocks | None", *, chunked: bool) -> PrefixPlan | None:
    """The checked prefix-cache part of ``msg`` (a prompt of ``length`` tokens), or None when
    it asks for none. :class:`ConfigError` naming the values when the rank cannot do it: a hit
    (``cached_tokens > 0``) or an intermediate checkpoint on a model that does not prefill
    from a state (``chunked`` False), a hit not shorter than the prompt, pages or blocks
    outside the rank's pools, checkpoint counts not strictly increasing in
    ``(cached_tokens, length]``, lists of different lengths, a checkpoint written where the
    request still writes."""
    cached, restore_page, restore_blocks = msg.cached_tokens, msg.restore_page, \
        tuple(msg.restore_blocks)
    at, pages, tails = tuple(msg.checkpoint_at), tuple(msg.checkpoint_pages), \
        tuple(msg.checkpoint_tails)
    if not cached and restore_page == -1 and not restore_blocks and not at and not pages \
            and not tails:
        return None
    rid = msg.request_id
    if cache is None:
        raise ConfigError(f"{rid}: prefix cache fields (cached_tokens={cached}, checkpoint_at="
                          f"{at[:8]}) for a rank without a page cache")
    if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
        raise ConfigError(f"{rid}: cached_tokens must be an integer >= 0, got {cached!r}")
    if cached and not chunked:
        raise ConfigError(f"{rid}: cached_tokens={cached} needs a model that prefills from a "
                          f"state (chunked_prefill); this rank's model does not")
    if cached and cached >= length:
        raise ConfigError(f"{rid}: cached_tokens={cached} must be below the prompt's {length} "
                          f"tokens (at least the last token is prefilled)")
    if not cached and (restore_page != -1 or restore_blocks):
        raise ConfigError(f"{rid}: restore_page={restore_page}, restore_blocks="
                          f"{restore_blocks[:8]} without cached_tokens")
    num_pages = cache.num_pages
    if cached:
        _ids(f"{rid}: restore_page", (restore_page,), num_pages, "page")
    blocks = tuple(msg.src_blocks)
    bs = kv.geometry.block_size if kv is not None else 0
    if restore_blocks:
        if kv is None or not blocks:
            raise ConfigError(f"{rid}: restore_blocks {restore_blocks[:8]} for a request "
                              f"without KV blocks")
        if len(restore_blocks) != blocks_for(cached, bs) or len(restore_blocks) > len(blocks):
            raise ConfigError(f"{rid}: restore_blocks {restore_blocks[:8]} "
                              f"({len(restore_blocks)} blocks) do not hold cached_tokens="
                              f"{cached} in blocks of {bs} (src_blocks has {len(blocks)})")
        _ids(f"{rid}: restore_blocks", restore_blocks, kv.geometry.num_blocks, "KV block")
    elif cached and blocks:
        raise ConfigError(f"{rid}: cached_tokens={cached} with KV blocks {blocks[:8]} but no "
                          f"restore_blocks")
    if len(pages) != len(at) or (tails and len(tails) != len(at)):
        raise ConfigError(f"{rid}: checkpoint_at {at[:8]}, checkpoint_pages {pages[:8]} and "
                          f"checkpoint_tails {tails[:8]} differ in length")
    bad = [n for n in at if isinstance(n, bool) or not isinstance(n, int)]
    if bad or any(not cached < n <= length for n in at) \
            or any(a >= b for a, b in zip(at, at[1:])):
        raise ConfigError(f"{rid}: checkpoint_at {at[:8]} must increase strictly within "
                          f"(cached_tokens={cached}, {length}]")
    if at and at[0] < length and not chunked:
        raise ConfigError(f"{rid}: checkpoint_at {at[:8]}: a checkpoint inside the prompt of "
                          f"{length} tokens needs a model that prefills in chunks "
                          f"(chunked_prefill); this rank's model does not")
    _ids(f"{rid}: checkpoint_pages", pages, num_pages, "page")
    if len(set(pages)) != len(pages) or msg.src_page in pages:
        raise ConfigError(f"{rid}: checkpoint_pages {pages[:8]} must be distinct and not the "
                          f"request's page {msg.src_page}")
    tails = tails or (-1,) * len(at)
    checkpoints = []
    for n, page, tail in zip(at, pages, tails):
        tail_src = -1
        if tail != -1:
            if kv is None or not blocks:
                raise ConfigError(f"{rid}: checkpoint_tails {tails[:8]} for a request without "
                                  f"KV blocks")
            _ids(f"{rid}: checkpoint_tails", (tail,), kv.geometry.num_blocks, "KV block")
            if not n % bs or n // bs >= len(blocks):
                raise ConfigError(f"{rid}: checkpoint at {n} tokens: a tail block needs a "
                                  f"count inside a block of {bs} of its {len(blocks)} blocks")
            if tail in blocks:
                raise ConfigError(f"{rid}: checkpoint tail block {tail} is one of the "
                                  f"request's own blocks")
            tail_src = blocks[n // bs]
        checkpoints.append((n, page, tail_src, tail))
    used = [t for t in tails if t != -1]
    if len(set(used)) != len(used):
        raise ConfigError(f"{rid}: checkpoint_tails {tails[:8]} repeat a block")
    return PrefixPlan(cached, restore_page if cached else -1,
                      tuple(zip(restore_blocks, blocks)), tuple(checkpoints))
