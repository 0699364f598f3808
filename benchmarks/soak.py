"""Soak: thousands of requests through real prefill/decode rank processes, broken on purpose.

One :class:`~statebridge.connector.decode.DecodeCoordinator` (its ranks spawned processes, alive
for the whole run) pulls requests from a sequence of
:class:`~statebridge.connector.prefill.PrefillServer` generations over UCX on loopback, with
``--concurrency`` requests in flight. Faults are injected on the way:

- random aborts (``decode.abort``) of a fraction ``--abort-rate`` of the requests, at one of
  three moments: right after submit (before the transfer starts: the prefill "model" sleeps up
  to ``--prefill-delay-ms``), after a random delay (mid-flight), or after the transfer is done
  but before the page is released;
- prefill restarts (``--faults``): ``close`` closes the running PrefillServer, ``kill``
  SIGKILLs one of its rank processes (the harsh version; that generation's ranks are spawned
  processes); either way a fresh server is started and ``decode.connect``-ed;
- ``storm``: abort every request in flight at once.

Every request must END -- ok, or a typed failure (``TransferError.kind``) -- within the overall
deadline (``--seconds`` to submit, plus ``--drain-seconds``). At the end the run checks that no
page is held anywhere (both coordinators' page pools, and every rank's own report of the
requests it still works on), that no transfer handle is outstanding in any rank's transport,
that every byte-exact check passed, and that the resident memory (VmRSS) of this process and of
every rank process did not grow past ``max(--rss-growth-mib, --rss-growth-frac x baseline)``
between its warm-up and the end. Prints a progress line every ``--progress-seconds``, a summary
at the end; exits 1 if a check fails. ``--json FILE`` writes everything.

Ranks report through the extension points they have: the rank model serves a message of this
script's own (:class:`RankReportQuery`, answered by :class:`SoakModel` with its process's
counters as a :class:`RankReport`), and the coordinator routes the answers here
(``RankGroup.on_rank_message``), so nothing in the connector exists only for this script.

    python benchmarks/soak.py --requests 5000 --seconds 300 --json soak.json
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import heapq
import itertools
import json
import logging
import os
import platform
import signal
import sys
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from statebridge.config import ConnectorConfig
from statebridge.connector import messages as m
from statebridge.errors import (
    CacheFullError,
    PeerLostError,
    TransferError,
)
from statebridge.state.spec import StateSpec
from statebridge.testing.models import SyntheticModel
from statebridge.testing.probes import instrumented, probes_of

log = logging.getLogger("statebridge.soak")

BENCH_DIR = str(Path(__file__).resolve().parent)
MODEL = "soak:SoakModel"                  # imported by the rank processes (BENCH_DIR on sys.path)
DELAY_ENV = "SOAK_PREFILL_DELAY_MS"       # read by SoakModel in the rank processes
MIB = 1 << 20

SPECS = {
    "mamba2": dict(config={"model_type": "mamba2", "hidden_size": 16, "expand": 2,
                           "head_dim": 4, "state_size": 6, "n_groups": 1, "conv_kernel": 4,
                           "num_hidden_layers": 3, "torch_dtype": "bfloat16"},
                   kwargs={"ssm_dtype": "float32"}),
    "lfm2": dict(config={"model_type": "lfm2", "hidden_size": 40, "conv_L_cache": 3,
                         "torch_dtype": "bfloat16", "num_attention_heads": 4,
                         "num_key_value_heads": 2,
                         "layer_types": ["conv", "full_attention", "conv", "conv"]},
                 kwargs={}),
}
FAULTS = ("close", "kill", "storm")
# What a request may legitimately end with under the injected faults.
EXPECTED_KINDS = ("aborted", "peer_lost")
_REPORT_FIELDS = ("pid", "rss_kb", "pending", "computing", "handles_outstanding",
                  "staging_pool_bytes", "staging_quarantined_bytes", "transport_peers",
                  "num_pages")


# -- this script's rank messages -----------------------------------------------------------------

@m.message
class RankReportQuery(m.Message):
    """Soak -> every rank: report your counters under ``query``."""
    query: int


@m.message
class RankReport(m.Message):
    """A rank's counters (:data:`_REPORT_FIELDS`, in order)."""
    query: int
    tp_rank: int
    values: tuple[int, ...]


# -- in the rank processes ---------------------------------------------------------------------

