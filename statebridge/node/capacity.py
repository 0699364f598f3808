"""How many max-length requests a prefill/decode pair holds at once, which pool bounds it, and
what each rank holds (:func:`memory_fields`).

Four pools bound the requests in flight between a prefill node and a decode node:

- the decode node's pages (one per request, from arrival to the last token) and its KV pool
  (a request's prompt and generated tokens: up to ``max_prompt_len + max_new_tokens``);
- the prefill node's pages and KV pool (a request's prompt but its last token, from the
  prefill until every decode rank holds the state).

A KV pool holds the same tokens on every rank of its node (each rank its share of the heads),
so its capacity is counted in tokens per rank whatever the TP. The decode node learns the
prefill node's pages and KV pool in the handshake (``GroupInfo``) and logs the pair's bound,
naming the binding pool -- a warning when a KV pool, not the page counts the user chose,
bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from statebridge.state.kv import blocks_for

__all__ = ["PoolBound", "pair_bounds", "capacity_message", "max_model_len", "memory_fields"]


def max_model_len(limits: int, kv_tokens: int) -> int:
    """The longest request (prompt + new tokens) a decode node serves: its limits'
    (``max_prompt_len + max_new_tokens``), capped at the tokens one of its ranks' KV pool holds
    (``kv_tokens``; 0: no KV pool, no cap) -- a longer request could never get its blocks."""
    return min(limits, kv_tokens) if kv_tokens else limits


@dataclass(frozen=True)
class PoolBound:
    """One pool's bound: ``requests`` max-length requests of ``tokens_each`` tokens fit in it
    at once (``tokens`` its tokens per rank; 0 for pages)."""

    side: str                 # "decode" | "prefill"
    node_id: str
    tp_size: int
    pool: str                 # "pages" | "KV pool"
    requests: int
    tokens: int = 0
    tokens_each: int = 0

    def name(self) -> str:
        return f"the {self.pool} of {self.side} node {self.node_id} (TP {self.tp_size})"

    def describe(self) -> str:
        if self.pool == "pages":
            return f"{self.name()}: {self.requests} pages"
        return (f"{self.name()}: {self.tokens:,} tokens per rank = {_requests(self.requests)} "
                f"of {self.tokens_each:,} tokens")


def pair_bounds(*, decode_id: str, decode_tp: int, decode_pages: int, decode_blocks: int,
                prefill_id: str, prefill_tp: int, prefill_pages: int, prefill_blocks: int,
                block_size: int, max_prompt_len: int, max_model_len: int) -> list[PoolBound]:
    """Every pool's bound on max-length requests in flight (``max_model_len`` tokens in all,
    prompts of up to ``max_prompt_len``), tightest first (KV pools before page pools on a tie:
    they are the ones a page count does not show). ``*_blocks`` 0: that node has no KV pool
    (a model without attention layers), it bounds nothing."""
    bounds = [PoolBound("decode", decode_id, decode_tp, "pages", decode_pages),
              PoolBound("prefill", prefill_id, prefill_tp, "pages", prefill_pages)]
    if decode_blocks:
        each = max_model_len
        bounds.append(PoolBound("decode", decode_id, decode_tp, "KV pool",
                                decode_blocks // blocks_for(each, block_size),
                                decode_blocks * block_size, each))
    if prefill_blocks:
        each = max(1, min(max_prompt_len, max_model_len) - 1)   # it computes prompt[:-1]
        bounds.append(PoolBound("prefill", prefill_id, prefill_tp, "KV pool",
                                prefill_blocks // blocks_for(each, block_size),
                                prefill_blocks * block_size, each))
    return sorted(bounds, key=lambda b: (b.requests, b.pool == "pages"))


def capacity_message(bounds: list[PoolBound]) -> tuple[bool, str]:
    """(warn, line): the pair's bound naming the binding pool. ``warn`` when the prefill
    node's KV pool binds below the page counts (it holds a request only until its state moved,
    so a prefill pool that bounds the pair is too small for its peer), or when no request of
    the longest length fits at all. A decode KV pool binding is the expected case (it holds
    every request for its whole life): said, not warned about."""
    binding = bounds[0]
    pages = min(b.requests for b in bounds if b.pool == "pages")
    others = "; ".join(b.describe() for b in bounds[1:])
    line = (f"{_requests(binding.requests)} of the longest length fit at once; the binding "
            f"pool is {binding.describe()} (then: {others})")
    warn = binding.requests == 0 or (binding.pool != "pages" and binding.side == "prefill"
                                     and binding.requests < pages)
    if binding.requests == 0:
        line += (f". A request of {binding.tokens_each:,} tokens never fits in it: such "
                 f"requests are refused")
    if binding.pool != "pages" and binding.requests < pages:
        line += (f". The {binding.side} node's KV pool, not the {pages} pages, bounds "
                 f"concurrency at the longest length: more with --kv-tokens or --kv-gib on "
                 f"that node")
    return warn, line


def _requests(n: int) -> str:
    return f"{n} request" if n == 1 else f"{n} requests"


def memory_fields(group) -> dict:
    """The ``rank_*`` memory fields of :class:`~statebridge.node.messages.NodeStats` for a
    rank group (its :meth:`~statebridge.connector.group.RankGroup.rank_memory`; loop
    thread)."""
    rows = group.rank_memory()
    return {"rank_weights_private": tuple(r["weights_private"] for r in rows),
            "rank_weights_mapped": tuple(r["weights_mapped"] for r in rows),
            "rank_pages_bytes": tuple(r["pages"] for r in rows),
            "rank_kv_pool_bytes": tuple(r["kv_pool"] for r in rows)}
