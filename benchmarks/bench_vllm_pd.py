"""PD inside real vLLM: StatebridgeConnector against vLLM's NixlConnector (Mamba2, Granite-4.0-H,
both in the DS conv layout NixlConnector requires) and against the decode instance prefilling
itself (LFM2 with attention, which NixlConnector refuses), in one run; every arm's first tokens
against the decode instance alone (Mamba2 and Granite here have ``n_groups`` 1).

Per arm (benchmarks/_vllm_pd_arm.py, its own process): a prefill and a decode instance on
127.0.0.1 (prefill TP 1 -> decode TP 2 by default), sequential requests of random prompts: the
prefill instance runs the prompt with ``do_remote_decode``, then the decode instance runs it with
the returned ``kv_transfer_params`` and ``max_tokens=1``. Measured: the decode instance's TTFT
(the pull and the last prompt token), p50; for statebridge also its transfer time, control and
UCX messages and bytes per request, at two layer counts (messages independent of layers?).

    .venv-vllm/bin/python -m pip install --no-deps nixl==1.5.2   # the module NixlConnector imports
    .venv-vllm/bin/python benchmarks/bench_vllm_pd.py --requests 20 --json benchmarks/results/vllm-pd.json

(in the venv of `.ci/vllm-venv`: vLLM runs in the interpreter that runs this script)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from statebridge.testing.group_process import run_group

HERE = Path(__file__).resolve().parent


def run_arm(arm: dict, layout: str, timeout: float = 900) -> dict:
    env = dict(os.environ, VLLM_SSM_CONV_STATE_LAYOUT=layout)
    env.pop("TRITON_INTERPRET", None)
    rc, text = run_group([sys.executable, str(HERE / "_vllm_pd_arm.py"), json.dumps(arm)], env,
                         timeout)
    lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
    if rc != 0 or not lines:
        raise SystemExit(f"arm {arm} exited {rc}:\n{text[-5000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    out["layout"] = layout
    if "failed" in out:        # what the instances said, for the journal
        out["log_tail"] = [x for x in text.splitlines()
                           if "ERROR" in x or "statebridge connector" in x][-20:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=2)
    ap.add_argument("--json", default=None, help="write every arm's numbers here")
    args = ap.parse_args()

    from statebridge.models.checkpoint import make_checkpoint

    root = Path(tempfile.mkdtemp(prefix="bench-vllm-pd-"))
    models = {arch: str(make_checkpoint(arch, root / arch, preset="vllm"))
              for arch in ("mamba2", "granite-hybrid", "lfm2-hybrid")}
    deep = {"num_hidden_layers": 16, "layer_types": ["full_attention" if i in (2, 6, 10, 14)
                                                     else "linear_attention" for i in range(16)]}
    models["granite-hybrid-16"] = str(make_checkpoint("granite-hybrid", root / "g16",
                                                      preset="vllm", overrides=deep))
    # "local" is the decode instance alone (no connector): its first tokens are the reference
    plan = [("mamba2", "statebridge", "DS"), ("mamba2", "nixl", "DS"), ("mamba2", "local", "DS"),
            ("granite-hybrid", "statebridge", "DS"), ("granite-hybrid", "nixl", "DS"),
            ("granite-hybrid", "local", "DS"),
            ("granite-hybrid-16", "statebridge", "DS"),
            ("lfm2-hybrid", "statebridge", "SD"), ("lfm2-hybrid", "local", "SD")]
    results = []
    for k, (arch, connector, layout) in enumerate(plan):
        arm = {"model": models[arch], "arch": arch, "connector": connector,
               "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
               "requests": args.requests, "warmup": args.warmup,
               "prompt_len": args.prompt_len, "port": 7000 + 10 * k}
        r = run_arm(arm, layout)
        results.append(r)
        if "failed" in r:
            print(f"{arch:18} {connector:12} {layout}  FAILED: {r['failed']}", flush=True)
            continue
        extra = ""
        if connector == "statebridge":
            extra = (f"  transfer {r['transfer_ms_per_request']:.2f} ms, "
                     f"{r['control_messages_per_request']:.1f} control + "
                     f"{r['ucx_messages_per_request']:.0f} UCX messages, "
                     f"{r['bytes_per_request']:,.0f} B a request")
        print(f"{arch:18} {connector:12} {layout}  decode TTFT p50 "
              f"{r['decode_ttft_ms_p50']:7.1f} ms{extra}", flush=True)
    by = {(r["arm"]["arch"], r["arm"]["connector"]): r for r in results if "failed" not in r}
    for arch in ("mamba2", "granite-hybrid"):
        if (arch, "nixl") not in by or (arch, "statebridge") not in by:
            print(f"{arch}: no comparison (an arm failed)")
            continue
        sb, nx = by[(arch, "statebridge")], by[(arch, "nixl")]
        print(f"{arch}: NixlConnector / statebridge decode TTFT p50 "
              f"{nx['decode_ttft_ms_p50'] / sb['decode_ttft_ms_p50']:.2f}")
    sb, local = by.get(("lfm2-hybrid", "statebridge")), by.get(("lfm2-hybrid", "local"))
    if sb and local:
        print(f"lfm2-hybrid: local prefill / statebridge decode TTFT p50 "
              f"{local['decode_ttft_ms_p50'] / sb['decode_ttft_ms_p50']:.2f}")
    for (arch, connector), r in by.items():
        ref = by.get((arch, "local"))
        if ref and connector != "local":
            same = sum(a == b for a, b in zip(r["first_tokens"], ref["first_tokens"]))
            print(f"{arch} {connector}: first tokens equal to vLLM alone in {same} of "
                  f"{len(ref['first_tokens'])} requests")
    g8 = by.get(("granite-hybrid", "statebridge"))
    g16 = by.get(("granite-hybrid-16", "statebridge"))
    if g8 and g16:
        print(f"granite 8 -> 16 layers: control messages a request "
              f"{g8['control_messages_per_request']:.1f} -> "
              f"{g16['control_messages_per_request']:.1f}, UCX messages "
              f"{g8['ucx_messages_per_request']:.0f} -> {g16['ucx_messages_per_request']:.0f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
