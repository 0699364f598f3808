"""What the benchmark's two NIXL read loops share (:mod:`statebridge.bench._nixl`, statebridge's
runs, and :mod:`statebridge.bench._vllm_way`, vLLM's descriptors): the slot layout of a cell
(:class:`SlotPlan`), runs with their per-slot strides (:func:`with_strides`), the poll of the
READs in flight (:func:`poll_reads`) and the sources' final notification prefix."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["FINAL_NOTIF", "SlotPlan", "poll_reads", "with_strides"]

#: Prefix of a destination's notification that it finished reading a request (vLLM's way).
FINAL_NOTIF = "F"


def poll_reads(agent, active: dict, calls: dict, done, deadline: float, timeout: float,
               yield_cpu: bool) -> None:
    """One poll of every request in flight (``active``: slot -> (request, post time, handles)):
    ``check_xfer_state`` on each of its handles; a request whose handles are all ``DONE``
    leaves ``active`` and ``done(slot, request, latency in s, handles)`` runs at once (it may
    post the slot's next request). RuntimeError on a failed READ; when nothing finished, past
    ``deadline``; otherwise, when nothing finished and ``yield_cpu``, the CPU is yielded."""
    progressed = False
    for slot, (req, started, handles) in list(active.items()):
        states = [agent.check_xfer_state(h) for h in handles]
        calls["check_xfer_state"] += len(handles)
        if "ERR" in states:
            raise RuntimeError(f"NIXL READ of request {req} failed")
        if all(st == "DONE" for st in states):
            latency = time.perf_counter() - started
            del active[slot]
            progressed = True
            done(slot, req, latency, handles)
    if not progressed:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"NIXL READs not done after {timeout} s ({len(active)} in flight)")
        if yield_cpu:
            os.sched_yield()


def with_strides(runs, src_page: int, dst_page: int) -> np.ndarray:
    """Runs as ``[R, 5]`` (src off, dst off, len, src slot stride, dst slot stride): a plain
    ``[R, 3]`` table moves by one page per slot on both sides; a request's KV runs move by its
    blocks' stride instead (slot ``s`` owns the ``s``-th range of blocks)."""
    runs = np.asarray(runs, dtype=np.int64)
    if runs.shape[1] == 5:
        return runs
    return np.column_stack([runs, np.full(len(runs), src_page, dtype=np.int64),
                            np.full(len(runs), dst_page, dtype=np.int64)])


class SlotPlan:
    """A :class:`~statebridge.state.plan.TransferPlan` plus the KV of ``tokens`` prompt tokens,
    shaped for :meth:`NixlPool.run_cell`: each buffer is ``pages`` recurrent pages followed by a
    KV pool of ``pages x blocks`` blocks; slot ``s`` owns page ``s`` and blocks
    ``[s*blocks, (s+1)*blocks)`` on both sides (contiguous tables), and reads exactly the runs
    statebridge posts for it: the page's runs, then ``KVPairPlan.runs`` of its blocks."""

    def __init__(self, plan, kv_layouts: tuple[str, str], block_size: int, tokens: int,
                 pages: int) -> None:
        from statebridge.state.kv import BlockGeometry, KVPlan, blocks_for

        self.plan, self.src, self.dst, self.pages = plan, plan.src, plan.dst, pages
        spec = plan.spec
        self.blocks = max(1, blocks_for(tokens, block_size))
        pool = pages * self.blocks
        self.kv_src = BlockGeometry(spec.kv, plan.src.tp_size, kv_layouts[0], block_size, pool)
        self.kv_dst = BlockGeometry(spec.kv, plan.dst.tp_size, kv_layouts[1], block_size, pool)
        self.kv = KVPlan(self.kv_src, self.kv_dst)
        self._src_base = _round64(pages * plan.src.page_size)
        self._dst_base = _round64(pages * plan.dst.page_size)
        table = range(self.blocks)
        self._pairs = []
        for d in range(plan.dst.tp_size):
            for s in range(plan.src.tp_size):
                page = plan.pair(s, d)
                kv = self.kv.pair(s, d)
                runs = []
                if page is not None:
                    runs.append(with_strides(page.runs, plan.src.page_size,
                                              plan.dst.page_size))
                if kv is not None:
                    r = kv.runs(table, table)
                    runs.append(np.column_stack([
                        r[:, 0] + self._src_base, r[:, 1] + self._dst_base, r[:, 2],
                        np.full(len(r), self.blocks * kv.src_block_stride, dtype=np.int64),
                        np.full(len(r), self.blocks * kv.dst_block_stride, dtype=np.int64)]))
                if runs:
                    self._pairs.append(_SlotPair(s, d, np.concatenate(runs)))

    def src_bytes(self, pages: int) -> int:
        return self._src_base + self.kv_src.nbytes

    def dst_bytes(self, pages: int) -> int:
        return self._dst_base + self.kv_dst.nbytes

    def __iter__(self):
        return iter(self._pairs)

    def for_destination(self, d: int) -> list:
        return [p for p in self._pairs if p.dst_rank == d]

    @property
    def bytes_per_request(self) -> int:
        return int(sum(p.runs[:, 2].sum() for p in self._pairs))


@dataclass(frozen=True)
class _SlotPair:
    src_rank: int
    dst_rank: int
    runs: np.ndarray


def _round64(n: int) -> int:
    return -(-n // 64) * 64
