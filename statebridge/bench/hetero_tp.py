"""Heterogeneous-TP transfer benchmark: statebridge vs the line rate, NIXL, and vLLM's way.

For every (preset, prefill TP x decode TP, layout) cell, in one run on this machine:

- statebridge: a :class:`~statebridge.connector.prefill.PrefillServer` and a
  :class:`~statebridge.connector.decode.DecodeCoordinator`, every rank its own process
  (:class:`~statebridge.testing.hosts.RankHostPool`), move ``--requests`` requests with
  ``--concurrency`` in flight. Byte-exactness is checked first on a few requests (decode-rank
  checksums against the synthetic-state oracle), then the timed round runs without checksums.
  The prefill "model" (:class:`~statebridge.bench._model.PageOnceModel`) fills each page once,
  so the transfer, not the stand-in model, is measured.
- line rate: ``ucx_perftest -t tag_bw`` over the same UCX transport at the plan's mean message
  size (:mod:`statebridge.bench._perftest`).
- NIXL (UCX backend): READ of exactly the cell's runs between page buffers of separate
  processes, one descriptor per run; and vLLM's way: the same state laid out ``LDS`` (one
  descriptor per layer per piece). See :mod:`statebridge.bench._nixl`.

Wire into a CLI with :func:`add_parser` and :func:`main`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from statebridge.config import ConnectorConfig
from statebridge.bench._nixl import _cpu_seconds
from statebridge.errors import CacheFullError, ConfigError
from statebridge.state.layout import Layout
from statebridge.state.plan import TransferPlan
from statebridge.state.spec import StateSpec

log = logging.getLogger(__name__)

__all__ = ["PRESETS", "TRANSPORTS", "add_parser", "main", "run", "preset_spec"]

GIB = 1 << 30
MODEL = "statebridge.bench._model:PageOnceModel"

_LFM2_1_2B = {
    "model_type": "lfm2", "hidden_size": 2048, "num_hidden_layers": 16, "conv_L_cache": 3,
    "torch_dtype": "bfloat16", "num_attention_heads": 32, "num_key_value_heads": 8,
    "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv",
                    "conv", "full_attention", "conv", "full_attention", "conv",
                    "full_attention", "conv", "full_attention", "conv"]}
_MAMBA2_2_7B = {
    "model_type": "mamba2", "hidden_size": 2560, "expand": 2, "head_dim": 64, "num_heads": 80,
    "state_size": 128, "n_groups": 1, "num_hidden_layers": 64, "conv_kernel": 4,
    "torch_dtype": "bfloat16"}
# Granite-4.0-H-1B (dense): 40 layers, attention at 5, 15, 25, 35 (12 heads / 4 KV heads x 128),
# Mamba2 48 heads x 64, d_state 128, n_groups 1 (B/C replicated), d_conv 4.
_GRANITE_4_0_H_1B = {
    "model_type": "granitemoehybrid", "hidden_size": 1536, "num_hidden_layers": 40,
    "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 4096,
    "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
    "mamba_d_conv": 4, "mamba_expand": 2, "num_local_experts": 0,
    "position_embedding_type": "nope", "torch_dtype": "bfloat16",
    "layer_types": ["full_attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)]}
_TINY = {
    "model_type": "mamba2", "hidden_size": 64, "expand": 2, "head_dim": 16, "num_heads": 8,
    "state_size": 16, "n_groups": 2, "num_hidden_layers": 3, "conv_kernel": 4,
    "torch_dtype": "bfloat16"}

# A tiny LFM2 with attention: 2 conv + 2 attention layers, 4 heads / 2 KV heads x 16 (tests).
_TINY_HYBRID = {
    "model_type": "lfm2", "hidden_size": 64, "conv_L_cache": 3, "torch_dtype": "bfloat16",
    "num_attention_heads": 4, "num_key_value_heads": 2,
    "layer_types": ["conv", "full_attention", "conv", "full_attention"]}

# name -> (HF config, StateSpec.from_config keyword arguments; "kv": False drops the attention
# KV: the recurrent state alone, as the preset measured before KV moved)
PRESETS: dict[str, tuple[dict, dict]] = {
    "lfm2-1.2b": (_LFM2_1_2B, {"kv": False}),
    "lfm2-1.2b-hybrid": (_LFM2_1_2B, {}),
    "granite-4.0-h-1b": (_GRANITE_4_0_H_1B, {}),
    "mamba2-2.7b": (_MAMBA2_2_7B, {}),
    "mamba2-2.7b-fp32ssm": (_MAMBA2_2_7B, {"ssm_dtype": "float32"}),
    "tiny": (_TINY, {}),
    "tiny-hybrid": (_TINY_HYBRID, {}),
}

# --transport -> (ConnectorConfig.ucx_error_handling, ucx_perftest UCX_TLS, perftest -e)
TRANSPORTS: dict[str, tuple[bool, str, bool]] = {
    "sm": (False, "sm", False),        # worker-address endpoints, no error handling: shared memory
    "tcp-eh": (True, "tcp", True),     # UCX endpoint error handling on: UCX drops to tcp/lo
}
DEFAULT_TP = (1, 2, 4, 8)
LAYOUTS = ("LSD", "LDS", "DLS")
#: Completions closer than the round's mean gap over this belong to one burst
#: (:func:`completions_per_burst`).
BURST_GAP_FACTOR = 4.0

CELL_FIELDS = ("pair", "layout", "preset", "gbps", "messages_per_request",
               "staging_bytes_per_request", "latency_p50_ms", "latency_p99_ms",
               "line_rate_gbps", "ratio_to_line_rate", "nixl_gbps", "ratio_to_nixl",
               "vllm_way_gbps", "ratio_to_vllm_way", "vllm_way_requests_per_s",
               "vllm_way_latency_p50_ms", "vllm_way_latency_p99_ms",
               "vllm_way_cpu_us_per_request", "vllm_way_descriptors_per_request",
               "vllm_way_nixl_calls_per_request", "nixl_calls_per_request",
               "nixl_cpu_us_per_request", "copy_limit_gbps", "ratio_to_copy_limit",
               "shared_map_copy_limit_gbps", "ratio_to_shared_map_copy_limit",
               "shared_map_reads_per_request",
               "control_messages_per_request", "ucx_operations_per_request",
               "cpu_us_per_request", "wakeups_per_request", "completions_per_burst",
               "low_load_latency_p50_ms", "low_load_latency_p99_ms",
               "low_load_final_to_held_p50_ms", "low_load_final_to_held_p99_ms",
               "vllm_way_low_load_latency_p50_ms", "vllm_way_low_load_latency_p99_ms",
               "vllm_way_low_load_final_to_held_p50_ms",
               "vllm_way_low_load_final_to_held_p99_ms", "peak_rss_mib", "peak_rss_scope")


def preset_spec(name: str) -> StateSpec:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    config, kwargs = PRESETS[name]
    kwargs = dict(kwargs)
    keep_kv = kwargs.pop("kv", True)
    spec = StateSpec.from_config(config, **kwargs)
    return spec if keep_kv else dataclasses.replace(spec, kv=None)


def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        src, sep, dst = item.strip().lower().partition("x")
        if not sep or not src.isdigit() or not dst.isdigit() or int(src) < 1 or int(dst) < 1:
            raise ConfigError(f"bad TP pair {item!r}; expected PREFILLxDECODE like 2x4")
        pairs.append((int(src), int(dst)))
    return pairs


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GIB


def cell_memory(spec: StateSpec, src_tp: int, dst_tp: int, layout: str, pages: int,
                tokens: int = 0, block_size: int = 16) -> int:
    """Bytes of page (and KV block) memory a cell holds at once (prefill + decode groups, or
    NIXL buffers)."""
    plan = TransferPlan.build(spec, src_tp, layout, dst_tp)
    per_slot = plan.src.page_size * src_tp + plan.dst.page_size * dst_tp
    if spec.kv is not None:
        from statebridge.state.kv import BlockGeometry, blocks_for

        blocks = max(1, blocks_for(tokens, block_size))
        per_slot += blocks * sum(tp * BlockGeometry(spec.kv, tp, "HB", block_size, 1).nbytes
                                 for tp in (src_tp, dst_tp))
    return (pages + 2) * per_slot


def prompt_tokens(spec: StateSpec, a: argparse.Namespace) -> int:
    """Tokens of each request's prompt prefix: --prompt-len (default 1024) for a spec with
    attention KV; one token for the recurrent state alone (its size does not depend on it)."""
    if spec.kv is None:
        return 1
    return 1024 if a.prompt_len is None else a.prompt_len


# -- progress ------------------------------------------------------------------------------------

class _Progress:
    """tqdm when importable, else one plain stderr line per cell."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.n, self.enabled = total, 0, enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="cell", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(label)
        else:
            print(f"[{self.n + 1}/{self.total}] {label}", file=sys.stderr, flush=True)

    def done(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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
    thread only waits for the round to end; the first failure ends it and is raised."""
    state = {"next": 0, "inflight": 0, "error": None}
    results: list = []
    finished = threading.Event()

    def start_more() -> None:
        while state["next"] < count and state["inflight"] < concurrency \
                and state["error"] is None:
            i = state["next"]
            try:
                decode.start(f"{prefix}{i}-{uuid.uuid4().hex[:6]}", (i % 1000,) * tokens,
                             on_done)
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
        decode.loop.call(start_more)
        if not finished.wait(timeout):
            raise TimeoutError(f"{count - len(results)} of {count} requests not done after "
                               f"{timeout} s")
    if state["error"] is not None:
        raise state["error"]
    return results


def _cpu_snapshot(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(_cpu_seconds(pid) for pid in pids) for name, pids in groups.items()}


def _sleeps(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid``: each is a thread going to sleep,
    i.e. one wake-up to come (zmq's I/O threads, UCX's, compute threads included)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
                        break
        except OSError:                           # the thread ended meanwhile
            pass
    return total


def _sleeps_snapshot(groups: dict[str, list[int]]) -> dict[str, int]:
    return {name: sum(_sleeps(pid) for pid in pids) for name, pids in groups.items()}


def _reset_peak_rss(pid: int) -> bool:
    """Reset process ``pid``'s peak RSS (VmHWM) to its current RSS (``/proc/PID/clear_refs``
    ``5``, Linux >= 4.0); False where that is refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mib(pid: int) -> float | None:
    """Peak resident set size (VmHWM) of process ``pid`` in MiB, or None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024        # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


class _PeakRss:
    """Peak RSS per process over one cell, by process class. The rank hosts and NIXL workers
    live across cells, so their peaks are reset when the cell starts; where the kernel refuses
    the reset the figure is the peak since the process started (``scope`` says which)."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        resets = [_reset_peak_rss(pid) for pids in groups.values() for pid in pids]
        self.scope = "cell" if all(resets) else "process"

    def read(self) -> dict[str, list[float | None]]:
        return {name: [_peak_rss_mib(pid) for pid in pids] for name, pids in self.groups.items()}


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

    prefill_hosts, decode_hosts = pools
    c = a.concurrency
    tokens = prompt_tokens(spec, a)
    blocks = blocks_for(tokens, a.block_size) if spec.kv is not None else 0

    def kv(pages: int) -> dict:
        return {"kv_layout": a.kv_layout, "block_size": a.block_size,
                "num_blocks": max(1, pages * blocks)} if spec.kv is not None else {}
    out: dict[str, Any] = {"prompt_tokens": tokens if spec.kv is not None else None,
                           "kv_layout": a.kv_layout if spec.kv is not None else None}
    with PrefillServer(spec, src_tp, layout, num_pages=c + 2, config=config,
                       launcher=prefill_hosts.launcher(), model=MODEL, **kv(c + 2)) as server:
        server.wait_ready()
        # 1. byte-exactness on a few requests, checksums on
        if a.check_requests:
            with DecodeCoordinator(spec, dst_tp, layout, num_pages=a.check_requests,
                                   config=config, launcher=decode_hosts.launcher(),
                                   checksums=True, **kv(a.check_requests)) as check:
                check.connect(server.address)
                results = _run_requests(check, a.check_requests, a.check_requests,
                                        CHECK_PREFIX, a.timeout, tokens)
                for r in results:
                    if r.checksums != _expected_checksums(check.geometry, r.request_id):
                        raise AssertionError(f"{r.request_id}: decode pages differ from the "
                                             f"synthetic-state oracle")
                    if spec.kv is not None and r.kv_checksums != _expected_kv_checksums(
                            check.kv_geometry, r.request_id, tokens):
                        raise AssertionError(f"{r.request_id}: decode KV blocks differ from "
                                             f"the synthetic-KV oracle")
            out["checked_requests"] = len(results)
        # 2. the timed round, checksums off
        with DecodeCoordinator(spec, dst_tp, layout, num_pages=c, config=config,
                               launcher=decode_hosts.launcher(), **kv(c)) as decode:
            decode.connect(server.address)
            plan = TransferPlan(server.geometry, decode.geometry)
            if spec.kv is not None:
                from statebridge.state.kv import KVPlan

                kv_plan = KVPlan(server.kv_geometry, decode.kv_geometry).summary(tokens)
                out["plan_kv_runs_per_request"] = kv_plan["kv_runs"]
                out["plan_kv_bytes_per_request"] = kv_plan["kv_bytes"]
            warm = _run_requests(decode, c + 2 + c, c, "warm-", a.timeout, tokens)
            dst_staging0 = np.max([r.rank_staging_bytes for r in warm], axis=0)
            src_staging0 = np.array(server.stats()["rank_staging_bytes"])
            # CPU seconds per process group over the timed round: where the work goes, and a
            # figure that (unlike wall time) other load on a shared machine barely moves.
            groups = {"bench_process": [os.getpid()],
                      "prefill_ranks": prefill_hosts.pids[:src_tp],
                      "decode_ranks": decode_hosts.pids[:dst_tp]}
            ops0 = _opcounts_snapshot(prefill_hosts, decode_hosts, src_tp, dst_tp)
            cpu0, sleeps0 = _cpu_snapshot(groups), _sleeps_snapshot(groups)
            started = time.perf_counter()
            results = _run_requests(decode, a.requests, c, "req-", a.timeout, tokens)
            wall = time.perf_counter() - started
            cpu1, sleeps1 = _cpu_snapshot(groups), _sleeps_snapshot(groups)
            dst_staging = np.max([r.rank_staging_bytes for r in results], axis=0) - dst_staging0
            time.sleep(0.05)                      # the last RankDone of the prefill side
            src_staging = np.array(server.stats()["rank_staging_bytes"]) - src_staging0
            ops1 = _opcounts_snapshot(prefill_hosts, decode_hosts, src_tp, dst_tp)
            # 3. low load: one request in flight
            low = (_run_requests(decode, a.low_load_requests, 1, "low-", a.timeout, tokens)
                   if a.low_load else [])
            finals = _state_final_times(server, decode.node_id, [r.request_id for r in low])
    lat = np.array([r.seconds for r in results])
    rank_lat = np.array([max(r.rank_seconds) for r in results])
    messages = sorted({r.messages for r in results})
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
    out["completions_per_burst"] = completions_per_burst([r.held_at for r in results])
    out.update(_per_request_counts(ops0, ops1, len(results)))
    out.update({"low_load_requests": len(low), "low_load_latency_p50_ms": None,
                "low_load_latency_p99_ms": None, "low_load_rank_transfer_p50_ms": None,
                "low_load_rank_transfer_p99_ms": None, "low_load_final_to_held_p50_ms": None,
                "low_load_final_to_held_p99_ms": None})
    if low:
        low_lat = np.array([r.seconds for r in low]) * 1e3
        low_rank = np.array([max(r.rank_seconds) for r in low]) * 1e3
        out.update({"low_load_latency_p50_ms": float(np.percentile(low_lat, 50)),
                    "low_load_latency_p99_ms": float(np.percentile(low_lat, 99)),
                    "low_load_rank_transfer_p50_ms": float(np.percentile(low_rank, 50)),
                    "low_load_rank_transfer_p99_ms": float(np.percentile(low_rank, 99))})
        # "prefill state final -> every decode rank holds it": the last prefill rank's
        # state-final moment to the last decode rank's completion, one clock (CLOCK_MONOTONIC)
        held = np.array([(r.held_at - finals[r.request_id]) * 1e3 for r in low
                         if r.request_id in finals])
        if len(held) != len(low):
            raise AssertionError(f"state-final times of {len(low) - len(held)} low-load "
                                 f"requests missing")
        out.update({"low_load_final_to_held_p50_ms": float(np.percentile(held, 50)),
                    "low_load_final_to_held_p99_ms": float(np.percentile(held, 99))})
    return out, plan


