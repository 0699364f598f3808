"""Replay a multi-turn chat trace against the prefill group's prefix-cache bookkeeping alone
(no model, no transfer) and print the hit rate against the ideal, per pool size and policy.

The trace: N conversations x T turns sharing one long system prompt; turn t of a conversation
is the system prompt + every earlier user message and answer + a new user message. Turns are
interleaved (turn 1 of every conversation, then turn 2, ...), the order that is hardest on LRU.
Each prompt is served as the prefill node serves it under the N-1 rule: it prefills
``prompt[:-1]``; a hit leaves at least that sequence's last token to prefill.

Ideal = for each prompt, the longest prefix (capped the same way) that any earlier prompt had:
every token seen before is reused. Hit rate = hit tokens / ideal tokens, summed over the trace.

    python benchmarks/replay_prefix_cache.py --conversations 32 --turns 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

from statebridge.connector.prefix_cache import PrefixCache
from statebridge.state.cache import PagePool
from statebridge.state.kv import BlockPool, blocks_for
from statebridge.state.prefix import PrefixHasher


def make_trace(conversations: int, turns: int, system: int, user: int, answer: int,
               vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    sys_prompt = [rng.randrange(vocab) for _ in range(system)]
    history = [list(sys_prompt) for _ in range(conversations)]
    trace = []
    for _ in range(turns):
        for c in range(conversations):
            history[c] += [rng.randrange(vocab)
                           for _ in range(rng.randint(user // 2, user * 3 // 2))]
            trace.append(list(history[c]))
            history[c] += [rng.randrange(vocab) for _ in range(rng.randint(answer // 2,
                                                                          answer * 3 // 2))]
    return trace


def ideal_hits(trace: list[list[int]]) -> list[int]:
    """Per prompt: the longest prefix of ``prompt[:-1]`` (capped at its length - 1) that an
    earlier prompt's ``[:-1]`` shared, by a token trie."""
    root: dict = {}
    out = []
    for prompt in trace:
        seq = prompt[:-1]
        node, n = root, 0
        for t in seq[:max(len(seq) - 1, 0)]:
            node = node.get(t)
            if node is None:
                break
            n += 1
        out.append(n)
        node = root
        for t in seq:
            node = node.setdefault(t, {})
    return out


def replay(trace, *, pages: int, blocks: int, block_size: int, stride: int, budget: float,
           cold: bool) -> dict:
    pool, block_pool = PagePool(pages), BlockPool(blocks)
    hasher = PrefixHasher(b"replay", block_size, stride=stride)
    cache = PrefixCache(pool, block_pool, hasher, page_budget=int(pages * budget),
                        block_budget=int(blocks * budget), cold_intermediate=cold)
    hits, refused, lookup_s = [], 0, 0.0
    for prompt in trace:
        seq = prompt[:-1]
        t0 = time.perf_counter()
        hashed = hasher.prompt(seq)
        hit = cache.lookup(hashed)
        lookup_s += time.perf_counter() - t0
        lease = cache.acquire(hit)
        fresh = blocks_for(len(seq), block_size) - hit.tokens // block_size
        if not cache.make_room(pages=1, contiguous=fresh):      # a pinned hit in the way
            cache.release(lease)
            hit, lease = cache.lookup(hashed, cap=0), cache.acquire()
            fresh = blocks_for(len(seq), block_size)
            if not cache.make_room(pages=1, contiguous=fresh):
                refused += 1
                cache.release(lease)
                hits.append(0)
                continue
        page = pool.allocate()
        table = list(hit.blocks) + block_pool.allocate(fresh, contiguous=True)
        for unit in cache.reserve(hashed, lease, start=hit.tokens):
            cache.commit(unit.key, lease, table)
        own = lease.private(table)
        cache.release(lease)
        pool.free(page)
        block_pool.free(own)
        hits.append(hit.tokens)
    return {"hits": hits, "refused": refused, "evictions": cache.evictions,
            "lookup_us": 1e6 * lookup_s / len(trace), "units_end": cache.num_units,
            "blocks_end": cache.num_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1400)
    ap.add_argument("--user-tokens", type=int, default=60, help="mean per user message")
    ap.add_argument("--answer-tokens", type=int, default=150, help="mean per answer")
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--pools", default="16:1024,64:4096,128:8192,512:32768",
                    help="comma-separated pages:blocks pool sizes of the group")
    ap.add_argument("--budgets", default="0.5,0.9", help="cache share of each pool")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    trace = make_trace(args.conversations, args.turns, args.system_tokens, args.user_tokens,
                       args.answer_tokens, args.vocab, args.seed)
    ideal = ideal_hits(trace)
    prompt_tokens = sum(len(p) - 1 for p in trace)
    per_turn_ideal = sum(ideal[args.conversations:])
    print(f"trace: {args.conversations} conversations x {args.turns} turns, system prompt "
          f"{args.system_tokens} tokens, {len(trace)} prompts, {prompt_tokens} prefill tokens, "
          f"ideal reuse {sum(ideal)} ({sum(ideal) / prompt_tokens:.3f} of prefill tokens); "
          f"block {args.block_size}, stride {args.stride}")
    header = (f"{'pages':>6} {'blocks':>7} {'budget':>6} {'policy':>6} {'hit tok':>9} "
              f"{'ideal':>9} {'hit/ideal':>9} {'turn>=2':>8} {'evict':>6} {'refused':>7} "
              f"{'lookup us':>9}")
    print(header)
    rows = []
    for spec in args.pools.split(","):
        pages, blocks = (int(x) for x in spec.split(":"))
        for budget in (float(b) for b in args.budgets.split(",")):
            for cold in (False, True):
                r = replay(trace, pages=pages, blocks=blocks, block_size=args.block_size,
                           stride=args.stride, budget=budget, cold=cold)
                hit = sum(r["hits"])
                later = sum(r["hits"][args.conversations:])
                row = {"pages": pages, "blocks": blocks, "budget": budget,
                       "policy": "cold" if cold else "lru", "hit_tokens": hit,
                       "ideal_tokens": sum(ideal), "hit_over_ideal": hit / max(sum(ideal), 1),
                       "turn2plus_over_ideal": later / max(per_turn_ideal, 1),
                       "evictions": r["evictions"], "refused": r["refused"],
                       "lookup_us": r["lookup_us"], "prefill_tokens": prompt_tokens}
                rows.append(row)
                print(f"{pages:>6} {blocks:>7} {budget:>6.2f} {row['policy']:>6} {hit:>9} "
                      f"{sum(ideal):>9} {row['hit_over_ideal']:>9.3f} "
                      f"{row['turn2plus_over_ideal']:>8.3f} {r['evictions']:>6} "
                      f"{r['refused']:>7} {r['lookup_us']:>9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
