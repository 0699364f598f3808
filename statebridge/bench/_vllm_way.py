"""vLLM's way, replayed in the benchmark's NIXL worker processes (:mod:`statebridge.bench._nixl`):
the pull loop of vLLM's NixlConnector from Python. Descriptors as vLLM builds them (pages
``LDS``, KV ``LH``, one per region per block, prepared once), per request one prepped READ per
source rank with a notification, ``check_xfer_state`` on every handle in flight, and the
sources freeing a request once every destination rank reading from it has notified."""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np

from statebridge.bench._nixl_reads import FINAL_NOTIF, SlotPlan, poll_reads, with_strides
from statebridge.errors import ConfigError

__all__ = ["vllm_descriptors_per_request", "vllm_groups"]


def _prep_groups(agent, name: str, ptr: int, groups, local: bool):
    """One prepped descriptor list of every group's regions x blocks, region-major within a
    group (``desc id = group base + region * num_blocks + block``, vLLM's numbering)."""
    rows, bases, base = [], [], 0
    for runs, num_blocks, _ in groups:
        runs = np.asarray(runs, dtype=np.int64)
        off, stride = (runs[:, 1], runs[:, 4]) if local else (runs[:, 0], runs[:, 3])
        blocks = np.arange(num_blocks, dtype=np.int64)
        addr = ptr + off[:, None] + blocks[None, :] * stride[:, None]
        lens = np.repeat(runs[:, 2], num_blocks)
        rows.append(np.column_stack([addr.ravel(), lens, np.zeros(len(lens), dtype=np.int64)]))
        bases.append(base)
        base += len(runs) * num_blocks
    return agent.prep_xfer_dlist("NIXL_INIT_AGENT" if local else name, np.concatenate(rows),
                                 "DRAM"), bases


