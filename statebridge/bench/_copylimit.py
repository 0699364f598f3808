"""The copy limit: a cell's bytes per request copied between cold page buffers of separate
processes by ``os.cpu_count()`` copying processes with ``process_vm_readv``.

Here (one host, no RDMA) every byte statebridge, UCX's cma transport or NIXL moves is one
``process_vm_readv`` copy done by a CPU; ``ucx_perftest`` measures it out of one warm buffer,
the cells move it between many pages. This measures the copy itself the way the cells need it:

- sources: one process per prefill rank, holding ``pages`` pages of the bytes it sends per
  request (:func:`~statebridge.connector.data.alloc_buffer`, transparent huge pages, written),
  like the cells' prefill page buffers;
- copiers: ``os.cpu_count()`` processes, each with its share of ``pages`` destination pages
  (``alloc_buffer``, faulted in once). Copier ``k`` does requests ``k, k + N, ...``; request
  ``i`` reads source page ``i % pages`` into the copier's next destination page in rotation,
  so neither side reuses a warm buffer;
- one iovec per (source rank, destination rank) pair of the plan: each pair's bytes as one
  contiguous range (``process_vm_readv(pid, [dst range], [src range])``, one call per pair per
  request) -- the copy at its best granularity, not per run, so the figure is an upper bound
  for any run layout of the same bytes.

GB/s = requests x bytes per request / (last copier's end - start).

``mechanism="shared_map"`` measures the copy statebridge's same-host shared-map reads do
(:mod:`statebridge.connector.data.shared`): the sources' pages are a memfd
(:class:`~statebridge.connector.data.shared.SharedBuffer`, 4 KiB pages: shared memory gets
no transparent huge pages here), each copier maps it read-only and copies each pair's range
with :func:`~statebridge.connector.data.shared.copy_runs`. Everything else is the same.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import time
from typing import Sequence

__all__ = ["copy_limit"]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                      ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _source_main(conn, nbytes: int, mechanism: str = "cma") -> None:
    from statebridge.connector.data import alloc_buffer
    from statebridge.connector.data.shared import SharedBuffer

    try:                                     # let sibling processes read us (Yama ptrace_scope)
        ctypes.CDLL(None).prctl(0x59616d61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    except Exception:  # noqa: BLE001
        pass
    shared = SharedBuffer(max(1, nbytes)) if mechanism == "shared_map" else None
    buf = shared.tensor if shared is not None else alloc_buffer(max(1, nbytes), huge_pages=True)
    view = buf.numpy()
    view[:] = 7                               # real pages, not the zero page
    conn.send((buf.data_ptr(), shared.fd if shared is not None else -1))
    conn.recv()                               # held until the driver is done


def _copier_main(conn, sources: list, pairs: list, src_page_bytes: list, request_bytes: int,
                 first: int, step: int, requests: int, pages: int, dst_pages: int,
                 mechanism: str = "cma") -> None:
    """``sources``: [(pid, address, memfd)]; ``pairs``: [(src rank, offset in the source
    page, offset in the destination page, bytes)]."""
    import numpy as np

    from statebridge.connector.data import alloc_buffer
    from statebridge.connector.data.shared import PeerMap, copy_runs

    dst = alloc_buffer(max(1, dst_pages * request_bytes), huge_pages=True)
    dst.numpy()[:] = 0
    if mechanism == "shared_map":
        maps = [PeerMap(pid, fd) for pid, _addr, fd in sources]
        row, view = np.zeros((1, 3), dtype=np.int64), dst.numpy()

        def copy(s: int, src: int, at: int, n: int) -> str | None:
            row[0] = (src, at, n)
            copy_runs(view, maps[s], row)
            return None
    else:
        libc, base = _libc(), dst.data_ptr()
        local, remote = _IoVec(), _IoVec()

        def copy(s: int, src: int, at: int, n: int) -> str | None:
            pid, addr, _fd = sources[s]
            remote.base, remote.len = addr + src, n
            local.base, local.len = base + at, n
            got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            return None if got == n else (f"process_vm_readv: {got} of {n} bytes, "
                                          f"errno {ctypes.get_errno()}")
    conn.send(("ready", None))
    start_at = conn.recv()                    # every copier ready: start together
    while time.perf_counter() < start_at:
        time.sleep(0.0005)
    t0, c0 = time.perf_counter(), time.process_time()
    slot = 0
    for i in range(first, requests, step):
        src_page = i % pages
        for s, src_off, dst_off, n in pairs:
            error = copy(s, src_page * src_page_bytes[s] + src_off,
                         slot * request_bytes + dst_off, n)
            if error is not None:
                conn.send(("error", error))
                return
        slot = (slot + 1) % dst_pages
    conn.send(("ok", (t0, time.perf_counter(), time.process_time() - c0)))


def copy_limit(pair_bytes: Sequence[tuple[int, int, int]], *, src_tp: int, requests: int,
               pages: int, copiers: int | None = None, timeout: float = 300.0,
               mechanism: str = "cma") -> dict:
    """``pair_bytes``: [(src rank, dst rank, bytes per request)] of a plan. Returns GB/s over
    ``requests`` requests, the copiers, and their CPU seconds per request. ``mechanism``:
    ``"cma"`` (``process_vm_readv``) or ``"shared_map"`` (see the module docstring)."""
    if mechanism not in ("cma", "shared_map"):
        raise ValueError(f"mechanism must be 'cma' or 'shared_map', got {mechanism!r}")
    copiers = copiers or os.cpu_count() or 1
    pages = max(1, pages)
    ctx = multiprocessing.get_context("spawn")
    src_page = [0] * src_tp
    pairs, dst_off = [], 0
    for s, _d, n in pair_bytes:
        if n > 0:
            pairs.append((s, src_page[s], dst_off, int(n)))
            src_page[s] += int(n)
            dst_off += int(n)
    request_bytes = dst_off
    procs, conns = [], []
    try:
        sources = []
        for s in range(src_tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_source_main, args=(child, pages * src_page[s], mechanism),
                            daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
        for s in range(src_tp):
            if not conns[s].poll(120):
                raise RuntimeError("copy-limit source did not start")
            sources.append((procs[s].pid, *conns[s].recv()))
        dst_pages = max(1, -(-pages // copiers))
        workers = []
        for k in range(copiers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_copier_main, daemon=True, args=(
                child, sources, pairs, src_page, request_bytes, k, copiers, requests, pages,
                dst_pages, mechanism))
            p.start()
            procs.append(p)
            workers.append(parent)
        for w in workers:
            if not w.poll(120) or w.recv()[0] != "ready":
                raise RuntimeError("copy-limit copier did not start")
        start_at = time.perf_counter() + 0.05
        for w in workers:
            w.send(start_at)
        results = []
        for w in workers:
            if not w.poll(timeout + 60):
                raise RuntimeError(f"copy-limit copier silent for {timeout + 60} s")
            status, value = w.recv()
            if status != "ok":
                raise RuntimeError(value)
            results.append(value)
        for c in conns:
            c.send(None)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(2)
    wall = max(r[1] for r in results) - min(r[0] for r in results)
    return {"gbps": requests * request_bytes / wall / 1e9, "seconds": wall,
            "bytes_per_request": request_bytes, "copiers": copiers, "mechanism": mechanism,
            "calls_per_request": len(pairs),
            "cpu_us_per_request": sum(r[2] for r in results) / requests * 1e6}