def _state_final_times(server, decode_node: str, ids: list[str],
                       timeout: float = 10.0) -> dict[str, float]:
    """``server.state_final_times`` of ``ids``, waiting up to ``timeout`` for all of them: the
    prefill side records a request once its sends completed, just after the decode side holds
    it (the caller checks that none is missing)."""
    give_up = time.monotonic() + timeout
    finals = server.state_final_times(decode_node, ids)
    while len(finals) < len(ids) and time.monotonic() < give_up:
        time.sleep(0.01)
        finals = server.state_final_times(decode_node, ids)
    return finals


def _opcounts_snapshot(prefill_hosts, decode_hosts, src_tp: int, dst_tp: int) -> dict:
    """Operation counts (:mod:`statebridge.connector.opcounts`) by process class: this process
    (the coordinators), the prefill rank hosts, the decode rank hosts."""
    from statebridge.connector.opcounts import snapshot

    def total(snaps):
        out: dict[str, int] = {}
        for snap in snaps:
            for k, v in snap.items():
                out[k] = out.get(k, 0) + v
        return out
    return {"bench_process": snapshot(), "prefill_ranks": total(prefill_hosts.opcounts(src_tp)),
            "decode_ranks": total(decode_hosts.opcounts(dst_tp))}


def _per_request_counts(ops0: dict, ops1: dict, requests: int) -> dict:
    """``control_messages_per_request`` (control messages sent + received, all statebridge
    processes) and ``ucx_operations_per_request`` (UCX tag sends + receives posted), each with
    its split by process class, over the timed round."""
    def per(keys, group):
        return sum(ops1[group].get(k, 0) - ops0[group].get(k, 0) for k in keys) / requests
    out = {}
    for field, keys in (("control_messages", ("control_sent", "control_received")),
                        ("ucx_operations", ("ucx_ops",))):
        split = {g: per(keys, g) for g in ops0}
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