class SoakModel(SyntheticModel):
    """The synthetic state, after a short per-request sleep (so an abort can land before the
    transfer starts); a :class:`RankReportQuery` is answered with the rank's counters."""

    def __init__(self, setup, cache, kv=None) -> None:
        super().__init__(setup, cache, kv)
        self.max_delay = float(os.environ.get(DELAY_ENV, "0") or 0) / 1e3

    def prefill(self, page: int, prompt: tuple[int, ...], request_id: str,
                blocks: tuple[int, ...] = ()) -> None:
        if self.max_delay > 0:
            # Same delay on every rank of the group for one request.
            time.sleep(self.max_delay * (zlib.crc32(request_id.encode()) % 1000) / 1000)
        super().prefill(page, prompt, request_id, blocks)

    def handlers(self) -> dict:
        return {**super().handlers(), RankReportQuery: self.report}

    def report(self, msg: RankReportQuery) -> RankReport:
        stats = self.rank_stats()
        values = {
            "pid": os.getpid(), "rss_kb": rss_kb(os.getpid()) or 0,
            "pending": stats["pending"], "computing": stats["computing"],
            "handles_outstanding": stats["handles_outstanding"],
            "staging_pool_bytes": stats["staging_pool_bytes"],
            "staging_quarantined_bytes": stats["staging_quarantined_bytes"],
            "transport_peers": stats["peers"], "num_pages": self.setup.num_pages,
        }
        return RankReport(query=msg.query, tp_rank=self.setup.tp_rank,
                          values=tuple(int(values[k]) for k in _REPORT_FIELDS))


