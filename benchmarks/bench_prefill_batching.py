"""Batched prefill: time to first token of concurrent prompts, one prompt per step against
steps of up to ``max_prefill_tokens``.

Starts a prefill node (``--prefill-tp``, default 1) and a decode node (``--decode-tp``,
default 2) on 127.0.0.1 serving a checkpoint made by ``statebridge make-checkpoint`` (default
``--arch lfm2-hybrid --preset small``: 16 layers, hidden 256, attention at six of them), and
per cell sends ``N`` concurrent prompts of ``L`` random token ids at once through the zmq
front door (one client thread each), ``--max-tokens`` tokens each.

Per cell: TTFT (the client's clock, from sending to the first token) p50 and max, and prompt
tokens/s = ``N * L`` / the largest TTFT (every prompt was sent at once, so that is when the
prefill node finished the burst).

Variants (``--variant NAME=off`` or ``NAME=TOKENS``, repeatable): ``off`` starts the prefill
node with the A/B switch ``batched_prefill`` off (one whole prompt per step, as before
batching; :mod:`statebridge.bench.ab`, through :mod:`statebridge.bench.node`); ``TOKENS`` with
``--max-prefill-tokens TOKENS``. Default: ``before=off after=2048``. Every variant runs every
cell, variants adjacent per cell ``--alternate`` times (noisy shared machine: compare
adjacent runs).

    python benchmarks/bench_prefill_batching.py --json benchmarks/results/prefill-batching.json

``--compute-only``: no nodes, no transfers -- the prefill rank's compute alone, in this
process (one torch thread, as a rank): a burst of ``N`` prompts queued at once runs as the
compute thread would run it (:class:`~statebridge.connector.rank.compute.PrefillBatcher`
steps through :meth:`ModelRankModel.prefill_chunks`; ``off``: one whole prompt per step), and
each request's time is when the step with its last token ended (its state final). Variants
alternate per cell, so a busy machine slows both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from statebridge.bench.process import NodeProcess
from statebridge.net import free_port


def _burst(address: str, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Send every prompt at once (a client thread each); each one's TTFT in seconds."""
    from statebridge.node.client import Client

    clients = [Client(address, timeout=600) for _ in prompts]
    ttft: list[float] = [0.0] * len(prompts)
    errors: list[str] = []
    gate = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        try:
            gate.wait()
            start = time.perf_counter()
            for msg in clients[i].stream(prompts[i], max_new_tokens=max_tokens):
                if msg.tokens and not ttft[i]:
                    ttft[i] = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    gate.wait()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return ttft


#: The nodes' connector settings here: a burst of long prompts one at a time queues for
#: minutes, and a prefill page's lease (and a decode rank's transfer bound) count from the
#: request's dispatch, queueing included.
NODE_ENV = {"STATEBRIDGE_LEASE_TIMEOUT": "900", "STATEBRIDGE_TRANSFER_TIMEOUT": "900"}


def run_variant(name: str, budget: str, args, workdir: str, cells, vocab: int) -> list[dict]:
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", **NODE_ENV)
    model = os.path.join(workdir, "model")
    common = ["--host", "127.0.0.1", "--num-pages", str(max(2 * max(c[0] for c in cells), 8))]
    prefill_port, decode_port = free_port(), free_port()
    if budget == "off":
        head = ["statebridge.bench.node", "--off", "batched_prefill", "--", "prefill"]
    else:
        head = ["statebridge", "prefill", "--max-prefill-tokens", budget]
    prefill = NodeProcess([*head, "--model", model, "--tp", str(args.prefill_tp), "--port",
                           str(prefill_port), *common], env, "prefill node ready",
                          os.path.join(workdir, f"prefill-{name}.log"))
    out = []
    try:
        decode = NodeProcess(["statebridge", "decode", "--model", model,
                              "--tp", str(args.decode_tp), "--prefill", f"127.0.0.1:{prefill_port}",
                              "--port", str(decode_port), "--max-new-tokens", str(args.max_tokens),
                              *common], env, "decode node ready",
                             os.path.join(workdir, f"decode-{name}.log"))
        try:
            address = f"127.0.0.1:{decode_port}"
            rng = random.Random(0)
            _burst(address, [[rng.randrange(vocab) for _ in range(64)]], args.max_tokens)
            for n, length in cells:
                prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
                ttft = _burst(address, prompts, args.max_tokens)
                row = {"variant": name, "max_prefill_tokens": budget, "concurrency": n,
                       "prompt_tokens": length, "ttft_s": ttft,
                       "ttft_p50_s": statistics.median(ttft), "ttft_max_s": max(ttft),
                       "prompt_tokens_per_s": n * length / max(ttft)}
                print(f"{name:>8} ({budget:>5}): {n:3d} x {length:5d} tokens: TTFT p50 "
                      f"{row['ttft_p50_s']:7.2f} s, max {row['ttft_max_s']:7.2f} s, "
                      f"{row['prompt_tokens_per_s']:8.0f} prompt tokens/s", flush=True)
                out.append(row)
        finally:
            decode.stop()
    finally:
        prefill.stop()
    return out


