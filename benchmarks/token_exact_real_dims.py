"""Token-exact at real dimensions: greedy tokens of statebridge's disaggregated serving against
transformers' own ``generate``, in fp32, on random checkpoints of real models' shapes.

The tests check token-exactness on tiny checkpoints (hidden 32-64). This script checks it where
the numbers are big: hidden 2,048, a 65,536-token vocabulary, 16-48 layers. Per model:

1. **Checkpoint.** ``transformers`` builds the model from its config class with its own random
   init (optionally a larger embedding std, ``--embed-std``), in fp32, and ``save_pretrained``
   writes it; :func:`statebridge.models.tokenizer.write_tokenizer` writes the tokenizer beside
   it. Shapes (see ``MODELS``):

   - ``lfm2-1.2b``: LFM2-1.2B's published ``config.json`` (huggingface.co/LiquidAI/LFM2-1.2B):
     vocabulary 65,536, hidden 2,048, 16 layers with full attention at 2, 5, 8, 10, 12, 14 and
     ShortConv (``conv_L_cache`` 3, no bias) elsewhere, 32 query / 8 KV heads of 64,
     ``block_ff_dim`` 12,288 auto-adjusted (2/3, multiple of 256) to an 8,192-wide SwiGLU,
     RoPE theta 1e6, norm eps 1e-5, tied embeddings, bos 1 / eos 7 / pad 0.
   - ``mamba2-1.3b`` (default) and ``mamba2-780m``: state-spaces/mamba2-1.3b and -780m
     (``config.json``: d_model 2,048 / 1,536, 48 layers, vocabulary 50,277 padded to a
     multiple of 16, tied embeddings, RMSNorm) with mamba_ssm's ``Mamba2`` defaults
     (d_state 128, head_dim 64, n_groups 1, expand 2, d_conv 4, chunk 256, conv bias, no
     in/out bias). ``initializer_range`` 0.02 as mamba_ssm initialises (transformers'
     Mamba2Config defaults to 0.1, which puts most ``dt`` far above the 0.001-0.1 range the
     ``dt_bias`` init targets, so the state forgets within a token or two).

2. **Reference.** ``model.generate(do_sample=False)`` in fp32 (EOS disabled, so every prompt
   gets all ``--new-tokens``), with the logits of every step. The same greedy path is also run
   as ONE uncached forward over prompt + generated tokens: its argmax must agree, and its
   largest logit difference to ``generate``'s is transformers' own fp32 noise between two
   ways of computing the same thing. The smallest top-1 minus top-2 logit gap over every step
   of every prompt is the margin the comparison has.

3. **statebridge, one process** (``--no-runner-check`` skips it): ``ModelRunner`` at TP 1
   prefills ``prompt[:-1]``, then decodes ``prompt[-1]`` and the reference tokens (teacher
   forced); the largest absolute logit difference to the reference at any step is the noise
   the margin has to beat. Then the state is ablated: ``prompt[-1]`` decoded again with the
   recurrent state zeroed (and, for hybrids, also the KV): if that changes the first token,
   the transferred state decides the tokens and a match is evidence that it arrived whole.

4. **statebridge, served.** ``python -m statebridge.cli prefill --tp 1`` and ``decode --tp D``
   for each ``--decode-tp`` (default 2 and 4) on 127.0.0.1, every prompt sent at once through
   the zmq :class:`~statebridge.node.client.Client` (greedy, token ids back), then the nodes
   are stopped. Node logs go to ``WORKDIR/logs``.

Per prompt and configuration the table shows ``match`` or the first divergent step with both
tokens and the reference's logit gap between them at that step. Steps 1-3 run in child
processes one after another and the nodes of one configuration at a time, so the machine holds
one copy of the model (plus the nodes' shards) at once; ``free -g`` before a run.

    python benchmarks/token_exact_real_dims.py --json benchmarks/results/token-exact.json
    python benchmarks/token_exact_real_dims.py --models lfm2-1.2b --decode-tp 2 --new-tokens 8

Exit status 0 when every prompt matched in every configuration, 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing as mp
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

#: name -> (transformers config class, model class, config kwargs). Sources in the docstring.
MODELS: dict[str, tuple[str, str, dict]] = {
    "lfm2-1.2b": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        vocab_size=65536, hidden_size=2048, num_hidden_layers=16,
        layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv"
                     for i in range(16)],
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=12288,
        block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
        conv_L_cache=3, conv_bias=False, norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=128000, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=7, pad_token_id=0)),
    "mamba2-1.3b": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=50288, hidden_size=2048, num_hidden_layers=48, state_size=128, head_dim=64,
        num_heads=64, n_groups=1, expand=2, conv_kernel=4, chunk_size=256, use_bias=False,
        use_conv_bias=True, residual_in_fp32=True, tie_word_embeddings=True,
        initializer_range=0.02)),
    "mamba2-780m": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=50288, hidden_size=1536, num_hidden_layers=48, state_size=128, head_dim=64,
        num_heads=48, n_groups=1, expand=2, conv_kernel=4, chunk_size=256, use_bias=False,
        use_conv_bias=True, residual_in_fp32=True, tie_word_embeddings=True,
        initializer_range=0.02)),
}

#: Text the prompts are cut from (encoded by the checkpoint's tokenizer).
TEXT = (
    "The river ran through the valley, past the old mill and the houses by the bridge, and on "
    "towards the sea. In spring the water rose with the rain and the snow from the hills; in "
    "summer children swam where it turned slow and deep. A model reads a prompt and writes an "
    "answer, one token at a time, and each token it writes becomes part of what it reads "
    "next. Numbers: 1 2 3 4 5 6 7 8 9 10 11 12. How many days are there in a week? Seven, and "
    "twelve months in a year, and about three hundred and sixty five days. Good morning! The "
    "old man walked to the market every day to buy bread, milk, and apples for his family. ")


# -- child-process stages (each returns plain data; the model is freed when the child exits) --

def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_checkpoint(name: str, out_dir: str, seed: int, embed_std: float | None) -> dict:
    """``transformers`` builds ``name`` in fp32 with its own init; save it and a tokenizer."""
    import torch
    import transformers

    from statebridge.models.tokenizer import write_tokenizer

    start = time.perf_counter()
    config_cls, model_cls, kwargs = MODELS[name]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        if embed_std is not None:
            embed.normal_(0.0, embed_std, generator=torch.Generator().manual_seed(seed + 1))
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir)
    del model
    with open(os.path.join(out_dir, "config.json")) as f:
        saved = json.load(f)
    write_tokenizer(saved, out_dir)
    weight_bytes = sum(p.stat().st_size for p in Path(out_dir).glob("*.safetensors"))
    return {"params": params, "weight_bytes": weight_bytes, "seconds": time.perf_counter() - start,
            "peak_rss_mib": _peak_rss_mib(), "config": saved}


def make_prompts(model_dir: str, lengths: list[int]) -> list[list[int]]:
    """Prompts of exactly ``lengths`` tokens, cut from ``TEXT`` at different offsets."""
    from statebridge.node.text import TextTokenizer

    tok = TextTokenizer.from_dir(model_dir)
    ids = tok.encode(TEXT)
    need = max(lengths) + 7 * len(lengths)
    while len(ids) < need:
        ids = ids + ids
    return [ids[7 * i:7 * i + n] for i, n in enumerate(lengths)]


def reference(model_dir: str, prompts: list[list[int]], new_tokens: int, logits_dir: str) -> dict:
    """transformers fp32 ``generate(do_sample=False)``; per-step logits saved to
    ``logits_dir/ref-<i>.pt``."""
    import torch
    import transformers

    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None     # every prompt runs all new_tokens
    load_s = time.perf_counter() - start
    out = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=0,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=model.config.pad_token_id)
            gen_s = time.perf_counter() - t0
            tokens = gen.sequences[0, len(prompt):].tolist()
            logits = torch.stack([x[0].float() for x in gen.logits])           # [steps, V]
            # The same greedy path as one uncached forward.
            full = torch.tensor([prompt + tokens[:-1]])
            flat = model(full, use_cache=False).logits[0, len(prompt) - 1:].float()
            top2 = logits.topk(2, dim=-1)
            gaps = (top2.values[:, 0] - top2.values[:, 1]).tolist()
            torch.save(logits, os.path.join(logits_dir, f"ref-{i}.pt"))
            out.append({
                "tokens": tokens, "gaps": gaps,
                "argmax_is_token": bool((logits.argmax(-1) == torch.tensor(tokens)).all()),
                "uncached_tokens_agree": bool((flat.argmax(-1) == torch.tensor(tokens)).all()),
                "uncached_max_abs_logit_diff": float((flat - logits).abs().max()),
                "logit_std": float(logits.std(dim=-1).mean()),
                "generate_seconds": gen_s})
    return {"prompts": out, "load_seconds": load_s, "seconds": time.perf_counter() - start,
            "peak_rss_mib": _peak_rss_mib()}


def runner_check(model_dir: str, prompts: list[list[int]], ref_tokens: list[list[int]],
                 logits_dir: str) -> dict:
    """statebridge's ModelRunner at TP 1, the serving order (prefill ``p[:-1]``, decode
    ``p[-1]``, then the reference tokens teacher forced); logits against the reference's."""
    import numpy as np
    import torch

    from statebridge.connector.rank import KVBlocks
    from statebridge.models.runner import ModelRunner
    from statebridge.state.cache import StateCache
    from statebridge.state.kv import DEFAULT_BLOCK_SIZE, DEFAULT_KV_LAYOUT, BlockGeometry, blocks_for
    from statebridge.state.layout import PageGeometry
    from statebridge.state.spec import StateSpec

    start = time.perf_counter()
    spec = StateSpec.from_pretrained(model_dir)
    cache = StateCache(PageGeometry(spec, 1, "DLS"), len(prompts))
    kv = tables = None
    steps = len(ref_tokens[0])
    if spec.kv is not None:
        need = [blocks_for(len(p) + steps, DEFAULT_BLOCK_SIZE) for p in prompts]
        geo = BlockGeometry(spec.kv, 1, DEFAULT_KV_LAYOUT, DEFAULT_BLOCK_SIZE, sum(need))
        kv = KVBlocks(geo, torch.zeros(geo.nbytes, dtype=torch.uint8), 0)
        bounds = np.cumsum([0] + need).tolist()
        tables = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
    runner = ModelRunner(model_dir, 1, 0, cache, kv=kv)
    load_s = time.perf_counter() - start
    pages = list(range(len(prompts)))
    runner.prefill([p[:-1] for p in prompts], pages, blocks=tables)
    tokens = [p[-1] for p in prompts]
    positions = [len(p) - 1 for p in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(steps):
        logits = runner.decode(tokens, pages, blocks=tables, positions=positions)
        for i in range(len(prompts)):
            got[i].append(logits[i].clone())
        tokens = [r[step] for r in ref_tokens]
        positions = [n + 1 for n in positions]
    # Ablations: prompt[-1] again at its position, from a zeroed recurrent state (the prompt's
    # KV is intact: the decodes above wrote only later positions), then with zeroed KV too.
    ablations = {}
    first = [p[-1] for p in prompts]
    first_pos = [len(p) - 1 for p in prompts]
    runner.reset(pages)
    ablations["recurrent_state_zeroed"] = runner.decode(first, pages, blocks=tables,
                                                         positions=first_pos)
    if kv is not None:
        runner.reset(pages)
        kv.buffer.zero_()
        ablations["state_and_kv_zeroed"] = runner.decode(first, pages, blocks=tables,
                                                          positions=first_pos)
    out = []
    for i in range(len(prompts)):
        mine = torch.stack(got[i])
        ref = torch.load(os.path.join(logits_dir, f"ref-{i}.pt"))
        diff = (mine - ref).abs()
        out.append({"max_abs_logit_diff": float(diff.max()),
                    "max_abs_logit_diff_per_step": diff.max(dim=-1).values.tolist(),
                    "argmax_agrees": bool((mine.argmax(-1) == torch.tensor(ref_tokens[i])).all()),
                    "ablations": {
                        what: {"first_token": int(logits[i].argmax()),
                               "changes_first_token": int(logits[i].argmax()) != ref_tokens[i][0],
                               "max_abs_logit_diff": float((logits[i] - ref[0]).abs().max())}
                        for what, logits in ablations.items()}})
    return {"prompts": out, "load_seconds": load_s, "seconds": time.perf_counter() - start,
            "peak_rss_mib": _peak_rss_mib()}


def in_child(fn, *args):
    """Run ``fn(*args)`` in a fresh spawned process (its memory goes back when it exits)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


# -- serving -------------------------------------------------------------------------------------

def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    out = dict.fromkeys(keys, 0)
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


class MemorySampler:
    """Every ``interval`` s: the summed PSS and private memory of the node process trees (PSS
    shares the mapped safetensors fairly among the ranks mapping it) and the machine's
    MemAvailable. Keeps the peaks, and each process's own peak RSS (VmHWM)."""

    def __init__(self, roots: list[int], interval: float = 1.0) -> None:
        self.roots, self.interval = roots, interval
        self.peak_pss_mib = self.peak_private_mib = 0.0
        self.min_available_mib = float("inf")
        self.hwm_mib: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        pss = private = 0
        for root in self.roots:
            for pid in _descendants(root):
                r = _kib(f"/proc/{pid}/smaps_rollup", ("Pss", "Private_Clean", "Private_Dirty"))
                pss += r["Pss"]
                private += r["Private_Clean"] + r["Private_Dirty"]
                hwm = _kib(f"/proc/{pid}/status", ("VmHWM",))["VmHWM"] / 1024
                if hwm:
                    self.hwm_mib[pid] = max(self.hwm_mib.get(pid, 0.0), hwm)
                    if pid not in self.names:
                        try:
                            with open(f"/proc/{pid}/cmdline", "rb") as f:
                                self.names[pid] = f.read().replace(b"\0", b" ").decode()[:120]
                        except OSError:
                            pass
        self.peak_pss_mib = max(self.peak_pss_mib, pss / 1024)
        self.peak_private_mib = max(self.peak_private_mib, private / 1024)
        avail = _kib("/proc/meminfo", ("MemAvailable",))["MemAvailable"] / 1024
        self.min_available_mib = min(self.min_available_mib, avail)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_pss_mib": round(self.peak_pss_mib), "peak_private_mib":
                round(self.peak_private_mib), "min_mem_available_mib":
                round(self.min_available_mib), "largest_process_peak_rss_mib":
                round(max(self.hwm_mib.values(), default=0.0))}


