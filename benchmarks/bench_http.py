"""The HTTP front door under load: tokens/s of concurrent streaming completions, and the CPU
time the decode node's process spends per token.

Starts a prefill node and a decode node (``statebridge prefill`` / ``statebridge decode
--http-port``) on 127.0.0.1, serving a tiny checkpoint made by ``statebridge make-checkpoint``,
and drives ``--streams`` concurrent streaming ``/v1/completions`` requests (httpx, one
asyncio loop) of ``--max-tokens`` tokens each (``ignore_eos``), ``--rounds`` times after one
warm-up round.

Per round: tokens/s (tokens the server reported in ``usage`` / wall time of the round), and
CPU per token of the decode node PROCESS (``utime + stime`` of ``/proc/PID/stat``: every thread
of it -- the coordinator's loop, the HTTP server's thread, zmq's I/O threads; and, finer, the
sum of its live threads' ``schedstat`` run time), and separately of its rank processes (its
descendants).

``--code NAME=DIR`` (repeatable) runs the nodes with ``PYTHONPATH=DIR``, e.g. a checkout of
another commit, and ``--alternate N`` runs the codes in turn N times (A B A B ...): on a shared,
noisy machine compare adjacent runs, not runs far apart. Without ``--code`` the nodes run with
this process's PYTHONPATH.

    python benchmarks/bench_http.py --code before=/tmp/base --code after=. --alternate 2 \\
        --json benchmarks/results/http-front-door.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
from statebridge.bench.process import NodeProcess
from statebridge.net import free_port


def _cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads, the exited ones too), in seconds: clock
    ticks, so a round should last seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS      # fields 14 and 15 of stat(5)


def _run_seconds(pid: int) -> float:
    """Time on CPU of the live threads of one process (``/proc/PID/task/*/schedstat``,
    nanoseconds): finer than :func:`_cpu_seconds`, blind to threads that exit meanwhile."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


def _thread_names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return names


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except FileNotFoundError:
                continue
            out += kids
            todo += kids
    return out


def _cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += _cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


async def _stream(client, url: str, prompt: str, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens = -1
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"stream failed: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if tokens != max_tokens:
        raise SystemExit(f"a stream ended with {tokens} tokens, not {max_tokens}")
    return tokens


async def _round(url: str, streams: int, max_tokens: int) -> tuple[int, float]:
    import httpx

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(
            _stream(client, url, f"Request {i}: the river ran on and on", max_tokens)
            for i in range(streams)))
        return sum(counts), time.perf_counter() - start


def run_code(name: str, path: str | None, args: argparse.Namespace, workdir: str) -> dict:
    """Start both nodes with ``PYTHONPATH=path``, warm up, measure ``args.rounds`` rounds."""
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    if path is not None:
        env["PYTHONPATH"] = os.path.abspath(path)
    model = os.path.join(workdir, "model")
    common = ["--host", "127.0.0.1", "--num-pages", str(max(2 * args.streams, 8))]
    if args.keys:
        common += ["--keys", os.path.join(workdir, "keys")]
    prefill_port, decode_port, http_port = free_port(), free_port(), free_port()
    prefill = NodeProcess(
        ["statebridge", "prefill", "--model", model, "--tp", str(args.prefill_tp),
         "--port", str(prefill_port), *common], env, "prefill node ready",
        os.path.join(workdir, f"prefill-{name}.log"), start_timeout=180)
    try:
        decode = NodeProcess(
            ["statebridge", "decode", "--model", model, "--tp", str(args.decode_tp),
             "--prefill", f"127.0.0.1:{prefill_port}", "--port", str(decode_port),
             "--http-port", str(http_port), "--max-new-tokens", str(args.max_tokens), *common],
            env, "decode node ready", os.path.join(workdir, f"decode-{name}.log"),
            start_timeout=180)
        try:
            url = f"http://127.0.0.1:{http_port}"
            for _ in range(args.warmup):
                asyncio.run(_round(url, args.streams, args.max_tokens))
            rounds = []
            for _ in range(args.rounds):
                ranks = _descendants(decode.pid)
                node0, run0, ranks0 = (_cpu_seconds(decode.pid), _run_seconds(decode.pid),
                                       _cpu_of(ranks))
                tokens, wall = asyncio.run(_round(url, args.streams, args.max_tokens))
                node_cpu = _cpu_seconds(decode.pid) - node0
                node_run = _run_seconds(decode.pid) - run0
                rank_cpu = _cpu_of(ranks) - ranks0
                rounds.append({"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                               "node_cpu_s": node_cpu,
                               "node_cpu_us_per_token": 1e6 * node_cpu / tokens,
                               "node_run_us_per_token": 1e6 * node_run / tokens,
                               "rank_cpu_us_per_token": 1e6 * rank_cpu / tokens,
                               "rank_processes": len(ranks),
                               "node_threads": len(os.listdir(f"/proc/{decode.pid}/task"))})
            threads = sorted(_thread_names(decode.pid))
        finally:
            decode.stop()
    finally:
        prefill.stop()
    summary = {key: statistics.median(r[key] for r in rounds)
               for key in ("tokens_per_s", "node_cpu_us_per_token", "node_run_us_per_token",
                           "rank_cpu_us_per_token", "node_threads")}
    print(f"{name:>10}: {summary['tokens_per_s']:8.1f} tokens/s, decode node "
          f"{summary['node_cpu_us_per_token']:6.1f} us CPU/token (schedstat "
          f"{summary['node_run_us_per_token']:6.1f}, {summary['node_threads']} threads; ranks "
          f"{summary['rank_cpu_us_per_token']:6.1f}); medians of {len(rounds)} rounds",
          flush=True)
    return {"code": name, "pythonpath": env.get("PYTHONPATH", ""), "rounds": rounds,
            "median": summary, "node_threads": threads}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="lfm2", help="make-checkpoint --arch (default lfm2)")
    p.add_argument("--preset", default="tiny", help="make-checkpoint --preset")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--streams", type=int, default=16, help="concurrent streams (default 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per run")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    p.add_argument("--keys", action="store_true",
                   help="nodes with CURVE keys (--keys DIR from statebridge keygen)")
    p.add_argument("--code", action="append", default=[], metavar="NAME=DIR",
                   help="run the nodes with PYTHONPATH=DIR (repeatable: A/B)")
    p.add_argument("--alternate", type=int, default=1,
                   help="run the codes in turn this many times (A B A B ...)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    args = p.parse_args(argv)
    codes = []
    for item in args.code:
        name, sep, path = item.partition("=")
        if not sep or not name or not os.path.isdir(path):
            p.error(f"--code wants NAME=DIR with an existing DIR, got {item!r}")
        codes.append((name, path))
    codes = codes or [("current", None)]

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-http-") as workdir:
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
        if codes[0][1] is not None:
            env["PYTHONPATH"] = os.path.abspath(codes[0][1])
        subprocess.run([sys.executable, "-m", "statebridge", "make-checkpoint", "--arch",
                        args.arch, "--preset", args.preset, "--out",
                        os.path.join(workdir, "model")], env=env, check=True, cwd=workdir,
                       stdout=subprocess.DEVNULL)
        if args.keys:
            subprocess.run([sys.executable, "-m", "statebridge", "keygen",
                            os.path.join(workdir, "keys")], env=env, check=True, cwd=workdir,
                           stdout=subprocess.DEVNULL)
        for _ in range(args.alternate):
            for name, path in codes:
                runs.append(run_code(name, path, args, workdir))

    # Ratios of adjacent runs (each code to the first code, within one pass of the codes).
    ratios = []
    for i in range(0, len(runs), len(codes)):
        group = runs[i:i + len(codes)]
        base = group[0]["median"]
        for run in group[1:]:
            ratios.append({"code": run["code"], "vs": group[0]["code"],
                           "tokens_per_s": run["median"]["tokens_per_s"] / base["tokens_per_s"],
                           "node_cpu_per_token": run["median"]["node_cpu_us_per_token"] /
                           base["node_cpu_us_per_token"],
                           "node_run_per_token": run["median"]["node_run_us_per_token"] /
                           base["node_run_us_per_token"]})
    for r in ratios:
        print(f"{r['code']} / {r['vs']}: tokens/s x{r['tokens_per_s']:.3f}, decode node CPU per "
              f"token x{r['node_cpu_per_token']:.3f} (schedstat x{r['node_run_per_token']:.3f})")
    out = {"benchmark": "bench_http", "machine": platform.node(), "cpus": os.cpu_count(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": vars(args), "runs": runs,
           "ratios": ratios}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
