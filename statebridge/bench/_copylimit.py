"""The copy limit: the fastest copy of a cell's bytes this machine does, whatever copies them.

Here (one host, no RDMA) every byte statebridge, UCX or NIXL moves between two processes is one
copy done by a CPU: a decode rank's copy out of a map of the prefill rank's memfd (statebridge's
shared-map reads) or a ``process_vm_readv`` (UCX's cma transport, and so NIXL). A limit that a
cell beats is not a limit, so the limit is the best of several ways of copying the same bytes
(:data:`CANDIDATES`), each measured, and the result names the one it came from (its
*yardstick*). A candidate is three choices:

- mechanism: ``shared_map`` -- each copier maps the source's memfd read-only
  (:class:`~statebridge.connector.data.shared.PeerMap`; 4 KiB pages: shared memory gets no
  transparent huge pages here) and copies with the C copy statebridge's shared-map reads use
  (:func:`~statebridge.connector.data.shared.copy_groups`: streaming stores and source prefetch
  for long runs, ``memcpy`` for short ones), one call per (request, source rank); or ``cma`` --
  ``process_vm_readv`` out of transparent huge pages
  (:func:`~statebridge.connector.data.alloc_buffer`), one call per (request, source rank) with
  one iovec per pair;
- copiers: ``per_core`` -- ``os.cpu_count()`` copying processes, copier ``k`` copies every pair
  of requests ``k, k + N, ...``; or ``per_rank`` -- one copier per decode rank, copying that
  rank's pairs of every request into its own pages: the processes of the cell;
- source: ``cold`` -- the first pass of fresh copiers (every map and page touched for the first
  time, as a copy of a new buffer) or ``warm`` -- a second pass in the same copiers (everything
  mapped, the caches as warm as the rotation below leaves them, as in the cell, whose decode
  ranks ran warm-up requests first).

Common to every candidate:

- sources: one process per prefill rank, holding ``pages`` pages of the bytes it sends per
  request, written (real pages, not the zero page); request ``i`` reads source page
  ``i % pages``;
- destinations: each copier's own pages, faulted in before the first pass, rotated per request
  it copies (a ``per_rank`` copier holds ``pages`` pages of its rank's share, a ``per_core``
  copier ``ceil(pages / N)`` whole requests);
- each (source rank, decode rank) pair's bytes as one contiguous range: the copy at its best
  granularity, so the figure is an upper bound for any run layout of the same bytes;
- no control plane and no join across ranks: a copier starts its next request when its own is
  copied.

What a candidate's figure counts. Every copier of a pass starts at one agreed moment;
``wall_gbps`` = requests x bytes per request / (last copier's end - first copier's start). On a
machine shared with other work that figure says how much of the cores the copiers got, not how
fast the cores copy: the cell, measured at another moment with more processes of its own, can
get more of them and beat it. So the figure a candidate is ranked by, ``gbps``, counts the
copy's CPU instead: bytes per CPU-second of the copiers over the pass, times the cores they can
use (``min(copiers, os.cpu_count())``). No process can move the bytes faster than that unless
its copy costs less CPU per byte than the best candidate's -- which would show that candidate
is not the best copy. On an idle machine the two figures agree (``cpu_share``, the copiers' CPU
over what the cores could give them in the pass, is about 1); on a busy one ``gbps`` reads
higher than any wall-clock copy there (a copier that runs while the other waits has the memory
bandwidth to itself), so the limit stays a limit and is tight only on an idle machine.

After each pass every copier compares the last request it copied with its sources' patterns: a
candidate that copied wrong bytes fails instead of setting the limit.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Sequence

from statebridge.bench._pipe_worker import PipeWorker, WorkerGone
from statebridge.errors import ConfigError

__all__ = ["CANDIDATES", "Candidate", "copy_limit"]

MECHANISMS = ("shared_map", "cma")
COPIERS = ("per_core", "per_rank")
SOURCES = ("cold", "warm")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One way of copying a cell's bytes (module docstring); :attr:`name` is how the report
    names it, e.g. ``shared_map/per_rank/warm``."""

    mechanism: str
    copiers: str
    source: str

    def __post_init__(self) -> None:
        for field, value, allowed in (("mechanism", self.mechanism, MECHANISMS),
                                      ("copiers", self.copiers, COPIERS),
                                      ("source", self.source, SOURCES)):
            if value not in allowed:
                raise ConfigError(f"copy-limit candidate {field} must be one of {allowed}, got "
                                  f"{value!r}")

    @property
    def name(self) -> str:
        return f"{self.mechanism}/{self.copiers}/{self.source}"

    @classmethod
    def parse(cls, name: str) -> "Candidate":
        parts = str(name).split("/")
        if len(parts) != 3:
            raise ConfigError(f"copy-limit candidate must be MECHANISM/COPIERS/SOURCE like "
                              f"shared_map/per_rank/warm, got {name!r}")
        return cls(*parts)


