"""Same-host transfer of one request with device memory: the one-launch gather
(:func:`statebridge.kernels.pack.gather`, what a decode rank runs per request and peer rank)
against per-run ``cudaMemcpyAsync`` (one device-to-device copy per run, what a transport
posting runs one by one does) and ONE device-to-device copy of the same bytes (the limit).

Cells are requests the transfer plan gives (``statebridge plan``): an LFM2-1.2B-sized request
(81,920 B recurrent state + 12.6 MB of attention KV at 1k tokens) with contiguous and with
scattered block tables, and a Mamba2-2.7B one. Each cell reports bytes, runs, the median time
of each method over ``repeat`` calls (CUDA events), GB/s, the gather's fraction of the limit,
its speed-up over per-run copies, the host CPU time of one gather launch, and whether every
byte landed (checked against the torch reference).

Run: ``python -m statebridge.bench.device_gather --json out.json`` (needs a CUDA GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Sequence

import numpy as np
import torch

__all__ = ["CELLS", "cell_runs", "measure", "run", "format_table", "main"]

#: name -> (preset, decode TP, prompt tokens, recurrent layout, KV layout, block size,
#: scattered decode table); the request is what decode rank 0 reads from prefill rank 0 (TP 1)
CELLS: dict[str, tuple[str, int, int, str, str, int, bool]] = {
    "lfm2-1.2b-1k": ("lfm2-1.2b-hybrid", 1, 1024, "DLS", "HB", 16, False),
    "lfm2-1.2b-1k-scattered": ("lfm2-1.2b-hybrid", 1, 1024, "LSD", "HB", 2, True),
    "mamba2-2.7b": ("mamba2-2.7b", 1, 0, "DLS", "HB", 16, False),
    "mamba2-2.7b-tp2-LSD": ("mamba2-2.7b", 2, 0, "LSD", "HB", 16, False),
}


def cell_runs(name: str) -> list[np.ndarray]:
    """The request's runs, prefill rank 0 (TP 1) -> decode rank 0, as the gather's groups: the recurrent
    runs relative to the two pages, then (hybrid) the KV runs of its block table (scattered:
    the decode table in reverse order in a pool twice its size)."""
    from statebridge.bench.hetero_tp import preset_spec
    from statebridge.state.kv import BlockGeometry, KVPlan, blocks_for
    from statebridge.state.plan import TransferPlan

    preset, dst_tp, tokens, layout, kv_layout, block, scattered = CELLS[name]
    spec = preset_spec(preset)
    groups = [TransferPlan.build(spec, 1, layout, dst_tp, layout).pairs[(0, 0)].runs]
    if spec.kv is not None and tokens:
        n = blocks_for(tokens, block)
        pair = KVPlan(BlockGeometry(spec.kv, 1, kv_layout, block, 2 * n + 1),
                      BlockGeometry(spec.kv, dst_tp, kv_layout, block, 2 * n + 1)).pairs[(0, 0)]
        dst = list(range(2 * n, n, -1)) if scattered else list(range(n))
        groups.append(pair.runs(list(range(n)), dst))
    return groups


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(groups: list[np.ndarray], device: "torch.device | str" = "cuda",
            repeat: int = 20) -> dict:
    """Time the three methods on ``groups`` of runs (see the module docstring)."""
    from statebridge.kernels.pack import gather, gather_ref, prepare_gather

    device = torch.device(device)
    ends = [(int((g[:, 0] + g[:, 2]).max()), int((g[:, 1] + g[:, 2]).max())) if len(g)
            else (0, 0) for g in groups]
    src_base = [0, ends[0][0]] if len(groups) == 2 else [0]
    dst_base = [0, ends[0][1]] if len(groups) == 2 else [0]
    bases = list(zip(src_base, dst_base))
    src_n = max(sum(e[0] for e in ends), total_bytes := int(sum(int(g[:, 2].sum())
                                                                  for g in groups)))
    dst_n = sum(e[1] for e in ends)
    total = total_bytes
    src = torch.randint(0, 256, (src_n,), dtype=torch.uint8, device=device)
    dst = torch.zeros(dst_n, dtype=torch.uint8, device=device)
    template = prepare_gather(groups, device)
    flat = [(int(a) + s, int(b) + d, int(n)) for g, (s, d) in zip(groups, bases)
            for a, b, n in g.tolist()]

    def one_gather():
        gather(src, dst, template, bases)

    def per_run():
        for a, b, n in flat:
            dst[b:b + n].copy_(src[a:a + n], non_blocking=True)

    limit_dst = torch.empty(total, dtype=torch.uint8, device=device)

    def one_copy():
        limit_dst.copy_(src[:total], non_blocking=True)

    for fn in (one_gather, per_run, one_copy):       # compile, warm the caches
        fn()
    torch.cuda.synchronize(device)
    expect = gather_ref(src, torch.zeros_like(dst), template, bases)
    dst.zero_()
    one_gather()
    torch.cuda.synchronize(device)
    exact = bool(torch.equal(dst, expect))
    launch_us = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        one_gather()
        launch_us.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize(device)
    ms = {name: _median_ms(fn, repeat) for name, fn in
          (("gather", one_gather), ("per_run", per_run), ("d2d_copy", one_copy))}
    gbps = {k: total / (v * 1e-3) / 1e9 for k, v in ms.items()}
    return {"bytes": total, "runs": len(flat), "byte_exact": exact,
            "ms": ms, "gbps": gbps,
            "gather_vs_limit": ms["d2d_copy"] / ms["gather"],
            "gather_speedup_vs_per_run": ms["per_run"] / ms["gather"],
            "gather_launch_cpu_us": statistics.median(launch_us)}


def run(names: Sequence[str] = tuple(CELLS), device: str = "cuda", repeat: int = 20) -> dict:
    """Every cell in ``names``: ``{"device": ..., "cells": {name: figures or {"error": ...}}}``
    (a failing cell is recorded and the others still run)."""
    cells = {}
    for name in names:
        try:
            cells[name] = measure(cell_runs(name), device, repeat)
        except Exception as e:  # noqa: BLE001 -- recorded in the report
            cells[name] = {"error": f"{type(e).__name__}: {e}"}
    return {"device": torch.cuda.get_device_name(torch.device(device)), "cells": cells}


def format_table(result: dict) -> str:
    """The cells as a fixed-width table."""
    head = (f"{'cell':<24} {'bytes':>12} {'runs':>6} {'gather ms':>10} {'per-run ms':>10} "
            f"{'d2d ms':>8} {'x limit':>7} {'x per-run':>9} {'launch us':>9} exact")
    lines = [head]
    for name, c in result["cells"].items():
        if "error" in c:
            lines.append(f"{name:<24} error: {c['error']}")
            continue
        ms = c["ms"]
        lines.append(f"{name:<24} {c['bytes']:>12,} {c['runs']:>6} {ms['gather']:>10.4f} "
                     f"{ms['per_run']:>10.4f} {ms['d2d_copy']:>8.4f} "
                     f"{c['gather_vs_limit']:>7.2f} {c['gather_speedup_vs_per_run']:>9.1f} "
                     f"{c['gather_launch_cpu_us']:>9.1f} {'yes' if c['byte_exact'] else 'NO'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m statebridge.bench.device_gather",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", dest="cells", action="append", choices=sorted(CELLS),
                   help="a cell (repeatable; default all)")
    p.add_argument("--device", default="cuda", help="a CUDA device (default cuda)")
    p.add_argument("--repeat", type=int, default=20, help="timed calls per method")
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device visible: this benchmark measures device memory", file=sys.stderr)
        return 2
    result = run(a.cells or tuple(CELLS), a.device, a.repeat)
    print(format_table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all("error" not in c and c["byte_exact"] for c in result["cells"].values()) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
