"""The report: the JSON file (and ``--append``), the CSV file, the PNG plot, and the printed
table with its warnings."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from statebridge.errors import ConfigError

CELL_FIELDS = ("pair", "layout", "preset", "device", "gbps", "messages_per_request",
               "staging_bytes_per_request", "latency_p50_ms", "latency_p99_ms",
               "line_rate_gbps", "ratio_to_line_rate", "nixl_gbps", "ratio_to_nixl",
               "vllm_way_gbps", "ratio_to_vllm_way", "vllm_way_requests_per_s",
               "vllm_way_latency_p50_ms", "vllm_way_latency_p99_ms",
               "vllm_way_cpu_us_per_request", "vllm_way_descriptors_per_request",
               "vllm_way_nixl_calls_per_request", "nixl_calls_per_request",
               "nixl_cpu_us_per_request", "copy_limit_gbps", "ratio_to_copy_limit",
               "copy_limit_yardstick", "copy_limit_candidates", "copy_limit_beaten_by",
               "shared_map_reads_per_request",
               "control_messages_per_request", "ucx_operations_per_request",
               "cpu_us_per_request", "wakeups_per_request", "completions_per_burst",
               "low_load_latency_p50_ms", "low_load_latency_p99_ms",
               "low_load_final_to_held_p50_ms", "low_load_final_to_held_p99_ms",
               "vllm_way_low_load_latency_p50_ms", "vllm_way_low_load_latency_p99_ms",
               "vllm_way_low_load_final_to_held_p50_ms",
               "vllm_way_low_load_final_to_held_p99_ms", "peak_rss_mib", "peak_rss_scope")


#: CSV columns: the cell's identity, then :data:`CELL_FIELDS`.
CSV_FIELDS = ("preset", "pair", "layout", "transport", "switched_off", "prompt_tokens",
              "kv_layout", "requests_per_s") + tuple(f for f in CELL_FIELDS
                                        if f not in ("preset", "pair", "layout"))


def write_json(path: str, out: dict, *, append: bool = False) -> dict:
    """Write the run's object to ``path``; with ``append`` and an existing file, this run's
    cells are added to it (:func:`_appended`). Returns what was written."""
    if append and Path(path).exists():
        out = _appended(json.loads(Path(path).read_text()), out, path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, default=_jsonable) + "\n")
    return out


def write_csv(path: str, cells: Sequence[dict]) -> str:
    """One row per cell, :data:`CSV_FIELDS` as columns: numbers and text as they are, nested
    figures (per process class, per candidate) as JSON, a missing figure empty."""
    def value(x):
        if x is None:
            return ""
        if isinstance(x, (dict, list, tuple)):
            return json.dumps(x, default=_jsonable, sort_keys=True)
        return _jsonable(x) if isinstance(x, (np.generic, np.ndarray)) else x
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for c in cells:
            w.writerow([value(c.get(k)) for k in CSV_FIELDS])
    return path


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
            "x line | x NIXL | vLLM's way GB/s | x vLLM's way | x copy limit | "
            "copy limit GB/s (yardstick) | ctl msgs/req | "
            "UCX ops/req | CPU us/req | vLLM CPU us/req | vLLM NIXL calls/req | "
            "low-load final->held p50/p99 ms | vLLM low-load final->held p50/p99 ms | "
            "vLLM low-load READ post->done p50/p99 ms | peak RSS MiB P/D/NIXL |",
            "|" + "---|" * 24]
    for c in cells:
        layout = c["layout"] + (f"+{c['kv_layout']}" if c.get("kv_layout") else "") + "".join(
            f" ({name} off)" for name in c.get("switched_off") or ()) + (
            " (prefix cache)" if c.get("prefix_caching") else "")
        tokens = c.get("prompt_tokens") or "-"
        rows.append(
            f"| {c['preset']} | {c['pair']} | {layout} | {tokens} | {f(c['gbps'])} | "
            f"{f(c['requests_per_s'], '{:.0f}')} | {c['messages_per_request']} | "
            f"{f(c['latency_p50_ms'])} | {f(c['latency_p99_ms'])} | "
            f"{f(c['ratio_to_line_rate'])} | {f(c.get('ratio_to_nixl'))} | "
            f"{f(c.get('vllm_way_gbps'))} | {f(c.get('ratio_to_vllm_way'))} | "
            f"{f(c.get('ratio_to_copy_limit'))} | {_limit_text(c)} | "
            f"{f(c.get('control_messages_per_request'))} | "
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


def _limit_text(c: dict) -> str:
    """The copy limit, the candidate it came from and the share of the cores its copiers got
    (well under 1: the machine was busy, and the limit reads high):
    ``15.2 (shared_map/per_rank/warm, CPU share 0.97)``."""
    if c.get("copy_limit_gbps") is None:
        return "-"
    share = c.get("copy_limit_cpu_share")
    return (f"{c['copy_limit_gbps']:.3g} ({c.get('copy_limit_yardstick')}, CPU share "
            f"{'-' if share is None else format(share, '.2f')})")


def limit_warnings(cells: Sequence[dict]) -> list[str]:
    """One line per cell whose copy limit was beaten (``copy_limit_beaten_by``): a figure
    above the fastest copy of the same bytes shows the limit is wrong, not a fast cell."""
    out = []
    for c in cells:
        for who in c.get("copy_limit_beaten_by") or ():
            field = "gbps" if who == "statebridge" else f"{who}_gbps"
            out.append(f"copy limit beaten: {c['preset']} {c['pair']} {c['layout']}: {who} "
                       f"{c[field]:.3g} GB/s > {c['copy_limit_gbps']:.3g} GB/s "
                       f"({c['copy_limit_yardstick']}); the limit is wrong")
    return out


def _rss_text(rss: dict | None) -> str:
    """The largest peak RSS of the prefill ranks, the decode ranks and the NIXL workers
    (``412/530/-``: no NIXL workers in the cell)."""
    if not rss:
        return "-"

    def peak(*names: str) -> str:
        values = [v for n in names for v in rss.get(n, []) if v is not None]
        return f"{max(values):.0f}" if values else "-"
    return f"{peak('prefill_ranks')}/{peak('decode_ranks')}/{peak('nixl_src', 'nixl_dst')}"
