"""NIXL (UCX backend) reading the benchmark's runs, in separate source and destination processes.

Each worker process owns one page buffer (``torch.zeros``, like
:class:`~statebridge.state.cache.StateCache`) registered with its own NIXL agent. Destination
workers READ: per request, for every source rank they receive from, one transfer whose
descriptors are exactly the plan's runs of that (source, destination) pair, one descriptor per
run -- prepared once per page (``prep_xfer_dlist``) and posted by index per request
(``make_prepped_xfer``), the way vLLM's NixlConnector does. Sources run NIXL's progress thread
(UCX wire-up needs the target to progress); destinations poll without one.

Lifecycle: :class:`NixlPool` (processes) -> :meth:`NixlPool.run_cell` (register -> exchange
metadata -> read -> release) -> :meth:`NixlPool.close`.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Sequence

import numpy as np

__all__ = ["NixlPool", "nixl_available"]

_MODULES = ("nixl_cu12", "nixl")


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


def _worker_main(conn, role: str, index: int) -> None:
    import logging
    import torch

    logging.getLogger("NIXL").setLevel(logging.WARNING)
    nixl_agent, nixl_agent_config = _import_api()
    state: dict = {}

    def close() -> None:
        agent = state.pop("agent", None)
        for h in state.pop("dlists", []):
            agent.release_dlist_handle(h)
        if agent is not None and "reg" in state:
            agent.deregister_memory(state.pop("reg"))
        state.clear()

    while True:
        try:
            cmd, kw = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "exit":
                close()
                conn.send(("ok", None))
                return
            if cmd == "open":
                close()
                cfg = nixl_agent_config(enable_prog_thread=(role == "src"), backends=["UCX"])
                agent = nixl_agent(kw["name"], cfg)
                buf = torch.zeros(kw["nbytes"], dtype=torch.uint8)
                buf.numpy()[:] = 1 if role == "src" else 0      # real pages, like a filled cache
                state.update(agent=agent, buf=buf, reg=agent.register_memory(buf), dlists=[])
                conn.send(("ok", (agent.get_agent_metadata(), buf.data_ptr())))
            elif cmd == "peers":
                names = [state["agent"].add_remote_agent(md) for md in kw["metadata"]]
                for name in names:
                    state["agent"].make_connection(name)
                conn.send(("ok", names))
            elif cmd == "read":
                conn.send(("ok", _read(state, **kw)))
            elif cmd == "close":
                close()
                conn.send(("ok", None))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception as e:  # noqa: BLE001 -- reported to the driver
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _read(state: dict, *, sources: Sequence[tuple[str, int, np.ndarray]], src_page: int,
          dst_page: int, pages: int, requests: int, concurrency: int, start_at: float,
          timeout: float) -> dict:
    """``requests`` READs, ``concurrency`` in flight; request i uses page ``i % pages``."""
    agent, buf = state["agent"], state["buf"]
    dst_ptr = buf.data_ptr()
    prepped = []                                          # (remote name, local h, remote h, R)
    for name, src_ptr, runs in sources:
        r = len(runs)
        page_idx = np.repeat(np.arange(pages, dtype=np.int64), r)
        tiled = np.tile(runs, (pages, 1))
        zeros = np.zeros(len(tiled), dtype=np.int64)
        remote = np.column_stack([src_ptr + page_idx * src_page + tiled[:, 0], tiled[:, 2], zeros])
        local = np.column_stack([dst_ptr + page_idx * dst_page + tiled[:, 1], tiled[:, 2], zeros])
        rh = agent.prep_xfer_dlist(name, remote, "DRAM")
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        state["dlists"] += [rh, lh]
        prepped.append((name, lh, rh, r))
    slots = min(concurrency, pages, requests)
    nxt = 0
    active: dict[int, tuple[int, float, list]] = {}      # slot -> (request, started, handles)
    latencies = []

    def post(slot: int) -> None:
        nonlocal nxt
        handles = []
        for name, lh, rh, r in prepped:
            idx = list(range(slot * r, (slot + 1) * r))
            h = agent.make_prepped_xfer("READ", lh, idx, rh, idx)
            if agent.transfer(h) == "ERR":
                raise RuntimeError(f"NIXL READ from {name} failed to post")
            handles.append(h)
        active[slot] = (nxt, time.perf_counter(), handles)
        nxt += 1

    while time.perf_counter() < start_at:
        pass
    t0 = time.perf_counter()
    for slot in range(slots):
        post(slot)
    while active:
        for slot, (req, started, handles) in list(active.items()):
            states = [agent.check_xfer_state(h) for h in handles]
            if "ERR" in states:
                raise RuntimeError(f"NIXL READ of request {req} failed")
            if all(s == "DONE" for s in states):
                latencies.append(time.perf_counter() - started)
                for h in handles:
                    agent.release_xfer_handle(h)
                del active[slot]
                if nxt < requests:
                    post(slot)
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"NIXL READs not done after {timeout} s")
    t1 = time.perf_counter()
    for h in state["dlists"]:
        agent.release_dlist_handle(h)
    state["dlists"] = []
    return {"start": t0, "end": t1, "latencies": latencies}


class _Worker:
    def __init__(self, ctx, role: str, index: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, role, index), daemon=True,
                                name=f"statebridge-nixl-{role}{index}")
        self.proc.start()

    def send(self, cmd: str, **kw) -> None:
        self.conn.send((cmd, kw))

    def recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"NIXL worker {self.proc.name} silent for {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"NIXL worker {self.proc.name}: {value}")
        return value

    def call(self, cmd: str, timeout: float = 120.0, **kw):
        self.send(cmd, **kw)
        return self.recv(timeout)


class NixlPool:
    """``num_src`` source and ``num_dst`` destination worker processes, reused across cells."""

    def __init__(self, num_src: int, num_dst: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.src = [_Worker(ctx, "src", i) for i in range(num_src)]
        self.dst = [_Worker(ctx, "dst", i) for i in range(num_dst)]
        self._serial = 0

    def run_cell(self, plan, *, pages: int, requests: int, concurrency: int,
                 timeout: float = 300.0) -> dict:
        """NIXL READ of every pair's runs of ``plan`` (a TransferPlan); GB/s, latencies."""
        src_tp, dst_tp = plan.src.tp_size, plan.dst.tp_size
        self._serial += 1
        tag = f"c{self._serial}"
        src_size, dst_size = plan.src.page_size, plan.dst.page_size
        for i in range(src_tp):
            self.src[i].send("open", name=f"{tag}-src{i}", nbytes=pages * src_size)
        for i in range(dst_tp):
            self.dst[i].send("open", name=f"{tag}-dst{i}", nbytes=pages * dst_size)
        src_info = [self.src[i].recv(120) for i in range(src_tp)]
        for i in range(dst_tp):
            self.dst[i].recv(120)
        try:
            for d in range(dst_tp):
                pairs = plan.for_destination(d)
                self.dst[d].call("peers", metadata=[src_info[p.src_rank][0] for p in pairs])
            start_at = time.perf_counter() + 0.3
            for d in range(dst_tp):
                sources = [(f"{tag}-src{p.src_rank}", src_info[p.src_rank][1], p.runs)
                           for p in plan.for_destination(d)]
                self.dst[d].send("read", sources=sources, src_page=src_size, dst_page=dst_size,
                                 pages=pages, requests=requests, concurrency=concurrency,
                                 start_at=start_at, timeout=timeout)
            results = [self.dst[d].recv(timeout + 60) for d in range(dst_tp)]
        finally:
            for w in self.src[:src_tp] + self.dst[:dst_tp]:
                try:
                    w.call("close", timeout=60)
                except RuntimeError:
                    pass
        wall = max(r["end"] for r in results) - min(r["start"] for r in results)
        # A request is done when every destination rank holds it; ranks run in lock step per
        # slot, so per-request latency is the slowest rank's latency of that request.
        lat = np.max(np.array([r["latencies"][:requests] for r in results]), axis=0) \
            if all(len(r["latencies"]) >= requests for r in results) else \
            np.concatenate([r["latencies"] for r in results])
        nbytes = requests * plan.bytes_per_request
        return {"gbps": nbytes / wall / 1e9, "seconds": wall,
                "requests_per_s": requests / wall,
                "latency_p50_ms": float(np.percentile(lat, 50) * 1e3),
                "latency_p99_ms": float(np.percentile(lat, 99) * 1e3),
                "descriptors_per_request": sum(len(p.runs) for p in plan)}

    def close(self) -> None:
        for w in self.src + self.dst:
            try:
                w.send("exit")
            except (BrokenPipeError, OSError):
                pass
        for w in self.src + self.dst:
            w.proc.join(5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(2)
        self.src, self.dst = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
