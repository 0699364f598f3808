"""Prefix caching on multi-turn chats, through the HTTP API of real nodes on 127.0.0.1.

N conversations x T turns: every prompt starts with one long shared system prompt, then the
conversation's history (each turn appends the previous answer and a new user message). Prompts
are token ids (``/v1/completions`` with a list of ids, greedy), so what each turn shares with
earlier ones is known exactly. Turn by turn, the conversations' requests go one after the other
(streamed: the time to the first token is the client's).

Arms, each on freshly started nodes (``statebridge prefill`` / ``statebridge decode
--http-port``, prefill TP ``--prefill-tp`` -> decode TP ``--decode-tp``):

- ``off``: one prefill node, ``--no-enable-prefix-caching`` on both nodes;
- ``on``: one prefill node, the cache on (the default);
- ``rr2``: two prefill nodes, the cache on, the decode node round robin (``--no-prefix-routing``);
- ``aware2``: two prefill nodes, the decode node routes by cached prefix (the default).

Per arm: TTFT p50/p90 per turn, prompt tokens and those prefilled (prompt - cached), the hit
rate (cached / prompt tokens) against the ideal -- every prompt token that an earlier prompt
already had at the same position (the longest common prefix with any earlier prompt, at most
all but the last token, which is always computed) -- and the memory of the cache pools (pages
and KV blocks each prefill node holds, from ``/metrics``, times their bytes from ``statebridge
plan``). Every arm's answers are compared with the ``off`` arm's (greedy: equal).

Misses (``--miss-requests K``, arms ``off`` and ``on``): after its chats, each of these arms
serves the same K prompts of fresh random tokens (as long as a turn-1 prompt; none shares a
prefix with another or with anything before), one after the other, streamed. Their TTFT p50
with the cache on over off is what hashing and lookup add to a request that matches nothing
(the cache then holds the chats' checkpoints); ``cached_tokens`` of each is 0. The arms run
back to back on fresh nodes (the script's structure), so the ratio carries that noise.

    python benchmarks/bench_prefix_cache.py --json benchmarks/results/prefix-cache.json
    python benchmarks/bench_prefix_cache.py --quick          # seconds: the test's run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

from statebridge.bench.process import NodeProcess
from statebridge.net import free_port

ARMS = ("off", "on", "rr2", "aware2")
#: The arms that also serve the miss requests (one prefill node each: cache off vs on).
MISS_ARMS = ("off", "on")


def conversations(n: int, system_tokens: int, user_tokens: int, vocab: int,
                  seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and, per conversation, its user messages of every turn (token
    ids from 3 up: 0..2 are the checkpoints' special tokens)."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(3, vocab) for _ in range(k)]            # noqa: E731
    return ids(system_tokens), [[ids(user_tokens) for _ in range(64)] for _ in range(n)]


def fresh_prompts(k: int, length: int, vocab: int, seed: int,
                  avoid: tuple[int, ...] = ()) -> list[list[int]]:
    """``k`` prompts of ``length`` random token ids (from 3 up, their own seed) whose first
    tokens differ from each other's and from ``avoid`` (the chats' first token): none shares
    even one token of prefix with another or with a chat."""
    rng = random.Random(f"miss-{seed}")
    firsts = rng.sample([t for t in range(3, vocab) if t not in avoid], k)
    return [[first] + [rng.randrange(3, vocab) for _ in range(length - 1)] for first in firsts]


def ideal_hits(prompts: list[list[int]]) -> list[int]:
    """For each prompt in order: the tokens an ideal cache serves -- its longest common prefix
    with any earlier prompt, at most all but its last token."""
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            for a, b in zip(p, q):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        out.append(min(best, len(p) - 1))
    return out


async def _complete(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: its answer's token ids, TTFT, usage."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    start, ttft, tokens, usage = time.perf_counter(), None, [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"stream failed: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                if choice.get("token_ids"):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    tokens += choice["token_ids"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None or len(tokens) != max_tokens:
        raise SystemExit(f"a stream ended with {len(tokens)} tokens and usage {usage}")
    return {"answer": tokens, "ttft_s": ttft,
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def _chats(url: str, args, system: list[int], users: list[list[list[int]]]) -> list[dict]:
    """Every turn of every conversation, turn by turn; one record per request."""
    import httpx

    history = [list(system) for _ in users]
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for turn in range(args.turns):
            for c, msgs in enumerate(users):
                prompt = history[c] + msgs[turn]
                got = await _complete(client, url, prompt, args.max_tokens)
                out.append({"conversation": c, "turn": turn + 1, "prompt": prompt, **got})
                history[c] = prompt + got["answer"]
    return out


async def _misses(url: str, args, prompts: list[list[int]]) -> list[dict]:
    """The fresh prompts one after the other; one record per request (no answer kept)."""
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for prompt in prompts:
            got = await _complete(client, url, prompt, args.max_tokens)
            out.append({k: got[k] for k in ("ttft_s", "prompt_tokens", "cached_tokens")})
    return out


def _metrics(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _plan(model: str, args) -> dict:
    out = subprocess.run([sys.executable, "-m", "statebridge.cli", "plan", "--model", model,
                          "--prefill-tp", str(args.prefill_tp), "--decode-tp",
                          str(args.decode_tp), "--json"], capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout)["prefix_cache"]


def run_arm(arm: str, model: str, args, env: dict, work: str, system, users,
            misses: list[list[int]] = ()) -> dict:
    """Start the arm's nodes, run the chats, read /metrics, serve ``misses`` (after /metrics:
    its counts are the chats'), stop the nodes."""
    cache = [] if arm != "off" else ["--no-enable-prefix-caching"]
    common = ["--host", "127.0.0.1", "--device", args.device]
    limits = ["--max-prompt-len", str(args.max_prompt_len), "--max-new-tokens",
              str(max(args.max_tokens, 16))]
    procs, prefill = [], []
    try:
        for i in range(2 if arm.endswith("2") else 1):
            port = free_port()
            procs.append(NodeProcess(
                ["statebridge.cli", "prefill", "--model", model, "--tp", str(args.prefill_tp),
                 "--port", str(port), "--prefix-checkpoint-tokens", str(args.stride), *cache,
                 *common], env, "ready", os.path.join(work, f"{arm}-prefill{i}.log")))
            prefill += ["--prefill", f"127.0.0.1:{port}"]
        http_port = free_port()
        routing = ["--no-prefix-routing"] if arm == "rr2" else []
        procs.append(NodeProcess(
            ["statebridge.cli", "decode", "--model", model, "--tp", str(args.decode_tp),
             "--port", str(free_port()), *prefill, "--http-port", str(http_port), *cache,
             *routing, *limits, *common], env, "ready", os.path.join(work, f"{arm}-decode.log")))
        url = f"http://127.0.0.1:{http_port}"
        start = time.perf_counter()
        requests = asyncio.run(_chats(url, args, system, users))
        seconds = time.perf_counter() - start
        time.sleep(args.settle)                 # one heartbeat: the announcements of the end
        samples = _metrics(url)
        missed = asyncio.run(_misses(url, args, misses)) if misses else []
    finally:
        for p in reversed(procs):
            p.stop()
    return {"arm": arm, "seconds": seconds, "requests": requests, "misses": missed, "metrics": {
        "queries": samples.get(("statebridge_prefix_cache_queries_total", ()), 0),
        "hits": samples.get(("statebridge_prefix_cache_hits_total", ()), 0),
        "pages": {dict(k[1])["prefill"]: v for k, v in samples.items()
                  if k[0] == "statebridge_prefix_cache_pages"},
        "kv_blocks": {dict(k[1])["prefill"]: v for k, v in samples.items()
                      if k[0] == "statebridge_prefix_cache_kv_blocks"}}}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summarize(result: dict, ideal: list[int], plan: dict, block_size: int) -> dict:
    """TTFT per turn, tokens, hit rate against the ideal, cache memory."""
    reqs = result["requests"]
    turns = sorted({r["turn"] for r in reqs})
    prompt = sum(r["prompt_tokens"] for r in reqs)
    cached = sum(r["cached_tokens"] for r in reqs)
    best = sum(ideal)
    m = result["metrics"]
    pages, blocks = sum(m["pages"].values()), sum(m["kv_blocks"].values())
    memory = (pages * plan["checkpoint_bytes_per_rank"]
              + blocks * block_size * plan["kv_bytes_per_token_per_rank"])
    return {
        "arm": result["arm"], "seconds": round(result["seconds"], 3),
        "ttft_per_turn": {t: {"p50_s": _pct([r["ttft_s"] for r in reqs if r["turn"] == t], .5),
                              "p90_s": _pct([r["ttft_s"] for r in reqs if r["turn"] == t], .9)}
                          for t in turns},
        "prompt_tokens": prompt, "cached_tokens": cached, "prefilled_tokens": prompt - cached,
        "ideal_cached_tokens": best, "hit_rate": cached / prompt if prompt else 0.0,
        "ideal_hit_rate": best / prompt if prompt else 0.0,
        "hit_rate_vs_ideal": cached / best if best else 0.0,
        "metrics_queries": m["queries"], "metrics_hits": m["hits"],
        "cache_pages_per_rank": pages, "cache_kv_blocks_per_rank": blocks,
        "cache_bytes_per_rank": memory}