def rss_kb(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB (None once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


# -- rank reports ---------------------------------------------------------------------------------

class ErrorTrap(logging.Handler):
    """Log records with a traceback from the connector in this process (an event-loop handler
    that raised): each one is a bug the soak reports."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and len(self.records) < 100:
            self.records.append(f"{record.name}: {record.getMessage()}: "
                                f"{record.exc_info[0].__name__}: {record.exc_info[1]}")


class RankReports:
    """Collects rank reports (:class:`RankReport`) of the groups it is installed on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._got: dict[tuple[str, int], dict[int, tuple[int, ...]]] = {}
        self._queries = itertools.count(1)

    def install(self, group) -> None:
        def on_report(rank: int, msg: RankReport) -> None:
            with self._cond:
                self._got.setdefault((group.node_id, msg.query), {})[rank] = msg.values
                self._cond.notify_all()
        group.on_rank_message(RankReport, on_report)

    def query(self, group, timeout: float) -> list[dict[str, int] | None]:
        """Every rank's counters (None for a rank that did not answer within ``timeout``)."""
        query = next(self._queries)
        group.loop.call_soon(group.to_ranks, RankReportQuery(query=query))
        key = (group.node_id, query)
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._got.get(key, {})) < group.tp_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            got = self._got.pop(key, {})
        return [dict(zip(_REPORT_FIELDS, got[r])) if r in got else None
                for r in range(group.tp_size)]


# -- memory -------------------------------------------------------------------------------------

@dataclass
class _Proc:
    name: str
    pid: int
    born_at: int                       # requests ended when it was first seen
    baseline_kb: int | None = None
    baseline_at: int | None = None
    last_kb: int | None = None
    peak_kb: int = 0
    gone: bool = False


class RssWatch:
    """VmRSS per process: a baseline once ``warmup`` requests ended after the process was first
    seen, then the last and peak value."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.procs: dict[int, _Proc] = {}

    def add(self, name: str, pid: int, ended: int) -> None:
        if pid and pid not in self.procs:
            self.procs[pid] = _Proc(name, pid, ended)

    def sample(self, ended: int) -> None:
        for p in self.procs.values():
            if p.gone:
                continue
            kb = rss_kb(p.pid)
            if kb is None:
                p.gone = True
                continue
            p.last_kb = kb
            p.peak_kb = max(p.peak_kb, kb)
            if p.baseline_kb is None and ended >= p.born_at + self.warmup:
                p.baseline_kb, p.baseline_at = kb, ended

    def needs_baseline(self, ended: int) -> bool:
        return any(p.baseline_kb is None and not p.gone and ended >= p.born_at + self.warmup
                   for p in self.procs.values())

    def current_kb(self, pid: int) -> int | None:
        p = self.procs.get(pid)
        return p.last_kb if p else None

    def report(self, growth_mib: float, growth_frac: float) -> list[dict]:
        out = []
        for p in self.procs.values():
            growth = (p.last_kb - p.baseline_kb) if p.baseline_kb is not None and not p.gone \
                else None
            bound = None if p.baseline_kb is None else \
                max(growth_mib * 1024, growth_frac * p.baseline_kb)
            out.append({"name": p.name, "pid": p.pid, "baseline_kb": p.baseline_kb,
                        "baseline_at_request": p.baseline_at, "end_kb": p.last_kb,
                        "peak_kb": p.peak_kb, "growth_kb": growth,
                        "bound_kb": None if bound is None else int(bound),
                        "checked": growth is not None,
                        "ok": growth is None or growth <= bound,
                        "alive_at_end": not p.gone})
        return out


# -- the soak -----------------------------------------------------------------------------------

@dataclass
class _Req:
    rid: str
    index: int
    generation: int                  # prefill generation it was submitted to
    abort: str = ""                  # "", "before_start", "mid_flight", "after_done"
    check: bool = False
    tokens: int = 0                  # prompt length (the KV it carries)


@dataclass
class _Outcome:
    ok: int = 0
    failed: collections.Counter = field(default_factory=collections.Counter)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "failed": dict(self.failed)}


def expected_checksums(geometry, request_id: str, cache) -> tuple[str, ...]:
    """What every decode rank must hold for ``request_id`` (the synthetic-state oracle)."""
    from statebridge.state.cache import page_checksum
    from statebridge.testing.synthetic import fill_page, global_state, request_seed

    state = global_state(geometry.spec, request_seed(request_id))
    out = []
    for rank in range(geometry.tp_size):
        fill_page(cache, 0, state, rank)
        out.append(page_checksum(geometry, cache.page_bytes(0)))
    return tuple(out)


def expected_kv_checksums(spec, request_id: str, tokens: int, tp_size: int) -> tuple[str, ...]:
    """What every decode rank must hold of the request's attention KV (per layer, K then V of
    its heads, token-major), from the global synthetic KV and the head sharding rule only."""
    import hashlib

    import torch

    from statebridge.state.sharding import kv_heads
    from statebridge.testing.synthetic import global_kv, request_seed

    state = global_kv(spec.kv, request_seed(request_id), tokens)
    out = []
    for rank in range(tp_size):
        first, count = kv_heads(spec.kv, tp_size, rank)
        h = hashlib.blake2b(digest_size=16)
        for layer in range(spec.kv.num_layers):
            for c in range(2):
                h.update(state[layer, c, :, first:first + count].contiguous()
                         .view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return tuple(out)


def _node(generation: int) -> str:
    return f"prefill-g{generation}"


def fault_schedule(a: argparse.Namespace) -> list[tuple[int, str]]:
    """(request index, fault) pairs: the faults evenly spread after the warm-up."""
    faults = a.faults
    if not faults:
        return []
    start = min(a.warmup, a.requests // 2)
    span = a.requests - start
    return [(start + (i + 1) * span // (len(faults) + 1), f) for i, f in enumerate(faults)]


class Soak:
    """The groups, the requests in flight, the faults, and what came of them."""

    def __init__(self, a: argparse.Namespace, trap: ErrorTrap) -> None:
        from statebridge.testing.hosts import RankHostPool

        self.a = a
        self.trap = trap
        cfg = SPECS[a.model]
        self.spec = StateSpec.from_config(cfg["config"], **cfg["kwargs"])
        self.config = ConnectorConfig(heartbeat_interval=a.heartbeat, peer_timeout=a.peer_timeout,
                                      lease_timeout=a.lease_timeout,
                                      transfer_timeout=a.transfer_timeout,
                                      handshake_timeout=60.0)
        self.rng = np.random.default_rng(a.seed)
        self.num_pages = 2 * a.concurrency + 8     # aborted pages wait for their ranks' confirm
        self.schedule = fault_schedule(a)
        # generation g is started by the g-th restart; a generation that will be killed gets
        # spawned rank processes of its own (the host pool survives).
        restarts = [f for _, f in self.schedule if f in ("close", "kill")]
        self.spawned_generations = {g for g, f in enumerate(restarts) if f == "kill"}
        self.reports = RankReports()
        self.rss = RssWatch(a.warmup)
        self.t0 = time.monotonic()
        self.submitted = 0
        self.ended = 0
        self.ok = 0
        self.failed: collections.Counter = collections.Counter()
        self.by_generation: dict[int, _Outcome] = collections.defaultdict(_Outcome)
        self.faults: collections.Counter = collections.Counter()
        self.skipped: collections.Counter = collections.Counter()
        self.backpressure = 0
        self.checked = 0
        self.mismatches: list[str] = []
        self.errors: list[str] = []
        self.stray: list[str] = []        # requests served/failed by another prefill generation
        self.restarts: list[dict] = []
        self.progress: list[dict] = []
        self.inflight: dict[concurrent.futures.Future, _Req] = {}
        self.mid_aborts: list[tuple[float, int, concurrent.futures.Future]] = []
        self.generation = 0
        self.server = None
        self.decode = None
        self.dead_servers: list = []
        self._oracle_cache = None
        self.schedule_left: list[str] = []
        # prefill ranks, kept over restarts; they log like this process (see main)
        self.prefill_hosts = RankHostPool(a.src_tp, initializer=functools.partial(
            logging.basicConfig, level=os.environ.get("STATEBRIDGE_LOG_LEVEL", "WARNING")))

    # -- groups -----------------------------------------------------------------------------
    def _start_server(self, generation: int):
        from statebridge.connector.group import spawn_launcher
        from statebridge.connector.prefill import PrefillServer

        spawned = generation in self.spawned_generations
        launcher = spawn_launcher if spawned else self.prefill_hosts.launcher()
        server = PrefillServer(self.spec, self.a.src_tp, self.a.layout, num_pages=self.num_pages,
                               config=self.config, node_id=_node(generation),
                               launcher=launcher, model=MODEL)
        self.reports.install(server.group)
        server.wait_ready(timeout=120)
        for r, s in enumerate(server.group.ranks):
            name = (f"prefill-g{generation} rank {r}" if spawned
                    else f"prefill host {r}")
            self.rss.add(name, s.announced.pid, self.ended)
        return server

    def start(self) -> None:
        from statebridge.connector.decode import DecodeCoordinator
        from statebridge.state.cache import StateCache

        self.decode = instrumented(DecodeCoordinator(
            self.spec, self.a.dst_tp, self.a.layout, num_pages=self.num_pages,
            config=self.config, node_id="decode", model=MODEL, probes="checksums"))
        self.reports.install(self.decode.group)
        self.server = self._start_server(0)
        self.decode.wait_ready(timeout=120)
        self.decode.connect(self.server.address)
        self.rss.add("coordinator (this process)", os.getpid(), 0)
        for r, s in enumerate(self.decode.group.ranks):
            self.rss.add(f"decode rank {r}", s.announced.pid, 0)
        self._oracle_cache = StateCache(self.decode.group.geometry, 1)

    def restart(self, how: str) -> None:
        old, t = self.server, time.monotonic()
        in_flight = len(self.inflight)
        record: dict[str, Any] = {"how": how, "at_request": self.submitted,
                                  "at_seconds": round(t - self.t0, 2), "in_flight": in_flight,
                                  "old_node": old.node_id}
        if how == "kill":
            victim = self.a.src_tp - 1
            pid = old.group.ranks[victim].announced.pid
            os.kill(pid, signal.SIGKILL)
            record["killed_pid"] = pid
            deadline = time.monotonic() + self.config.peer_timeout + 10
            while old.stats()["healthy"] and time.monotonic() < deadline:
                time.sleep(0.02)
            record["noticed_after_s"] = round(time.monotonic() - t, 3)
            # Its requests in flight must fail because of the kill itself (peer_lost from the
            # broken server), not only once the server is closed below.
            mine = [f for f, r in self.inflight.items() if r.generation == self.generation]
            _, stuck = concurrent.futures.wait(mine, timeout=self.config.peer_timeout + 5)
            record["in_flight_at_close"] = len(stuck)
        old.close()
        self.dead_servers.append(old)
        self.generation += 1
        self.server = self._start_server(self.generation)
        self.decode.connect(self.server.address)
        record["new_node"] = self.server.node_id
        record["decode_prefills_after"] = self.decode.stats()["prefills"]
        record["seconds"] = round(time.monotonic() - t, 3)
        self.restarts.append(record)
        self.faults[f"restart_{how}"] += 1
        self._log(f"restart ({how}) done in {record['seconds']:.2f} s, {in_flight} were in "
                  f"flight")

    def storm(self) -> None:
        futures = [f for f in self.inflight if not f.done()]
        for f in futures:
            self.decode.abort(self.inflight[f].rid, "abort storm")
        self.faults["abort_storm"] += len(futures)
        self._log(f"abort storm: {len(futures)} requests")

    # -- requests ---------------------------------------------------------------------------
    def _submit_one(self) -> bool:
        index = self.submitted
        rid = f"soak-{index}-{uuid.uuid4().hex[:8]}"
        prompt = tuple(int(x) for x in self.rng.integers(0, 1000, int(self.rng.integers(1, 9))))
        try:
            future = self.decode.submit(rid, prompt)
        except CacheFullError:
            self.backpressure += 1
            return False
        except PeerLostError as e:                  # no prefill connected: ends at once
            self.submitted += 1
            self._end(_Req(rid, index, self.generation), e.kind)
            return True
        self.submitted += 1
        req = _Req(rid, index, self.generation,
                   check=index % self.a.check_every == 0, tokens=len(prompt))
        if self.rng.random() < self.a.abort_rate:
            req.abort = ("before_start", "mid_flight", "after_done")[int(self.rng.integers(3))]
        self.inflight[future] = req
        if req.abort == "before_start":
            self.decode.abort(rid, "soak: abort before start")
            self.faults["abort_before_start"] += 1
        elif req.abort == "mid_flight":
            due = time.monotonic() + self.rng.uniform(0, self.a.mid_abort_ms / 1e3)
            heapq.heappush(self.mid_aborts, (due, index, future))
        return True

    def _fire_mid_aborts(self) -> None:
        now = time.monotonic()
        while self.mid_aborts and self.mid_aborts[0][0] <= now:
            _, _, future = heapq.heappop(self.mid_aborts)
            req = self.inflight.get(future)
            if req is None or future.done():
                self.skipped["abort_mid_flight_too_late"] += 1
                continue
            self.decode.abort(req.rid, "soak: abort mid-flight")
            self.faults["abort_mid_flight"] += 1

    def _end(self, req: _Req, kind: str) -> None:
        self.ended += 1
        if kind:
            self.failed[kind] += 1
            self.by_generation[req.generation].failed[kind] += 1
        else:
            self.ok += 1
            self.by_generation[req.generation].ok += 1

    def _finish(self, future: concurrent.futures.Future) -> None:
        req = self.inflight.pop(future)
        try:
            result = future.result(0)
        except TransferError as e:
            if e.peer and e.peer != _node(req.generation):
                self.stray.append(f"{req.rid} (prefill-g{req.generation}): {e.kind} from "
                                  f"{e.peer}")
            self._end(req, e.kind)
            return
        except Exception as e:  # noqa: BLE001 -- an untyped failure is a finding, not a crash
            self.errors.append(f"{req.rid}: untyped failure {type(e).__name__}: {e}")
            self._end(req, f"untyped:{type(e).__name__}")
            return
        if result.prefill_node != _node(req.generation):
            self.stray.append(f"{req.rid} (prefill-g{req.generation}): served by "
                              f"{result.prefill_node}")
        try:
            if req.abort == "after_done":
                self.decode.abort(req.rid, "soak: abort after done")   # must change nothing
                self.faults["abort_after_done"] += 1
            if req.check:
                self.checked += 1
                want = expected_checksums(self.decode.group.geometry, req.rid, self._oracle_cache)
                probes = probes_of(self.decode)
                if probes.checksums(result) != want:
                    self.mismatches.append(req.rid)
                if self.spec.kv is not None and probes.kv_checksums(result) != \
                        expected_kv_checksums(self.spec, req.rid, req.tokens, self.a.dst_tp):
                    self.mismatches.append(f"{req.rid} (KV)")
            self.decode.release(result)
        except Exception as e:  # noqa: BLE001 -- reported as a failed check
            self.errors.append(f"{req.rid}: after completion: {type(e).__name__}: {e}")
        self._end(req, "")

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        a = self.a
        submit_until = self.t0 + a.seconds
        hard_deadline = submit_until + a.drain_seconds
        next_progress = time.monotonic() + a.progress_seconds
        schedule = list(self.schedule)
        while True:
            now = time.monotonic()
            submitting = self.submitted < a.requests and now < submit_until
            if submitting:
                while schedule and self.submitted >= schedule[0][0]:
                    _, fault = schedule.pop(0)
                    if fault == "storm":
                        self.storm()
                    else:
                        self.restart(fault)
                while len(self.inflight) < a.concurrency and self.submitted < a.requests:
                    if not self._submit_one():
                        break
            elif not self.inflight:
                break
            if now > hard_deadline:
                break
            self._fire_mid_aborts()
            wait = 0.05
            if self.mid_aborts:
                wait = max(0.0, min(wait, self.mid_aborts[0][0] - time.monotonic()))
            done, _ = concurrent.futures.wait(list(self.inflight), timeout=wait,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for f in sorted(done, key=lambda f: self.inflight[f].index):
                self._finish(f)
            if self.rss.needs_baseline(self.ended):
                self.rss.sample(self.ended)
            if time.monotonic() >= next_progress:
                self._progress_line()
                next_progress = time.monotonic() + a.progress_seconds
        self.schedule_left = [f for _, f in schedule]

    def _progress_line(self) -> None:
        self.rss.sample(self.ended)
        d = self.decode.stats()
        s = self.server.stats()
        line = {"t": round(time.monotonic() - self.t0, 1), "submitted": self.submitted,
                "ok": self.ok, "failed": dict(self.failed), "in_flight": len(self.inflight),
                "decode_pages_used": d["pages_used"], "prefill_pages_used": s["pages_used"],
                "coordinator_rss_mib": round((self.rss.current_kb(os.getpid()) or 0) / 1024, 1)}
        self.progress.append(line)
        failed = " ".join(f"{k}={v}" for k, v in sorted(self.failed.items())) or "-"
        self._log(f"{self.submitted}/{self.a.requests} submitted, ok {self.ok}, failed {failed}, "
                  f"in flight {len(self.inflight)}, pages used decode {d['pages_used']} prefill "
                  f"{s['pages_used']}, rss {line['coordinator_rss_mib']} MiB")

    def _log(self, text: str) -> None:
        if not self.a.quiet:
            print(f"[soak {time.monotonic() - self.t0:7.1f}s] {text}", flush=True)

    # -- the end ------------------------------------------------------------------------------
    def settle(self) -> dict:
        """Wait (bounded) for every page to come back, then collect every side's view."""
        deadline = time.monotonic() + self.a.settle_seconds
        while True:
            d, s = self.decode.stats(), self.server.stats()
            quiet = (d["pages_used"] == 0 and d["requests_in_flight"] == 0
                     and d["blocks_used"] == 0 and s["blocks_used"] == 0
                     and d["completed_unreleased"] == 0 and s["pages_used"] == 0
                     and s["requests_in_flight"] == 0 and s["waiting"] == 0)
            if quiet or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        ranks = {"decode": self.reports.query(self.decode.group, 10.0),
                 "prefill": self.reports.query(self.server.group, 10.0)}
        futures_left = self.decode.group.loop.call(lambda: self.decode.pending_callbacks)
        self.rss.sample(self.ended)
        return {"decode": d, "prefill": s, "ranks": ranks, "decode_futures_left": futures_left}

    def close(self) -> None:
        for group in (self.server, self.decode):
            if group is not None:
                try:
                    group.close()
                except Exception as e:  # noqa: BLE001 -- the summary is still written
                    self.errors.append(f"closing {group.node_id}: {type(e).__name__}: {e}")
        self.prefill_hosts.close()