# -- the run --------------------------------------------------------------------------------------

def _machine(a: argparse.Namespace) -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform(),
           "cpus": os.cpu_count(), "mem_available_bytes": _mem_available(),
           "transport": a.transport, "ucx_error_handling": TRANSPORTS[a.transport][0],
           "perftest_tls": TRANSPORTS[a.transport][1], "progress_mode": "blocking",
           "requests": a.requests, "concurrency": a.concurrency,
           "check_requests": a.check_requests,
           "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX")}}
    for mod in ("torch", "numpy", "ucxx", "nixl_cu12"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 -- informational
            out[mod] = None
    try:
        out["transparent_hugepage"] = Path(
            "/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        pass
    return out


def plan_cells(a: argparse.Namespace) -> tuple[list[tuple[str, StateSpec, int, int, str]], list]:
    """The cells to run, and the ones skipped because they do not fit in memory."""
    specs = {}
    for name in a.presets:
        specs[name] = preset_spec(name)
    if a.config:
        specs[Path(a.config).parent.name or a.config] = StateSpec.from_pretrained(a.config)
    budget = a.memory_fraction * _mem_available()
    cells, skipped = [], []
    for name, spec in specs.items():
        for src_tp, dst_tp in a.pairs:
            for layout in a.layouts:
                need = cell_memory(spec, src_tp, dst_tp, layout, a.concurrency,
                                   prompt_tokens(spec, a), a.block_size)
                if need > budget:
                    skipped.append({"preset": name, "pair": f"{src_tp}x{dst_tp}",
                                    "layout": layout, "bytes_needed": need,
                                    "reason": f"needs {need / GIB:.1f} GiB > budget "
                                              f"{budget / GIB:.1f} GiB"})
                    continue
                cells.append((name, spec, src_tp, dst_tp, layout))
    return cells, skipped


def run(a: argparse.Namespace) -> dict:
    """Every cell; returns the JSON object (also written to ``a.json`` / ``a.plot``)."""
    from statebridge.bench._nixl import NixlPool, nixl_available
    from statebridge.connector.data import configure_ucx_env
    from statebridge.testing.hosts import RankHostPool

    configure_ucx_env()
    cells, skipped = plan_cells(a)
    if not cells:
        raise ConfigError("no cell to run (all skipped: " + "; ".join(s["reason"] for s in skipped)
                          + ")")
    # (STATEBRIDGE_* variables apply, as for the nodes)
    config = ConnectorConfig.from_env(ucx_error_handling=TRANSPORTS[a.transport][0],
                                      transfer_timeout=a.timeout, handshake_timeout=60.0)
    nixl_why = "disabled by --no-nixl" if a.no_nixl else nixl_available()
    if nixl_why is None and a.transport != "sm":
        nixl_why = (f"NIXL has no equivalent of --transport {a.transport}; measured only "
                    f"with --transport sm")
    line_rate = _LineRate(a.transport) if not a.no_line_rate else None
    max_src = max(c[2] for c in cells)
    max_dst = max(c[3] for c in cells)
    out: dict[str, Any] = {"benchmark": "hetero_tp", "machine": _machine(a),
                           "nixl": {"available": nixl_why is None, "reason": nixl_why},
                           "cells": [], "skipped": skipped}
    progress = _Progress(len(cells), not a.quiet)
    vllm_cache: dict[tuple[str, int, int], dict] = {}
    copy_cache: dict[tuple[str, int, int], dict] = {}
    with RankHostPool(max_src) as prefill_hosts, RankHostPool(max_dst) as decode_hosts:
        nixl = None
        if nixl_why is None:
            try:
                nixl = NixlPool(max_src, max_dst)
            except Exception as e:  # noqa: BLE001 -- recorded
                nixl_why = f"NIXL worker start failed: {e}"
                out["nixl"] = {"available": False, "reason": nixl_why}
        try:
            for preset, spec, src_tp, dst_tp, layout in cells:
                progress.step(f"{preset} {src_tp}x{dst_tp} {layout}")
                cell: dict[str, Any] = {"preset": preset, "pair": f"{src_tp}x{dst_tp}",
                                        "layout": layout, "transport": a.transport}
                rss_groups = {"bench_process": [os.getpid()],
                              "prefill_ranks": prefill_hosts.pids[:src_tp],
                              "decode_ranks": decode_hosts.pids[:dst_tp]}
                if nixl is not None:
                    rss_groups["nixl_src"] = [w.proc.pid for w in nixl.src[:src_tp]]
                    rss_groups["nixl_dst"] = [w.proc.pid for w in nixl.dst[:dst_tp]]
                peak_rss = _PeakRss(rss_groups)
                sb, plan = _statebridge_cell(spec, src_tp, dst_tp, layout, a,
                                             (prefill_hosts, decode_hosts), config)
                cell.update(sb)
                rate, why = line_rate(sb["mean_message_bytes"]) if line_rate else \
                    (None, "disabled by --no-line-rate")
                cell["line_rate_gbps"], cell["line_rate_note"] = rate, why or None
                cell["line_rate_message_bytes"] = int(sb["mean_message_bytes"])
                cell["ratio_to_line_rate"] = _ratio(cell["gbps"], rate)
                cell.update(_nixl_cell(nixl, nixl_why, plan, spec, preset, src_tp, dst_tp,
                                       layout, a, vllm_cache, cell))
                cell.update(_copy_limit_cell(plan, spec, src_tp, dst_tp, preset, a,
                                             copy_cache, cell))
                # MiB per process of each class, over this cell (statebridge and NIXL rounds)
                cell["peak_rss_mib"] = peak_rss.read()
                cell["peak_rss_scope"] = peak_rss.scope
                out["cells"].append(cell)
                progress.done()
        finally:
            progress.close()
            if nixl is not None:
                nixl.close()
    out["runs"] = [{"argv": getattr(a, "argv", None), "machine": out["machine"]}]
    if a.json:
        if a.append and Path(a.json).exists():
            out = _appended(json.loads(Path(a.json).read_text()), out, a.json)
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1, default=_jsonable) + "\n")
    if a.plot:
        out["plot"] = write_plot(a.plot, out["cells"])
    return out