def _vllm_read(state: dict, *, sources, dst_tp: int, requests: int, concurrency: int,
               start_at: float, timeout: float, warmup: int, paced: bool = False) -> dict:
    """vLLM's NixlConnector's pull loop on one decode worker. Per request: block ids ->
    descriptor ids by numpy (``region * num_blocks + block`` per group, for the local and the
    remote side), one ``make_prepped_xfer("READ", ..., notif_msg="<req>:<dst tp>")`` + ``transfer``
    per source rank; every step ``check_xfer_state`` on every in-flight handle, and
    ``release_xfer_handle`` when done. ``sources``: ``[(agent name, buffer address, groups)]``,
    a group ``(runs [R, 5] at block 0 with strides, num_blocks, blocks per request)``; slot
    ``s`` owns blocks ``[s * bpr, (s + 1) * bpr)`` of every group.

    ``paced`` (one request in flight): a request is posted only once every source announced
    its state final (:func:`_serve_notifs` with ``announce``); per request the latest source
    stamp (``finals``) and the moment this worker's READs were done (``held``), both
    ``time.monotonic()`` -- one clock for the machine's processes."""
    agent, buf = state["agent"], state["buf"]
    dst_ptr = buf.data_ptr()
    prepped = []                    # (name, local h, remote h, [(region ids, num_blocks, bpr, base)])
    for name, src_ptr, groups in sources:
        rh, rbases = _prep_groups(agent, name, src_ptr, groups, local=False)
        lh, lbases = _prep_groups(agent, name, dst_ptr, groups, local=True)
        state["dlists"] += [rh, lh]
        meta = [(np.arange(len(runs), dtype=np.int64), nb, bpr, lb, rb)
                for (runs, nb, bpr), lb, rb in zip(groups, lbases, rbases)]
        prepped.append((name, lh, rh, meta))
    slots = concurrency
    calls = {"make_prepped_xfer": 0, "transfer": 0, "check_xfer_state": 0,
             "release_xfer_handle": 0}
    descriptors = [0]

    def ids(meta, slot: int, local: bool) -> np.ndarray:
        # vLLM's per-request block-id math: for every region, the request's block ids
        out = []
        for regions, nb, bpr, lbase, rbase in meta:
            block_ids = slot * bpr + np.arange(bpr, dtype=np.int64)
            out.append(((lbase if local else rbase) + regions[:, None] * nb
                        + block_ids[None, :]).ravel())
        return np.concatenate(out).astype(np.int32)

    announced: dict[str, list[float]] = {}
    finals: list[float] = []
    held: list[float] = []

    def wait_final(name: str, deadline: float) -> float:
        # The state-final announcements of request ``name`` from every source, polled the way
        # a vLLM worker polls its notifications (every step; here without sleeping).
        while len(announced.get(name, ())) < len(prepped):
            got = False
            for msgs in agent.get_new_notifs().values():
                for msg in msgs:
                    req, _, stamp = msg.decode()[len(FINAL_NOTIF):].rpartition(":")
                    announced.setdefault(req, []).append(float(stamp))
                    got = True
            if not got:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"no state-final announcement of {name!r} from "
                                       f"{len(prepped) - len(announced.get(name, ()))} of "
                                       f"{len(prepped)} sources after {timeout} s")
                os.sched_yield()
        return max(announced.pop(name))

    def round_(count: int, prefix: str, deadline: float) -> list[float]:
        nxt = 0
        active: dict[int, tuple[int, float, list]] = {}
        latencies = [0.0] * count
        if paced:
            finals[:] = [0.0] * count
            held[:] = [0.0] * count

        def post(slot: int) -> None:
            nonlocal nxt
            if paced:
                finals[nxt] = wait_final(f"{prefix}{nxt}", deadline)
            started = time.perf_counter()
            notif = f"{prefix}{nxt}:{dst_tp}".encode()
            handles = []
            for name, lh, rh, meta in prepped:
                local_idx, remote_idx = ids(meta, slot, True), ids(meta, slot, False)
                h = agent.make_prepped_xfer("READ", lh, local_idx, rh, remote_idx,
                                            notif_msg=notif)
                if agent.transfer(h) == "ERR":
                    raise RuntimeError(f"NIXL READ from {name} failed to post")
                descriptors[0] += len(local_idx)
                handles.append(h)
            calls["make_prepped_xfer"] += len(handles)
            calls["transfer"] += len(handles)
            active[slot] = (nxt, started, handles)
            nxt += 1

        def done(slot: int, req: int, latency: float, handles: list) -> None:
            latencies[req] = latency
            if paced:
                held[req] = time.monotonic()
            for h in handles:
                agent.release_xfer_handle(h)
            calls["release_xfer_handle"] += len(handles)

        while active or nxt < count:
            # one engine step: start what has room, then poll every in-flight handle
            for slot in range(slots):
                if slot not in active and nxt < count:
                    post(slot)
            poll_reads(agent, active, calls, done, deadline, timeout, True)
        return latencies

    try:
        if warmup:
            round_(warmup, "w", time.perf_counter() + timeout)
        # (paced: the sources' announcements pace the round; waiting here would count as
        # latency of its first request)
        while not paced and time.perf_counter() < start_at:
            time.sleep(min(0.001, max(0.0, start_at - time.perf_counter())))
        for k in calls:
            calls[k] = 0
        descriptors[0] = 0
        t0, c0 = time.perf_counter(), time.process_time()
        latencies = round_(requests, "r", t0 + timeout)
        t1, c1 = time.perf_counter(), time.process_time()
    finally:
        for h in state["dlists"]:
            agent.release_dlist_handle(h)
        state["dlists"] = []
    return {"start": t0, "end": t1, "latencies": latencies, "cpu_seconds": c1 - c0,
            "calls": calls, "descriptors": descriptors[0], "finals": list(finals),
            "held": list(held)}