def _checks(soak: Soak, end: dict, rss: list[dict], a: argparse.Namespace) -> dict:
    d, s, ranks = end["decode"], end["prefill"], end["ranks"]
    hung = [r.rid for r in soak.inflight.values()]
    unexpected = {k: v for k, v in soak.failed.items() if k not in EXPECTED_KINDS}
    rank_pages = {side: [None if r is None else r["pending"] + r["computing"] for r in rs]
                  for side, rs in ranks.items()}
    handles = {side: [None if r is None else r["handles_outstanding"] for r in rs]
               for side, rs in ranks.items()}
    ok_after_last_restart = soak.by_generation[soak.generation].ok if soak.restarts else soak.ok

    def check(ok: bool, detail: Any) -> dict:
        return {"ok": bool(ok), "detail": detail}

    return {
        "every_request_ended": check(not hung and soak.ended == soak.submitted,
                                     {"submitted": soak.submitted, "ended": soak.ended,
                                      "hung": hung[:20], "hung_count": len(hung)}),
        "counts_add_up": check(soak.ok + sum(soak.failed.values()) == soak.ended,
                               {"ok": soak.ok, "failed": sum(soak.failed.values()),
                                "ended": soak.ended}),
        "failures_of_expected_kinds": check(not unexpected,
                                            {"unexpected": unexpected,
                                             "expected": list(EXPECTED_KINDS)}),
        "byte_exact": check(not soak.mismatches and soak.checked > 0,
                            {"checked": soak.checked, "mismatches": soak.mismatches[:20]}),
        "no_errors": check(not soak.errors, soak.errors[:20]),
        "only_the_current_prefill_serves": check(
            not soak.stray and end["decode"]["prefills"] == [soak.server.node_id],
            {"stray": soak.stray[:20], "stray_count": len(soak.stray),
             "connected_at_end": end["decode"]["prefills"]}),
        "no_handler_errors": check(not soak.trap.records, soak.trap.records[:20]),
        "kill_failed_requests_before_close": check(
            all(r.get("in_flight_at_close", 0) == 0 for r in soak.restarts),
            [{k: r.get(k) for k in ("at_request", "in_flight", "in_flight_at_close")}
             for r in soak.restarts if r["how"] == "kill"]),
        "decode_pages_free": check(d["pages_free"] == d["pages_total"]
                                   and d["requests_in_flight"] == 0
                                   and d["completed_unreleased"] == 0
                                   and end["decode_futures_left"] == 0,
                                   {k: d[k] for k in ("pages_free", "pages_total",
                                                      "requests_in_flight",
                                                      "completed_unreleased")}),
        "decode_blocks_free": check(d["blocks_used"] == 0 and d["blocks_free"] == d["blocks_total"],
                                    {k: d[k] for k in ("blocks_used", "blocks_free",
                                                       "blocks_total")}),
        "prefill_blocks_free": check(s["blocks_used"] == 0 and s["blocks_free"] == s["blocks_total"],
                                     {k: s[k] for k in ("blocks_used", "blocks_free",
                                                        "blocks_total")}),
        "prefill_pages_free": check(s["pages_free"] == s["pages_total"]
                                    and s["requests_in_flight"] == 0 and s["waiting"] == 0,
                                    {k: s[k] for k in ("pages_free", "pages_total",
                                                       "requests_in_flight", "waiting")}),
        "rank_pages_free": check(all(v == 0 for vs in rank_pages.values() for v in vs)
                                 and all(v == 0 for v in d["rank_pages_busy"])
                                 and all(v == 0 for v in s["rank_pages_busy"]),
                                 {"rank_reports": rank_pages,
                                  "coordinator_view": {"decode": d["rank_pages_busy"],
                                                       "prefill": s["rank_pages_busy"]}}),
        "no_transfer_handles_left": check(all(v == 0 for vs in handles.values() for v in vs),
                                          handles),
        "rss_bounded": check(all(p["ok"] for p in rss),
                             [p for p in rss if not p["ok"]]),
        "all_faults_injected": check(not soak.schedule_left, {"not_injected":
                                                              soak.schedule_left}),
        "ok_after_last_restart": check(ok_after_last_restart > 0,
                                       {"ok_in_last_generation": ok_after_last_restart}),
    }