def _appended(old: dict, new: dict, path: str) -> dict:
    """``new``'s cells added to an earlier run's file (--append): one table from several runs
    with different --requests / --concurrency, each run's settings kept in ``runs``."""
    if old.get("benchmark") != "hetero_tp" or not isinstance(old.get("cells"), list):
        raise ConfigError(f"--append: {path} is not a hetero_tp result file")
    merged = dict(old)
    merged["cells"] = old["cells"] + new["cells"]
    merged["skipped"] = old.get("skipped", []) + new["skipped"]
    merged["runs"] = old.get("runs", []) + new["runs"]
    merged["nixl"] = new["nixl"]
    return merged


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x))


def _nixl_cell(nixl, nixl_why, plan, spec, preset, src_tp, dst_tp, layout, a, vllm_cache,
               cell) -> dict:
    """NIXL reading exactly the runs statebridge posts (``nixl_*``: the data plane alone), and
    vLLM's way (``vllm_way_*``): NixlConnector's loop over vLLM's descriptors -- pages ``LDS``
    (one descriptor per layer per conv x/B/C piece and SSM slice), KV ``LH`` (one per layer per
    K or V half per block), with notifications and the sources' free-on-every-reader loop
    (:func:`statebridge.bench._nixl._vllm_read`). vLLM's way does not depend on statebridge's
    layout: measured once per (preset, pair) and shared by its cells."""
    from statebridge.bench._nixl import SlotPlan
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
    from statebridge.bench._nixl import SlotPlan

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


