"""Throughput of the UCX data plane (``statebridge.connector.data``) against UCX's line rate.

A sender and a receiver process on 127.0.0.1 each own a :class:`ModeTransport` (the library's
Transport plus the progress modes and the ``send_multi`` path compared here); per cell the
receiver posts N receives of ``size`` bytes, the sender N sends, and both wait. GB/s is
``N * size / (receiver done - sender start)`` (CLOCK_MONOTONIC is shared by the processes),
median of ``--rounds`` after one warm-up round. Variants:

- ``zero-copy``: ``post_send``/``post_recv``, one tagged message per run, for every progress mode
  (``blocking`` is the library's only one; see :class:`ModeTransport`) and endpoint error
  handling on/off;
- ``seq``: one message per handle, posted and waited one after the other (per-message latency);
- ``multi``: ucxx ``tag_send_multi``/``tag_recv_multi`` (``ModeTransport.post_*_multi``);
- ``staged``: ``post_send_staged``/``post_recv_staged`` of the N runs as one message;
- ``no-thp``: zero-copy out of page buffers without transparent huge pages (``THP=off`` rows);
- ``untouched``: zero-copy out of buffers never written. The sender's pages are then the
  kernel's shared zero page, which cma reads much faster; ``ucx_perftest`` never writes its
  buffers either, so this is the like-for-like row against the line rate. Every other variant
  fills the buffers first, as real pages are.

The line rate (helpers in ``statebridge/bench/_perftest.py``) is ``ucx_perftest -t tag_bw``
between two processes at the same sizes with ``UCX_TLS=sm``, ``UCX_TLS=tcp`` and
``UCX_TLS=tcp -e`` (error handling), with ucxx's settings
(``UCX_RNDV_THRESH=8192``, ``UCX_MAX_RNDV_RAILS=1``), buffers from transparent huge pages like
:func:`alloc_buffer`'s, the better of ``-E poll`` and ``-E sleep``. Error handling makes UCX
drop shared memory, so EH-on cells are compared with ``tcp -e`` and EH-off cells with ``sm``.

Prints a table and writes ``benchmarks/results/transport-<date>.json`` (and a PNG when
matplotlib is installed)::

    python benchmarks/bench_transport.py            # the full matrix, a few minutes
    python benchmarks/bench_transport.py --quick    # fewer sizes and cells

This is a script, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import platform
import select
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from statebridge.bench._perftest import PERFTEST_ENV, UCXX_ENV, perftest
from statebridge.connector import data as tr
from statebridge.connector.data.runs import as_runs, check_span, copy_runs
from statebridge.errors import ConfigError, TransferError

log = logging.getLogger(__name__)

KIB, MIB = 1024, 1024 * 1024
SIZES = (8 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB)
MODES = ("blocking", "polling", "background", "thread")
VARIANTS = ("zero-copy", "seq", "multi", "staged", "no-thp", "untouched")
BUFFER_CAP = 128 * MIB          # page buffer per process; runs wrap around inside it
STAGED_CAP = 64 * MIB           # largest staged message


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help="message sizes (B)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--total-bytes", type=int, default=128 * MIB,
                   help="bytes per round and cell (N = total / size, clamped)")
    p.add_argument("--min-messages", type=int, default=4)
    p.add_argument("--max-messages", type=int, default=2000)
    p.add_argument("--seq-messages", type=int, default=200, help="messages of a 'seq' cell")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per cell (median)")
    p.add_argument("--timeout", type=float, default=60.0, help="bound on one round (s)")
    p.add_argument("--no-perftest", action="store_true", help="skip the ucx_perftest line rate")
    p.add_argument("--quick", action="store_true",
                   help="sizes 64 KiB, 1 MiB, 16 MiB; blocking/thread only; 2 rounds")
    p.add_argument("--json", default=None,
                   help="output file (default benchmarks/results/transport-<date>.json)")
    p.add_argument("--png", default=None, help="plot (needs matplotlib; default next to JSON)")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes = [64 * KIB, 1 * MIB, 16 * MIB]
        a.modes = ["blocking", "thread"]
        a.rounds = 2
    return a


# -- the Transport with the compared alternatives -----------------------------------------------

class ModeTransport(tr.Transport):
    """:class:`~statebridge.connector.data.Transport` with the progress modes and the
    ``send_multi`` path this benchmark compares; the connector uses neither.

    ``progress_mode``:

    - ``"blocking"``: the library's Transport as it is (the owner progresses and sleeps in
      ``poll()`` on the worker's epoll fd);
    - ``"polling"``: the same, spinning (``sched_yield``) instead of sleeping;
    - ``"background"``: a Python thread of the transport sleeps on the epoll fd (plus a wake-up
      pipe written after each post) and progresses on every event; the owner only looks at
      completion flags and waits for the thread's next round;
    - ``"thread"``: ucxx's C++ progress thread (it needs delayed submission: without it, posts
      from another thread lose wake-ups and stall).

    :meth:`post_send_multi` / :meth:`post_recv_multi`: all runs in one ucxx ``tag_send_multi``
    (header + one message per run, same tag); the receive lands in buffers ucxx allocates and
    is copied into the runs. Posting stays on the owner thread in every mode.
    """

    _DONE_COUNTERS = {**tr.Transport._DONE_COUNTERS,
                      ("send", "multi"): ("messages_sent", "bytes_sent", "multi_messages_sent"),
                      ("recv", "multi"): ("messages_received", "bytes_received",
                                          "multi_messages_received")}

    def __init__(self, buffer, *, progress_mode: str = "blocking", **kwargs) -> None:
        if progress_mode not in MODES:
            raise ConfigError(f"unknown progress_mode {progress_mode!r}; expected one of {MODES}")
        self.progress_mode = progress_mode
        self._wake_r = self._wake_w = -1
        self._posts = 0                  # bumped after each post (background wake-ups)
        self._sleeping = False           # the background thread is in poll()
        self._round = threading.Condition(threading.Lock())   # background progress rounds
        self._progress_thread: threading.Thread | None = None
        super().__init__(buffer, **kwargs)
        if progress_mode == "background":
            self._progress_thread = threading.Thread(
                target=self._progress_loop, name=f"bench-{self.name}-progress", daemon=True)
            self._progress_thread.start()

    def _start_worker(self) -> None:
        if self.progress_mode == "thread":
            self._worker = self._ucx.UCXWorker(self._context, enable_delayed_submission=True)
            self._worker.start_progress_thread(polling_mode=False, epoll_timeout=10)
            return
        super()._start_worker()
        if self.progress_mode == "background":
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._poller.register(self._wake_r, select.POLLIN)

    def _shutdown(self, peers) -> None:
        if self._progress_thread is not None:
            self._wake(force=True)
            self._progress_thread.join(5.0)
        for peer in peers:                        # while ucxx's thread still progresses
            self.endpoints.close_endpoint(peer)
        if self.progress_mode == "thread":
            self._worker.stop_progress_thread()
        super()._shutdown([])
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # -- progress -------------------------------------------------------------------------------
    def fileno(self) -> int:
        if self.progress_mode not in ("blocking", "polling"):
            raise ConfigError(f"fileno() is for caller-driven progress, not "
                              f"{self.progress_mode!r}")
        return super().fileno()

    def arm(self) -> bool:
        if self.progress_mode not in ("blocking", "polling"):
            raise ConfigError(f"arm() is for caller-driven progress, not {self.progress_mode!r}")
        return super().arm()

    def _drive(self, block_s: float, ready) -> None:
        mode = self.progress_mode
        if mode == "blocking":
            super()._drive(block_s, ready)
            return
        if self.endpoints.events:
            self.endpoints.process_events()
        if self._closed:
            return
        if mode == "polling":
            self._worker.progress()
            if block_s > 0 and (ready is None or not ready()):
                os.sched_yield()
        elif mode == "thread":
            if block_s > 0:
                time.sleep(min(block_s, 50e-6))
        elif block_s > 0:                       # background: wait for the thread's next round
            with self._round:                   # it notifies under this lock: no lost wake-up
                if ready is None or not ready():
                    self._round.wait(min(block_s, 0.05))
        if self.endpoints.events:
            self.endpoints.process_events()

    def _progress_loop(self) -> None:
        """``background``: progress whenever UCX (or a post) has something to do."""
        while not self._closed:
            try:
                worker = self._worker
                worker.progress()
                # A post after ``seen`` either sees ``_sleeping`` and writes to the wake-up
                # pipe, or bumps ``_posts`` before the check below: no lost wake-ups.
                seen = self._posts
                self._sleeping = True
                try:
                    if worker.arm() and self._posts == seen:
                        events = self._poller.poll(500)
                        if any(fd == self._wake_r for fd, _ in events):
                            self._drain_wake()
                finally:
                    self._sleeping = False
                worker.progress()
                with self._round:
                    self._round.notify_all()
            except Exception:  # noqa: BLE001 -- keep progressing; log once per failure
                if self._closed:
                    break
                log.exception("%s: progress thread", self.name)
                time.sleep(0.01)

    def _wake(self, force: bool = False) -> None:
        """After a post: make the background thread sleeping in ``poll()`` progress it now."""
        self._posts += 1
        if (force or self._sleeping) and self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:
            pass

    def post_runs(self, *args, **kwargs):
        handle = super().post_runs(*args, **kwargs)
        self._wake()
        return handle

    def post_send_staged(self, *args, **kwargs):
        handle = super().post_send_staged(*args, **kwargs)
        self._wake()
        return handle

    def post_recv_staged(self, *args, **kwargs):
        handle = super().post_recv_staged(*args, **kwargs)
        self._wake()
        return handle

    # -- send_multi -----------------------------------------------------------------------------
    def post_send_multi(self, peer_id: str, generation: int, src_rank: int, runs: object, *,
                        request_id: str | None = None) -> tr.TransferHandle:
        """All runs in one ucxx ``tag_send_multi`` (header + one message per run, same tag)."""
        runs = as_runs(runs, "runs")
        check_span(runs, 0, self.posting.size, "send", "page buffer")
        tag = tr.make_tag(generation, src_rank, 0)
        endpoint = self.endpoints.endpoint(peer_id)
        mv, Array = self.posting.page_mv, self._Array
        arrays = tuple(Array(mv[o:o + n]) for o, n in runs[:, [0, 2]].tolist())
        requests = self.posting.post_one(lambda _, t: endpoint.tag_send_multi(arrays, t), None, tag,
                                  peer_id)
        return self._multi_handle("send", peer_id, generation, src_rank, runs, request_id,
                                  requests, None)

    def post_recv_multi(self, peer_id: str, generation: int, src_rank: int, runs: object, *,
                        request_id: str | None = None) -> tr.TransferHandle:
        """Receive a :meth:`post_send_multi` (into ucxx's buffers, then copied into the runs)."""
        runs = as_runs(runs, "runs")
        check_span(runs, 1, self.posting.size, "receive", "page buffer")
        tag = tr.make_tag(generation, src_rank, 0)
        starts = np.concatenate([[0], np.cumsum(runs[:, 2])[:-1]]).astype(np.int64)
        stage_runs = np.stack([starts, runs[:, 1], runs[:, 2]], axis=1)
        total = int(runs[:, 2].sum())
        page = self.posting.page_np
        endpoint = self.endpoints.endpoint(peer_id)
        (request,) = self.posting.post_one(lambda _, t: endpoint.tag_recv_multi(t), None, tag, peer_id)

        def land() -> None:
            frames = [np.asarray(b, dtype=np.uint8).reshape(-1) for b in request.py_buffers]
            data = frames[0] if len(frames) == 1 else np.concatenate(frames)
            if data.size != total:
                raise TransferError(f"multi receive got {data.size} bytes, expected {total}")
            copy_runs(data, stage_runs, page)

        return self._multi_handle("recv", peer_id, generation, src_rank, runs, request_id,
                                  [request], land)

    def _multi_handle(self, direction, peer_id, generation, src_rank, runs, request_id,
                      requests, on_success) -> tr.TransferHandle:
        handle = tr.TransferHandle(self, direction=direction, kind="multi", peer_id=peer_id,
                                   generation=generation, src_rank=src_rank,
                                   nbytes=int(runs[:, 2].sum()), messages=len(runs),
                                   request_id=request_id, requests=requests,
                                   on_success=on_success)
        self._outstanding[id(handle)] = handle
        self._wake()
        return handle

    def stats(self) -> dict:
        return {"multi_messages_sent": 0, "multi_messages_received": 0, **super().stats(),
                "progress_mode": self.progress_mode}


# -- the two Transport processes -----------------------------------------------------------------

def _slots(nbytes: int, size: int, count: int) -> np.ndarray:
    """Offsets of ``count`` runs of ``size`` inside ``nbytes`` (wrapping around)."""
    per = max(1, nbytes // size)
    return (np.arange(count, dtype=np.int64) % per) * size


def _worker(conn) -> None:
    """Serve ``open`` / ``connect`` / ``run`` / ``stats`` commands until ``exit`` or EOF."""
    tr.configure_ucx_env()
    transport = None
    peer = "peer"
    generation = 0
    try:
        while True:
            try:
                cmd, kw = conn.recv()
            except EOFError:
                break
            try:
                if cmd == "exit":
                    conn.send(("ok", None))
                    break
                if cmd == "open":
                    if transport is not None:
                        transport.close()
                    buf = tr.alloc_buffer(kw["nbytes"], huge_pages=kw["huge_pages"])
                    if kw["touch"]:       # real pages hold data; see the "untouched" variant
                        buf.numpy()[:] = 1
                    transport = ModeTransport(buf, error_handling=kw["error_handling"],
                                              progress_mode=kw["progress_mode"],
                                              staging_pool_bytes=2 * STAGED_CAP + MIB)
                    conn.send(("ok", transport.address))
                elif cmd == "connect":
                    transport.connect(peer, kw["address"])
                    conn.send(("ok", None))
                elif cmd == "run":
                    generation += 1
                    conn.send(("ok", _run(transport, conn, peer, generation, **kw)))
                elif cmd == "stats":
                    conn.send(("ok", transport.stats()))
                else:
                    raise ValueError(f"unknown command {cmd!r}")
            except Exception as e:  # noqa: BLE001 -- reported to the parent
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if transport is not None:
            transport.close()


def _run(transport, conn, peer: str, generation: int, *, role: str, variant: str, size: int,
         count: int, timeout: float) -> dict:
    """One round. The receiver posts, reports ``posted`` early, then waits; the sender posts
    when the parent says so and waits. Returns monotonic timestamps."""
    nbytes = transport.posting.size
    offsets = _slots(nbytes, size, count)
    runs = np.stack([offsets, offsets, np.full(count, size, dtype=np.int64)], axis=1)
    gen = generation & 0xFFFFFFFF
    if variant == "seq":
        if role == "recv":
            conn.send(("posted", None))
        t0 = time.monotonic()
        for i in range(count):
            post = transport.post_recv if role == "recv" else transport.post_send
            post(peer, gen, 0, runs[i:i + 1]).wait(timeout)
        return {"start": t0, "end": time.monotonic()}
    t0 = time.monotonic()
    if variant == "staged":
        staging = np.stack([offsets, np.arange(count, dtype=np.int64) * size,
                            np.full(count, size, dtype=np.int64)], axis=1)
        if role == "send":
            h = transport.post_send_staged(peer, gen, 0, staging)
        else:
            h = transport.post_recv_staged(peer, gen, 0, count * size, staging[:, [1, 0, 2]])
    elif variant == "multi":
        post = transport.post_send_multi if role == "send" else transport.post_recv_multi
        h = post(peer, gen, 0, runs)
    else:
        post = transport.post_send if role == "send" else transport.post_recv
        h = post(peer, gen, 0, runs)
    t_posted = time.monotonic()
    if role == "recv":
        conn.send(("posted", None))
    h.wait(timeout)
    return {"start": t0, "posted": t_posted, "end": time.monotonic()}


class _Proc:
    def __init__(self, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child,), name=name, daemon=True)
        self.process.start()
        child.close()

    def send(self, cmd: str, **kw) -> None:
        self.conn.send((cmd, kw))

    def reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.process.name} did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.process.name}: {value}")
        return value

    def call(self, cmd: str, timeout: float = 60.0, **kw):
        self.send(cmd, **kw)
        return self.reply(timeout)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout=10)
            except (RuntimeError, TimeoutError, OSError, EOFError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def _messages(a: argparse.Namespace, variant: str, size: int) -> int:
    if variant == "seq":
        return a.seq_messages
    n = max(a.min_messages, min(a.max_messages, a.total_bytes // size))
    if variant == "staged":
        n = max(1, min(n, STAGED_CAP // size))
    return n


def run_cell(sender: _Proc, receiver: _Proc, a: argparse.Namespace, *, variant: str,
             progress_mode: str, error_handling: bool, huge_pages: bool, size: int) -> dict:
    count = _messages(a, variant, size)
    nbytes = max(size, min(count * size, BUFFER_CAP))
    opts = dict(nbytes=nbytes, error_handling=error_handling, progress_mode=progress_mode,
                huge_pages=huge_pages, touch=variant != "untouched")
    addr_s = sender.call("open", **opts)
    addr_r = receiver.call("open", **opts)
    sender.call("connect", address=addr_r)
    receiver.call("connect", address=addr_s)
    times = []
    for r in range(a.rounds + 1):
        job = dict(variant=variant, size=size, count=count, timeout=a.timeout)
        receiver.send("run", role="recv", **job)
        status, _ = receiver.conn.recv() if receiver.conn.poll(a.timeout) else (None, None)
        if status != "posted":
            raise RuntimeError(f"receiver did not post ({status})")
        sender.send("run", role="send", **job)
        s = sender.reply(a.timeout + 30)
        t = receiver.reply(a.timeout + 30)
        if r > 0:                                   # round 0 warms up
            times.append(max(t["end"], s["end"]) - s["start"])
    moved = count * size
    gbps = [moved / t / 1e9 for t in times]
    return {
        "variant": variant, "progress_mode": progress_mode, "error_handling": error_handling,
        "huge_pages": huge_pages, "size": size, "messages": count,
        "rounds": len(times), "gbps_median": statistics.median(gbps), "gbps_best": max(gbps),
        "us_per_message": statistics.median(times) / count * 1e6,
    }


def cells(a: argparse.Namespace) -> list[dict]:
    out = []
    v = set(a.variants)

    def add(variant: str, modes, *, eh: bool = False, thp: bool = True, max_size=None):
        for mode in modes:
            out.extend(dict(variant=variant, progress_mode=mode, error_handling=eh,
                            huge_pages=thp, size=s)
                       for s in a.sizes if max_size is None or s <= max_size)

    if "zero-copy" in v:
        add("zero-copy", a.modes)
        add("zero-copy", a.modes, eh=True)
    if "seq" in v:
        add("seq", a.modes, max_size=1 * MIB)
    if "multi" in v:
        add("multi", ["blocking"])
    if "staged" in v:
        add("staged", ["blocking"])
    if "no-thp" in v:
        add("zero-copy", ["blocking"], thp=False)
    if "untouched" in v:
        add("untouched", ["blocking"])
    return out


# -- ucx_perftest ---------------------------------------------------------------------------------
# The helpers live in the package (statebridge bench needs them from an installed statebridge).

def line_rates(a: argparse.Namespace) -> list[dict]:
    """Every (transport, size) in both wait modes; the line rate is the better of the two."""
    out = []
    for tls, eh in (("sm", False), ("tcp", False), ("tcp", True)):
        for size in a.sizes:
            iters = max(16, min(5000, 2 * a.total_bytes // size))
            for wait_mode in ("poll", "sleep"):
                try:
                    out.append(perftest(size, tls, eh, iters, a.timeout, wait_mode))
                except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
                    out.append({"tls": tls, "error_handling": eh, "wait_mode": wait_mode,
                                "size": size, "error": str(e)})
                print(f"  perftest {tls:3s}{' -e' if eh else '   '} {wait_mode:5s} "
                      f"{_fmt_size(size):>7s}: {out[-1].get('gbps', float('nan')):6.2f} GB/s",
                      flush=True)
    return out


# -- report -------------------------------------------------------------------------------------

def _fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def attach_ratios(results: list[dict], rates: list[dict]) -> None:
    table: dict[tuple, float] = {}
    for r in rates:
        if r.get("gbps") is not None:
            key = (r["tls"], r["error_handling"], r["size"])
            table[key] = max(table.get(key, 0.0), r["gbps"])
    for r in results:
        key = ("tcp", True, r["size"]) if r["error_handling"] else ("sm", False, r["size"])
        line = table.get(key)
        r["line_rate"] = f"{key[0]}{' -e' if key[1] else ''}"
        r["line_rate_gbps"] = line
        r["ratio_to_line_rate"] = r["gbps_median"] / line if line else None


def print_table(results: list[dict]) -> None:
    head = (f"{'variant':10s} {'progress':10s} {'EH':3s} {'THP':3s} {'size':>7s} {'msgs':>5s} "
            f"{'GB/s':>6s} {'us/msg':>8s} {'line':>6s} {'ratio':>5s}")
    print(head)
    print("-" * len(head))
    for r in results:
        ratio = r.get("ratio_to_line_rate")
        line = r.get("line_rate_gbps")
        eh, thp = ("on" if r[k] else "off" for k in ("error_handling", "huge_pages"))
        print(f"{r['variant']:10s} {r['progress_mode']:10s} {eh:3s} {thp:3s} "
              f"{_fmt_size(r['size']):>7s} "
              f"{r['messages']:5d} {r['gbps_median']:6.2f} {r['us_per_message']:8.1f} "
              f"{line if line is not None else float('nan'):6.2f} "
              f"{ratio if ratio is not None else float('nan'):5.2f}")


def write_png(path: str, results: list[dict], rates: list[dict]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 5))
    series: dict[str, list] = {}
    for r in results:
        label = (f"{r['variant']} {r['progress_mode']} EH={'on' if r['error_handling'] else 'off'}"
                 f"{'' if r['huge_pages'] else ' no-THP'}")
        series.setdefault(label, []).append((r["size"], r["gbps_median"]))
    for r in rates:
        if "gbps" in r:
            label = f"perftest {r['tls']}{' -e' if r['error_handling'] else ''}"
            series.setdefault(label, []).append((r["size"], r["gbps"]))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                linestyle="--" if label.startswith("perftest") else "-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (B)")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _versions() -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform(),
           "cpus": os.cpu_count()}
    for mod in ("torch", "numpy", "ucxx"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 -- informational only
            out[mod] = None
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        out["transparent_hugepage"] = thp
    except OSError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    started = time.time()
    load_start = os.getloadavg()
    date = datetime.date.today().isoformat()
    json_path = a.json or str(Path(__file__).parent / "results" / f"transport-{date}.json")
    todo = cells(a)
    print(f"{len(todo)} cells, {a.rounds} rounds each (+1 warm-up); load average "
          f"{load_start[0]:.2f}", flush=True)
    results = []
    sender, receiver = _Proc("bench-sender"), _Proc("bench-receiver")
    try:
        # Warm both processes up once (imports, first allocations, page faults).
        run_cell(sender, receiver, a, variant="zero-copy", progress_mode="blocking",
                 error_handling=False, huge_pages=True, size=64 * KIB)
        for i, cell in enumerate(todo, 1):
            try:
                row = run_cell(sender, receiver, a, **cell)
            except (RuntimeError, TimeoutError) as e:
                print(f"[{i}/{len(todo)}] {cell}: FAILED {e}", flush=True)
                sender.stop(), receiver.stop()
                sender, receiver = _Proc("bench-sender"), _Proc("bench-receiver")
                continue
            results.append(row)
            print(f"[{i}/{len(todo)}] {row['variant']} {row['progress_mode']} "
                  f"EH={'on' if row['error_handling'] else 'off'} "
                  f"THP={'on' if row['huge_pages'] else 'off'} {_fmt_size(row['size'])}: "
                  f"{row['gbps_median']:.2f} GB/s, {row['us_per_message']:.1f} us/msg",
                  flush=True)
    finally:
        sender.stop()
        receiver.stop()
    rates = [] if a.no_perftest else line_rates(a)
    attach_ratios(results, rates)
    print()
    print_table(results)
    report = {"benchmark": "transport", "date": date, "seconds": round(time.time() - started, 1),
              "host": _versions(), "args": vars(a), "ucx_env": UCXX_ENV,
              "perftest_env": PERFTEST_ENV,
              # The machine may be shared: the load average says how quiet it was.
              "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
              "results": results, "perftest": rates}
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {json_path}")
    png = a.png or json_path.replace(".json", ".png")
    if write_png(png, results, rates):
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
