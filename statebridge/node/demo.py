"""``statebridge demo``: a tiny checkpoint served disaggregated on localhost, checked against a
single-process run of the same checkpoint.

1. make a tiny random checkpoint (no download; by default LFM2 with attention layers, as every
   released LFM2 is, so both recurrent state and attention KV move) and its small tokenizer;
2. start a prefill node (TP=2) and a decode node (TP=4, with its OpenAI-compatible HTTP API)
   as two processes of their own (each with its rank processes), exactly as
   ``statebridge prefill`` / ``statebridge decode`` would;
3. send a handful of text prompts (encoded by the checkpoint's tokenizer) concurrently through
   the client, and one through the HTTP API;
4. compute the same greedy continuations in this process at TP=1 (whole prompt prefilled at
   once, no transfer) and compare token for token; the HTTP text must be the decoded tokens;
5. print the text, TTFT, recurrent and KV bytes per request and transfer figures, and shut
   both nodes down. (The weights are random: the text is fluent only in its tokens.)
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

__all__ = ["run_demo", "reference_greedy", "NodeProcess"]


class NodeProcess:
    """A node started as ``python -m statebridge.cli ...``; waits for its "ready on" line (or
    the decode node's "up on" line: listening, still dialling its prefill nodes)."""

    def __init__(self, args: list[str], name: str, timeout: float = 300.0) -> None:
        self.name = name
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "statebridge.cli", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip())
            if " ready on " in line or " up on " in line:
                return
        self.stop()
        raise RuntimeError(f"{name} did not start:\n" + "\n".join(self.lines[-30:]))

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; SIGKILL the whole process group if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