def compute_only(args, model_dir: str, cells, variants, vocab: int) -> list[dict]:
    """Each cell's burst through the rank's model in this process, variants alternating."""
    import torch

    from statebridge.connector.rank import KVBlocks, PrefillChunk, RankSetup
    from statebridge.connector.rank.compute import PrefillBatcher, PrefillJob
    from statebridge.node.rank_model import ModelRankModel
    from statebridge.state import PageGeometry, StateCache, StateSpec
    from statebridge.state.kv import BlockGeometry, blocks_for

    torch.set_num_threads(1)
    most = max(n for n, _ in cells)
    longest = max(length for _, length in cells)
    spec = StateSpec.from_pretrained(model_dir)
    cache = StateCache(PageGeometry(spec, 1, "DLS"), most)
    per = blocks_for(longest, 16)
    kv = None
    if spec.kv is not None:
        geo = BlockGeometry(spec.kv, 1, "HB", 16, most * per)
        kv = KVBlocks(geo, torch.zeros(geo.nbytes, dtype=torch.uint8), 0)
    setup = RankSetup(role="prefill", coordinator="127.0.0.1:9", tp_rank=0, tp_size=1,
                      spec_json=spec.to_json(), layout="DLS", num_pages=most,
                      node_id="bench", model_dir=model_dir)
    model = ModelRankModel(setup, cache, kv)
    rng = random.Random(0)
    rows = []
    for _ in range(args.alternate):
        for n, length in cells:
            prompts = [tuple(rng.randrange(vocab) for _ in range(length)) for _ in range(n)]
            for name, budget in variants:
                batcher = PrefillBatcher(None if budget == "off" else int(budget),
                                         chunked=True)
                for b, prompt in enumerate(prompts):
                    batcher.add(PrefillJob(msg=b, key=b, page=b, tokens=prompt,
                                           blocks=tuple(range(b * per, (b + 1) * per))
                                           if kv is not None else ()))
                done: list[float] = [0.0] * n
                steps = 0
                start = time.perf_counter()
                while batcher:
                    plan = batcher.plan()
                    errors = model.prefill_chunks([
                        PrefillChunk(request_id=str(job.msg), page=job.page,
                                     tokens=job.tokens[s:e], start=s, last=e == len(job.tokens),
                                     blocks=job.blocks) for job, s, e in plan])
                    if any(errors):
                        raise SystemExit(f"a prefill failed: {errors}")
                    steps += 1
                    now = time.perf_counter() - start
                    for job in batcher.ran(plan):
                        done[job.msg] = now
                row = {"variant": name, "max_prefill_tokens": budget, "concurrency": n,
                       "prompt_tokens": length, "steps": steps, "state_final_s": done,
                       "ttft_p50_s": statistics.median(done), "ttft_max_s": max(done),
                       "prompt_tokens_per_s": n * length / max(done)}
                print(f"{name:>8} ({budget:>5}) compute only: {n:3d} x {length:5d} tokens, "
                      f"{steps:3d} steps: state final p50 {row['ttft_p50_s']:7.2f} s, max "
                      f"{row['ttft_max_s']:7.2f} s, {row['prompt_tokens_per_s']:8.0f} prompt "
                      f"tokens/s", flush=True)
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="lfm2-hybrid", help="make-checkpoint --arch")
    p.add_argument("--preset", default="small", help="make-checkpoint --preset")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=2)
    p.add_argument("--concurrency", default="8,32", help="prompts per burst (comma list)")
    p.add_argument("--prompt-tokens", default="256,1024", help="prompt lengths (comma list)")
    p.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=off|TOKENS")
    p.add_argument("--alternate", type=int, default=1, help="passes over the variants")
    p.add_argument("--compute-only", action="store_true",
                   help="the prefill rank's compute alone, in this process (no nodes)")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    variants = []
    for item in args.variant or ["before=off", "after=2048"]:
        name, sep, budget = item.partition("=")
        if not sep or not name or not (budget == "off" or budget.isdigit()):
            p.error(f"--variant wants NAME=off or NAME=TOKENS, got {item!r}")
        variants.append((name, budget))
    cells = [(int(n), int(length)) for length in args.prompt_tokens.split(",")
             for n in args.concurrency.split(",")]
    rows = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-prefill-") as workdir:
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
        subprocess.run([sys.executable, "-m", "statebridge", "make-checkpoint", "--arch",
                        args.arch, "--preset", args.preset, "--out",
                        os.path.join(workdir, "model")], env=env, check=True, cwd=workdir,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(workdir, "model", "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        if args.compute_only:
            rows = compute_only(args, os.path.join(workdir, "model"), cells, variants, vocab)
        for _ in range(0 if args.compute_only else args.alternate):
            for name, budget in variants:
                rows += run_variant(name, budget, args, workdir, cells, vocab)
    base = variants[0][0]
    ratios = []
    for row in rows:
        if row["variant"] == base:
            continue
        # the latest base run of the cell before this one (adjacent in time)
        ref = [r for r in rows[:rows.index(row)] if r["variant"] == base and
               (r["concurrency"], r["prompt_tokens"]) == (row["concurrency"],
                                                          row["prompt_tokens"])][-1]
        ratios.append({"variant": row["variant"], "vs": base, "concurrency": row["concurrency"],
                       "prompt_tokens": row["prompt_tokens"],
                       "ttft_p50": row["ttft_p50_s"] / ref["ttft_p50_s"],
                       "ttft_max": row["ttft_max_s"] / ref["ttft_max_s"],
                       "prompt_tokens_per_s": row["prompt_tokens_per_s"] /
                       ref["prompt_tokens_per_s"]})
        r = ratios[-1]
        print(f"{r['variant']} / {base}: {r['concurrency']} x {r['prompt_tokens']}: TTFT p50 "
              f"x{r['ttft_p50']:.2f}, max x{r['ttft_max']:.2f}, prompt tokens/s "
              f"x{r['prompt_tokens_per_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "prefill-batching", "started": started,
                       "seconds": time.time() - started, "argv": sys.argv[1:],
                       "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                   "python": platform.python_version()},
                       "checkpoint": {"arch": args.arch, "preset": args.preset},
                       "compute_only": args.compute_only,
                       "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
                       "max_tokens": args.max_tokens, "node_env": NODE_ENV, "rows": rows,
                       "ratios": ratios},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