def _copy_limit_cell(plan, spec, src_tp, dst_tp, preset, a, cache, cell) -> dict:
    """``copy_limit_gbps``: the cell's bytes per request copied between cold page buffers of
    separate processes by ``os.cpu_count()`` copiers (:mod:`statebridge.bench._copylimit`);
    the same bytes for every layout, so measured once per (preset, pair)."""
    out = {"copy_limit_gbps": None, "ratio_to_copy_limit": None,
           "copy_limit_note": "disabled by --no-copy-limit" if a.no_copy_limit else None,
           "copy_limit_cpu_us_per_request": None, "copy_limit_copiers": None,
           "shared_map_copy_limit_gbps": None, "ratio_to_shared_map_copy_limit": None,
           "shared_map_copy_limit_note": "disabled by --no-copy-limit" if a.no_copy_limit
           else None}
    if a.no_copy_limit:
        return out
    if cell.get("shared_map_reads_per_request"):
        # The same bytes copied the way the cell's shared-map reads copy them (memfd source,
        # streaming copy): the limit of the mechanism statebridge used, beside cma's.
        skey = (preset, src_tp, dst_tp, "shared_map")
        try:
            if skey not in cache:
                from statebridge.bench._copylimit import copy_limit

                cache[skey] = copy_limit(_pair_bytes(plan, spec, a), src_tp=src_tp,
                                         requests=a.requests, pages=a.concurrency,
                                         timeout=a.timeout, mechanism="shared_map")
            out["shared_map_copy_limit_gbps"] = cache[skey]["gbps"]
            out["ratio_to_shared_map_copy_limit"] = _ratio(cell["gbps"], cache[skey]["gbps"])
        except Exception as e:  # noqa: BLE001 -- recorded
            out["shared_map_copy_limit_note"] = f"shared-map copy limit failed: {e}"[:300]
    else:
        out["shared_map_copy_limit_note"] = "no shared-map read in this cell: UCX moved " \
                                            "every byte"
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
    out.update({"copy_limit_gbps": r["gbps"], "ratio_to_copy_limit": _ratio(cell["gbps"],
                                                                             r["gbps"]),
                "copy_limit_bytes_per_request": r["bytes_per_request"],
                "copy_limit_cpu_us_per_request": r["cpu_us_per_request"],
                "copy_limit_copiers": r["copiers"]})
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