def reference_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, *,
                     device: str = "cpu") -> list[list[int]]:
    """Greedy continuations in one process at TP=1 on ``device`` (a ``--device`` spelling):
    each prompt prefilled whole, then decoded."""
    import torch

    from statebridge.models.runner import ModelRunner
    from statebridge.state.cache import StateCache
    from statebridge.state.layout import PageGeometry
    from statebridge.state.spec import StateSpec

    from statebridge.connector.rank import KVBlocks
    from statebridge.state.kv import BlockGeometry, blocks_for

    from statebridge.devices import rank_device

    where = rank_device(device, 0)
    spec = StateSpec.from_pretrained(model_dir)
    cache = StateCache(PageGeometry(spec, 1, "LSD"), len(prompts), device=where)
    kv, tables = None, None
    if spec.kv is not None:            # a block table per prompt, blocks for every token
        block = 16
        need = [blocks_for(len(p) + max_new_tokens, block) for p in prompts]
        geo = BlockGeometry(spec.kv, 1, "LH", block, sum(need))
        kv = KVBlocks(geo, torch.zeros(geo.nbytes, dtype=torch.uint8, device=where), 0)
        starts = np.cumsum([0] + need)
        tables = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
    runner = ModelRunner(model_dir, 1, 0, cache, kv=kv)
    pages = list(range(len(prompts)))
    positions = [len(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        logits = runner.prefill(prompts, pages, blocks=tables)
        tokens = [int(t) for t in logits.argmax(dim=-1)]
        for _ in range(max_new_tokens):
            for i, t in enumerate(tokens):
                out[i].append(t)
            if len(out[0]) == max_new_tokens:
                break
            logits = runner.decode(tokens, pages, blocks=tables, positions=positions)
            tokens = [int(t) for t in logits.argmax(dim=-1)]
            positions = [n + 1 for n in positions]
    return out


#: The demo's prompts (any text of the bundled tokenizer's characters works).
_PROMPTS = ["Hello!", "The river ran through the valley", "How many days are there in a week?",
            "A model reads a prompt and writes an answer, one token at a time.", "Good morning",
            "The old man", "Numbers: 1 2 3 4", "Spring came back to the valley with rain"]


def _until_eos(tok, tokens: list[int]) -> str:
    """What the HTTP API answers for greedy ``tokens``: their text, up to an EOS token."""
    cut = next((i for i, t in enumerate(tokens) if t in tok.eos_token_ids), len(tokens))
    return tok.decode(tokens[:cut])


def _http_completion(port: int, model: str, prompt: str, max_tokens: int) -> str:
    """One greedy completion through the decode node's OpenAI-compatible HTTP API."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["text"]


def run_demo(*, arch: str = "lfm2-hybrid", prefill_tp: int = 2, decode_tp: int = 4,
             layout: str = "DLS", prompts: int = 4, max_new_tokens: int = 8,
             device: str = "cpu") -> int:
    from statebridge.models.checkpoint import make_checkpoint
    from statebridge.node.client import Client
    from statebridge.net import free_port

    from statebridge.node.text import TextTokenizer

    with tempfile.TemporaryDirectory(prefix="statebridge-demo-") as tmp:
        model = os.path.join(tmp, f"{arch}-tiny")
        make_checkpoint(arch, model, preset="tiny", seed=0)
        print(f"[1/4] tiny {arch} checkpoint in {model}", flush=True)
        from statebridge.state.spec import StateSpec

        spec = StateSpec.from_pretrained(model)
        tok = TextTokenizer.from_dir(model)
        texts = (_PROMPTS * (prompts // len(_PROMPTS) + 1))[:prompts]
        batch = [tok.encode(t) for t in texts]

        prefill_port, decode_port, http_port = free_port(), free_port(), free_port()
        print(f"[2/4] starting prefill node TP={prefill_tp} and decode node TP={decode_tp} "
              f"({layout}, device {device}) on 127.0.0.1", flush=True)
        nodes = []
        try:
            nodes.append(NodeProcess(["prefill", "--model", model, "--tp", str(prefill_tp),
                                      "--port", str(prefill_port), "--layout", layout,
                                      "--device", device],
                                     "prefill node"))
            nodes.append(NodeProcess(["decode", "--model", model, "--tp", str(decode_tp),
                                      "--prefill", f"127.0.0.1:{prefill_port}",
                                      "--port", str(decode_port), "--layout", layout,
                                      "--http-port", str(http_port), "--device", device],
                                     "decode node"))
            address = f"127.0.0.1:{decode_port}"
            with Client(address) as probe:
                probe.wait_ready()
            http = _http_completion(http_port, os.path.basename(model), texts[0],
                                    max_new_tokens)
            print(f"[3/4] {len(batch)} prompts in flight at once", flush=True)

            def one(prompt):
                with Client(address) as client:
                    return client.generate(prompt, max_new_tokens=max_new_tokens)

            with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
                results = list(pool.map(one, batch))
        finally:
            codes = [n.stop() for n in reversed(nodes)]
        expected = reference_greedy(model, batch, max_new_tokens, device=device)
        print("[4/4] disaggregated vs single process (TP=1, no transfer):")
        ok = True
        recurrent = spec.bytes_per_request()
        for text, prompt, got, want in zip(texts, batch, results, expected):
            same = got.tokens == want
            ok &= same
            # The N-1 protocol: the prefill node computes prompt[:-1], so that much KV moves.
            kv_bytes = spec.kv_bytes(len(prompt) - 1) if spec.kv is not None else 0
            print(f"  {text!r} ({len(prompt)} tokens) -> {tok.decode(got.tokens)!r}")
            print(f"      {got.tokens} {'==' if same else '!='} reference  TTFT "
                  f"{got.ttft * 1e3:7.1f} ms  recurrent {recurrent:,} B + KV {kv_bytes:,} B, "
                  f"transfer {got.transfer_bytes:,} B in {got.transfer_seconds * 1e3:.1f} ms")
        want_text = _until_eos(tok, expected[0])
        same = http == want_text
        ok &= same
        print(f"  HTTP /v1/completions {texts[0]!r} -> {http!r} "
              f"{'==' if same else '!='} the reference tokens decoded")
        print(f"nodes exited with {codes}")
        print("demo OK: every token matches" if ok else "demo FAILED: tokens differ")
        return 0 if ok and all(c == 0 for c in codes) else 1
