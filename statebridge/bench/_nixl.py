"""NIXL (UCX backend) reading the benchmark's runs, in separate source and destination processes.

Each worker process owns one page buffer from
:func:`~statebridge.connector.data.alloc_buffer` (transparent huge pages, like statebridge's
page buffers), written before use so its pages are real, registered with its own NIXL agent.
Destination workers READ: per request, for every source rank they receive from, one transfer
whose descriptors are exactly the plan's runs of that (source, destination) pair, one
descriptor per run. The descriptor lists of every page are
prepared once per cell (``prep_xfer_dlist``) and each request's transfer is made from them by
index (``make_prepped_xfer``), the way vLLM's NixlConnector does; ``reuse_handles`` instead makes
one transfer per (slot, source) once and re-posts it.

Fairness to NIXL on a machine whose cores every process of the benchmark shares: what
:class:`NixlOptions` defaults to, and why (compared with the first cut's settings by
``benchmarks/bench_nixl.py``; docs/measurements.md, "NIXL, measured fairly").

- Page buffers from transparent huge pages (``alloc_buffer``), written before use: a READ here
  is cma (``process_vm_readv``) done by the destination's CPU, and out of 4 KiB pages it costs
  more CPU per byte.
- No NIXL progress thread on the sources: the Python API fixes its delay at 0, so each source
  agent's thread spins most of a core, idle or not. A READ over cma is one-sided; sources
  progress their worker from their command loop (wire-up replies) and otherwise sleep. (The
  first cut also kept each closed agent alive until the next cell, its thread spinning through
  the next cells' statebridge and line-rate measurements; ``close`` now destroys it.)
- One untimed READ per slot before the timed round: the first READ to a peer wires the
  endpoint up, which takes far longer than a READ.
- UCX endpoint error handling off (``ucx_error_handling_mode=none``), as statebridge's ``sm``
  transport. The READs go by cma either way (``UCX_PROTO_INFO=y``: ``remote memory read by
  ucp_get*`` -> ``cma/memory``); NIXL's default ``peer`` moves UCX's active messages (wire-up)
  from shared memory to tcp/lo.
- Destinations poll ``check_xfer_state`` and yield the CPU between polls that completed
  nothing, so several destination processes on 2 cores do not starve each other.

Lifecycle: :class:`NixlPool` (processes) -> :meth:`NixlPool.run_cell` (register -> exchange
metadata -> prepare -> warm-up -> timed READs -> optional byte check -> release) ->
:meth:`NixlPool.close`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from statebridge.bench._nixl_reads import poll_reads, with_strides
from statebridge.bench._pipe_worker import PipeWorker
from statebridge.bench._vllm_way import _serve_notifs, _vllm_read, vllm_groups
from statebridge.errors import ConfigError

__all__ = ["NixlOptions", "NixlPool", "nixl_available", "pattern_block"]

_MODULES = ("nixl_cu12", "nixl")
_WAITS = ("spin", "yield")
#: Prefix of a source's "state final" notification in a paced vLLM-way round.
PATTERN_PERIOD = 4093            # prime: a run read from the wrong offset shows up as a mismatch


def _import_api():
    last = None
    for name in _MODULES:
        try:
            mod = __import__(f"{name}._api", fromlist=["nixl_agent", "nixl_agent_config"])
            return mod.nixl_agent, mod.nixl_agent_config
        except ImportError as e:
            last = e
    raise ImportError(f"no NIXL python module ({', '.join(_MODULES)}): {last}")


def nixl_available() -> str | None:
    """None when NIXL imports; else why not."""
    try:
        _import_api()
    except Exception as e:  # noqa: BLE001 -- reported in the JSON
        return f"{type(e).__name__}: {e}"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class NixlOptions:
    """How the NIXL workers set up and run. The defaults are the fair setting (module docstring).

    - ``error_handling``: UCX endpoint error handling (NIXL's ``ucx_error_handling_mode``
      ``peer``; off is ``none``). On, UCX's active messages (wire-up) take tcp/lo; the READs
      stay on cma.
    - ``huge_pages``: page buffers from transparent huge pages (``alloc_buffer``).
    - ``touch``: write the page buffers before the cell (else the source pages are the kernel's
      zero page and the destination's are faulted in during the timed round).
    - ``progress_thread``: NIXL's progress thread on the source agents (spins a core each).
    - ``wait``: how a destination waits for its READs: ``spin`` or ``yield`` the CPU.
    - ``reuse_handles``: one transfer handle per (slot, source), re-posted per request, instead
      of one ``make_prepped_xfer`` per request.
    - ``warmup``: one untimed request per slot before the timed round (wire-up, page faults).
    """

    error_handling: bool = False
    huge_pages: bool = True
    touch: bool = True
    progress_thread: bool = False
    wait: str = "yield"
    reuse_handles: bool = False
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.wait not in _WAITS:
            raise ConfigError(f"NixlOptions.wait must be one of {_WAITS}, got {self.wait!r}")

    @classmethod
    def first_cut(cls) -> "NixlOptions":
        """The settings of the first benchmark run: NIXL's defaults
        (error handling on, progress thread), 4 KiB pages, spinning destinations, no warm-up."""
        return cls(error_handling=True, huge_pages=False, progress_thread=True, wait="spin",
                   warmup=False)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def pattern_block(seed: int) -> np.ndarray:
    """``PATTERN_PERIOD`` bytes; source ``seed``'s buffer byte ``i`` is ``block[i % period]``."""
    return np.random.default_rng(seed + 1).integers(0, 256, PATTERN_PERIOD, dtype=np.uint8)


def _fill_pattern(view: np.ndarray, seed: int) -> None:
    block = pattern_block(seed)
    chunk = np.resize(block, PATTERN_PERIOD * max(1, (16 << 20) // PATTERN_PERIOD))
    for start in range(0, len(view), len(chunk)):       # chunk is a whole number of periods
        n = min(len(chunk), len(view) - start)
        view[start:start + n] = chunk[:n]


# -- the worker processes -------------------------------------------------------------------------

def _worker_main(conn, role: str, index: int) -> None:
    import logging

    logging.getLogger("NIXL").setLevel(logging.WARNING)
    nixl_agent, nixl_agent_config = _import_api()
    state: dict = {}

    def close() -> None:
        # Drops the last reference to the agent, so NIXL destroys it now (and with it any
        # progress thread) -- not at the next "open", which would leave a thread spinning
        # through the statebridge half of the next benchmark cell.
        agent = state.get("agent")
        if agent is not None:
            for h in state.pop("dlists", []):
                agent.release_dlist_handle(h)
            if "reg" in state:
                agent.deregister_memory(state.pop("reg"))
        del agent
        state.clear()

    def wait_for_command():
        # Without a progress thread a source progresses its UCX worker itself between commands
        # (wire-up replies), sleeping on the pipe in between: a millisecond's latency at most
        # (the poll's timeout), no spinning.
        agent = state.get("agent")
        if role == "src" and agent is not None and not state["options"].progress_thread:
            while not conn.poll(0.001):
                agent.get_new_notifs()
        return conn.recv()

    while True:
        try:
            cmd, kw = wait_for_command()
        except EOFError:
            close()
            return
        try:
            if cmd == "exit":
                close()
                conn.send(("ok", None))
                conn.close()
                os._exit(0)             # the agent is gone; skip torch/UCX interpreter teardown
            if cmd == "open":
                close()
                conn.send(("ok", _open(state, role, nixl_agent, nixl_agent_config, **kw)))
            elif cmd == "peers":
                names = [state["agent"].add_remote_agent(md) for md in kw["metadata"]]
                for name in names:
                    state["agent"].make_connection(name)
                conn.send(("ok", names))
            elif cmd == "read":
                conn.send(("ok", _read(state, **kw)))
            elif cmd == "vllm_read":
                conn.send(("ok", _vllm_read(state, **kw)))
            elif cmd == "serve":
                conn.send(("ok", _serve_notifs(state, **kw)))
            elif cmd == "verify":
                conn.send(("ok", _verify(state, **kw)))
            elif cmd == "close":
                close()
                conn.send(("ok", None))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception as e:  # noqa: BLE001 -- reported to the driver
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _open(state: dict, role: str, nixl_agent, nixl_agent_config, *, name: str, nbytes: int,
          options: dict, seed: int) -> tuple[bytes, int, dict]:
    """A fresh agent and page buffer in ``state``: (agent metadata, buffer address, UCX env)."""
    from statebridge.connector.data import alloc_buffer

    opts = NixlOptions(**options)
    cfg = nixl_agent_config(enable_prog_thread=role == "src" and opts.progress_thread,
                            backends=[])
    state.update(agent=nixl_agent(name, cfg), options=opts, dlists=[])
    state["agent"].create_backend("UCX", {"ucx_error_handling_mode":
                                          "peer" if opts.error_handling else "none"})
    buf = alloc_buffer(nbytes, huge_pages=opts.huge_pages)
    if role == "src" and opts.touch:
        _fill_pattern(buf.numpy(), seed)
    elif role == "dst":
        buf.numpy()[:] = 0          # always faulted in: the READs land in real pages
    state.update(buf=buf, reg=state["agent"].register_memory(buf))
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    return state["agent"].get_agent_metadata(), buf.data_ptr(), env


def _read(state: dict, *, sources: Sequence[tuple[str, int, np.ndarray]], src_page: int,
          dst_page: int, pages: int, requests: int, concurrency: int, start_at: float,
          timeout: float) -> dict:
    """``requests`` READs, ``concurrency`` in flight; slot ``s`` (one request in flight) always
    uses page ``s``, so the pages read are the first ``min(concurrency, pages, requests)``."""
    agent, buf, opts = state["agent"], state["buf"], state["options"]
    dst_ptr = buf.data_ptr()
    prepped = []                              # (remote name, local h, remote h, [idx per page])
    for name, src_ptr, runs in sources:
        r = len(runs)
        page_idx = np.repeat(np.arange(pages, dtype=np.int64), r)
        tiled = np.tile(with_strides(runs, src_page, dst_page), (pages, 1))
        zeros = np.zeros(len(tiled), dtype=np.int64)
        remote = np.column_stack([src_ptr + page_idx * tiled[:, 3] + tiled[:, 0], tiled[:, 2],
                                  zeros])
        local = np.column_stack([dst_ptr + page_idx * tiled[:, 4] + tiled[:, 1], tiled[:, 2],
                                 zeros])
        rh = agent.prep_xfer_dlist(name, remote, "DRAM")
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        state["dlists"] += [rh, lh]
        idx = [np.arange(p * r, (p + 1) * r, dtype=np.int32) for p in range(pages)]
        prepped.append((name, lh, rh, idx))
    slots = min(concurrency, pages, requests)
    reusable: dict[int, list] = {}            # slot -> its handles (reuse_handles)
    calls = {"make_prepped_xfer": 0, "transfer": 0, "check_xfer_state": 0,
             "release_xfer_handle": 0}

    def handles_for(slot: int) -> list:
        if opts.reuse_handles and slot in reusable:
            return reusable[slot]
        hs = [agent.make_prepped_xfer("READ", lh, idx[slot], rh, idx[slot])
              for _, lh, rh, idx in prepped]
        calls["make_prepped_xfer"] += len(hs)
        if opts.reuse_handles:
            reusable[slot] = hs
        return hs

    def release(handles: list) -> None:
        if not opts.reuse_handles:
            for h in handles:
                agent.release_xfer_handle(h)
            calls["release_xfer_handle"] += len(handles)

    def round_(count: int, deadline: float) -> list[float]:
        nxt = 0
        active: dict[int, tuple[int, float, list]] = {}  # slot -> (request, started, handles)
        latencies = [0.0] * count

        def post(slot: int) -> None:
            nonlocal nxt
            handles = handles_for(slot)
            started = time.perf_counter()
            for (name, *_), h in zip(prepped, handles):
                if agent.transfer(h) == "ERR":
                    raise RuntimeError(f"NIXL READ from {name} failed to post")
            calls["transfer"] += len(handles)
            active[slot] = (nxt, started, handles)
            nxt += 1

        for slot in range(min(slots, count)):
            post(slot)

        def done(slot: int, req: int, latency: float, handles: list) -> None:
            latencies[req] = latency
            release(handles)
            if nxt < count:
                post(slot)

        while active:
            poll_reads(agent, active, calls, done, deadline, timeout, opts.wait == "yield")
        return latencies

    try:
        if opts.warmup:
            round_(slots, time.perf_counter() + timeout)
        while time.perf_counter() < start_at:
            time.sleep(min(0.001, max(0.0, start_at - time.perf_counter())))
        for k in calls:
            calls[k] = 0
        t0, c0 = time.perf_counter(), time.process_time()
        latencies = round_(requests, t0 + timeout)
        t1, c1 = time.perf_counter(), time.process_time()
    finally:
        for hs in reusable.values():
            for h in hs:
                agent.release_xfer_handle(h)
        for h in state["dlists"]:
            agent.release_dlist_handle(h)
        state["dlists"] = []
    return {"start": t0, "end": t1, "latencies": latencies, "cpu_seconds": c1 - c0,
            "calls": calls}


def _verify(state: dict, *, sources: Sequence[tuple[int, np.ndarray]], src_page: int,
            dst_page: int, pages: int) -> dict:
    """Compare every run of every page read with the source's pattern: bytes checked, and the
    first mismatching runs."""
    view = state["buf"].numpy()
    checked, bad = 0, []
    for seed, runs in sources:
        block = pattern_block(seed)
        for p in range(pages):
            for src_off, dst_off, length, src_stride, dst_stride in \
                    with_strides(runs, src_page, dst_page):
                start = p * int(src_stride) + int(src_off)
                expect = block[(start + np.arange(length, dtype=np.int64)) % PATTERN_PERIOD]
                at = p * int(dst_stride) + int(dst_off)
                got = view[at:at + int(length)]
                checked += int(length)
                if not np.array_equal(got, expect) and len(bad) < 8:
                    bad.append({"source": seed, "page": p, "run": [int(src_off), int(dst_off),
                                                                   int(length)]})
    return {"bytes": checked, "bad_runs": bad}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker(ctx, role: str, index: int) -> PipeWorker:
    return PipeWorker(ctx, _worker_main, (role, index), f"statebridge-nixl-{role}{index}",
                      "NIXL worker")


class NixlPool:
    """``num_src`` source and ``num_dst`` destination worker processes, reused across cells."""

    def __init__(self, num_src: int, num_dst: int, options: NixlOptions | None = None) -> None:
        self.options = NixlOptions() if options is None else options
        ctx = multiprocessing.get_context("spawn")
        self.src: list[PipeWorker] = []
        self.dst: list[PipeWorker] = []
        try:
            self.src = [_worker(ctx, "src", i) for i in range(num_src)]
            self.dst = [_worker(ctx, "dst", i) for i in range(num_dst)]
        except BaseException:
            self.close()
            raise
        self._serial = 0

    def run_cell(self, plan, *, pages: int, requests: int, concurrency: int,
                 timeout: float = 300.0, verify: bool = False,
                 options: NixlOptions | None = None, vllm: bool = False,
                 paced: bool = False) -> dict:
        """NIXL READ of every pair's runs of ``plan`` (a TransferPlan, or anything shaped like
        one: :class:`~statebridge.bench._nixl_reads.SlotPlan` for state plus KV): GB/s,
        latencies, and with ``verify`` the bytes compared with the sources' pattern
        (``verified_bytes``; a mismatch raises).
        ``options`` overrides the pool's for this cell. ``vllm``: vLLM's NixlConnector's loop
        instead (:mod:`statebridge.bench._vllm_way`: ``_vllm_read`` on the destinations over
        ``vllm_groups``, with notifications, and ``_serve_notifs`` on the sources). ``paced`` (with ``vllm``, one
        request in flight): every source declares each request's state final by a notification
        to its readers, which post only then; adds ``final_to_held_p50_ms`` / ``p99`` (latest
        source's final -> every destination's READs done)."""
        src_tp, dst_tp = plan.src.tp_size, plan.dst.tp_size
        if src_tp > len(self.src) or dst_tp > len(self.dst):
            raise ConfigError(f"plan {src_tp}x{dst_tp} needs more NIXL workers than the pool's "
                              f"{len(self.src)}x{len(self.dst)}")
        for name, value in (("pages", pages), ("requests", requests),
                            ("concurrency", concurrency)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if paced and not (vllm and concurrency == 1):
            raise ConfigError(f"a paced round is vLLM's way with one request in flight, got "
                              f"vllm={vllm}, concurrency={concurrency}")
        opts = self.options if options is None else options
        if verify and not opts.touch:
            raise ConfigError("verify needs the sources' pattern: options.touch is False")
        self._serial += 1
        tag = f"c{self._serial}-{os.getpid()}"
        src_size, dst_size = plan.src.page_size, plan.dst.page_size
        src_bytes = getattr(plan, "src_bytes", lambda n: n * src_size)(pages)
        dst_bytes = getattr(plan, "dst_bytes", lambda n: n * dst_size)(pages)
        options = opts.to_dict()
        opened = []
        try:
            for i in range(src_tp):
                self.src[i].send("open", name=f"{tag}-src{i}", nbytes=src_bytes,
                                 options=options, seed=i)
                opened.append(self.src[i])
            for i in range(dst_tp):
                self.dst[i].send("open", name=f"{tag}-dst{i}", nbytes=dst_bytes,
                                 options=options, seed=0)
                opened.append(self.dst[i])
            src_info = [self.src[i].recv(120) for i in range(src_tp)]
            dst_info = [self.dst[i].recv(120) for i in range(dst_tp)]
            dst_env = [info[2] for info in dst_info]
            for d in range(dst_tp):
                pairs = plan.for_destination(d)
                self.dst[d].call("peers", metadata=[src_info[p.src_rank][0] for p in pairs])
            # Warm-up rounds run before start_at; leave them time (2 s per GB to copy: a cma
            # copy is faster than that).
            warm = 0.3 + (2.0 * min(concurrency, pages, requests) * plan.bytes_per_request / 1e9
                          if opts.warmup else 0.0)
            start_at = time.perf_counter() + warm
            src_cpu0 = [_cpu_seconds(self.src[i].proc.pid) for i in range(src_tp)]
            served = []
            if vllm:
                groups = vllm_groups(plan, pages)
                slots = min(concurrency, pages, requests)
                warm_n = slots if opts.warmup else 0
                serving = [s for s in range(src_tp) if any(k[0] == s for k in groups)]
                names = [f"w{i}" for i in range(warm_n)] + [f"r{i}" for i in range(requests)]
                for s in serving:
                    readers = sorted(d for (ss, d) in groups if ss == s)
                    announce = self.src[s].call("peers", metadata=[
                        dst_info[d][0] for d in readers]) if paced else []
                    self.src[s].send("serve", readers=len(readers),
                                     expect=warm_n + requests, timeout=timeout + warm,
                                     announce=announce, names=names if paced else [])
                for d in range(dst_tp):
                    sources = [(f"{tag}-src{s}", src_info[s][1], g)
                               for (s, dd), g in sorted(groups.items()) if dd == d]
                    self.dst[d].send("vllm_read", sources=sources, dst_tp=dst_tp,
                                     requests=requests, concurrency=slots, start_at=start_at,
                                     timeout=timeout, warmup=warm_n, paced=paced)
            else:
                for d in range(dst_tp):
                    sources = [(f"{tag}-src{p.src_rank}", src_info[p.src_rank][1], p.runs)
                               for p in plan.for_destination(d)]
                    self.dst[d].send("read", sources=sources, src_page=src_size,
                                     dst_page=dst_size, pages=pages, requests=requests,
                                     concurrency=concurrency, start_at=start_at,
                                     timeout=timeout)
            results = [self.dst[d].recv(timeout + warm + 60) for d in range(dst_tp)]
            if vllm:
                served = [self.src[s].recv(timeout + warm + 60) for s in serving]
                if any(x["freed"] != warm_n + requests or x["pending"] for x in served):
                    raise RuntimeError(f"sources freed {[x['freed'] for x in served]} of "
                                       f"{warm_n + requests} requests")
            src_cpu = sum(_cpu_seconds(self.src[i].proc.pid) - src_cpu0[i]
                          for i in range(src_tp))
            busy = time.perf_counter() - start_at + warm
            verified = None
            if verify:
                used = min(concurrency, pages, requests)
                for d in range(dst_tp):
                    self.dst[d].send("verify", sources=[(p.src_rank, p.runs)
                                                        for p in plan.for_destination(d)],
                                     src_page=src_size, dst_page=dst_size, pages=used)
                checks = [self.dst[d].recv(timeout + 60) for d in range(dst_tp)]
                bad = [(d, c["bad_runs"]) for d, c in enumerate(checks) if c["bad_runs"]]
                if bad:
                    raise AssertionError(f"NIXL READ moved wrong bytes (destination rank, "
                                         f"first runs): {bad}")
                verified = sum(c["bytes"] for c in checks)
        finally:
            for w in opened:
                try:
                    w.call("close", timeout=60)
                except RuntimeError:
                    pass
        wall = max(r["end"] for r in results) - min(r["start"] for r in results)
        # Each destination rank runs its own window of ``concurrency`` reads (no join across
        # ranks: a rank starts its next read when its own read of a slot ends); a request's
        # latency is the slowest rank's latency of it.
        lat = np.max(np.array([r["latencies"] for r in results]), axis=0)
        nbytes = requests * plan.bytes_per_request
        calls: dict[str, float] = {}
        for r in results:
            for k, v in r["calls"].items():
                calls[k] = calls.get(k, 0) + v / requests
        if served:
            # the sources' figures cover the warm-up requests too: per request freed
            freed = served[0]["freed"]
            calls["get_new_notifs"] = sum(x["get_new_notifs"] for x in served) / freed
            src_cpu_us = sum(x["cpu_seconds"] for x in served) / freed * 1e6
        else:
            src_cpu_us = src_cpu / requests * 1e6
        dst_cpu_us = sum(r["cpu_seconds"] for r in results) / requests * 1e6
        descriptors = (sum(r["descriptors"] for r in results) / requests if vllm
                       else sum(len(p.runs) for p in plan))
        paced_out = {}
        if paced:
            # state final = the latest source's stamp; held = the last destination's READs done
            final = np.max(np.array([r["finals"] for r in results]), axis=0)
            held = np.max(np.array([r["held"] for r in results]), axis=0) - final
            paced_out = {"final_to_held_p50_ms": float(np.percentile(held, 50) * 1e3),
                         "final_to_held_p99_ms": float(np.percentile(held, 99) * 1e3)}
        return {**paced_out, "gbps": nbytes / wall / 1e9, "seconds": wall,
                "nixl_calls_per_request": sum(calls.values()),
                "nixl_calls_per_request_by_call": calls,
                "cpu_us_per_request": {"nixl_dst": dst_cpu_us, "nixl_src": src_cpu_us,
                                       "total": dst_cpu_us + src_cpu_us},
                "requests_per_s": requests / wall,
                "latency_p50_ms": float(np.percentile(lat, 50) * 1e3),
                "latency_p99_ms": float(np.percentile(lat, 99) * 1e3),
                "descriptors_per_request": descriptors,
                # CPU the workers burnt: destinations over the timed round; sources over the
                # whole read command (warm-up included) as a share of one core.
                "dst_cpu_seconds": sum(r["cpu_seconds"] for r in results),
                "src_cpu_cores": src_cpu / busy if busy > 0 else None,
                "verified_bytes": verified, "options": options,
                "ucx_env": dst_env[0] if dst_env else {}}

    def close(self) -> None:
        for w in self.src + self.dst:
            w.ask_exit()
        for w in self.src + self.dst:
            w.reap()
        self.src, self.dst = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