def run(a: argparse.Namespace) -> dict:
    """The soak; returns the summary (also written to ``--json``)."""
    if BENCH_DIR not in sys.path:           # the rank processes import SoakModel from here
        sys.path.insert(0, BENCH_DIR)
    old_delay = os.environ.get(DELAY_ENV)
    os.environ[DELAY_ENV] = str(a.prefill_delay_ms)
    started = time.monotonic()
    trap = ErrorTrap()
    logging.getLogger("statebridge").addHandler(trap)
    soak = Soak(a, trap)
    out: dict[str, Any] = {}
    try:
        soak.start()
        soak._log(f"started: {a.model} TP {a.src_tp}x{a.dst_tp} {a.layout}, "
                  f"{soak.num_pages} pages, faults {soak.schedule}")
        soak.run()
        end = soak.settle()
    finally:
        soak.close()
        logging.getLogger("statebridge").removeHandler(trap)
        if old_delay is None:
            os.environ.pop(DELAY_ENV, None)
        else:
            os.environ[DELAY_ENV] = old_delay
    rss = soak.rss.report(a.rss_growth_mib, a.rss_growth_frac)
    checks = _checks(soak, end, rss, a)
    pages_leaked = (end["decode"]["pages_used"] + end["prefill"]["pages_used"]
                    + sum(r["pending"] + r["computing"] for rs in end["ranks"].values()
                          for r in rs if r is not None))
    out = {
        "ok": all(c["ok"] for c in checks.values()),
        "requests": soak.ended, "submitted": soak.submitted, "ok_requests": soak.ok,
        "failed": sum(soak.failed.values()), "failed_by_kind": dict(soak.failed),
        "faults_injected": dict(soak.faults), "faults_skipped": dict(soak.skipped),
        "aborts": sum(v for k, v in soak.faults.items() if k.startswith("abort")),
        "restarts": soak.restarts, "by_prefill_generation": {
            g: o.as_dict() for g, o in sorted(soak.by_generation.items())},
        "pages_leaked": pages_leaked, "checked_byte_exact": soak.checked,
        "blocks_leaked": end["decode"]["blocks_used"] + end["prefill"]["blocks_used"],
        "kv": soak.spec.kv is not None,
        "backpressure_waits": soak.backpressure, "seconds": round(time.monotonic() - started, 2),
        "requests_per_s": round(soak.ended / max(1e-9, time.monotonic() - soak.t0), 1),
        "rss": rss, "checks": checks, "end_state": end, "progress": soak.progress,
        "args": vars(a), "machine": {"python": platform.python_version(),
                                     "platform": platform.platform(), "cpus": os.cpu_count()},
    }
    _print_summary(out, a)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