# -- output ------------------------------------------------------------------------------------

def write_plot(path: str, cells: Sequence[dict]) -> str | None:
    """Bars: statebridge GB/s per cell; markers: line rate, NIXL, NIXL LDS (vLLM's way).
    Returns the path, or None (with a warning) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib); no plot written",
              file=sys.stderr)
        return None
    labels = [f"{c['preset']}\n{c['pair']} {c['layout']}"
              + (f" {c['transport']}" if c.get("transport", "sm") != "sm" else "") for c in cells]
    x = np.arange(len(cells))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cells) + 2), 4.5))
    ax.bar(x, [c["gbps"] for c in cells], 0.6, label="statebridge", color="tab:blue")
    for key, marker, color, name in (("line_rate_gbps", "_", "black", "ucx_perftest line rate"),
                                     ("nixl_gbps", "o", "tab:orange", "NIXL, same runs"),
                                     ("vllm_way_gbps", "x", "tab:red", "vLLM's way (NIXL)"),
                                     ("copy_limit_gbps", "^", "tab:green", "copy limit")):
        ys = [c.get(key) for c in cells]
        if any(y is not None for y in ys):
            ax.scatter(x, [np.nan if y is None else y for y in ys], marker=marker, s=200,
                       color=color, label=name, zorder=3)
    ax.set_xticks(x, labels, fontsize=7)
    values = [v for c in cells for v in (c["gbps"], c.get("line_rate_gbps"), c.get("nixl_gbps"))
              if v]
    if values and max(values) > 50 * min(values):       # small-state cells would be invisible
        ax.set_yscale("log")
    ax.set_ylabel("GB/s (1e9 B/s)")
    ax.set_title("statebridge hetero-TP transfer vs ucx_perftest and NIXL (one machine)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(cells: Sequence[dict]) -> str:
    def f(x, fmt="{:.3g}"):
        return "-" if x is None else fmt.format(x)

    def cpu(d):
        return "-" if not d else f"{d['total']:.0f}"
    rows = ["| preset | pair | layout | tokens | GB/s | req/s | msgs/req | p50 ms | p99 ms | "
            "x line | x NIXL | vLLM's way GB/s | x vLLM's way | x copy limit | ctl msgs/req | "
            "UCX ops/req | CPU us/req | vLLM CPU us/req | vLLM NIXL calls/req | "
            "low-load final->held p50/p99 ms | vLLM low-load final->held p50/p99 ms | "
            "vLLM low-load READ post->done p50/p99 ms | peak RSS MiB P/D/NIXL |",
            "|" + "---|" * 23]
    for c in cells:
        layout = c["layout"] + (f"+{c['kv_layout']}" if c.get("kv_layout") else "")
        tokens = c.get("prompt_tokens") or "-"
        rows.append(
            f"| {c['preset']} | {c['pair']} | {layout} | {tokens} | {f(c['gbps'])} | "
            f"{f(c['requests_per_s'], '{:.0f}')} | {c['messages_per_request']} | "
            f"{f(c['latency_p50_ms'])} | {f(c['latency_p99_ms'])} | "
            f"{f(c['ratio_to_line_rate'])} | {f(c.get('ratio_to_nixl'))} | "
            f"{f(c.get('vllm_way_gbps'))} | {f(c.get('ratio_to_vllm_way'))} | "
            f"{f(c.get('ratio_to_copy_limit'))} | {f(c.get('control_messages_per_request'))} | "
            f"{f(c.get('ucx_operations_per_request'))} | {cpu(c.get('cpu_us_per_request'))} | "
            f"{cpu(c.get('vllm_way_cpu_us_per_request'))} | "
            f"{f(c.get('vllm_way_nixl_calls_per_request'))} | "
            f"{f(c.get('low_load_final_to_held_p50_ms'))}/"
            f"{f(c.get('low_load_final_to_held_p99_ms'))} | "
            f"{f(c.get('vllm_way_low_load_final_to_held_p50_ms'))}/"
            f"{f(c.get('vllm_way_low_load_final_to_held_p99_ms'))} | "
            f"{f(c.get('vllm_way_low_load_latency_p50_ms'))}/"
            f"{f(c.get('vllm_way_low_load_latency_p99_ms'))} | "
            f"{_rss_text(c.get('peak_rss_mib'))} |")
    return "\n".join(rows)


def _rss_text(rss: dict | None) -> str:
    """The largest peak RSS of the prefill ranks, the decode ranks and the NIXL workers
    (``412/530/-``: no NIXL workers in the cell)."""
    if not rss:
        return "-"

    def peak(*names: str) -> str:
        values = [v for n in names for v in rss.get(n, []) if v is not None]
        return f"{max(values):.0f}" if values else "-"
    return f"{peak('prefill_ranks')}/{peak('decode_ranks')}/{peak('nixl_src', 'nixl_dst')}"


# -- CLI ---------------------------------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an argparse ``subparsers`` object."""
    p = subparsers.add_parser("bench", help="heterogeneous-TP transfer benchmark",
                              description=__doc__.splitlines()[0])
    configure_parser(p)
    p.set_defaults(func=main)
    return p


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--preset", dest="presets", action="append", choices=sorted(PRESETS),
                   help="model shape (repeatable; default mamba2-2.7b unless --config)")
    p.add_argument("--config", default=None, help="a Hugging Face config.json instead")
    p.add_argument("--pairs", type=parse_pairs, default=None,
                   help="PREFILLxDECODE TP pairs, e.g. 1x2,2x4,4x2 (default {1,2,4,8}^2 minus "
                        "what does not fit in memory)")
    p.add_argument("--layouts", type=lambda s: [Layout.parse(x.strip()).name
                                                for x in s.split(",")],
                   default=list(LAYOUTS), help="comma-separated, e.g. LSD,LDS,DLS")
    p.add_argument("--requests", type=int, default=64, help="timed requests per cell")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--prompt-len", type=int, default=None, metavar="N",
                   help="prompt tokens whose KV each request moves (hybrid presets; default "
                        "1024 for them); recurrent-only presets send 1-token prompts")
    p.add_argument("--kv-layout", default="HB",
                   help="KV block pool layout of both sides: HB, BH, LH (default HB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--check-requests", type=int, default=2,
                   help="requests checked byte-exact (checksums) per cell before timing")
    p.add_argument("--transport", choices=sorted(TRANSPORTS), default="sm",
                   help="sm: shared memory, no UCX endpoint error handling (default); "
                        "tcp-eh: UCX endpoint error handling on (UCX then uses tcp/lo)")
    p.add_argument("--timeout", type=float, default=300.0, help="bound on one round (s)")
    p.add_argument("--memory-fraction", type=float, default=0.6,
                   help="share of MemAvailable a cell may hold (cells above are skipped)")
    p.add_argument("--no-nixl", action="store_true", help="skip the NIXL measurements")
    p.add_argument("--no-line-rate", action="store_true", help="skip ucx_perftest")
    p.add_argument("--no-copy-limit", action="store_true",
                   help="skip the process_vm_readv copy limit")
    p.add_argument("--low-load-requests", type=int, default=100, metavar="N",
                   help="requests of each cell's concurrency-1 round (statebridge and vLLM's "
                        "way; 0: none)")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--append", action="store_true",
                   help="add this run's cells to an existing --json file (and plot them all)")
    p.add_argument("--plot", default=None, help="PNG plot (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no table")
    return p


