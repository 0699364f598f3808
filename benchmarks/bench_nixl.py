"""Why NIXL looked slow in ``statebridge bench``: its READs measured variant by variant.

NIXL (``nixl-cu12``, UCX backend) READs a TP cell's runs -- one descriptor per run of the
:class:`~statebridge.state.plan.TransferPlan`, exactly what ``statebridge bench`` measures --
between page buffers of separate processes (:class:`statebridge.bench._nixl.NixlPool`), in two
scopes:

- ``standalone``: one source and one destination process READing one (source, destination)
  pair's descriptor lists (rank pair 0 -> 0 of the cell), nothing else running;
- ``cell``: every pair of the cell, one process per rank, as ``statebridge bench`` runs it. With
  ``--bench-like`` the benchmark's idle statebridge rank hosts
  (:class:`~statebridge.testing.hosts.RankHostPool`) are alive too.

Per scope, the variants (:class:`~statebridge.bench._nixl.NixlOptions`) run interleaved for
``--rounds`` rounds (the machine may be shared; the median is reported), each reporting GB/s,
p50 latency, the CPU the destinations spent per GB and the cores the sources burnt meanwhile:

- ``first-cut``: the settings of the first benchmark run (NIXL's defaults: a progress thread per
  agent, UCX error handling ``peer``; 4 KiB pages; spinning destinations; no warm-up);
- ``fair``: what ``statebridge bench`` now uses (see ``statebridge/bench/_nixl.py``);
- ``fair+<one change>``: ``fair`` with one setting of ``first-cut`` put back (or handles reused),
  to show what each setting costs.

``--layouts DLS,LDS`` also measures vLLM's way (``LDS``: one descriptor per layer per piece).
Prints a table and writes ``benchmarks/results/nixl-<preset>-<pair>-<date>.json``::

    python benchmarks/bench_nixl.py --preset mamba2-2.7b --pair 2x4 --layouts DLS,LDS

``--proto-info`` makes UCX print which transport each protocol uses (``UCX_PROTO_INFO=y``) in the
worker processes. This is a script, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

from statebridge.bench._nixl import NixlOptions, NixlPool, _cpu_seconds, nixl_available
from statebridge.bench.hetero_tp import PRESETS, parse_pairs, preset_spec
from statebridge.state.plan import TransferPlan

_FAIR = NixlOptions()
VARIANTS: dict[str, NixlOptions] = {
    "first-cut": NixlOptions.first_cut(),
    "fair": _FAIR,
    "fair+progress-thread": dataclasses.replace(_FAIR, progress_thread=True),
    "fair+spin": dataclasses.replace(_FAIR, wait="spin"),
    "fair+4k-pages": dataclasses.replace(_FAIR, huge_pages=False),
    "fair+error-handling": dataclasses.replace(_FAIR, error_handling=True),
    "fair+no-warmup": dataclasses.replace(_FAIR, warmup=False),
    "fair+reuse-handles": dataclasses.replace(_FAIR, reuse_handles=True),
}
SCOPES = ("standalone", "cell")


class OnePair:
    """A one-pair view of a plan (rank pair ``src_rank -> dst_rank``), shaped like a
    TransferPlan for :meth:`NixlPool.run_cell`: source rank 0 -> destination rank 0."""

    class _Side:
        def __init__(self, page_size: int) -> None:
            self.tp_size, self.page_size = 1, page_size

    def __init__(self, plan: TransferPlan, src_rank: int = 0, dst_rank: int = 0) -> None:
        pair = plan.pair(src_rank, dst_rank)
        if pair is None:
            raise ValueError(f"rank pair {src_rank} -> {dst_rank} moves nothing in this plan")
        self.src, self.dst = self._Side(plan.src.page_size), self._Side(plan.dst.page_size)
        self._pair = dataclasses.replace(pair, src_rank=0, dst_rank=0)
        self.bytes_per_request = pair.nbytes

    def __iter__(self):
        return iter([self._pair])

    def for_destination(self, dst_rank: int):
        return [self._pair] if dst_rank == 0 else []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mamba2-2.7b", choices=sorted(PRESETS))
    p.add_argument("--pair", type=lambda s: parse_pairs(s)[0], default=(2, 4),
                   help="PREFILLxDECODE TP pair of the cell (default 2x4)")
    p.add_argument("--layouts", type=lambda s: [x.strip().upper() for x in s.split(",")],
                   default=["DLS"], help="comma-separated; LDS is vLLM's way")
    p.add_argument("--scopes", type=lambda s: [x.strip() for x in s.split(",")],
                   default=list(SCOPES), help="standalone,cell")
    p.add_argument("--variants", type=lambda s: [x.strip() for x in s.split(",")],
                   default=list(VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}")
    p.add_argument("--requests", type=int, default=16, help="timed requests per run")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (= pages)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--bench-like", action="store_true",
                   help="keep statebridge bench's idle rank host processes alive (cell scope)")
    p.add_argument("--verify", action="store_true",
                   help="check every byte NIXL moved in the first round (slow on big cells)")
    p.add_argument("--proto-info", action="store_true", help="UCX_PROTO_INFO=y in the workers")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default=None,
                   help="output (default benchmarks/results/nixl-<preset>-<pair>-<date>.json)")
    a = p.parse_args(argv)
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; expected some of {list(VARIANTS)}")
    bad = [s for s in a.scopes if s not in SCOPES]
    if bad:
        p.error(f"unknown scopes {bad}; expected some of {list(SCOPES)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    why = nixl_available()
    if why is not None:
        print(f"NIXL not available: {why}", file=sys.stderr)
        return 2
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if a.proto_info:
        os.environ["UCX_PROTO_INFO"] = "y"
    spec = preset_spec(a.preset)
    src_tp, dst_tp = a.pair
    plans = {layout: TransferPlan.build(spec, src_tp, layout, dst_tp) for layout in a.layouts}
    load_start = os.getloadavg()
    rows: list[dict] = []
    hosts = []
    if a.bench_like:
        from statebridge.testing.hosts import RankHostPool
        hosts = [RankHostPool(src_tp), RankHostPool(dst_tp)]
        _statebridge_round(spec, src_tp, dst_tp, a.layouts[0], hosts, a.timeout)
    try:
        with NixlPool(src_tp, dst_tp) as pool:
            host_pids = [pid for h in hosts for pid in h.pids]
            for rnd in range(a.rounds):
                for scope in a.scopes:
                    for layout, plan in plans.items():
                        target = OnePair(plan) if scope == "standalone" else plan
                        for name in a.variants:
                            h0 = sum(_cpu_seconds(p) for p in host_pids)
                            t0 = time.perf_counter()
                            r = pool.run_cell(target, pages=a.concurrency, requests=a.requests,
                                              concurrency=a.concurrency, timeout=a.timeout,
                                              verify=a.verify and rnd == 0,
                                              options=VARIANTS[name])
                            held = time.perf_counter() - t0
                            r.update(scope=scope, layout=layout, variant=name, round=rnd,
                                     bytes_per_request=target.bytes_per_request,
                                     dst_cpu_s_per_gb=r["dst_cpu_seconds"]
                                     / (a.requests * target.bytes_per_request / 1e9),
                                     host_cpu_cores=(sum(_cpu_seconds(p) for p in host_pids)
                                                     - h0) / held if host_pids else None)
                            rows.append(r)
                            print(f"round {rnd} {scope:10s} {layout} {name:22s} "
                                  f"{r['gbps']:6.2f} GB/s  p50 {r['latency_p50_ms']:7.1f} ms  "
                                  f"dst {r['dst_cpu_s_per_gb']:.2f} CPU-s/GB  src "
                                  f"{r['src_cpu_cores']:.2f} cores", flush=True)
    finally:
        for h in hosts:
            h.close()
    summary = summarize(rows)
    print()
    print(format_table(summary))
    date = datetime.date.today().isoformat()
    path = a.json or str(Path(__file__).parent / "results"
                         / f"nixl-{a.preset}-{src_tp}x{dst_tp}-{date}.json")
    report = {"benchmark": "nixl", "date": date, "args": {k: v for k, v in vars(a).items()},
              "cpus": os.cpu_count(), "loadavg_start": load_start,
              "loadavg_end": os.getloadavg(),
              "variants": {k: v.to_dict() for k, v in VARIANTS.items() if k in a.variants},
              "summary": summary, "runs": rows}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {path}")
    return 0


def _statebridge_round(spec, src_tp: int, dst_tp: int, layout: str, hosts, timeout: float):
    """A few statebridge requests on the rank hosts first, so they are in the state
    ``statebridge bench`` leaves them in when it measures NIXL (after a cell, idle)."""
    from statebridge.bench.hetero_tp import _statebridge_cell
    from statebridge.bench.hetero_tp.cli import configure_parser
    from statebridge.config import ConnectorConfig

    ns = configure_parser(argparse.ArgumentParser()).parse_args(
        ["--concurrency", "2", "--check-requests", "0", "--requests", "4",
         "--low-load-requests", "0", "--timeout", str(timeout)])
    ns.low_load = False
    config = ConnectorConfig(ucx_error_handling=False, transfer_timeout=timeout,
                             handshake_timeout=60.0)
    _statebridge_cell(spec, src_tp, dst_tp, layout, ns, hosts, config)


def summarize(rows: list[dict]) -> list[dict]:
    """Median over rounds per (scope, layout, variant)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scope"], r["layout"], r["variant"]), []).append(r)
    out = []
    for (scope, layout, variant), rs in groups.items():
        def med(key):
            vals = [r[key] for r in rs if r.get(key) is not None]
            return statistics.median(vals) if vals else None
        out.append({"scope": scope, "layout": layout, "variant": variant, "rounds": len(rs),
                    "gbps_median": med("gbps"), "gbps_best": max(r["gbps"] for r in rs),
                    "latency_p50_ms": med("latency_p50_ms"),
                    "dst_cpu_s_per_gb": med("dst_cpu_s_per_gb"),
                    "src_cpu_cores": med("src_cpu_cores"),
                    "host_cpu_cores": med("host_cpu_cores"),
                    "descriptors_per_request": rs[0]["descriptors_per_request"]})
    return out


def format_table(summary: list[dict]) -> str:
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)
    lines = ["| scope | layout | variant | descs/req | GB/s median | GB/s best | p50 ms | "
             "dst CPU-s/GB | src cores | idle hosts cores |", "|" + "---|" * 10]
    for s in summary:
        lines.append(f"| {s['scope']} | {s['layout']} | {s['variant']} | "
                     f"{s['descriptors_per_request']} | {f(s['gbps_median'])} | "
                     f"{f(s['gbps_best'])} | {f(s['latency_p50_ms'], '{:.1f}')} | "
                     f"{f(s['dst_cpu_s_per_gb'])} | {f(s['src_cpu_cores'])} | "
                     f"{f(s['host_cpu_cores'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
