"""What a newcomer sees while a pair of node commands starts: each phase as it starts and ends,
"ready in N s", no UCX warning about a variable they never set (unless they asked for such
warnings), a memory report per rank that adds up, and the pool that bounds concurrency named.

The checkpoint is ``make-checkpoint --arch lfm2-hybrid`` (tiny, float32): 4 KV heads of 8
dims in 2 attention layers, so one token of KV is 2 x 2 x 4 x 8 x 4 = 512 bytes at TP 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from safetensors import safe_open

from statebridge.models.checkpoint import make_checkpoint
from statebridge.net import free_port
from statebridge.state.layout import PageGeometry
from statebridge.state.spec import StateSpec

from ._nodes import HOST, NodeCommand, stats

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

KV_MEMORY = 1 << 20               # the same per-rank bytes on both nodes (deprecated flag)
PAGES = 8
MAX_PROMPT, MAX_NEW = 1200, 300   # decode node limits: max-length request 1500 tokens
KV_TOKEN_BYTES_TP1 = 2 * 2 * 4 * 8 * 4
BLOCK = 16


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_WARN_UNUSED_ENV_VARS"}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(sys.path),
               STATEBRIDGE_HEARTBEAT_INTERVAL="0.2", **extra)
    return env


def _expected_weight_bytes(model: str, tp: int) -> int:
    """What one rank of TP ``tp`` keeps of the checkpoint, from the file alone: 1-D weights
    (norms) and the embedding whole, every other weight split ``tp`` ways."""
    total = 0
    with safe_open(f"{model}/model.safetensors", "pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            shape = t.get_shape()
            nbytes = 4
            for n in shape:
                nbytes *= n
            whole = len(shape) == 1 or "embed_tokens" in name
            total += nbytes if whole else nbytes // tp
    return total


def _in_order(text: str, needles: list[str]) -> None:
    at = 0
    for needle in needles:
        found = re.search(needle, text[at:])
        assert found, f"{needle!r} not found after offset {at} in:\n{text}"
        at += found.end()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_checkpoint("lfm2-hybrid", tmp_path_factory.mktemp("ck") / "m"))


@pytest.mark.timeout(300)
def test_a_pair_says_what_it_does_while_it_starts(model, tmp_path):
    prefill_port, decode_port, http_port = (free_port(HOST) for _ in range(3))
    common = ["--model", model, "--host", HOST, "--num-pages", str(PAGES),
              "--kv-memory", str(KV_MEMORY)]
    prefill = NodeCommand("prefill node", ["prefill", "--tp", "1", "--port", str(prefill_port),
                                           *common], tmp_path / "prefill.log", _env())
    decode = NodeCommand("decode node", [
        "decode", "--tp", "2", "--port", str(decode_port), "--prefill",
        f"{HOST}:{prefill_port}", "--http-port", str(http_port), "--max-prompt-len",
        str(MAX_PROMPT), "--max-new-tokens", str(MAX_NEW), *common],
        tmp_path / "decode.log", _env())
    try:
        prefill.start()
        decode.start()
        p_out, d_out = prefill.output(), decode.output()
        prefill_id = re.search(r"(prefill-[0-9a-f]{8})", p_out).group(1)
        decode_id = re.search(r"(decode-[0-9a-f]{8})", d_out).group(1)

        # Every phase, as it starts and as it ends, in order; then "ready in".
        _in_order(p_out, [r"spawning 1 prefill rank processes \.\.\.", r"spawning done in",
                          r"prefill rank 0: pools \.\.\.", r"prefill rank 0: pools done in",
                          r"prefill rank 0: UCX worker \.\.\.",
                          r"prefill rank 0: UCX worker done in",
                          r"prefill rank 0: weights from .* \.\.\.",
                          r"prefill rank 0: weights from .* done in [0-9.]+ s \(.* read\)",
                          r"all 1 ranks up after", r"memory per rank",
                          r"prefill node ready on .*: ready in [0-9.]+ s"])
        for r in (0, 1):
            _in_order(d_out, [r"spawning 2 decode rank processes", rf"decode rank {r}: pools "
                              r"\.\.\.", rf"decode rank {r}: pools done in",
                              rf"decode rank {r}: UCX worker done in",
                              rf"decode rank {r}: rendezvous of TP 2 \.\.\.",
                              rf"decode rank {r}: rendezvous of TP 2 done in",
                              rf"decode rank {r}: weights from .* done in",
                              r"all 2 ranks up after",
                              rf"handshake with prefill group {prefill_id} done in",
                              r"decode node ready on .*: ready in [0-9.]+ s"])
        # The variable ucxx sets and this libucx does not know: no warning about it.
        assert "UCX_MEMTYPE_CACHE" not in p_out + d_out

        # Equal bytes per rank: the TP 1 prefill rank holds half the tokens of a TP 2 decode
        # rank, and it binds. Computed here from the geometry alone.
        prefill_tokens = KV_MEMORY // (KV_TOKEN_BYTES_TP1 * BLOCK) * BLOCK
        decode_tokens = KV_MEMORY // (KV_TOKEN_BYTES_TP1 // 2 * BLOCK) * BLOCK
        assert (prefill_tokens, decode_tokens) == (2048, 4096)
        max_model_len = min(MAX_PROMPT + MAX_NEW, decode_tokens)
        blocks = lambda tokens: -(-tokens // BLOCK)                      # noqa: E731
        fit_prefill = (prefill_tokens // BLOCK) // blocks(MAX_PROMPT - 1)
        fit_decode = (decode_tokens // BLOCK) // blocks(max_model_len)
        assert fit_prefill < fit_decode and fit_prefill < PAGES
        warning = next(line for line in d_out.splitlines() if "binding pool" in line)
        assert " WARNING " in warning
        assert re.search(rf"{fit_prefill} requests? of the longest length fit at once; the "
                         rf"binding pool is the KV pool of prefill node {prefill_id} \(TP 1\): "
                         rf"{prefill_tokens:,} tokens per rank", warning), warning
        assert re.search(rf"the KV pool of decode node {decode_id} \(TP 2\): "
                         rf"{decode_tokens:,} tokens per rank = {fit_decode} requests? ",
                         warning), warning

        # /v1/models: what one decode rank's pool holds, at most.
        with urllib.request.urlopen(f"http://{HOST}:{http_port}/v1/models", timeout=10) as r:
            assert json.load(r)["data"][0]["max_model_len"] == max_model_len

        # Memory per rank, against the checkpoint and the geometry.
        spec = StateSpec.from_pretrained(model)
        for address, tp, tokens in ((f"{HOST}:{prefill_port}", 1, prefill_tokens),
                                    (f"{HOST}:{decode_port}", 2, decode_tokens)):
            s = stats(address)
            page = PageGeometry(spec, tp, "DLS").page_size
            weights = _expected_weight_bytes(model, tp)
            assert s.rank_weights_private == (weights,) * tp, address
            assert s.rank_weights_mapped == (0,) * tp, address
            assert s.rank_pages_bytes == (PAGES * page,) * tp
            assert s.rank_kv_pool_bytes == (tokens * KV_TOKEN_BYTES_TP1 // tp,) * tp
        with urllib.request.urlopen(f"http://{HOST}:{http_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        from prometheus_client.parser import text_string_to_metric_families

        samples = {(s.labels["rank"], s.labels["part"]): s.value
                   for fam in text_string_to_metric_families(text)
                   if fam.name == "statebridge_rank_memory_bytes" for s in fam.samples}
        page = PageGeometry(spec, 2, "DLS").page_size
        weights = _expected_weight_bytes(model, 2)
        for r in ("0", "1"):
            parts = {"weights_private": weights, "weights_mapped": 0, "pages": PAGES * page,
                     "kv_pool": decode_tokens * KV_TOKEN_BYTES_TP1 // 2}
            for part, value in parts.items():
                assert samples[(r, part)] == value, (r, part)
            assert samples[(r, "total")] == sum(parts.values())
    finally:
        decode.stop()
        prefill.stop()


@pytest.mark.timeout(200)
def test_a_users_own_ucx_warning_setting_is_kept(model, tmp_path):
    """UCX_WARN_UNUSED_ENV_VARS=y set by the user: the ranks leave it, and UCX warns about a
    variable it does not know. (A made-up name: whether UCX counts ucxx's own
    ``UCX_MEMTYPE_CACHE`` as used depends on which of its config tables a process has read.)"""
    node = NodeCommand("prefill node", ["prefill", "--tp", "1", "--port",
                                        str(free_port(HOST)), "--model", model, "--host", HOST,
                                        "--num-pages", "4", "--kv-blocks", "8"],
                       tmp_path / "prefill.log",
                       _env(UCX_WARN_UNUSED_ENV_VARS="y", UCX_STATEBRIDGE_NOT_A_SETTING="1"))
    try:
        node.start()
        deadline = time.monotonic() + 30      # the rank's stderr reaches the log a moment later
        while not re.search(r"unused environment variables?: .*UCX_STATEBRIDGE_NOT_A_SETTING",
                            node.output()):
            assert time.monotonic() < deadline, node.output()
            time.sleep(0.2)
    finally:
        node.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags,needle", [
    (["--kv-tokens", "0"], "'0'"), (["--kv-tokens", "-3"], "'-3'"),
    (["--kv-gib", "0"], "'0'"), (["--kv-gib", "-1.5"], "'-1.5'"),
    (["--kv-gib", "1000000"], "kv_gib=1e+06"),
])
def test_a_bad_kv_pool_size_stops_the_node_naming_it(model, tmp_path, flags, needle):
    proc = subprocess.run([sys.executable, "-m", "statebridge.cli", "prefill", "--tp", "1",
                           "--port", str(free_port(HOST)), "--model", model, "--host", HOST,
                           *flags], env=_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2
    assert needle in proc.stderr, proc.stderr
