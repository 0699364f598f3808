"""CPU per request of the prefill coordinator's prefix-cache part alone (no ranks, no transfer).

Builds a :class:`~statebridge.connector.prefill_cache.PrefillPrefix` over a stand-in rank group
(the pools, ledger and counters a :class:`~statebridge.connector.prefill.PrefillServer` has) of
the transfer benchmark's cell (``statebridge bench --preset tiny-hybrid``: KV blocks of 16
tokens, ``--concurrency`` requests in flight, pools of ``concurrency + 2`` requests with the cache
on or off) and serves ``--requests`` prompts of ``--tokens`` token ids through the calls
the server makes per request, in its order::

    admit(blocks) -> ledger.open -> plan(msg, record)      (start; up to --concurrency in flight)
    settle(record, True) -> ledger.free -> release(record)  (the oldest ends)

and the announcement drain (``changes()``) every ``--drain-every`` requests (the server drains
once per heartbeat). Arms: ``off`` (the server's part with the cache off, as without
``--prefix-caching``) and ``on``. Shapes: ``random`` (no two prompts share a token: every
request misses, as in the transfer benchmark) and ``system`` (every prompt starts with the
same ``--system`` tokens, then random ones: a hit on the shared prefix). Arms and shapes
alternate ``--rounds`` times; the figure is ``time.process_time`` per request (CPU, steadier
than wall clock on a shared machine), the smallest of the rounds and their median.

    python benchmarks/micro_prefix_cache.py --json benchmarks/results/micro-prefix-cache.json
    python benchmarks/micro_prefix_cache.py --profile on-random      # yappi, top functions
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

from statebridge.bench.hetero_tp.cli import preset_spec
from statebridge.connector import messages as m
from statebridge.connector.handshake import RankAnnouncement
from statebridge.connector.ledger import Ledger, RequestKey
from statebridge.connector.prefill_cache import PrefillPrefix
from statebridge.connector.stats import Counters
from statebridge.state.cache import PagePool
from statebridge.state.kv import BlockGeometry, BlockPool, blocks_for
from statebridge.state.layout import PageGeometry

SHAPES = ("random", "system")
ARMS = ("off", "on")


def make_group(a: argparse.Namespace) -> SimpleNamespace:
    """What PrefillPrefix and the server's request path use of a rank group, sized as the
    transfer benchmark sizes a cell's prefill pools."""
    spec = preset_spec(a.preset)
    pages = a.concurrency + 2
    num_blocks = pages * blocks_for(a.tokens, a.block_size)
    pool, blocks = PagePool(pages), BlockPool(num_blocks)
    return SimpleNamespace(
        node_id="prefill-micro", spec=spec, geometry=PageGeometry(spec, 1, "DLS"),
        kv_geometry=BlockGeometry(spec.kv, 1, "HB", a.block_size, num_blocks),
        block_size=a.block_size, pool=pool, blocks=blocks, num_pages=pages,
        num_blocks=num_blocks, counters=Counters(), ledger=Ledger(1, pool, blocks),
        announcements=lambda: [RankAnnouncement(address=b"a", chunked_prefill=True)])


def make_prompts(a: argparse.Namespace, shape: str, seed: int) -> list[bytes]:
    """``--requests`` prompts as wire bytes; ``system``: the first ``--system`` tokens shared."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=(a.requests, a.tokens), dtype=np.int32)
    if shape == "system":
        tokens[:, :a.system] = tokens[0, :a.system]
    return [m.pack_tokens(row) for row in tokens]


def serve(a: argparse.Namespace, arm: str, prompts: list[bytes]) -> dict:
    """Every prompt through the server's calls; CPU seconds per request and the cache's
    figures."""
    group = make_group(a)
    prefix = PrefillPrefix(group, enabled=arm == "on", stride=a.stride)
    ledger, need = group.ledger, blocks_for(a.tokens, a.block_size)
    inflight: collections.deque = collections.deque()
    cached = 0

    def finish() -> int:
        record = inflight.popleft()
        prefix.settle(record, True)
        ledger.free(record)
        return prefix.release(record)

    start = time.process_time()
    for i, prompt in enumerate(prompts):
        if len(inflight) >= a.concurrency:
            cached += finish()
        while not prefix.admit(need):           # the pools fit every request in flight
            cached += finish()
        msg = m.TransferRequest(request_id=f"r{i}", generation=1, prompt=prompt,
                                kv_blocks=tuple(range(need)))
        record = ledger.open(RequestKey("decode", msg.request_id, 1), float("inf"),
                             num_blocks=need, contiguous=True)
        prefix.plan(msg, record)
        inflight.append(record)
        if a.drain_every and (i + 1) % a.drain_every == 0:
            prefix.changes()
    while inflight:
        cached += finish()
    cpu = time.process_time() - start
    stats = prefix.stats()
    return {"us_per_request": cpu / len(prompts) * 1e6, "cached_tokens": cached,
            "pages_cached": stats["pages_cached"], "blocks_cached": stats["blocks_cached"],
            "evictions": stats["prefix_evictions"]}


def profile(a: argparse.Namespace, cell: str) -> None:
    import yappi

    arm, shape = cell.split("-")
    prompts = make_prompts(a, shape, a.seed)
    serve(a, arm, prompts[:200])                    # warm up
    yappi.set_clock_type("cpu")
    yappi.start()
    serve(a, arm, prompts)
    yappi.stop()
    stats = yappi.get_func_stats()
    stats.sort("tsub")
    stats.print_all(out=sys.stdout, columns={0: ("name", 60), 1: ("ncall", 10),
                                              2: ("tsub", 9), 3: ("ttot", 9)})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny-hybrid", help="the spec (a bench preset with KV)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per prompt")
    p.add_argument("--system", type=int, default=512, help="shared tokens (shape system)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--stride", type=int, default=256, help="checkpoint stride (0: none)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--drain-every", type=int, default=100,
                   help="requests between announcement drains (0: none)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile", metavar="ARM-SHAPE",
                   help="one cell (e.g. on-random) under yappi's CPU clock instead")
    a = p.parse_args(argv)
    if a.profile:
        profile(a, a.profile)
        return 0
    prompts = {shape: make_prompts(a, shape, a.seed) for shape in SHAPES}
    for shape in SHAPES:                               # warm up (imports, allocator)
        for arm in ARMS:
            serve(a, arm, prompts[shape][:100])
    runs: dict[str, list[dict]] = {f"{arm}-{shape}": [] for shape in SHAPES for arm in ARMS}
    for _ in range(a.rounds):
        for shape in SHAPES:
            for arm in ARMS:
                runs[f"{arm}-{shape}"].append(serve(a, arm, prompts[shape]))
    cells = {}
    for cell, rs in runs.items():
        us = [r["us_per_request"] for r in rs]
        cells[cell] = {"us_per_request_min": min(us),
                       "us_per_request_median": statistics.median(us), "us_per_request": us,
                       **{k: v for k, v in rs[-1].items() if k != "us_per_request"}}
        print(f"{cell:14s} {min(us):8.1f} µs/request (median {statistics.median(us):7.1f}), "
              f"cached tokens {rs[-1]['cached_tokens']}, evictions {rs[-1]['evictions']}")
    for shape in SHAPES:
        on, off = cells[f"on-{shape}"], cells[f"off-{shape}"]
        print(f"{shape}: the cache adds {on['us_per_request_min'] - off['us_per_request_min']:.1f}"
              f" µs/request")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "python": sys.version.split()[0],
                       "machine": platform.processor() or platform.machine(),
                       "cells": cells}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