class Node:
    """``python -m statebridge.cli ARGS`` with its output in ``log``; ready when the log has its
    "ready on" / "up on" line."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PYTHONUNBUFFERED="1")
        # Every prompt is sent at once to one TP 1 prefill rank: at real dimensions on a CPU
        # the last waits minutes for its turn, and a decode rank's wait for the state counts
        # from submit (transfer_timeout). A caller's own setting wins.
        env.setdefault("STATEBRIDGE_TRANSFER_TIMEOUT", "1800")
        self._file = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "statebridge.cli", *args],
                                     stdout=self._file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_up(self, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            text = self.log.read_text()
            if " ready on " in text or " up on " in text:
                return time.monotonic() - start
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"{' '.join(self.proc.args[3:5])} did not come up "
                           f"(exit {self.proc.poll()}); last lines of {self.log}:\n"
                           + "\n".join(self.log.read_text().splitlines()[-30:]))

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._file.close()
        return self.proc.returncode


def serve(model_dir: str, prompts: list[list[int]], new_tokens: int, decode_tp: int,
          log_dir: Path, start_timeout: float, request_timeout: float) -> dict:
    """Prefill TP 1 -> decode TP ``decode_tp`` on 127.0.0.1; every prompt sent at once."""
    from statebridge.net import free_port
    from statebridge.node.client import Client

    pages = str(len(prompts) + 1)
    p_port, d_port = free_port(), free_port()
    start = time.monotonic()
    nodes: list[Node] = []
    sampler = None
    try:
        nodes.append(Node(["prefill", "--model", model_dir, "--tp", "1", "--port", str(p_port),
                           "--num-pages", pages], log_dir / f"prefill-tp1-for-tp{decode_tp}.log"))
        sampler = MemorySampler([nodes[0].proc.pid])
        nodes.append(Node(["decode", "--model", model_dir, "--tp", str(decode_tp), "--prefill",
                           f"127.0.0.1:{p_port}", "--port", str(d_port), "--num-pages", pages],
                          log_dir / f"decode-tp{decode_tp}.log"))
        sampler.roots.append(nodes[1].proc.pid)
        for node in nodes:
            node.wait_up(start_timeout)
        address = f"127.0.0.1:{d_port}"
        with Client(address, timeout=request_timeout) as probe:
            probe.wait_ready(timeout=max(1.0, start_timeout - (time.monotonic() - start)))
        ready_s = time.monotonic() - start

        def one(prompt):
            with Client(address, timeout=request_timeout) as client:
                return client.generate(prompt, max_new_tokens=new_tokens)

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, prompts))
        serve_s = time.monotonic() - t0
    finally:
        codes = [node.stop() for node in reversed(nodes)]
        memory = sampler.stop() if sampler is not None else {}
    return {"decode_tp": decode_tp, "ready_seconds": ready_s, "requests_seconds": serve_s,
            "exit_codes": codes[::-1], "memory": memory,
            "prompts": [{"tokens": r.tokens, "ttft_s": r.ttft, "seconds": r.seconds,
                         "transfer_bytes": r.transfer_bytes} for r in results]}


# -- comparison ----------------------------------------------------------------------------------

def compare(got: list[int], ref: list[int], ref_logits_path: str) -> dict:
    """``match``, or the first divergent step with both tokens and the reference's logit gap
    between its token and ours at that step (the paths agree until then)."""
    for step, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            import torch

            logits = torch.load(ref_logits_path)[step]
            return {"match": False, "step": step, "got": a, "want": b,
                    "gap": float(logits[b] - logits[a]),
                    "got_rank": int((logits > logits[a]).sum())}
    if len(got) != len(ref):
        return {"match": False, "step": min(len(got), len(ref)), "got": None, "want": None,
                "gap": None, "note": f"{len(got)} tokens, reference {len(ref)}"}
    return {"match": True}


def _fmt_row(cols, widths):
    return "  ".join(str(c).rjust(w) for c, w in zip(cols, widths))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="lfm2-1.2b,mamba2-1.3b",
                   help=f"comma-separated, of {', '.join(MODELS)} (default: %(default)s)")
    p.add_argument("--decode-tp", default="2,4",
                   help="decode TP sizes served from a TP 1 prefill node (default: %(default)s)")
    p.add_argument("--prompt-lens", default="6,17,18,75,300",
                   help="prompt lengths in tokens; KV blocks are 16 tokens and the N-1 protocol "
                        "moves len-1 (default %(default)s: under one block, exactly one, one "
                        "and a token, several; 300 crosses Mamba2's 256-token chunk)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--embed-std", type=float, default=None,
                   help="std of the (tied) embedding init; default: transformers' own init "
                        "(initializer_range)")
    p.add_argument("--workdir", default="/tmp/statebridge-token-exact",
                   help="checkpoints, reference logits and node logs (default: %(default)s)")
    p.add_argument("--reuse", action="store_true",
                   help="reuse checkpoints already in WORKDIR (made with the same arguments)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    p.add_argument("--no-runner-check", action="store_true",
                   help="skip the in-process ModelRunner logit comparison")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds for both nodes to serve (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--json", default=None, metavar="FILE",
                   help="write every figure as JSON (default: benchmarks/results/"
                        "token-exact-real-dims-DATE.json)")
    args = p.parse_args(argv)

    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    decode_tps = [int(x) for x in args.decode_tp.split(",") if x]
    lengths = [int(x) for x in args.prompt_lens.split(",") if x]
    if min(lengths) < 1 or args.new_tokens < 1:
        p.error("prompt lengths and --new-tokens must be positive")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    json_path = args.json or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"token-exact-real-dims-{datetime.date.today().isoformat()}.json")

    started = time.monotonic()
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                       "python": platform.python_version()},
              "args": vars(args), "models": {}}
    all_match = True
    rows = []
    for name in models:
        model_dir = workdir / name
        logits_dir = workdir / f"{name}-logits"
        log_dir = workdir / f"{name}-logs"
        for d in (logits_dir, log_dir):
            d.mkdir(exist_ok=True)
        entry: dict = {"shape": MODELS[name][2]}
        report["models"][name] = entry
        if args.reuse and (model_dir / "config.json").exists():
            print(f"[{name}] reusing {model_dir}", flush=True)
            entry["checkpoint"] = {"reused": True}
        else:
            shutil.rmtree(model_dir, ignore_errors=True)
            model_dir.mkdir()
            print(f"[{name}] building the checkpoint with transformers ...", flush=True)
            entry["checkpoint"] = in_child(build_checkpoint, name, str(model_dir), args.seed,
                                           args.embed_std)
            c = entry["checkpoint"]
            print(f"[{name}] {c['params']:,} parameters, {c['weight_bytes'] / 2**30:.2f} GiB "
                  f"fp32 in {c['seconds']:.0f} s (peak RSS {c['peak_rss_mib']:.0f} MiB)",
                  flush=True)
        prompts = make_prompts(str(model_dir), lengths)
        entry["prompt_lens"] = [len(x) for x in prompts]
        entry["prompts"] = prompts

        print(f"[{name}] transformers fp32 generate(do_sample=False), {len(prompts)} prompts x "
              f"{args.new_tokens} tokens ...", flush=True)
        ref = in_child(reference, str(model_dir), prompts, args.new_tokens, str(logits_dir))
        entry["reference"] = ref
        ref_tokens = [r["tokens"] for r in ref["prompts"]]
        min_gap = min(min(r["gaps"]) for r in ref["prompts"])
        entry["min_top2_gap"] = min_gap
        print(f"[{name}] reference in {ref['seconds']:.0f} s (peak RSS "
              f"{ref['peak_rss_mib']:.0f} MiB); smallest top-2 logit gap {min_gap:.4g}; "
              f"uncached forward agrees: {all(r['uncached_tokens_agree'] for r in ref['prompts'])}"
              f", max |logit diff| cached vs uncached "
              f"{max(r['uncached_max_abs_logit_diff'] for r in ref['prompts']):.3g}", flush=True)

        if not args.no_runner_check:
            print(f"[{name}] statebridge ModelRunner TP 1 in one process, teacher forced ...",
                  flush=True)
            rc = in_child(runner_check, str(model_dir), prompts, ref_tokens, str(logits_dir))
            entry["runner_check"] = rc
            noise = max(r["max_abs_logit_diff"] for r in rc["prompts"])
            entry["runner_max_abs_logit_diff"] = noise
            print(f"[{name}] runner in {rc['seconds']:.0f} s (peak RSS {rc['peak_rss_mib']:.0f} "
                  f"MiB); max |logit - reference| {noise:.3g}; argmax agrees everywhere: "
                  f"{all(r['argmax_agrees'] for r in rc['prompts'])}", flush=True)
            for what in rc["prompts"][0]["ablations"]:
                changed = sum(r["ablations"][what]["changes_first_token"] for r in rc["prompts"])
                print(f"[{name}] {what.replace('_', ' ')}: the first token changes for "
                      f"{changed}/{len(prompts)} prompts", flush=True)

        entry["served"] = []
        for tp in decode_tps:
            print(f"[{name}] serving prefill TP 1 -> decode TP {tp} ...", flush=True)
            t0 = time.monotonic()
            served = serve(str(model_dir), prompts, args.new_tokens, tp, log_dir,
                           args.start_timeout, args.request_timeout)
            served["wall_seconds"] = time.monotonic() - t0
            for i, (got, want) in enumerate(zip(served["prompts"], ref_tokens)):
                got["compare"] = compare(got["tokens"], want, str(logits_dir / f"ref-{i}.pt"))
                all_match &= got["compare"]["match"]
                rows.append((name, f"1->{tp}", len(prompts[i]), got["compare"],
                             min(ref["prompts"][i]["gaps"])))
            entry["served"].append(served)
            mem = served["memory"]
            print(f"[{name}] TP 1 -> {tp}: ready in {served['ready_seconds']:.0f} s, requests "
                  f"{served['requests_seconds']:.0f} s, peak PSS of the nodes "
                  f"{mem.get('peak_pss_mib', 0) / 1024:.1f} GiB, exit codes "
                  f"{served['exit_codes']}", flush=True)
        if not args.keep:
            shutil.rmtree(model_dir, ignore_errors=True)

    report["wall_seconds"] = time.monotonic() - started
    report["all_match"] = all_match
    widths = (12, 6, 6, 44, 10)
    print()
    print(_fmt_row(("model", "P->D", "prompt", "greedy tokens vs transformers fp32",
                    "min gap"), widths))
    for name, pair, n, cmp, gap in rows:
        if cmp["match"]:
            what = f"match ({args.new_tokens}/{args.new_tokens})"
        elif cmp.get("got") is None:
            what = f"differ: {cmp.get('note')}"
        else:
            what = (f"step {cmp['step']}: {cmp['got']} vs {cmp['want']}, gap "
                    f"{cmp['gap']:.3g}")
        rows_fmt = (name, pair, n, what, f"{gap:.3g}")
        print(_fmt_row(rows_fmt, widths))
    for name, entry in report["models"].items():
        extra = ""
        if "runner_max_abs_logit_diff" in entry:
            extra = f", statebridge TP 1 max |logit diff| {entry['runner_max_abs_logit_diff']:.3g}"
        print(f"{name}: smallest top-2 logit gap {entry['min_top2_gap']:.4g}{extra}")
    print(f"{'every prompt matched' if all_match else 'NOT token-exact'} "
          f"(wall {report['wall_seconds'] / 60:.1f} min)")
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {json_path}")
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
