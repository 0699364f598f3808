"""Running one cell: statebridge end to end, NIXL on the same runs and vLLM's way, the copy
limit, and the ``ucx_perftest`` line rate. Each returns the cell's figures as a dict."""

from __future__ import annotations

import argparse
import itertools
import os
import threading
import time
import uuid
from typing import Any, Sequence

import numpy as np

from statebridge.config import ConnectorConfig
from statebridge.bench.hetero_tp.procstats import _cpu_snapshot, _sleeps_snapshot
from statebridge.errors import CacheFullError
from statebridge.state.plan import TransferPlan
from statebridge.state.prefix import DEFAULT_CHECKPOINT_TOKENS
from statebridge.state.spec import StateSpec

MODEL = "statebridge.bench._model:PageOnceModel"

# --transport -> (ConnectorConfig.ucx_error_handling, ucx_perftest UCX_TLS, perftest -e)
TRANSPORTS: dict[str, tuple[bool, str, bool]] = {
    "sm": (False, "sm", False),        # worker-address endpoints, no error handling: shared memory
    "tcp-eh": (True, "tcp", True),     # UCX endpoint error handling on: UCX drops to tcp/lo
}
#: Completions closer than the round's mean gap over this belong to one burst
#: (:func:`completions_per_burst`).
BURST_GAP_FACTOR = 4.0
#: Every request's prompt starts with the next of these (:func:`_run_requests`): no two prompts
#: of a run share a token prefix, so a prefix cache (``--prefix-caching``) never hits.
_PROMPT_IDS = itertools.count()
#: The prefix cache's figures of a prefill server's stats, in a cell (``prefix_cache``).
PREFIX_STATS = ("prefix_cache", "pages_cached", "blocks_cached", "prefix_evictions",
                "prefix_queries", "prefix_hits")

def prompt_tokens(spec: StateSpec, a: argparse.Namespace) -> int:
    """Tokens of each request's prompt prefix: --prompt-len (default 1024) for a spec with
    attention KV; one token for the recurrent state alone (its size does not depend on it)."""
    if spec.kv is None:
        return 1
    return 1024 if a.prompt_len is None else a.prompt_len


# -- line rate ---------------------------------------------------------------------------------

