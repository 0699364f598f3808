"""One arm of benchmarks/bench_vllm_pd.py in its own process (vLLM spawns engines and workers,
which want a plain ``__main__``): a prefill and a decode vLLM instance with the arm's connector,
or the decode instance alone (``local``), then sequential requests. Prints one JSON line.

    python benchmarks/_vllm_pd_arm.py ARM_JSON
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1",
                  VLLM_NO_USAGE_STATS="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                  UCX_WARN_UNUSED_ENV_VARS="n", VLLM_ALLOW_INSECURE_SERIALIZATION="1")


def _config(connector: str, role: str, port: int) -> dict:
    if connector == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return {"kv_connector": "StatebridgeConnector", "kv_connector_module_path": "statebridge.vllm",
            "kv_role": role, "kv_connector_extra_config": {"side_channel_port": port}}


def _instance(model: str, tp: int, bind: str, config: dict | None, nixl_port: int):
    from vllm import LLM

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(nixl_port)
    kwargs = {"kv_transfer_config": config} if config else {}
    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=2048,
               max_num_seqs=4, block_size=32, gpu_memory_utilization=0.15, seed=0,
               tensor_parallel_size=tp, enable_prefix_caching=False,
               disable_hybrid_kv_cache_manager=False,
               compilation_config={"custom_ops": ["-rotary_embedding"]}, **kwargs)


def main() -> None:
    arm = json.loads(sys.argv[1])
    from vllm import SamplingParams

    from statebridge.vllm.connector import worker_counters

    import random

    rng = random.Random(arm.get("seed", 0))
    prompts = [[rng.randrange(3, 250) for _ in range(arm["prompt_len"])]
               for _ in range(arm["requests"] + arm["warmup"])]
    connector = arm["connector"]
    t0 = time.monotonic()
    d = _instance(arm["model"], arm["decode_tp"], "1" if arm["decode_tp"] == 1 else "0|1",
                  None if connector == "local" else _config(connector, "kv_consumer",
                                                            arm["port"] + 100),
                  arm["port"] + 200)
    p = None
    if connector != "local":
        p = _instance(arm["model"], arm["prefill_tp"], "0" if arm["prefill_tp"] == 1 else "0|1",
                      _config(connector, "kv_producer", arm["port"]), arm["port"] + 300)
    out = {"arm": arm, "start_s": time.monotonic() - t0}
    first = SamplingParams(max_tokens=1, temperature=0)
    hand_off = SamplingParams(max_tokens=1, temperature=0,
                              extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    ttft, prefill_s, tokens = [], [], []
    for i, prompt in enumerate(prompts):
        params = None
        if p is not None:
            t = time.monotonic()
            params = p.generate([{"prompt_token_ids": prompt}], hand_off,
                                use_tqdm=False)[0].kv_transfer_params
            prefill_s.append(time.monotonic() - t)
        sp = first if params is None else SamplingParams(
            max_tokens=1, temperature=0, extra_args={"kv_transfer_params": params})
        t = time.monotonic()
        o = d.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        if not o[0].outputs[0].token_ids:
            print("RESULT " + json.dumps({"arm": arm, "failed": f"request {i} produced no "
                                          f"token (see the log)"}), flush=True)
            os._exit(0)
        if i >= arm["warmup"]:
            ttft.append(time.monotonic() - t)
            tokens.append(o[0].outputs[0].token_ids[0])
    out["decode_ttft_ms"] = [1e3 * x for x in ttft]
    out["decode_ttft_ms_p50"] = 1e3 * statistics.median(ttft)
    out["prefill_ms_p50"] = 1e3 * statistics.median(prefill_s) if prefill_s else None
    out["first_tokens"] = tokens
    if connector == "statebridge":
        dc = [c for c in d.collective_rpc(worker_counters) if c]
        pc = [c for c in p.collective_rpc(worker_counters) if c]
        n = arm["requests"] + arm["warmup"]
        out["transfer_ms_per_request"] = 1e3 * max(c["load_seconds"] for c in dc) / n
        out["control_messages_per_request"] = (sum(c["control_messages"] for c in dc + pc)
                                               - 2 * len(dc) * len(pc)) / n   # less handshakes
        out["ucx_messages_per_request"] = sum(c["runs_received"] for c in dc) / n
        out["bytes_per_request"] = sum(c["bytes_received"] for c in dc) / n
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
