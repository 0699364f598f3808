"""Copy mechanisms between processes on this machine: the cross-memory-attach read that UCX's cma
transport and NIXL use (``process_vm_readv``) against a plain copy out of a shared mapping of
the source buffer (a memfd the reader maps read-only), with 1 and 2 readers.

A source process holds a 256 MiB buffer (written, so it is resident); each reader copies runs of
``--run`` bytes from scattered offsets into its own written buffer for ``--seconds``.

    python benchmarks/bench_copy.py --run 3145728 262144 --repeats 2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import time

import numpy as np

SRC_BYTES = 256 << 20
DST_BYTES = 64 << 20


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _source(q, stop) -> None:
    anon = np.zeros(SRC_BYTES, np.uint8)        # numpy: transparent huge pages where allowed
    anon[:] = 7
    fd = os.memfd_create("bench-copy")
    os.ftruncate(fd, SRC_BYTES)
    shared = np.frombuffer(mmap.mmap(fd, SRC_BYTES), np.uint8)
    shared[:] = 9
    q.put((os.getpid(), anon.ctypes.data, fd))
    stop.wait()


def _reader(pid: int, addr: int, fd: int, mode: str, run: int, seconds: float, out) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    dst = np.zeros(DST_BYTES, np.uint8)
    dst[:] = 1
    src = None
    if mode == "shared-map":
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
        src = np.frombuffer(mmap.mmap(f, SRC_BYTES, prot=mmap.PROT_READ), np.uint8)
    local, remote = _Iovec(), _Iovec()
    runs, slots = SRC_BYTES // run, DST_BYTES // run
    moved, i = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        s, d = (i * 7919 % runs) * run, (i % slots) * run
        if src is None:
            local.base, local.len = dst.ctypes.data + d, run
            remote.base, remote.len = addr + s, run
            got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got != run:
                raise OSError(ctypes.get_errno(), "process_vm_readv")
        else:
            np.copyto(dst[d:d + run], src[s:s + run])
        moved += run
        i += 1
    out.put(moved / (time.perf_counter() - start) / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=int, nargs="+", default=[3 << 20, 256 << 10])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    ctx = mp.get_context("fork")
    q, stop = ctx.Queue(), ctx.Event()
    source = ctx.Process(target=_source, args=(q, stop))
    source.start()
    pid, addr, fd = q.get(timeout=60)
    rows = []
    try:
        for rep in range(a.repeats):
            for run in a.run:
                for mode in ("process_vm_readv", "shared-map"):
                    for readers in (1, 2):
                        out = ctx.Queue()
                        procs = [ctx.Process(target=_reader,
                                             args=(pid, addr, fd, mode, run, a.seconds, out))
                                 for _ in range(readers)]
                        for p in procs:
                            p.start()
                        gbps = sum(out.get(timeout=a.seconds + 60) for _ in procs)
                        for p in procs:
                            p.join()
                        rows.append({"repeat": rep, "run_bytes": run, "mode": mode,
                                     "readers": readers, "gbps": gbps})
                        print(f"{mode:16s} run {run >> 10:5d} KiB, {readers} reader(s): "
                              f"{gbps:6.2f} GB/s", flush=True)
    finally:
        stop.set()
        source.join()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cores": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