class _LineRate:
    def __init__(self, transport: str) -> None:
        _, self.tls, self.error_handling = TRANSPORTS[transport]
        self.cache: dict[int, tuple[float | None, str]] = {}
        try:
            from statebridge.bench._perftest import perftest
            self.perftest, self.error = perftest, ""
        except Exception as e:  # noqa: BLE001 -- recorded per cell
            self.perftest, self.error = None, f"ucx_perftest helpers unavailable: {e}"

    def __call__(self, size: int) -> tuple[float | None, str]:
        """Best of the poll and sleep wait modes, GB/s, at ``size`` bytes per message."""
        size = max(1, int(size))
        if size in self.cache:
            return self.cache[size]
        if self.perftest is None:
            return None, self.error
        iters = int(min(20000, max(20, (512 << 20) // size)))
        best, why = None, ""
        for mode in ("poll", "sleep"):
            try:
                r = self.perftest(size, self.tls, self.error_handling, iters, 120.0, mode)
                best = max(best or 0.0, r["gbps"])
            except Exception as e:  # noqa: BLE001 -- recorded
                why = f"ucx_perftest ({mode}): {e}"[:300]
        self.cache[size] = (best, "" if best else why)
        return self.cache[size]


# -- statebridge --------------------------------------------------------------------------------

def _run_requests(decode, count: int, concurrency: int, prefix: str,
                  timeout: float, tokens: int = 1) -> list:
    """``count`` requests, ``concurrency`` in flight, driven on the decode coordinator's loop
    thread the way the decode node drives its own (:meth:`DecodeCoordinator.start` /
    :meth:`~DecodeCoordinator.free` with a callback): a completed request's page is freed and
    the next request started in the same loop pass, with no thread hand-off per request (the
    NIXL and vLLM's-way loops likewise start the next read from their own loop). The calling
    thread only waits for the round to end; the first failure ends it and is raised.
    Each prompt is ``tokens`` tokens that begin with a number no other prompt of the process
    begins with (so no prefix is ever shared: a prefix cache never hits)."""
    state = {"next": 0, "inflight": 0, "error": None}
    results: list = []
    finished = threading.Event()

    def start_more() -> None:
        while state["next"] < count and state["inflight"] < concurrency \
                and state["error"] is None:
            i = state["next"]
            try:
                decode.start(f"{prefix}{i}-{uuid.uuid4().hex[:6]}",
                             (next(_PROMPT_IDS),) + (i % 1000,) * (tokens - 1), on_done)
            except CacheFullError:
                if not state["inflight"]:
                    state["error"] = CacheFullError(f"no page free with nothing in flight "
                                                    f"(request {i} of {count})")
                    finished.set()
                return                    # back-pressure: the next completion starts more
            except Exception as e:  # noqa: BLE001 -- ends the round, raised by the caller
                state["error"] = e
                if not state["inflight"]:
                    finished.set()
                return
            state["next"] = i + 1
            state["inflight"] += 1

    def on_done(result, error) -> None:
        state["inflight"] -= 1
        if error is not None:
            if state["error"] is None:
                state["error"] = error
        else:
            results.append(result)
            decode.free(result.request_id)
            start_more()
        if len(results) == count or (state["error"] is not None and not state["inflight"]):
            finished.set()

    if count:
        decode.group.loop.call(start_more)
        if not finished.wait(timeout):
            raise TimeoutError(f"{count - len(results)} of {count} requests not done after "
                               f"{timeout} s")
    if state["error"] is not None:
        raise state["error"]
    return results


def _expected_checksums(geometry, request_id: str) -> tuple[str, ...]:
    from statebridge.state.cache import StateCache, page_checksum
    from statebridge.testing.synthetic import fill_page, global_state, request_seed

    state = global_state(geometry.spec, request_seed(request_id))
    cache = StateCache(geometry, 1)
    out = []
    for rank in range(geometry.tp_size):
        fill_page(cache, 0, state, rank)
        out.append(page_checksum(geometry, cache.page_bytes(0)))
    return tuple(out)


def _expected_kv_checksums(kv_geometry, request_id: str, tokens: int) -> tuple[str, ...]:
    """Each decode rank's KV checksum of the request, from the synthetic KV written into a
    fresh pool of just the request's blocks (the checksum does not depend on block ids)."""
    import torch

    from statebridge.connector.rank import KVBlocks, kv_checksum
    from statebridge.state.kv import BlockGeometry, blocks_for
    from statebridge.testing.synthetic import fill_kv, global_kv, request_seed

    n = blocks_for(tokens, kv_geometry.block_size)
    geo = BlockGeometry(kv_geometry.kv, kv_geometry.tp_size, kv_geometry.layout,
                        kv_geometry.block_size, max(1, n))
    state = global_kv(geo.kv, request_seed(request_id), tokens)
    out = []
    for rank in range(geo.tp_size):
        pool = KVBlocks(geo, torch.zeros(geo.nbytes, dtype=torch.uint8), 0)
        fill_kv(pool, range(n), state, rank)
        out.append(kv_checksum(pool, range(n), tokens))
    return tuple(out)


def _statebridge_cell(spec: StateSpec, src_tp: int, dst_tp: int, layout: str,
                      a: argparse.Namespace, pools, config: ConnectorConfig) -> dict:
    from statebridge.bench._model import CHECK_PREFIX
    from statebridge.connector.decode import DecodeCoordinator
    from statebridge.connector.prefill import PrefillServer
    from statebridge.state.kv import blocks_for
    from statebridge.testing.probes import Probes

    prefill_hosts, decode_hosts = pools
    c = a.concurrency
    tokens = prompt_tokens(spec, a)
    blocks = blocks_for(tokens, a.block_size) if spec.kv is not None else 0

    def kv(pages: int) -> dict:
        return {"kv_layout": a.kv_layout, "block_size": a.block_size,
                "num_blocks": max(1, pages * blocks)} if spec.kv is not None else {}
    out: dict[str, Any] = {"device": a.device,
                           "prompt_tokens": tokens if spec.kv is not None else None,
                           "kv_layout": a.kv_layout if spec.kv is not None else None}
    # Every rank is instrumented (connector.messages.RankProbe): the check round's decode ranks
    # with checksums, the others with timing probes -- per rank and request one more row in
    # the RankDone's frame, left out of the control-message counts below.
    # With --prefix-caching the prefill server keeps recurrent-state checkpoints and KV blocks
    # of every prompt (none ever hits: the prompts share no prefix) until it idles after 64 of
    # them (connector.prefill_cache.IDLE_AFTER: then it keeps none and skips each prompt after
    # hashing its first block). Its pools are the same as without the cache, as a node's are
    # when the flag is flipped: a request evicts cached units when it needs their room.
    cached = bool(getattr(a, "prefix_caching", False))
    src_pages = c + 2
    out["prefix_caching"] = cached
    out["prefix_checkpoint_tokens"] = getattr(a, "prefix_stride", DEFAULT_CHECKPOINT_TOKENS) \
        if cached else None
    with PrefillServer(spec, src_tp, layout, num_pages=src_pages, config=config,
                       launcher=prefill_hosts.launcher(), model=MODEL, probes="timing",
                       device=a.device, prefix_cache=cached,
                       prefix_stride=getattr(a, "prefix_stride", DEFAULT_CHECKPOINT_TOKENS),
                       **kv(src_pages)) as server:
        server.wait_ready()
        # 1. byte-exactness on a few requests, checksums on
        if a.check_requests:
            with DecodeCoordinator(spec, dst_tp, layout, num_pages=a.check_requests,
                                   config=config, launcher=decode_hosts.launcher(),
                                   probes="checksums", device=a.device,
                                   **kv(a.check_requests)) as check:
                probes = Probes(check)
                check.connect(server.address)
                results = _run_requests(check, a.check_requests, a.check_requests,
                                        CHECK_PREFIX, a.timeout, tokens)
                for r in results:
                    if probes.checksums(r) != _expected_checksums(check.group.geometry, r.request_id):
                        raise AssertionError(f"{r.request_id}: decode pages differ from the "
                                             f"synthetic-state oracle")
                    if spec.kv is not None and probes.kv_checksums(r) != _expected_kv_checksums(
                            check.group.kv_geometry, r.request_id, tokens):
                        raise AssertionError(f"{r.request_id}: decode KV blocks differ from "
                                             f"the synthetic-KV oracle")
            out["checked_requests"] = len(results)
        # 2. the timed round, timing probes only
        with DecodeCoordinator(spec, dst_tp, layout, num_pages=c, config=config,
                               launcher=decode_hosts.launcher(), probes="timing",
                               device=a.device, **kv(c)) as decode:
            probes = Probes(decode, server)
            decode.connect(server.address)
            plan = TransferPlan(server.group.geometry, decode.group.geometry)
            if spec.kv is not None:
                from statebridge.state.kv import KVPlan

                kv_plan = KVPlan(server.group.kv_geometry, decode.group.kv_geometry).summary(tokens)
                out["plan_kv_runs_per_request"] = kv_plan["kv_runs"]
                out["plan_kv_bytes_per_request"] = kv_plan["kv_bytes"]
            warm = _run_requests(decode, c + 2 + c, c, "warm-", a.timeout, tokens)
            _wait_for_probes(probes, server, warm, a.timeout)
            dst_staging0 = np.array(probes.staging_bytes(decode))
            src_staging0 = np.array(probes.staging_bytes(server))
            # CPU seconds per process group over the timed round: where the work goes, and a
            # figure that (unlike wall time) other load on a shared machine barely moves.
            groups = {"bench_process": [os.getpid()],
                      "prefill_ranks": prefill_hosts.pids[:src_tp],
                      "decode_ranks": decode_hosts.pids[:dst_tp]}
            ops0 = _ops_snapshot(prefill_hosts, decode_hosts, src_tp, dst_tp)
            received0 = probes.received
            cpu0, sleeps0 = _cpu_snapshot(groups), _sleeps_snapshot(groups)
            started = time.perf_counter()
            results = _run_requests(decode, a.requests, c, "req-", a.timeout, tokens)
            wall = time.perf_counter() - started
            cpu1, sleeps1 = _cpu_snapshot(groups), _sleeps_snapshot(groups)
            _wait_for_probes(probes, server, results, a.timeout)  # the prefill side's last
            dst_staging = np.array(probes.staging_bytes(decode)) - dst_staging0
            src_staging = np.array(probes.staging_bytes(server)) - src_staging0
            ops1 = _ops_snapshot(prefill_hosts, decode_hosts, src_tp, dst_tp)
            ops1["bench_process"]["probes_received"] = probes.received - received0
            # 3. low load: one request in flight
            low = (_run_requests(decode, a.low_load_requests, 1, "low-", a.timeout, tokens)
                   if a.low_load else [])
            _wait_for_probes(probes, server, low, a.timeout)
            rank_lat = np.array([max(probes.rank_seconds(r)) for r in results])
            messages = sorted({probes.messages(r) for r in results})
            held_at = [probes.held_at(r) for r in results]
            stats = server.stats()
            out["prefix_cache"] = {k: stats.get(k) for k in PREFIX_STATS}
            if cached and not stats.get("prefix_cache"):
                raise AssertionError("--prefix-caching: the prefill server's cache is off "
                                     "(the stand-in model does not prefill in chunks?)")
            low_rank = np.array([max(probes.rank_seconds(r)) for r in low]) * 1e3
            held = np.array([(probes.held_at(r) - probes.state_final_at(r, server)) * 1e3
                             for r in low])
    lat = np.array([r.seconds for r in results])
    nbytes = sum(r.nbytes for r in results)
    out.update({
        "gbps": nbytes / wall / 1e9,
        "requests_per_s": len(results) / wall,
        "seconds": wall,
        "bytes_per_request": nbytes // len(results),
        "messages_per_request": messages[0] if len(messages) == 1 else messages,
        "plan_messages_per_request": plan.messages_per_request + out.get(
            "plan_kv_runs_per_request", 0),
        "plan_bytes_per_request": plan.bytes_per_request + out.get(
            "plan_kv_bytes_per_request", 0),
        "mean_message_bytes": nbytes / len(results) / messages[0] if len(messages) == 1 else
        plan.bytes_per_request / plan.messages_per_request,
        "staging_bytes_per_request": int(dst_staging.sum() + src_staging.sum()) // len(results),
        "plan_staging_bytes_per_request": plan.staging_bytes_per_request,
        "latency_p50_ms": float(np.percentile(lat, 50) * 1e3),
        "latency_p99_ms": float(np.percentile(lat, 99) * 1e3),
        # Where the time goes: post -> done inside the slowest decode rank (UCX + polling), vs
        # submit -> done (adds the control plane, prefill queueing and the stand-in model).
        "rank_transfer_p50_ms": float(np.percentile(rank_lat, 50) * 1e3),
        "rank_transfer_p99_ms": float(np.percentile(rank_lat, 99) * 1e3),
        "cpu_us_per_request": {k: (cpu1[k] - cpu0[k]) / len(results) * 1e6 for k in groups},
    })
    out["cpu_us_per_request"]["total"] = sum(out["cpu_us_per_request"].values())
    out["wakeups_per_request"] = {k: (sleeps1[k] - sleeps0[k]) / len(results) for k in groups}
    out["wakeups_per_request"]["total"] = sum(out["wakeups_per_request"].values())
    out["completions_per_burst"] = completions_per_burst(held_at)
    out.update(_per_request_counts(ops0, ops1, len(results)))
    out.update({"low_load_requests": len(low), "low_load_latency_p50_ms": None,
                "low_load_latency_p99_ms": None, "low_load_rank_transfer_p50_ms": None,
                "low_load_rank_transfer_p99_ms": None, "low_load_final_to_held_p50_ms": None,
                "low_load_final_to_held_p99_ms": None})
    if low:
        low_lat = np.array([r.seconds for r in low]) * 1e3
        out.update({"low_load_latency_p50_ms": float(np.percentile(low_lat, 50)),
                    "low_load_latency_p99_ms": float(np.percentile(low_lat, 99)),
                    "low_load_rank_transfer_p50_ms": float(np.percentile(low_rank, 50)),
                    "low_load_rank_transfer_p99_ms": float(np.percentile(low_rank, 99))})
        # "prefill state final -> every decode rank holds it": the last prefill rank's
        # state-final moment to the last decode rank's completion, one clock (CLOCK_MONOTONIC)
        out.update({"low_load_final_to_held_p50_ms": float(np.percentile(held, 50)),
                    "low_load_final_to_held_p99_ms": float(np.percentile(held, 99))})
    return out, plan


def _wait_for_probes(probes, server, results: list, timeout: float) -> None:
    """Wait until the prefill ranks' probes of ``results`` are in: a prefill rank settles a
    request once its sends completed, just after the decode side holds it (the decode ranks'
    probes are in when a result is). AssertionError naming a request whose probes never came."""
    from statebridge.errors import ConfigError

    give_up = time.monotonic() + timeout
    for r in results:
        while True:
            try:
                probes.of(r, server)
                break
            except ConfigError:
                if time.monotonic() > give_up:
                    raise AssertionError(f"no prefill-side probes of {r.request_id} after "
                                         f"{timeout} s") from None
                time.sleep(0.005)


def _ops_snapshot(prefill_hosts, decode_hosts, src_tp: int, dst_tp: int) -> dict:
    """Operation counts (:data:`statebridge.connector.stats.ops`) by process class: this
    process (the coordinators), the prefill rank hosts, the decode rank hosts."""
    from statebridge.connector.stats import ops

    def total(snaps):
        out: dict[str, int] = {}
        for snap in snaps:
            for k, v in snap.items():
                out[k] = out.get(k, 0) + v
        return out
    return {"bench_process": ops.snapshot(), "prefill_ranks": total(prefill_hosts.ops(src_tp)),
            "decode_ranks": total(decode_hosts.ops(dst_tp))}


def _per_request_counts(ops0: dict, ops1: dict, requests: int) -> dict:
    """``control_messages_per_request`` (control messages sent + received, all statebridge
    processes, the benchmark's own probes left out: ``probes_sent`` by the ranks,
    ``probes_received`` by this process) and ``ucx_operations_per_request`` (UCX tag sends +
    receives posted), each with its split by process class, over the timed round."""
    def per(keys, group, minus=()):
        def moved(k):
            return ops1[group].get(k, 0) - ops0[group].get(k, 0)
        return (sum(map(moved, keys)) - sum(map(moved, minus))) / requests
    out = {}
    for field, keys, minus in (
            ("control_messages", ("control_sent", "control_received"),
             ("probes_sent", "probes_received")),
            ("ucx_operations", ("ucx_ops",), ())):
        split = {g: per(keys, g, minus) for g in ops0}
        out[f"{field}_per_request"] = sum(split.values())
        out[f"{field}_per_request_by_process"] = split
    # decode ranks' copies out of a prefill rank's shared map (one per rank pair per request
    # where the pair is large enough; 0: UCX moved every byte)
    out["shared_map_reads_per_request"] = sum(per(("shared_map_reads",), g) for g in ops0)
    return out


def completions_per_burst(times: Sequence[float], factor: float = BURST_GAP_FACTOR) -> float:
    """How bunched a round's completions are: the mean number of completions per burst, where
    completions less than ``1/factor`` of the round's mean gap apart belong to one burst. A
    steady stream gives about 1 (a Poisson stream ~1.3); a round in which requests advance in
    lock step (those in flight finish together, then restart together) gives about the
    concurrency, and cores wait while the next batch goes round the control plane."""
    t = np.sort(np.asarray(times, dtype=float))
    if len(t) < 2:
        return float(len(t))
    mean = (t[-1] - t[0]) / (len(t) - 1)
    if mean <= 0:
        return float(len(t))
    return len(t) / (1 + int(np.count_nonzero(np.diff(t) >= mean / factor)))


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x and y else None


def _nixl_cell(nixl, nixl_why, plan, spec, preset, src_tp, dst_tp, layout, a, vllm_cache,
               cell) -> dict:
    """NIXL reading exactly the runs statebridge posts (``nixl_*``: the data plane alone), and
    vLLM's way (``vllm_way_*``): NixlConnector's loop over vLLM's descriptors -- pages ``LDS``
    (one descriptor per layer per conv x/B/C piece and SSM slice), KV ``LH`` (one per layer per
    K or V half per block), with notifications and the sources' free-on-every-reader loop
    (:func:`statebridge.bench._vllm_way._vllm_read`). vLLM's way does not depend on statebridge's
    layout: measured once per (preset, pair) and shared by its cells."""
    from statebridge.bench._nixl_reads import SlotPlan
    from statebridge.state.layout import PageGeometry

    out: dict[str, Any] = {f: None for f in _NIXL_FIELDS}
    out["nixl_note"] = nixl_why
    if nixl is None:
        return out
    kw = dict(pages=a.concurrency, requests=a.requests, concurrency=a.concurrency,
              timeout=a.timeout)
    tokens = prompt_tokens(spec, a)
    vllm_pages = TransferPlan(PageGeometry(spec, src_tp, "LDS"),
                              PageGeometry(spec, dst_tp, "LDS"))
    if spec.kv is not None:
        same_plan = SlotPlan(plan, (a.kv_layout, a.kv_layout), a.block_size, tokens,
                             a.concurrency)
        vllm_plan = SlotPlan(vllm_pages, ("LH", "LH"), a.block_size, tokens, a.concurrency)
    else:
        same_plan, vllm_plan = plan, vllm_pages
    try:
        same = nixl.run_cell(same_plan, **kw)
        key = (preset, src_tp, dst_tp)
        if key not in vllm_cache:
            vllm = nixl.run_cell(vllm_plan, vllm=True, **kw)
            if a.low_load:
                low = nixl.run_cell(vllm_plan, vllm=True, paced=True, **dict(
                    kw, requests=a.low_load_requests, concurrency=1))
                for name in ("latency_p50_ms", "latency_p99_ms", "final_to_held_p50_ms",
                             "final_to_held_p99_ms"):
                    vllm[f"low_load_{name}"] = low[name]
            vllm_cache[key] = vllm
        vllm = vllm_cache[key]
    except Exception as e:  # noqa: BLE001 -- recorded, the run goes on
        out["nixl_note"] = f"NIXL run failed: {e}"[:500]
        return out
    out.update({
        "nixl_gbps": same["gbps"], "ratio_to_nixl": _ratio(cell["gbps"], same["gbps"]),
        "nixl_requests_per_s": same["requests_per_s"],
        "nixl_latency_p50_ms": same["latency_p50_ms"],
        "nixl_latency_p99_ms": same["latency_p99_ms"],
        "nixl_descriptors_per_request": same["descriptors_per_request"],
        "nixl_calls_per_request": same["nixl_calls_per_request"],
        "nixl_calls_per_request_by_call": same["nixl_calls_per_request_by_call"],
        "nixl_cpu_us_per_request": same["cpu_us_per_request"],
        "nixl_options": same.get("options"),
        "nixl_src_cpu_cores": same.get("src_cpu_cores"),
        "vllm_way_gbps": vllm["gbps"], "ratio_to_vllm_way": _ratio(cell["gbps"], vllm["gbps"]),
        "vllm_way_requests_per_s": vllm["requests_per_s"],
        "vllm_way_latency_p50_ms": vllm["latency_p50_ms"],
        "vllm_way_latency_p99_ms": vllm["latency_p99_ms"],
        "vllm_way_descriptors_per_request": vllm["descriptors_per_request"],
        "vllm_way_nixl_calls_per_request": vllm["nixl_calls_per_request"],
        "vllm_way_nixl_calls_per_request_by_call": vllm["nixl_calls_per_request_by_call"],
        "vllm_way_cpu_us_per_request": vllm["cpu_us_per_request"],
        "vllm_way_low_load_latency_p50_ms": vllm.get("low_load_latency_p50_ms"),
        "vllm_way_low_load_latency_p99_ms": vllm.get("low_load_latency_p99_ms"),
        "vllm_way_low_load_final_to_held_p50_ms": vllm.get("low_load_final_to_held_p50_ms"),
        "vllm_way_low_load_final_to_held_p99_ms": vllm.get("low_load_final_to_held_p99_ms"),
        "nixl_note": None,
    })
    return out


def _pair_bytes(plan, spec, a) -> list[tuple[int, int, int]]:
    """(source rank, destination rank, bytes per request) of the cell's plan, KV included."""
    from statebridge.bench._nixl_reads import SlotPlan

    if spec.kv is not None:
        sp = SlotPlan(plan, (a.kv_layout, a.kv_layout), a.block_size, prompt_tokens(spec, a), 1)
        return [(p.src_rank, p.dst_rank, int(p.runs[:, 2].sum())) for p in sp]
    out = []
    for d in range(plan.dst.tp_size):
        for s in range(plan.src.tp_size):
            pair = plan.pair(s, d)
            if pair is not None:
                out.append((s, d, int(np.asarray(pair.runs)[:, 2].sum())))
    return out


#: The figures of a cell compared with its copy limit (``copy_limit_beaten_by``).
LIMITED = (("statebridge", "gbps"), ("nixl", "nixl_gbps"), ("vllm_way", "vllm_way_gbps"))


def _copy_limit_cell(plan, spec, src_tp, dst_tp, preset, a, cache, cell) -> dict:
    """``copy_limit_gbps``: the fastest copy of the cell's bytes this machine does, the best of
    :data:`statebridge.bench._copylimit.CANDIDATES` (the shared-map read and
    ``process_vm_readv``, one copier per core or per decode rank, cold and warm sources), by
    the copy's CPU (bytes per CPU-second x the cores it can use, so that other work on the
    machine does not lower it; :mod:`statebridge.bench._copylimit`). ``copy_limit_yardstick``
    names the candidate it came from, ``copy_limit_candidates`` has every candidate's figures
    (wall-clock ones too), ``copy_limit_cpu_share`` says how much of the cores its copiers got
    (about 1 on an idle machine). The same bytes for every layout, so measured once per
    (preset, pair). ``copy_limit_beaten_by``: which of statebridge, NIXL and vLLM's way moved
    the bytes faster than the limit (a limit that is beaten is wrong; the report says so)."""
    out = {"copy_limit_gbps": None, "ratio_to_copy_limit": None, "copy_limit_yardstick": None,
           "copy_limit_candidates": None, "copy_limit_beaten_by": None,
           "copy_limit_note": "disabled by --no-copy-limit" if a.no_copy_limit else None,
           "copy_limit_bytes_per_request": None, "copy_limit_cpu_us_per_request": None,
           "copy_limit_copiers": None, "copy_limit_cpu_share": None}
    if a.no_copy_limit:
        return out
    key = (preset, src_tp, dst_tp)
    try:
        if key not in cache:
            from statebridge.bench._copylimit import copy_limit

            cache[key] = copy_limit(_pair_bytes(plan, spec, a), src_tp=src_tp,
                                    requests=a.requests, pages=a.concurrency,
                                    timeout=a.timeout)
        r = cache[key]
    except Exception as e:  # noqa: BLE001 -- recorded
        out["copy_limit_note"] = f"copy limit failed: {e}"[:300]
        return out
    failed = [f"{name}: {c['error']}" for name, c in r["candidates"].items() if c.get("error")]
    out.update({"copy_limit_gbps": r["gbps"], "ratio_to_copy_limit": _ratio(cell["gbps"],
                                                                             r["gbps"]),
                "copy_limit_yardstick": r["yardstick"],
                "copy_limit_candidates": r["candidates"],
                "copy_limit_beaten_by": [who for who, field in LIMITED
                                         if (cell.get(field) or 0) > r["gbps"]],
                "copy_limit_note": ("candidates failed: " + "; ".join(failed))[:500]
                if failed else None,
                "copy_limit_bytes_per_request": r["bytes_per_request"],
                "copy_limit_cpu_us_per_request": r["cpu_us_per_request"],
                "copy_limit_copiers": r["copiers"], "copy_limit_cpu_share": r["cpu_share"]})
    return out


_NIXL_FIELDS = ("nixl_gbps", "ratio_to_nixl", "nixl_requests_per_s", "nixl_latency_p50_ms",
                "nixl_latency_p99_ms", "nixl_descriptors_per_request", "nixl_calls_per_request",
                "nixl_calls_per_request_by_call", "nixl_cpu_us_per_request", "vllm_way_gbps",
                "ratio_to_vllm_way", "vllm_way_requests_per_s", "vllm_way_latency_p50_ms",
                "vllm_way_latency_p99_ms", "vllm_way_descriptors_per_request",
                "vllm_way_nixl_calls_per_request", "vllm_way_nixl_calls_per_request_by_call",
                "vllm_way_cpu_us_per_request", "vllm_way_low_load_latency_p50_ms",
                "vllm_way_low_load_latency_p99_ms", "vllm_way_low_load_final_to_held_p50_ms",
                "vllm_way_low_load_final_to_held_p99_ms")
