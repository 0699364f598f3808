"""Time the statebridge kernels (Triton and/or torch references) on one device; write JSON.

Meant for a GPU machine, e.g.::

    python benchmarks/bench_kernels.py --provider ref triton --layout LDS --iters 100 \
        --json results/kernels.json --png results/kernels.png

Every kernel runs on a strided per-layer view of a page buffer in the chosen layout, as in
serving; ``decode_attn`` (split-K paged decode attention, LFM2-1.2B shapes by default: 32 query
heads, 8 KV heads, head dim 64, blocks of 16 tokens) reads scattered blocks of a real KV pool
view. In-place kernels keep advancing their state between iterations; that does not change the
work done.

Each row reports the bytes the call must read and write at least (its state, K/V, inputs and
outputs, each once) and the achieved bandwidth ``read_gbps`` = bytes read / median time, the
figure the decode kernels are judged by (at batch 64, the default), and ``moved_gbps`` = bytes
read and written / time. With ``--hbm-gbps`` (or on an H100/H200, whose HBM peaks of 3350 and
4800 GB/s are known) it also reports both as a fraction of the peak. On CPU the Triton provider
needs ``TRITON_INTERPRET=1`` (and is then very slow). This is a script, not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from statebridge.errors import StatebridgeError
from statebridge.state.kv import KV_LAYOUT_PRESETS, BlockGeometry
from statebridge.state.spec import KVSpec
from statebridge.kernels import (
    causal_conv1d_fn,
    causal_conv1d_fn_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    mamba_chunk_scan_varlen,
    mamba_chunk_scan_varlen_ref,
    pack,
    pack_ref,
    paged_attention_decode,
    paged_attention_decode_ref,
    prepare_runs,
    selective_state_update,
    selective_state_update_ref,
    varlen_attention_prefill,
    varlen_attention_prefill_ref,
)

KERNELS = ("conv_fn", "conv_update", "ssu", "chunk_scan", "pack", "decode_attn", "prefill_attn")
#: HBM peaks (GB/s) of the GPUs the project targets, matched against the device name
HBM_GBPS = {"H200": 4800.0, "H100": 3350.0}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--provider", nargs="+", choices=("ref", "triton"), default=None,
                   help="default: triton and ref on CUDA, ref elsewhere")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="inputs and conv state")
    p.add_argument("--ssm-dtype", choices=sorted(DTYPES), default="fp32", help="SSM state")
    p.add_argument("--layout", choices=("LSD", "LDS", "DLS"), default="LDS", help="conv region axis order")
    p.add_argument("--ssm-layout", choices=("LHPN", "HLPN"), default="LHPN")
    p.add_argument("--layers", type=int, default=4, help="layers per page region (the view is layer 1)")
    p.add_argument("--dim", type=int, default=2048, help="conv channels D (local to one rank)")
    p.add_argument("--width", type=int, default=4, help="conv width K")
    p.add_argument("--batch", type=int, default=64, help="requests per call (decode) / sequences (prefill)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per prefill sequence")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--d-state", type=int, default=128)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--pack-runs", type=int, default=4096, help="byte runs per pack call")
    p.add_argument("--pack-run-bytes", type=int, default=1024)
    p.add_argument("--q-heads", type=int, default=32, help="decode_attn query heads (LFM2-1.2B: 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="decode_attn KV heads (LFM2-1.2B: 8)")
    p.add_argument("--attn-head-dim", type=int, default=64)
    p.add_argument("--kv-block", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-tokens", type=int, default=2048, help="tokens each decode request attends to")
    p.add_argument("--kv-layout", choices=sorted(KV_LAYOUT_PRESETS), default="HB", help="KV pool axis order")
    p.add_argument("--hbm-gbps", type=float, default=None,
                   help="the device's peak memory bandwidth, for the fraction-of-peak columns "
                        "(default: known for H100/H200)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--png", default=None, help="bar chart of median times (needs matplotlib)")
    return p.parse_args(argv)


def conv_view(layout: str, pages: int, layers: int, dim: int, state_len: int, dtype, device) -> torch.Tensor:
    if layout == "LSD":
        return torch.randn(pages, layers, state_len, dim, dtype=dtype, device=device)[:, 1].transpose(-1, -2)
    if layout == "LDS":
        return torch.randn(pages, layers, dim, state_len, dtype=dtype, device=device)[:, 1]
    return torch.randn(pages, dim, layers, state_len, dtype=dtype, device=device)[:, :, 1, :]


def ssm_view(layout: str, pages: int, layers: int, heads: int, hd: int, n: int, dtype, device) -> torch.Tensor:
    if layout == "LHPN":
        return torch.randn(pages, layers, heads, hd, n, dtype=dtype, device=device)[:, 1]
    return torch.randn(pages, heads, layers, hd, n, dtype=dtype, device=device)[:, :, 1]


def build(kernel: str, provider: str, a: argparse.Namespace) -> tuple[Callable[[], object], int, int]:
    """A closure running one call, and the bytes it must at least read and write."""
    dev, dt, sdt = torch.device(a.device), DTYPES[a.dtype], DTYPES[a.ssm_dtype]
    tri = provider == "triton"
    pages = a.batch + 1
    slots = torch.randperm(pages, device=dev)[: a.batch].to(torch.int32)
    es, ess = torch.tensor([], dtype=dt).element_size(), torch.tensor([], dtype=sdt).element_size()
    if kernel in ("conv_fn", "conv_update"):
        state = conv_view(a.layout, pages, a.layers, a.dim, a.width - 1, dt, dev)
        w = torch.randn(a.dim, a.width, dtype=dt, device=dev)
        b = torch.randn(a.dim, dtype=dt, device=dev)
        state_bytes = a.batch * a.dim * (a.width - 1) * es
        params = (a.width + 1) * a.dim * es
        if kernel == "conv_fn":
            tokens = a.batch * a.seqlen
            x = torch.randn(tokens, a.dim, dtype=dt, device=dev).t()
            qsl = torch.arange(0, tokens + 1, a.seqlen, dtype=torch.int32, device=dev)
            init = torch.ones(a.batch, dtype=torch.bool, device=dev)
            fn = causal_conv1d_fn if tri else causal_conv1d_fn_ref
            return ((lambda: fn(x, w, b, state, qsl, slots, init, "silu")),
                    tokens * a.dim * es + state_bytes + params, tokens * a.dim * es + state_bytes)
        x = torch.randn(a.batch, a.dim, dtype=dt, device=dev)
        fn = causal_conv1d_update if tri else causal_conv1d_update_ref
        return ((lambda: fn(x, state, w, b, "silu", slots)),
                a.batch * a.dim * es + state_bytes + params, a.batch * a.dim * es + state_bytes)
    if kernel == "ssu":
        h, p, n, g = a.heads, a.head_dim, a.d_state, a.groups
        state = ssm_view(a.ssm_layout, pages, a.layers, h, p, n, sdt, dev)
        x = torch.randn(a.batch, h, p, dtype=dt, device=dev)
        dt_ = torch.randn(a.batch, h, dtype=dt, device=dev)[:, :, None].expand(-1, -1, p)
        A = -torch.rand(h, device=dev)[:, None, None].expand(h, p, n)
        B = torch.randn(a.batch, g, n, dtype=dt, device=dev)
        C = torch.randn(a.batch, g, n, dtype=dt, device=dev)
        D = torch.randn(h, device=dev)[:, None].expand(h, p)
        dtb = torch.randn(h, device=dev)[:, None].expand(h, p)
        fn = selective_state_update if tri else selective_state_update_ref
        state_bytes = a.batch * h * p * n * ess
        inputs = a.batch * (h * p + h + 2 * g * n) * es
        return ((lambda: fn(state, x, dt_, A, B, C, D=D, dt_bias=dtb, dt_softplus=True, state_batch_indices=slots)),
                state_bytes + inputs, state_bytes + a.batch * h * p * es)
    if kernel == "chunk_scan":
        # varlen SSD prefill of batch x seqlen tokens on the state slots (initial states read,
        # final states written)
        h, p, n, g = a.heads, a.head_dim, a.d_state, a.groups
        tokens = a.batch * a.seqlen
        state = ssm_view(a.ssm_layout, pages, a.layers, h, p, n, sdt, dev)
        x = torch.randn(tokens, h, p, dtype=dt, device=dev)
        dt_ = torch.randn(tokens, h, dtype=dt, device=dev)
        B = torch.randn(tokens, g, n, dtype=dt, device=dev) * 0.1
        C = torch.randn(tokens, g, n, dtype=dt, device=dev) * 0.1
        A, D, dtb = -torch.rand(h, device=dev), torch.randn(h, device=dev), torch.randn(h, device=dev)
        cu = torch.arange(0, tokens + 1, a.seqlen, dtype=torch.int32, device=dev)
        init = torch.ones(a.batch, dtype=torch.bool, device=dev)
        fn = mamba_chunk_scan_varlen if tri else mamba_chunk_scan_varlen_ref

        def scan():
            return fn(x, dt_, A, B, C, state, cu, slots, init, chunk_size=a.chunk_size, D=D, dt_bias=dtb,
                      dt_softplus=True)

        state_bytes = a.batch * h * p * n * ess
        return scan, tokens * (h * p + h + 2 * g * n) * es + state_bytes, tokens * h * p * es + state_bytes
    if kernel == "decode_attn":
        # one decode token per request over a.kv_tokens of KV in scattered blocks of a real pool
        # view (layer 1 of a.layers attention layers); it must read all of that K and V once
        bs, hkv, d = a.kv_block, a.kv_heads, a.attn_head_dim
        per_req = -(-a.kv_tokens // bs)
        spec = KVSpec(tuple(range(a.layers)), hkv, d, {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                                      torch.float16: "float16"}[dt])
        geo = BlockGeometry(spec, 1, a.kv_layout, bs, a.batch * per_req)
        buffer = torch.empty(geo.nbytes, dtype=torch.uint8, device=dev)
        buffer.view(dt).normal_()
        k, v = geo.view(buffer, 1)
        tables = torch.randperm(geo.num_blocks, device=dev).view(a.batch, per_req).to(torch.int32)
        lens = torch.full((a.batch,), a.kv_tokens, dtype=torch.int32, device=dev)
        q = torch.randn(a.batch, a.q_heads, d, dtype=dt, device=dev)
        out = torch.empty_like(q)
        fn = paged_attention_decode if tri else paged_attention_decode_ref
        kv_bytes = 2 * a.batch * a.kv_tokens * hkv * d * es
        return ((lambda: fn(q, k, v, tables, lens, d**-0.5, out=out)),
                kv_bytes + q.numel() * es + tables.numel() * 4, out.numel() * es)
    if kernel == "prefill_attn":
        tokens, d = a.batch * a.seqlen, a.attn_head_dim
        q = torch.randn(tokens, a.q_heads, d, dtype=dt, device=dev)
        k = torch.randn(tokens, a.kv_heads, d, dtype=dt, device=dev)
        v = torch.randn(tokens, a.kv_heads, d, dtype=dt, device=dev)
        cu = torch.arange(0, tokens + 1, a.seqlen, dtype=torch.int32, device=dev)
        fn = varlen_attention_prefill if tri else varlen_attention_prefill_ref
        return (lambda: fn(q, k, v, cu, d**-0.5)), (q.numel() + k.numel() + v.numel()) * es, q.numel() * es
    # pack: R runs of L bytes scattered over a source twice as large, packed densely, from a run
    # template checked and copied to the device once
    gen = np.random.default_rng(a.seed)
    r, length = a.pack_runs, a.pack_run_bytes
    src = torch.randint(0, 256, (2 * r * length,), dtype=torch.uint8, device=dev)
    staging = torch.empty(r * length, dtype=torch.uint8, device=dev)
    frm = gen.permutation(2 * r)[:r].astype(np.int64) * length
    runs = np.stack([frm, np.arange(r, dtype=np.int64) * length, np.full(r, length, dtype=np.int64)], axis=1)
    template = prepare_runs(runs, src.numel(), staging.numel(), dev)
    fn = pack if tri else pack_ref
    return (lambda: fn(src, template, staging)), r * length + template.runs.numel() * 8, r * length


def time_it(call: Callable[[], object], device: torch.device, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        call()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    providers = a.provider or (["triton", "ref"] if device.type == "cuda" else ["ref"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = a.hbm_gbps or next((v for k, v in HBM_GBPS.items() if k in name), None)
    results = []
    for kernel in a.kernels:
        for provider in providers:
            row = {"kernel": kernel, "provider": provider}
            try:
                call, read, written = build(kernel, provider, a)
                times = time_it(call, device, a.iters, a.warmup)
            except StatebridgeError as exc:
                row["skipped"] = str(exc)
                print(f"{kernel:12s} {provider:6s} skipped: {exc}")
            else:
                med = statistics.median(times)
                row.update(median_ms=med, mean_ms=statistics.fmean(times), min_ms=min(times),
                           read_bytes=read, written_bytes=written,
                           read_gbps=read / (med * 1e-3) / 1e9, moved_gbps=(read + written) / (med * 1e-3) / 1e9)
                if peak:
                    row.update(read_of_peak=row["read_gbps"] / peak, moved_of_peak=row["moved_gbps"] / peak)
                of_peak = f"  {100 * row['read_of_peak']:5.1f}% of {peak:.0f} GB/s" if peak else ""
                print(f"{kernel:12s} {provider:6s} median {med:9.4f} ms  min {min(times):9.4f} ms  "
                      f"read {row['read_gbps']:8.2f} GB/s  moved {row['moved_gbps']:8.2f} GB/s{of_peak}")
            results.append(row)
    report = {
        "args": vars(a),
        "device": name,
        "hbm_gbps": peak,
        "torch": torch.__version__,
        "results": results,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {a.json}")
    else:
        print(json.dumps(results, indent=2))
    if a.png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("--png needs matplotlib (pip install -e .[bench])", file=sys.stderr)
            return 1
        timed = [r for r in results if "median_ms" in r]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar([f"{r['kernel']}\n{r['provider']}" for r in timed], [r["median_ms"] for r in timed])
        ax.set_ylabel("median ms per call")
        ax.set_title(f"statebridge kernels on {report['device']} ({a.layout}/{a.ssm_layout}, {a.dtype})")
        fig.tight_layout()
        fig.savefig(a.png)
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