def _print_summary(out: dict, a: argparse.Namespace) -> None:
    if a.quiet:
        return
    print(f"soak: {out['requests']} requests in {out['seconds']} s "
          f"({out['requests_per_s']}/s), ok {out['ok_requests']}, failed {out['failed']} "
          f"{out['failed_by_kind']}")
    print(f"  faults injected: {out['faults_injected']} (skipped {out['faults_skipped']})")
    for r in out["restarts"]:
        print(f"  restart {r['how']} at request {r['at_request']}: {r['in_flight']} in flight, "
              f"{r['seconds']} s")
    print(f"  byte-exact checks: {out['checked_byte_exact']}, pages leaked: "
          f"{out['pages_leaked']}, KV blocks leaked: {out['blocks_leaked']}")
    for p in out["rss"]:
        growth = "-" if p["growth_kb"] is None else f"{p['growth_kb'] / 1024:+.1f} MiB"
        bound = "-" if p["bound_kb"] is None else f"{p['bound_kb'] / 1024:.0f} MiB"
        print(f"  rss {p['name']:<28} {(p['end_kb'] or 0) / 1024:7.1f} MiB, growth {growth} "
              f"(bound {bound})")
    for name, c in out["checks"].items():
        verdict = "ok" if c["ok"] else "FAILED: " + json.dumps(c["detail"], default=str)
        print(f"  check {name:<28} {verdict}")
    print("soak: " + ("PASSED" if out["ok"] else "FAILED"))