#: Every candidate: the limit is the best of them.
CANDIDATES: tuple[Candidate, ...] = tuple(Candidate(m, c, s) for m in MECHANISMS
                                          for c in COPIERS for s in SOURCES)


# -- the worker processes (a source or a copier, one command loop) -------------------------------

class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                      ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _allow_readers() -> None:
    """Let sibling processes read this one (Yama ptrace_scope): ``process_vm_readv`` and
    opening ``/proc/<pid>/fd/<fd>`` both need it."""
    try:
        ctypes.CDLL(None).prctl(0x59616d61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    except Exception:  # noqa: BLE001 -- where it is refused, the copy reports the error
        pass


def _source(state: dict, *, kind: str, nbytes: int, seed: int) -> tuple[int, int, int]:
    """Hold ``nbytes`` of source pages, written with source ``seed``'s pattern
    (:func:`~statebridge.bench._nixl.pattern_block`): a memfd (``kind="memfd"``) or transparent
    huge pages (``"anon"``). Returns (pid, address, memfd or -1)."""
    from statebridge.bench._nixl import _fill_pattern
    from statebridge.connector.data import alloc_buffer
    from statebridge.connector.data.shared import SharedBuffer

    state.clear()
    if kind == "memfd":
        shared = SharedBuffer(max(1, nbytes), "statebridge-copy-limit")
        state["shared"], buf = shared, shared.tensor
    else:
        buf = alloc_buffer(max(1, nbytes), huge_pages=True)
    _fill_pattern(buf.numpy(), seed)          # real pages (not the zero page), checkable
    state["buf"] = buf
    return os.getpid(), buf.data_ptr(), state["shared"].fd if "shared" in state else -1


def _copier(state: dict, *, mechanism: str, sources: list, pairs: list, src_page: list,
            slot_bytes: int, slots: int) -> None:
    """Set up a copier: ``slots`` destination pages of ``slot_bytes`` (faulted in), and per
    source rank the rows it copies per request. ``sources``: [(pid, address, memfd)];
    ``pairs``: [(src rank, offset in the source page, offset in the destination page, bytes)]."""
    import numpy as np

    from statebridge.connector.data import alloc_buffer
    from statebridge.connector.data.shared import PeerMap, copy_groups

    state.clear()
    dst = alloc_buffer(max(1, slots * slot_bytes), huge_pages=True)
    dst.numpy()[:] = 0
    by_src: dict[int, list] = {}
    for s, src_off, dst_off, n in pairs:
        by_src.setdefault(s, []).append((src_off, dst_off, n))
    state.update(dst=dst, slot_bytes=slot_bytes, slots=slots, src_page=src_page, pairs=pairs)
    if mechanism == "shared_map":
        view = dst.numpy()
        maps = {s: PeerMap(sources[s][0], sources[s][2]) for s in by_src}
        rows = {s: np.ascontiguousarray(r, dtype=np.int64) for s, r in by_src.items()}

        def copy(src_base: list, dst_base: int) -> None:
            for s, r in rows.items():
                copy_groups(view, maps[s], ((r, src_base[s], dst_base),))
        state["maps"] = maps
    else:
        libc, base = _libc(), dst.data_ptr()
        iovs = {}
        for s, r in by_src.items():
            local, remote = (_IoVec * len(r))(), (_IoVec * len(r))()
            for j, (_src_off, _dst_off, n) in enumerate(r):
                local[j].len = remote[j].len = n
            iovs[s] = (local, remote, r, sum(n for *_, n in r))

        def copy(src_base: list, dst_base: int) -> None:
            for s, (local, remote, r, total) in iovs.items():
                pid, addr, _fd = sources[s]
                for j, (src_off, dst_off, _n) in enumerate(r):
                    remote[j].base = addr + src_base[s] + src_off
                    local[j].base = base + dst_base + dst_off
                got = libc.process_vm_readv(pid, local, len(r), remote, len(r), 0)
                if got != total:
                    raise OSError(ctypes.get_errno(), f"process_vm_readv from pid {pid}: {got} "
                                                      f"of {total} bytes")
    state["copy"] = copy


def _pass(state: dict, *, first: int, step: int, requests: int, pages: int,
          start_at: float) -> tuple[float, float, float]:
    """Copy requests ``first, first + step, ...`` below ``requests``, starting at ``start_at``
    (``time.perf_counter``, one clock for the machine's processes): (start, end, CPU s)."""
    copy, slot_bytes, slots = state["copy"], state["slot_bytes"], state["slots"]
    src_page = state["src_page"]
    while time.perf_counter() < start_at:
        time.sleep(min(0.0005, max(0.0, start_at - time.perf_counter())))
    t0, c0 = time.perf_counter(), time.process_time()
    slot = 0
    for i in range(first, requests, step):
        page = i % pages
        copy([page * n for n in src_page], slot * slot_bytes)
        state["last"] = (page, slot)
        slot = (slot + 1) % slots
    return t0, time.perf_counter(), time.process_time() - c0


def _verify(state: dict) -> tuple[int, list]:
    """Compare the last request this copier copied with its sources' patterns: (bytes checked,
    the first pairs that differ as (src rank, src offset, dst offset, bytes))."""
    import numpy as np

    from statebridge.bench._nixl import PATTERN_PERIOD, pattern_block

    if "last" not in state:
        return 0, []
    page, slot = state["last"]
    view, checked, bad = state["dst"].numpy(), 0, []
    for s, src_off, dst_off, n in state["pairs"]:
        start = page * state["src_page"][s] + src_off
        expect = pattern_block(s)[(start + np.arange(n, dtype=np.int64)) % PATTERN_PERIOD]
        at = slot * state["slot_bytes"] + dst_off
        checked += n
        if not np.array_equal(view[at:at + n], expect) and len(bad) < 4:
            bad.append((s, src_off, dst_off, n))
    return checked, bad


def _worker_main(conn) -> None:
    _allow_readers()
    state: dict = {}
    commands = {"source": _source, "copier": _copier, "pass": _pass, "verify": _verify}
    while True:
        try:
            cmd, kw = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            conn.send(("ok", None))
            return
        try:
            if cmd == "free":
                state.clear()
                conn.send(("ok", None))
            else:
                conn.send(("ok", commands[cmd](state, **kw)))
        except Exception as e:  # noqa: BLE001 -- reported to the driver
            state.clear()
            conn.send(("error", f"{type(e).__name__}: {e}"[:300]))


def _gather(workers: Sequence[PipeWorker], timeout: float) -> list:
    """Every worker's answer to the command each was sent (all read, so none is left behind
    for the next command); RuntimeError naming the failures, :class:`WorkerGone` at once."""
    values, errors = [], []
    for w in workers:
        try:
            values.append(w.recv(timeout))
        except WorkerGone:
            raise
        except RuntimeError as e:
            errors.append(str(e))
    if errors:
        raise RuntimeError("; ".join(errors))
    return values


def _worker(ctx, name: str) -> PipeWorker:
    return PipeWorker(ctx, _worker_main, (), name, "copy-limit worker")


# -- the driver ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Job:
    """What one copier does in a pass."""

    pairs: list                # [(src rank, src offset, dst offset, bytes)]
    slot_bytes: int
    slots: int
    first: int
    step: int
    bytes_per_request: int     # of all copiers of the pass together


def _jobs(copiers: str, pair_bytes: list, src_page: list, pages: int, per_core: int) -> list:
    """The copiers' jobs of an arrangement (module docstring). ``pair_bytes``: [(src rank, dst
    rank, offset in the source page, bytes)]."""
    total = sum(n for *_, n in pair_bytes)
    if copiers == "per_core":
        pairs, at = [], 0
        for s, _d, src_off, n in pair_bytes:
            pairs.append((s, src_off, at, n))
            at += n
        slots = max(1, -(-pages // per_core))
        return [_Job(pairs, total, slots, k, per_core, total) for k in range(per_core)]
    jobs = []
    for d in sorted({d for _s, d, *_ in pair_bytes}):
        pairs, at = [], 0
        for s, dd, src_off, n in pair_bytes:
            if dd == d:
                pairs.append((s, src_off, at, n))
                at += n
        jobs.append(_Job(pairs, at, pages, 0, 1, total))
    return jobs


def copy_limit(pair_bytes: Sequence[tuple[int, int, int]], *, src_tp: int, requests: int,
               pages: int, copiers: int | None = None, timeout: float = 300.0,
               candidates: Sequence[Candidate | str] = CANDIDATES) -> dict:
    """The copy limit of a plan's bytes. ``pair_bytes``: [(src rank, dst rank, bytes per
    request)]; ``pages``: source pages per prefill rank (and destination pages per decode rank);
    ``copiers``: the ``per_core`` copiers (default ``os.cpu_count()``).

    Returns ``gbps`` (the best candidate's, by its CPU: module docstring), ``yardstick`` (its
    name), its ``wall_gbps``, ``cpu_share``, ``copiers``, ``cpu_us_per_request`` and
    ``seconds``, ``bytes_per_request``, and ``candidates``: name -> ``{"gbps", "wall_gbps",
    "cpu_share", "seconds", "copiers", "cpu_us_per_request"}``, or ``{"gbps": None, "error"}``
    for one that failed. RuntimeError when every candidate failed."""
    chosen = [c if isinstance(c, Candidate) else Candidate.parse(c) for c in candidates]
    if not chosen:
        raise ConfigError("copy_limit needs at least one candidate")
    for name, value in (("src_tp", src_tp), ("requests", requests), ("pages", pages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    per_core = copiers or os.cpu_count() or 1
    src_page = [0] * src_tp
    laid = []                                   # (src rank, dst rank, offset in src page, bytes)
    for s, d, n in pair_bytes:
        if not 0 <= s < src_tp:
            raise ConfigError(f"source rank {s} outside src_tp {src_tp}")
        if n > 0:
            laid.append((s, d, src_page[s], int(n)))
            src_page[s] += int(n)
    if not laid:
        raise ConfigError(f"no bytes to copy in {list(pair_bytes)!r}")
    request_bytes = sum(n for *_, n in laid)
    dst_tp = len({d for _s, d, *_ in laid})
    results: dict[str, dict] = {}
    ctx = multiprocessing.get_context("spawn")
    workers: list[PipeWorker] = []
    try:
        sources = [_worker(ctx, f"statebridge-copy-src{s}") for s in range(src_tp)]
        workers += sources
        copy_workers = [_worker(ctx, f"statebridge-copier{k}")
                        for k in range(max(per_core, dst_tp))]
        workers += copy_workers
        for mechanism in MECHANISMS:
            mine = [c for c in chosen if c.mechanism == mechanism]
            if not mine:
                continue
            try:
                kind = "memfd" if mechanism == "shared_map" else "anon"
                for s, w in enumerate(sources):
                    w.send("source", kind=kind, nbytes=pages * src_page[s], seed=s)
                located = _gather(sources, 120)
                for arrangement in COPIERS:
                    passes = [c for c in mine if c.copiers == arrangement]
                    if passes:
                        results.update(_measure(passes, copy_workers, located, laid, src_page,
                                                pages, per_core, requests, timeout))
                for w in sources:
                    w.send("free")
                _gather(sources, 120)
            except WorkerGone as e:                # no worker can be trusted any more
                for c in chosen:
                    results.setdefault(c.name, {"gbps": None, "error": str(e)[:300]})
                break
            except RuntimeError as e:           # recorded per candidate
                for c in mine:
                    results.setdefault(c.name, {"gbps": None, "error": str(e)[:300]})
    finally:
        for w in workers:
            w.close()
    ok = {name: r for name, r in results.items() if r.get("gbps")}
    if not ok:
        raise RuntimeError("every copy-limit candidate failed: " + "; ".join(
            f"{name}: {r.get('error')}" for name, r in results.items()))
    best = max(ok, key=lambda name: ok[name]["gbps"])
    return {**ok[best], "yardstick": best, "bytes_per_request": request_bytes,
            "candidates": results}


def _figures(spans: list, copiers: int, requests: int, bytes_per_request: int) -> dict:
    """A pass's figures from each copier's (start, end, CPU seconds): ``gbps`` by the copy's
    CPU (module docstring), ``wall_gbps`` by the clock, ``cpu_share``, ``seconds`` (wall),
    ``copiers``, ``cpu_us_per_request``."""
    nbytes = requests * bytes_per_request
    wall = max(r[1] for r in spans) - min(r[0] for r in spans)
    cpu = sum(r[2] for r in spans)
    usable = min(copiers, os.cpu_count() or 1)
    wall_gbps = nbytes / wall / 1e9
    return {"gbps": nbytes * usable / cpu / 1e9 if cpu > 0 else wall_gbps,
            "wall_gbps": wall_gbps, "cpu_share": cpu / (usable * wall), "seconds": wall,
            "copiers": copiers, "cpu_us_per_request": cpu / requests * 1e6}


def _measure(passes: list[Candidate], workers: list[PipeWorker], sources: list, laid: list,
             src_page: list, pages: int, per_core: int, requests: int,
             timeout: float) -> dict[str, dict]:
    """One arrangement of one mechanism: set its copiers up, then the cold pass, then the warm
    pass (run when asked for; the cold pass always runs, it warms); name -> figures or error.
    :class:`WorkerGone` when a worker did not answer."""
    mechanism, arrangement = passes[0].mechanism, passes[0].copiers
    jobs = _jobs(arrangement, laid, src_page, pages, per_core)
    used = workers[:len(jobs)]
    out: dict[str, dict] = {}
    try:
        for w, job in zip(used, jobs):
            w.send("copier", mechanism=mechanism, sources=sources, pairs=job.pairs,
                   src_page=src_page, slot_bytes=job.slot_bytes, slots=job.slots)
        _gather(used, 120)
        for source in SOURCES:                  # cold first: fresh maps and pages
            candidate = Candidate(mechanism, arrangement, source)
            if source == "warm" and candidate not in passes:
                break
            start_at = time.perf_counter() + 0.05
            for w, job in zip(used, jobs):
                w.send("pass", first=job.first, step=job.step, requests=requests, pages=pages,
                       start_at=start_at)
            spans = _gather(used, timeout + 60)
            for w in used:
                w.send("verify")
            bad = [(k, v[1]) for k, v in enumerate(_gather(used, 120)) if v[1]]
            if bad:
                raise RuntimeError(f"{candidate.name} copied wrong bytes (copier, first pairs "
                                   f"(src rank, src offset, dst offset, bytes)): {bad}")
            if candidate not in passes:
                continue
            out[candidate.name] = _figures(spans, len(jobs), requests,
                                           jobs[0].bytes_per_request)
    except WorkerGone:
        raise
    except RuntimeError as e:                   # recorded per candidate
        for c in passes:
            out.setdefault(c.name, {"gbps": None, "error": str(e)[:300]})
    for w in used:
        w.send("free")
    _gather(used, 120)
    return out
