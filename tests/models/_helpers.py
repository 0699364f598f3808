"""Shared pieces of the model tests. Imported by spawned TP rank processes too, so this module
never imports transformers (that costs ~10 s per process)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Sequence

import numpy as np
import torch

from statebridge.models import ModelRunner, init_tp_group
from statebridge.net import free_port
from statebridge.state import PageGeometry, StateCache, StateSpec, TransferPlan

#: Prompts of lengths 1 (N-1 prefills nothing), 2, 5, 12 and 21 (> two Mamba2 chunks of 8).
PROMPTS: tuple[tuple[int, ...], ...] = (
    (7,),
    (3, 91),
    (11, 4, 60, 2, 99),
    tuple((i * 37 + 5) % 120 for i in range(12)),
    tuple((i * 53 + 17) % 127 for i in range(21)),
)
NEW_TOKENS = 6
NUM_PAGES = 8
#: KV block size of the hybrid-model tests: PROMPTS and KV_PROMPTS have prompts of 1, 3
#: (block - 1), 4 (block), 5 (block + 1), 12 and 21 (several blocks) tokens, and NEW_TOKENS
#: generated cross block boundaries during decode.
KV_BLOCK = 4
KV_PROMPTS: tuple[tuple[int, ...], ...] = PROMPTS + ((9, 33, 77), (5, 66, 12, 101))


def make_cache(model_dir: str, tp_size: int, layout: str, num_pages: int = NUM_PAGES,
               **spec_kwargs) -> StateCache:
    spec = StateSpec.from_pretrained(model_dir, **spec_kwargs)
    return StateCache(PageGeometry(spec, tp_size, layout), num_pages)


def generate(runner: ModelRunner, prompts: Sequence[Sequence[int]], pages: Sequence[int],
             new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuation the N-1 way: prefill ``p[:-1]`` into the pages, decode ``p[-1]``,
    then decode each generated token."""
    runner.prefill([p[:-1] for p in prompts], pages)
    return decode_from_pages(runner, [p[-1] for p in prompts], pages, new_tokens)


def decode_from_pages(runner: ModelRunner, last_tokens: Sequence[int], pages: Sequence[int],
                      new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy tokens starting with a decode of ``last_tokens`` against state already in pages."""
    out: list[list[int]] = [[] for _ in last_tokens]
    tokens = list(last_tokens)
    for _ in range(new_tokens):
        logits = runner.decode(tokens, pages)
        if not bool(torch.isfinite(logits).all()):
            raise AssertionError(f"non-finite logits at step {len(out[0])}")
        tokens = logits.argmax(-1).tolist()
        for o, t in zip(out, tokens):
            o.append(t)
    return out


def copy_pages(plan: TransferPlan, src: Sequence[StateCache], dst: Sequence[StateCache],
               page_pairs: Sequence[tuple[int, int]]) -> int:
    """Move pages between two in-process TP groups with plain memory copies of the plan's runs;
    returns the bytes copied."""
    copied = 0
    for pair in plan:
        s_buf = src[pair.src_rank].buffer
        d_buf = dst[pair.dst_rank].buffer
        for src_page, dst_page in page_pairs:
            runs = pair.runs_at(src[pair.src_rank].page_offset(src_page),
                                dst[pair.dst_rank].page_offset(dst_page))
            for s_off, d_off, n in runs.tolist():
                d_buf[d_off:d_off + n] = s_buf[s_off:s_off + n]
                copied += n
    return copied


def fill_garbage(cache: StateCache, seed: int) -> None:
    """Random bytes over the whole cache (a stale page must never look like a valid state)."""
    rng = np.random.default_rng(seed)
    cache.buffer.copy_(torch.from_numpy(rng.integers(0, 256, cache.nbytes, dtype=np.uint8)))


# -- TP groups as real processes (gloo over 127.0.0.1) --------------------------------------------

def _tp_rank_main(tp_size: int, tp_rank: int, init_method: str, jobs: list[dict],
                  results: "mp.Queue") -> None:
    try:
        group = init_tp_group(tp_size, tp_rank, init_method, timeout_s=60.0, cpu_threads=1)
        try:
            out = {}
            for job in jobs:
                cache = make_cache(job["model_dir"], tp_size, job["layout"])
                runner = ModelRunner(job["model_dir"], tp_size, tp_rank, cache,
                                     all_reduce=group.all_reduce)
                pages = list(range(NUM_PAGES - 1, NUM_PAGES - 1 - len(job["prompts"]), -1))
                out[job["name"]] = generate(runner, job["prompts"], pages)
            results.put((tp_rank, "ok", out))
        finally:
            group.close()
    except BaseException:  # noqa: BLE001 -- reported to the parent, which fails the test
        results.put((tp_rank, "error", traceback.format_exc()))


def run_tp_processes(tp_size: int, jobs: list[dict], timeout_s: float = 150.0) -> list[dict]:
    """Run ``jobs`` (model_dir, layout, prompts, name) on ``tp_size`` spawned rank processes
    joined by gloo; returns each rank's ``{name: tokens}``. Children are always reaped."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_tp_rank_main, args=(tp_size, r, init_method, jobs, results),
                         name=f"tp{tp_size}-rank{r}", daemon=True) for r in range(tp_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, dict] = {}
    try:
        while len(got) < tp_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"TP={tp_size}: only ranks {sorted(got)} finished within "
                                     f"{timeout_s} s")
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise AssertionError(f"TP={tp_size}: {dead} died without reporting "
                                         f"(exit codes {[p.exitcode for p in procs]})") from None
                continue
            if status != "ok":
                raise AssertionError(f"TP={tp_size} rank {rank} failed:\n{payload}")
            got[rank] = payload
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [got[r] for r in range(tp_size)]