def summarize_misses(results: list[dict]) -> dict | None:
    """TTFT p50 of the miss requests per arm (``off``, ``on``) and on/off; None unless both
    arms served them."""
    arms = {r["arm"]: r["misses"] for r in results if r["arm"] in MISS_ARMS and r["misses"]}
    if set(arms) != set(MISS_ARMS):
        return None
    out: dict = {"requests": len(arms["off"]), "prompt_tokens": arms["off"][0]["prompt_tokens"]}
    for arm, reqs in arms.items():
        ttft = [r["ttft_s"] for r in reqs]
        out[arm] = {"ttft_p50_s": _pct(ttft, .5), "ttft_s": ttft,
                    "cached_tokens": [r["cached_tokens"] for r in reqs]}
    out["ttft_p50_on_over_off"] = out["on"]["ttft_p50_s"] / out["off"]["ttft_p50_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="lfm2-hybrid", help="make-checkpoint --arch")
    p.add_argument("--preset", default="small", help="make-checkpoint --preset")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of making one")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1400)
    p.add_argument("--user-tokens", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens of each answer")
    p.add_argument("--stride", type=int, default=256,
                   help="--prefix-checkpoint-tokens (the node's default; 0: none)")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--arms", default=",".join(ARMS), help=f"of {','.join(ARMS)}")
    p.add_argument("--miss-requests", type=int, default=8, metavar="K",
                   help="prompts of fresh random tokens (a turn-1 prompt's length) that arms "
                        "off and on serve after their chats: the cache's cost on a miss "
                        "(0: none)")
    p.add_argument("--settle", type=float, default=1.5,
                   help="seconds before reading /metrics at the end (announcements)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 2 conversations x 3 turns, a 300-token system prompt")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--logs", default=None, help="keep the nodes' logs (and the model) here")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.conversations, args.turns = "tiny", 2, 3
        args.system_tokens, args.user_tokens, args.max_tokens = 300, 12, 4
        args.miss_requests = min(args.miss_requests, 3)
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}; expected some of {ARMS}")
    args.max_prompt_len = args.system_tokens + args.turns * (args.user_tokens + args.max_tokens)

    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as work:
        if args.logs:
            work = os.path.abspath(args.logs)
            os.makedirs(work, exist_ok=True)
        model = args.model
        if model is None:
            model = os.path.join(work, "model")
            subprocess.run([sys.executable, "-m", "statebridge.cli", "make-checkpoint",
                            "--arch", args.arch, "--preset", args.preset, "--out", model],
                           check=True, env=env, capture_output=True, timeout=600)
        with open(os.path.join(model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        system, users = conversations(args.conversations, args.system_tokens, args.user_tokens,
                                      vocab, args.seed)
        misses = fresh_prompts(args.miss_requests, args.system_tokens + args.user_tokens,
                               vocab, args.seed, avoid=tuple(system[:1]))
        plan = _plan(model, args)
        results = [run_arm(arm, model, args, env, work, system, users,
                           misses if arm in MISS_ARMS else []) for arm in arms]
    base = results[0]["requests"]
    summaries = []
    for result in results:
        ideal = ideal_hits([r["prompt"] for r in result["requests"]])
        s = summarize(result, ideal, plan, block_size=16)
        s["answers_equal_first_arm"] = [r["answer"] for r in result["requests"]] == \
            [r["answer"] for r in base]
        summaries.append(s)
    out = {"benchmark": "prefix_cache", "date": time.strftime("%Y-%m-%d"),
           "host": platform.node(), "cpus": os.cpu_count(),
           "config": {k: v for k, v in vars(args).items() if k != "json"},
           "plan": plan, "arms": summaries, "miss": summarize_misses(results)}
    _print(out)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _print(out: dict) -> None:
    c = out["config"]
    print(f"{c['arch']} {c['preset']}: {c['conversations']} conversations x {c['turns']} turns, "
          f"system prompt {c['system_tokens']} tokens, checkpoints at prompt ends and branch "
          f"points" + (f" and every {c['stride']} tokens" if c['stride'] else ""))
    turns = sorted({t for s in out["arms"] for t in s["ttft_per_turn"]})
    print(f"{'arm':>7} " + " ".join(f"{'turn ' + str(t) + ' p50/p90 ms':>22}" for t in turns)
          + f" {'prefilled':>10} {'hit rate':>9} {'vs ideal':>9} {'cache MiB':>10} {'same':>5}")
    for s in out["arms"]:
        cells = " ".join(f"{s['ttft_per_turn'][t]['p50_s'] * 1e3:>10.1f}/"
                         f"{s['ttft_per_turn'][t]['p90_s'] * 1e3:<11.1f}" for t in turns)
        print(f"{s['arm']:>7} {cells} {s['prefilled_tokens']:>10} {s['hit_rate']:>9.3f} "
              f"{s['hit_rate_vs_ideal']:>9.3f} {s['cache_bytes_per_rank'] / 2**20:>10.2f} "
              f"{'yes' if s['answers_equal_first_arm'] else 'NO':>5}")
    miss = out.get("miss")
    if miss:
        print(f"miss: {miss['requests']} fresh prompts of {miss['prompt_tokens']} tokens, TTFT "
              f"p50 off {miss['off']['ttft_p50_s'] * 1e3:.1f} ms, on "
              f"{miss['on']['ttft_p50_s'] * 1e3:.1f} ms, on/off "
              f"{miss['ttft_p50_on_over_off']:.3f} (cached tokens: "
              f"{sum(miss['on']['cached_tokens'])})")


if __name__ == "__main__":
    sys.exit(main())
