"""Heterogeneous-TP transfer benchmark: statebridge vs the line rate, NIXL, and vLLM's way.

The command line (:func:`add_parser`, :func:`main`), the presets, and the run over every cell
(:func:`run`); a cell itself runs in :mod:`statebridge.bench.hetero_tp.cells`, the report is
written by :mod:`statebridge.bench.hetero_tp.report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

from statebridge.bench.hetero_tp.cells import (
    TRANSPORTS,
    _copy_limit_cell,
    _LineRate,
    _nixl_cell,
    _ratio,
    _statebridge_cell,
    prompt_tokens,
)
from statebridge.bench.hetero_tp.procstats import _PeakRss
from statebridge.bench.hetero_tp.report import (
    format_table,
    limit_warnings,
    write_csv,
    write_json,
    write_plot,
)
from statebridge.config import ConnectorConfig
from statebridge.errors import ConfigError
from statebridge.state.layout import Layout
from statebridge.state.plan import TransferPlan
from statebridge.state.prefix import DEFAULT_CHECKPOINT_TOKENS
from statebridge.state.spec import StateSpec

log = logging.getLogger(__name__)

GIB = 1 << 30

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

DEFAULT_TP = (1, 2, 4, 8)
LAYOUTS = ("LSD", "LDS", "DLS")


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
    # (STATEBRIDGE_* variables apply, as for the nodes; --off turns A/B switches off)
    from statebridge.bench.ab import switched_off

    config = switched_off(ConnectorConfig.from_env(
        ucx_error_handling=TRANSPORTS[a.transport][0], transfer_timeout=a.timeout,
        handshake_timeout=60.0), a.off)
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
                                        "layout": layout, "transport": a.transport,
                                        "switched_off": sorted(set(a.off))}
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
        out = write_json(a.json, out, append=a.append)
    if a.csv:
        write_csv(a.csv, out["cells"])
    if a.plot:
        out["plot"] = write_plot(a.plot, out["cells"])
    return out


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
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]",
                   help="where every rank of every cell holds its pages and KV pool (the "
                        "nodes' --device; default auto: CUDA when a GPU is visible)")
    p.add_argument("--memory-fraction", type=float, default=0.6,
                   help="share of MemAvailable a cell may hold (cells above are skipped)")
    p.add_argument("--no-nixl", action="store_true", help="skip the NIXL measurements")
    p.add_argument("--no-line-rate", action="store_true", help="skip ucx_perftest")
    p.add_argument("--no-copy-limit", action="store_true",
                   help="skip the copy limit (the fastest copy of each cell's bytes: shared-map "
                        "read or process_vm_readv, per core or per decode rank, cold or warm)")
    from statebridge.bench.ab import SWITCHES

    p.add_argument("--off", action="append", default=[], choices=sorted(SWITCHES),
                   metavar="SWITCH",
                   help="turn an A/B switch of the connector off, to compare the path it "
                        "replaced (repeatable; statebridge/bench/ab.py): " + "; ".join(
                            f"{k}: {v}" for k, v in sorted(SWITCHES.items())))
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="start the prefill servers with their prefix cache on (checkpoints "
                        "every --prefix-checkpoint-tokens and at each prompt's end, KV blocks kept; every prompt is unique, so "
                        "nothing hits: the cache's overhead alone -- after 64 such prompts an "
                        "idle cache's, which keeps none; the same pools as without it). "
                        "Default off: the cells stay comparable with earlier runs")
    p.add_argument("--prefix-checkpoint-tokens", dest="prefix_stride", type=int, metavar="N",
                   default=DEFAULT_CHECKPOINT_TOKENS, help="the prefill node's flag")
    p.add_argument("--low-load-requests", type=int, default=100, metavar="N",
                   help="requests of each cell's concurrency-1 round (statebridge and vLLM's "
                        "way; 0: none)")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--append", action="store_true",
                   help="add this run's cells to an existing --json file (and plot them all)")
    p.add_argument("--csv", default=None,
                   help="write one row per cell here (with --append: every cell of --json)")
    p.add_argument("--plot", default=None, help="PNG plot (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no table")
    return p


def _validate(a: argparse.Namespace) -> None:
    from statebridge.devices import DeviceSpec, visible_gpus

    device = DeviceSpec.parse(getattr(a, "device", "auto"))          # ConfigError names it
    if device.kind == "auto":
        device = DeviceSpec("cuda" if visible_gpus() else "cpu")
    a.device = str(device)
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
        for line in limit_warnings(out["cells"]):
            print(line)
        if not out["nixl"]["available"]:
            print(f"NIXL: not measured ({out['nixl']['reason']})")
        for s in out["skipped"]:
            print(f"skipped {s['preset']} {s['pair']} {s['layout']}: {s['reason']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