def _validate(a: argparse.Namespace) -> None:
    if not a.presets and not a.config:
        a.presets = ["mamba2-2.7b"]
    a.presets = a.presets or []
    if a.pairs is None:
        a.pairs = [(p, d) for p in DEFAULT_TP for d in DEFAULT_TP]
    for name in ("requests", "concurrency"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.low_load_requests < 0:
        raise ConfigError(f"--low-load-requests must be >= 0, got {a.low_load_requests}")
    a.low_load = a.low_load_requests > 0
    if a.check_requests < 0:
        raise ConfigError(f"--check-requests must be >= 0, got {a.check_requests}")
    if a.prompt_len is not None and a.prompt_len < 1:
        raise ConfigError(f"--prompt-len must be >= 1, got {a.prompt_len}")
    if a.block_size < 1:
        raise ConfigError(f"--block-size must be >= 1, got {a.block_size}")
    from statebridge.state.kv import KVLayout

    a.kv_layout = KVLayout.parse(a.kv_layout).name


def main(args: "argparse.Namespace | Sequence[str] | None" = None) -> int:
    """Run the benchmark from parsed ``args`` (from :func:`add_parser`) or an argv list."""
    if not isinstance(args, argparse.Namespace):
        argv = list(sys.argv[1:] if args is None else args)
        args = configure_parser(argparse.ArgumentParser(description=__doc__.splitlines()[0])
                                ).parse_args(argv)
        args.argv = " ".join(argv)
    elif getattr(args, "argv", None) is None:
        args.argv = " ".join(sys.argv[1:])
    _validate(args)
    out = run(args)
    if not args.quiet:
        print(format_table(out["cells"]))
        if not out["nixl"]["available"]:
            print(f"NIXL: not measured ({out['nixl']['reason']})")
        for s in out["skipped"]:
            print(f"skipped {s['preset']} {s['pair']} {s['layout']}: {s['reason']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