def _serve_notifs(state: dict, *, readers: int, expect: int, timeout: float,
                  step_s: float = 0.001, announce: Sequence[str] = (),
                  names: Sequence[str] = ()) -> dict:
    """vLLM's prefill worker: every step ``get_new_notifs``; a request (notif
    ``"<req>:<dst tp>"``) is freed when ``readers`` decode ranks have notified it. Returns when
    ``expect`` requests are freed: CPU seconds, calls, freed.

    ``announce`` (decode agents' names) paces a one-in-flight round: request ``names[k]``'s
    state is declared final (``time.monotonic()``) by a notification ``F<name>:<stamp>`` to
    each of them once request ``k - 1`` is freed -- the cheapest way a decode worker can learn
    that a prefill is done (vLLM's own path is a proxy round trip and a scheduler step)."""
    agent = state["agent"]
    counts: dict[str, int] = {}
    freed, calls, polls_empty = 0, 0, 0
    c0 = time.process_time()
    deadline = time.perf_counter() + timeout

    def declare_final(k: int) -> None:
        msg = f"{FINAL_NOTIF}{names[k]}:{time.monotonic()!r}".encode()
        for dst in announce:
            agent.send_notif(dst, msg)

    if announce:
        if len(names) != expect:
            raise ConfigError(f"{len(names)} request names to announce for {expect} requests")
        declare_final(0)
    while freed < expect:
        notifs = agent.get_new_notifs()
        calls += 1
        got = False
        for msgs in notifs.values():
            for msg in msgs:
                got = True
                req, _, _tp = msg.decode().rpartition(":")
                n = counts.get(req, 0) + 1
                if n == readers:
                    counts.pop(req, None)
                    freed += 1
                    if announce and freed < expect:
                        declare_final(freed)
                else:
                    counts[req] = n
        if not got:
            polls_empty += 1
            if time.perf_counter() > deadline:
                raise RuntimeError(f"source freed {freed} of {expect} requests in {timeout} s")
            time.sleep(step_s)          # the next engine step
    return {"cpu_seconds": time.process_time() - c0, "get_new_notifs": calls,
            "freed": freed, "pending": len(counts)}


def vllm_groups(plan, pages: int) -> dict[tuple[int, int], list]:
    """vLLM's descriptors of ``plan`` (a TransferPlan of ``LDS`` pages, or a :class:`SlotPlan`
    of them with ``LH`` KV) per (source rank, destination rank): groups ``(runs [R, 5] at block
    0 with strides, num_blocks, blocks per request)``. Pages: one region per run of the page
    (per layer per conv x/B/C piece and SSM slice), ``pages`` blocks, one per request; KV: one
    region per run of one block (per layer per K or V half), ``pages x blocks`` blocks, the
    request's ``blocks`` of them -- one descriptor per region per block, never coalesced
    (vLLM builds one per (region, block))."""
    base = plan.plan if isinstance(plan, SlotPlan) else plan
    out = {}
    for d in range(base.dst.tp_size):
        for s in range(base.src.tp_size):
            groups = []
            page = base.pair(s, d)
            if page is not None:
                groups.append((with_strides(page.runs, base.src.page_size, base.dst.page_size),
                               pages, 1))
            if isinstance(plan, SlotPlan):
                kv = plan.kv.pair(s, d)
                if kv is not None:
                    r = np.asarray(kv.block_runs, dtype=np.int64)
                    groups.append((np.column_stack([
                        r[:, 0] + plan._src_base, r[:, 1] + plan._dst_base, r[:, 2],
                        np.full(len(r), kv.src_block_stride, dtype=np.int64),
                        np.full(len(r), kv.dst_block_stride, dtype=np.int64)]),
                        pages * plan.blocks, plan.blocks))
            if groups:
                out[s, d] = groups
    return out


def vllm_descriptors_per_request(plan, pages: int = 1) -> int:
    """Descriptors vLLM's way reads per request over all rank pairs: regions x blocks."""
    return sum(len(runs) * bpr for groups in vllm_groups(plan, pages).values()
               for runs, _, bpr in groups)