def _pair(text: str) -> tuple[int, int]:
    try:
        src, dst = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"TP pair must look like 1x2, got {text!r}") from None
    if src < 1 or dst < 1:
        raise argparse.ArgumentTypeError(f"TP sizes must be >= 1, got {text!r}")
    return src, dst


def _faults(text: str) -> list[str]:
    faults = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown faults {bad}; choose from {list(FAULTS)}")
    return faults


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=5000, help="requests to submit")
    p.add_argument("--seconds", type=float, default=300.0,
                   help="stop submitting after this long (the run then drains)")
    p.add_argument("--drain-seconds", type=float, default=60.0,
                   help="after --seconds, every request in flight must end within this")
    p.add_argument("--settle-seconds", type=float, default=15.0,
                   help="bound on the wait for every page to come back at the end")
    p.add_argument("--concurrency", type=int, default=24, help="requests in flight")
    p.add_argument("--model", choices=sorted(SPECS), default="mamba2")
    p.add_argument("--pair", type=_pair, default=(1, 2), help="prefill TP x decode TP")
    p.add_argument("--layout", default="DLS")
    p.add_argument("--faults", type=_faults, default=["kill", "storm", "close"],
                   help=f"comma-separated, in order, evenly spread: {', '.join(FAULTS)}")
    p.add_argument("--abort-rate", type=float, default=0.05,
                   help="fraction of requests aborted at a random moment")
    p.add_argument("--mid-abort-ms", type=float, default=20.0,
                   help="a mid-flight abort comes 0..this after submit")
    p.add_argument("--prefill-delay-ms", type=float, default=2.0,
                   help="the prefill model sleeps 0..this per request")
    p.add_argument("--check-every", type=int, default=4,
                   help="check every n-th request byte-exact against the oracle")
    p.add_argument("--warmup", type=int, default=200,
                   help="requests before a process's RSS baseline is taken")
    p.add_argument("--rss-growth-mib", type=float, default=64.0)
    p.add_argument("--rss-growth-frac", type=float, default=0.10,
                   help="allowed RSS growth: max(--rss-growth-mib, this x baseline)")
    p.add_argument("--heartbeat", type=float, default=0.2)
    p.add_argument("--peer-timeout", type=float, default=10.0)
    p.add_argument("--lease-timeout", type=float, default=30.0)
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--progress-seconds", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    a.src_tp, a.dst_tp = a.pair
    for name in ("requests", "concurrency", "check_every"):
        if getattr(a, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    logging.basicConfig(level=os.environ.get("STATEBRIDGE_LOG_LEVEL", "WARNING"))
    out = run(a)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
