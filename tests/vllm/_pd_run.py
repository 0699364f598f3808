"""One PD scenario inside real vLLM, run as its own process by tests/vllm (vLLM spawns engine
and worker processes, which want a plain ``__main__``): a prefill instance (kv_producer) and a
decode instance (kv_consumer) with StatebridgeConnector, the decode instance's own greedy
tokens as the reference, then prefill -> decode through the connector. Prints one JSON line.

    python tests/vllm/_pd_run.py SCENARIO_JSON
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1",
                  VLLM_NO_USAGE_STATS="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                  UCX_WARN_UNUSED_ENV_VARS="n", VLLM_ALLOW_INSECURE_SERIALIZATION="1")


def _instance(model: str, tp: int, role: str, port: int, bind: str, prefix_caching: bool,
              extra: dict, policy: str):
    from vllm import LLM

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
               max_num_seqs=4, block_size=32, gpu_memory_utilization=0.15, seed=0,
               tensor_parallel_size=tp, enable_prefix_caching=prefix_caching,
               kv_transfer_config={
                   "kv_connector": "StatebridgeConnector",
                   "kv_connector_module_path": "statebridge.vllm", "kv_role": role,
                   "kv_load_failure_policy": policy,
                   "kv_connector_extra_config": {"side_channel_port": port, **extra}},
               # vLLM's CPU rotary op mis-rotates LFM2's [tokens, heads, head_dim] q/k; the
               # native one matches transformers (both instances run the same way).
               compilation_config={"custom_ops": ["-rotary_embedding"]})


def _overwrite_caches(worker) -> int:
    """Run inside each producer worker (collective_rpc): fill every KV cache tensor with a
    constant, as a later request reusing the blocks would."""
    n = 0
    caches = worker.model_runner.kv_caches
    for t in (caches.values() if isinstance(caches, dict) else caches):
        for x in (t if isinstance(t, (list, tuple)) else [t]):
            x.fill_(1)
            n += 1
    return n


def _pid(worker) -> int:
    return os.getpid()


def main() -> None:
    sc = json.loads(sys.argv[1])
    from vllm import SamplingParams

    from statebridge.vllm.connector import worker_counters

    extra = dict(sc.get("extra", {}))
    extra.setdefault("transfer_timeout_s", 20)
    t0 = time.monotonic()
    p = _instance(sc["model"], sc["prefill_tp"], "kv_producer", sc["port"],
                  "0" if sc["prefill_tp"] == 1 else "0|1", sc.get("prefill_caching", False),
                  extra, "fail")
    d = _instance(sc["model"], sc["decode_tp"], "kv_consumer", sc["port"] + 100,
                  "1" if sc["decode_tp"] == 1 else "0|1", sc.get("decode_caching", False), extra,
                  sc.get("policy", "fail"))
    out = {"start_s": time.monotonic() - t0}
    prompts = sc["prompts"]
    greedy = SamplingParams(max_tokens=sc.get("max_tokens", 8), temperature=0)
    out["reference"] = [o.outputs[0].token_ids for o in
                        d.generate([{"prompt_token_ids": x} for x in prompts], greedy)]

    def prefill():
        hand_off = SamplingParams(max_tokens=1, temperature=0,
                                  extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        return [o.kv_transfer_params for o in
                p.generate([{"prompt_token_ids": x} for x in prompts], hand_off)]

    def decode(params):
        tokens, times = [], []
        for x, kp in zip(prompts, params):
            t = time.monotonic()
            o = d.generate([{"prompt_token_ids": x}],
                           SamplingParams(max_tokens=sc.get("max_tokens", 8), temperature=0,
                                          extra_args={"kv_transfer_params": kp}))
            times.append(time.monotonic() - t)
            tokens.append(list(o[0].outputs[0].token_ids))
        return tokens, times

    params = prefill()
    out["params"] = params[0]
    out["pd"], out["pd_s"] = decode(params)
    if sc.get("overwrite"):
        params = prefill()
        out["overwritten"] = p.collective_rpc(_overwrite_caches)
        out["pd_overwritten"], _ = decode(params)
    if sc.get("alone_after"):
        out["alone_after"] = [o.outputs[0].token_ids for o in
                              d.generate([{"prompt_token_ids": x} for x in prompts], greedy)]
        out["decode_counters"] = [c for c in d.collective_rpc(worker_counters) if c]
    if sc.get("kill_prefill"):
        params = prefill()
        for pid in p.collective_rpc(_pid):
            os.kill(pid, signal.SIGKILL)
        out["pd_killed"], out["pd_killed_s"] = decode(params)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)       # the killed instance's engine would take its time to notice


if __name__ == "__main__":
    main()
