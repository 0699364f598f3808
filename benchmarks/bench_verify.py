"""What ``--verify-transfers`` costs per request.

Two measurements, for each preset (default: ``lfm2-1.2b-hybrid`` with a 1024-token prompt, and
``mamba2-2.7b``) at prefill TP x decode TP ``--pair`` (default 1x2):

1. **Digest passes** (in this process, one thread): the CPU time of exactly what the ranks add
   per request -- every prefill rank's digests of what it sends each decode rank, and every
   decode rank's digest of what landed -- over pages and KV blocks of the real sizes, through
   the same plans the ranks use (:func:`statebridge.connector.rank.routes.pair_digest`, the KV
   templates). Beside it, for scale, the same bytes through ``zlib.crc32`` and blake2b (the
   testing probes' checksum) on host bytes.
2. **End to end**: the benchmark harness's statebridge cell
   (:func:`statebridge.bench.hetero_tp.cells._statebridge_cell`: a prefill server and a decode
   coordinator, every rank its own process, ``--requests`` timed requests with
   ``--concurrency`` in flight), verification off and on in adjacent runs of one invocation,
   ``--rounds`` times alternating; requests per second and CPU microseconds per request by
   process class (bench process = both coordinators, prefill ranks, decode ranks), medians.

    python benchmarks/bench_verify.py --out benchmarks/results/verify-transfers-DATE.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
import zlib

import numpy as np
import torch


def _time(fn, repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls (after one warm-up), CPU time."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def digest_passes(spec, src_tp: int, dst_tp: int, layout: str, tokens: int,
                  block_size: int, kv_layout: str, repeat: int) -> dict:
    """CPU µs per request of the digest passes on each side (all ranks of the side)."""
    from statebridge.connector.rank.digest import StreamDigest, total
    from statebridge.connector.rank.routes import pair_digest
    from statebridge.state.kv import BlockGeometry, KVPlan, blocks_for
    from statebridge.state.layout import PageGeometry
    from statebridge.state.plan import TransferPlan

    src_geo = PageGeometry(spec, src_tp, layout, region_align=16)
    dst_geo = PageGeometry(spec, dst_tp, layout, region_align=16)
    plan = TransferPlan(src_geo, dst_geo)
    rng = np.random.default_rng(0)

    def buffer(nbytes: int) -> torch.Tensor:
        return torch.from_numpy(rng.integers(0, 256, size=nbytes, dtype=np.uint8))
    n_blocks = blocks_for(tokens, block_size) if spec.kv is not None else 0
    src_kv = dst_kv = None
    if n_blocks:
        src_kv = BlockGeometry(spec.kv, src_tp, kv_layout, block_size, n_blocks)
        dst_kv = BlockGeometry(spec.kv, dst_tp, kv_layout, block_size, n_blocks)
    # One rank buffer per side and rank: its page, then its KV pool (as the ranks hold them).
    src_bufs = [buffer(src_geo.page_size + (src_kv.nbytes if src_kv else 0))
                for _ in range(src_tp)]
    dst_bufs = [buffer(dst_geo.page_size + (dst_kv.nbytes if dst_kv else 0))
                for _ in range(dst_tp)]
    send = {s: [] for s in range(src_tp)}        # rank -> [(peer rank, digest plan, base)]
    recv = {d: [] for d in range(dst_tp)}
    for pair in plan.pairs.values():
        send[pair.src_rank].append((pair.dst_rank, pair_digest(pair, "send"), 0))
        recv[pair.dst_rank].append((pair.src_rank, pair_digest(pair, "recv"), 0))
    nbytes = sum(p.nbytes for p in plan.pairs.values())
    if n_blocks:
        for pair in KVPlan(src_kv, dst_kv).pairs.values():
            runs = pair.contiguous_runs(n_blocks)
            send[pair.src_rank].append((pair.dst_rank, StreamDigest(runs[:, 0], runs[:, 2]),
                                        src_geo.page_size))
            recv[pair.dst_rank].append((pair.src_rank, StreamDigest(runs[:, 1], runs[:, 2]),
                                        dst_geo.page_size))
            nbytes += int(runs[:, 2].sum())

    def prefill_side():
        for s in range(src_tp):
            by_rank: dict[int, list] = {}
            for d, plan_, base in send[s]:
                by_rank.setdefault(d, []).append(plan_.of(src_bufs[s], base))
            [total(by_rank.get(d, [])) for d in range(dst_tp)]

    def decode_side():
        for d in range(dst_tp):
            total([plan_.of(dst_bufs[d], base) for _, plan_, base in recv[d]])

    def host_hash(fn):
        def run():
            for s in range(src_tp):
                for _, plan_, base in send[s]:
                    raw = src_bufs[s].numpy()
                    for o, n in zip(plan_.offsets.tolist(), plan_.lengths.tolist()):
                        fn(raw[base + o:base + o + n])
        return run
    out = {"bytes_per_request": nbytes,
           "runs_per_request": sum(len(p.offsets) for v in send.values() for _, p, _ in v),
           "prefill_us": _time(prefill_side, repeat) * 1e6,
           "decode_us": _time(decode_side, repeat) * 1e6,
           "crc32_us": _time(host_hash(zlib.crc32), repeat) * 1e6,
           "blake2b_us": _time(host_hash(lambda b: hashlib.blake2b(b, digest_size=16)),
                               repeat) * 1e6}
    out["digest_gbps"] = nbytes / (out["decode_us"] * 1e-6) / 1e9
    return out


def _digest_passes(pools) -> int:
    return sum(c.get("transfer_digests", 0) for pool in pools for c in pool.ops())


def end_to_end(spec, src_tp: int, dst_tp: int, layout: str, a: argparse.Namespace,
               pools, rounds: int) -> dict:
    """Off and on in adjacent runs, ``rounds`` times alternating; medians and every run."""
    from statebridge.bench.hetero_tp.cells import _statebridge_cell
    from statebridge.config import ConnectorConfig

    base = ConnectorConfig.from_env(transfer_timeout=a.timeout, handshake_timeout=60.0)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode in ("off", "on"):
            config = base.replace(verify_transfers=mode == "on")
            passes = _digest_passes(pools)
            cell, _ = _statebridge_cell(spec, src_tp, dst_tp, layout, a, pools, config)
            runs[mode].append({"requests_per_s": cell["requests_per_s"],
                               "latency_p50_ms": cell["latency_p50_ms"],
                               "cpu_us_per_request": cell["cpu_us_per_request"],
                               # every request of the cell (check, warm-up and timed rounds)
                               "rank_digest_passes": _digest_passes(pools) - passes})
    out: dict = {"runs": runs}
    for mode, rs in runs.items():
        out[mode] = {"requests_per_s": statistics.median(r["requests_per_s"] for r in rs),
                     "latency_p50_ms": statistics.median(r["latency_p50_ms"] for r in rs),
                     "cpu_us_per_request": {
                         k: statistics.median(r["cpu_us_per_request"][k] for r in rs)
                         for k in rs[0]["cpu_us_per_request"]}}
    out["throughput_ratio_on_off"] = out["on"]["requests_per_s"] / out["off"]["requests_per_s"]
    out["cpu_us_added_per_request"] = {
        k: out["on"]["cpu_us_per_request"][k] - out["off"]["cpu_us_per_request"][k]
        for k in out["on"]["cpu_us_per_request"]}
    return out


def main(argv: list[str] | None = None) -> dict:
    from statebridge.bench.hetero_tp.cli import configure_parser, preset_spec
    from statebridge.connector.data import configure_ucx_env
    from statebridge.testing.hosts import RankHostPool

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", dest="bench_presets", action="append", default=None,
                   help="benchmark preset (repeatable; default lfm2-1.2b-hybrid, mamba2-2.7b)")
    p.add_argument("--pair", default="1x2", help="prefill TP x decode TP (default 1x2)")
    p.add_argument("--layout", default="DLS")
    p.add_argument("--rounds", type=int, default=3, help="off/on alternations (default 3)")
    p.add_argument("--repeat", type=int, default=20, help="timings per digest measurement")
    p.add_argument("--no-end-to-end", action="store_true")
    p.add_argument("--out", dest="out_json", default=None, help="write the results here")
    harness = argparse.ArgumentParser(add_help=False)
    configure_parser(harness)
    a, rest = p.parse_known_args(argv)
    h = harness.parse_args(["--requests", "32", "--concurrency", "4", "--check-requests", "1",
                            "--low-load-requests", "0", *rest])
    h.low_load = False
    src_tp, dst_tp = (int(x) for x in a.pair.split("x"))
    presets = a.bench_presets or ["lfm2-1.2b-hybrid", "mamba2-2.7b"]
    torch.set_num_threads(1)
    result: dict = {"benchmark": "verify_transfers", "date": time.strftime("%Y-%m-%d"),
                    "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                "torch": torch.__version__, "platform": platform.platform(),
                                "loadavg_start": os.getloadavg()},
                    "pair": a.pair, "layout": a.layout, "requests": h.requests,
                    "concurrency": h.concurrency, "rounds": a.rounds, "presets": {}}
    configure_ucx_env()
    pools = None
    try:
        if not a.no_end_to_end:
            pools = (RankHostPool(src_tp), RankHostPool(dst_tp))
        for name in presets:
            spec = preset_spec(name)
            tokens = (h.prompt_len or 1024) if spec.kv is not None else 1
            entry = {"prompt_tokens": tokens if spec.kv is not None else None,
                     "digest_passes": digest_passes(spec, src_tp, dst_tp, a.layout, tokens,
                                                    h.block_size, h.kv_layout, a.repeat)}
            print(f"{name} {a.pair} {a.layout}: digest passes {entry['digest_passes']}",
                  flush=True)
            if pools is not None:
                entry["end_to_end"] = end_to_end(spec, src_tp, dst_tp, a.layout, h, pools,
                                                 a.rounds)
                e = entry["end_to_end"]
                print(f"  end to end: {e['off']['requests_per_s']:.1f} -> "
                      f"{e['on']['requests_per_s']:.1f} req/s (x"
                      f"{e['throughput_ratio_on_off']:.3f}); CPU us/request added "
                      f"{ {k: round(v) for k, v in e['cpu_us_added_per_request'].items()} }",
                      flush=True)
            result["presets"][name] = entry
    finally:
        if pools is not None:
            for pool in pools:
                pool.close()
    result["machine"]["loadavg_end"] = os.getloadavg()
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
