"""Prefill node and decode node at different TP degrees serve checkpoints made by transformers,
token for token equal to transformers' own greedy continuation."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import time

import pytest

from statebridge.errors import ConfigError, PeerLostError
from statebridge.node.client import Client
from statebridge.net import free_port
from statebridge.node.decode_node import DecodeNode
from statebridge.node.demo import NodeProcess
from statebridge.node.prefill_node import start_prefill_node
from statebridge.state.spec import StateSpec
from statebridge.testing.sockets import alive, descendants, is_rank

from tests.models._helpers import KV_BLOCK, KV_PROMPTS, NEW_TOKENS, PROMPTS

from tests.connector._helpers import wait_until
from tests.connector._inprocess import check_kv, check_pages
from tests.models import test_transfer

from ._helpers import FAST

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def pools(shared_pools):
    """The session's rank hosts (tests/conftest.py)."""
    return shared_pools


def run_all(address: str, prompts, **kwargs):
    """Every prompt from its own client thread, all in flight at once."""
    def one(prompt):
        with Client(address, timeout=120) as client:
            return client.generate(prompt, max_new_tokens=NEW_TOKENS, **kwargs)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


MATRIX = [(model, p, d, layout, f"{model}-{p}x{d}-{layout}")
          for model in ("lfm2", "mamba2-g1", "mamba2-g4")
          for (p, d) in [(1, 2), (2, 1), (2, 4), (4, 2)]
          for layout in ("LDS", "DLS")]
#: Through real nodes by default (the rest under ``-m exhaustive``): each family, fan-out and
#: fan-in, each layout. Every case runs in process (test_greedy_tokens_in_process: thread
#: groups, the page moved by the plan's copies, transformers' tokens).
REAL = {"lfm2-1x2-LDS", "mamba2-g1-4x2-DLS", "mamba2-g4-2x4-DLS", "mamba2-g4-2x1-LDS"}
CASES = [pytest.param(*c[:4], id=c[4], marks=() if c[4] in REAL else pytest.mark.exhaustive)
         for c in MATRIX]
assert REAL <= {c[4] for c in MATRIX}


@pytest.mark.parametrize("model,prefill_tp,decode_tp,layout",
                         [pytest.param(*c[:4], id=c[4]) for c in MATRIX])
def test_greedy_tokens_in_process(hf_models, model, prefill_tp, decode_tp, layout):
    """test_greedy_tokens_equal_transformers's matrix without processes: prefill on a thread
    group, the page moved by the transfer plan's copies into garbage-filled pages of the other
    TP degree, decode there; the tokens are transformers' (tests/models/test_transfer.py)."""
    test_transfer.test_prefill_here_decode_there(hf_models, model, prefill_tp, layout,
                                                 decode_tp, layout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,prefill_tp,decode_tp,layout", CASES)
def test_greedy_tokens_equal_transformers(pools, hf_models, model, prefill_tp, decode_tp,
                                          layout):
    prefill_hosts, decode_hosts = pools
    hf = hf_models[model]
    server = start_prefill_node(hf.path, prefill_tp, layout=layout, num_pages=16, config=FAST,
                                launcher=prefill_hosts.launcher())
    try:
        with DecodeNode(hf.path, decode_tp, [server.address], layout=layout, num_pages=16,
                        config=FAST, launcher=decode_hosts.launcher()) as node:
            results = run_all(node.address, PROMPTS)
            for prompt, result, expected in zip(PROMPTS, results, hf.reference):
                assert result.tokens == list(expected), f"prompt of {len(prompt)} tokens"
                assert not result.recomputed
            # The 1-token prompt moves the zero state: N-1 = 0 tokens prefilled.
            assert all(r.transfer_bytes > 0 for r in results)
            stats = node.stats()
            assert stats["finished_ok"] == len(PROMPTS)
            assert stats["coordinator"]["pages_used"] == 0
    finally:
        server.close()


HYBRID_MATRIX = [(model, p, d, src, dst, f"{model}-{p}x{d}-{src}-{dst}")
                 for model in ("lfm2-hybrid", "granite-hybrid")
                 for (p, d) in [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
                 for src, dst in (("HB", "HB"), ("LH", "BH"))]
#: Through real nodes by default (the rest under ``-m exhaustive``): both families, fan-out
#: and fan-in, both KV layout pairs, Granite's KV heads replicated at TP 4. Every case's page
#: and KV bytes are checked in process against the byte oracles
#: (test_hybrid_transfer_bytes_in_process).
HYBRID_REAL = {"lfm2-hybrid-2x4-HB-HB", "lfm2-hybrid-4x1-LH-BH", "granite-hybrid-1x4-HB-HB",
               "granite-hybrid-2x1-LH-BH"}
HYBRID_CASES = [pytest.param(*c[:5], id=c[5],
                             marks=() if c[5] in HYBRID_REAL else pytest.mark.exhaustive)
                for c in HYBRID_MATRIX]
assert HYBRID_REAL <= {c[5] for c in HYBRID_MATRIX}


@pytest.mark.parametrize("model,prefill_tp,decode_tp,src_layout,dst_layout",
                         [pytest.param(*c[:5], id=c[5]) for c in HYBRID_MATRIX])
def test_hybrid_transfer_bytes_in_process(hf_models, model, prefill_tp, decode_tp, src_layout,
                                          dst_layout):
    """The hybrid matrix's transfers without processes: each decode rank's page and KV blocks
    (KV layouts as the case names them) byte-exact against the oracles."""
    spec = StateSpec.from_pretrained(hf_models[model].path)
    plan = check_pages(spec, prefill_tp, decode_tp, "DLS", "DLS")
    assert not any(p.staged for p in plan)
    check_kv(spec, prefill_tp, decode_tp, src_layout, dst_layout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,prefill_tp,decode_tp,src_layout,dst_layout", HYBRID_CASES)
def test_hybrid_greedy_tokens_equal_transformers(pools, hf_models, model, prefill_tp,
                                                 decode_tp, src_layout, dst_layout):
    """Recurrent state and attention KV move between TP degrees (KV heads split, or replicated
    at TP 4 for Granite's 2 KV heads) and KV layouts (HB both sides; vLLM's LH to BH);
    prompts of 1, block-1, block, block+1 and several blocks of tokens in flight together;
    decoding appends K/V across block boundaries."""
    prefill_hosts, decode_hosts = pools
    hf = hf_models[model]
    server = start_prefill_node(hf.path, prefill_tp, num_pages=16, config=FAST,
                                kv_layout=src_layout, block_size=KV_BLOCK, kv_blocks=64,
                                launcher=prefill_hosts.launcher())
    try:
        with DecodeNode(hf.path, decode_tp, [server.address], num_pages=16, config=FAST,
                        kv_layout=dst_layout, block_size=KV_BLOCK, kv_blocks=64,
                        launcher=decode_hosts.launcher()) as node:
            results = run_all(node.address, KV_PROMPTS)
            for prompt, result, expected in zip(KV_PROMPTS, results, hf.kv_reference):
                assert result.tokens == list(expected), f"prompt of {len(prompt)} tokens"
                assert not result.recomputed
            stats = node.stats()
            assert stats["finished_ok"] == len(KV_PROMPTS)
            assert stats["coordinator"]["pages_used"] == 0
            assert stats["coordinator"]["blocks_used"] == 0
        assert server.stats()["blocks_used"] == 0
    finally:
        server.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["lfm2-hybrid", "mamba2-g1"])
def test_batched_chunked_prefill_across_tp_ranks_gives_the_same_tokens(pools, hf_models, model):
    """Prefill steps of at most 8 tokens on a TP 2 prefill node: concurrent prompts share
    steps and the longer ones run in chunks (state and KV carried across steps), the ranks
    agreeing on every step; every prompt's tokens are transformers'."""
    prefill_hosts, decode_hosts = pools
    hf = hf_models[model]
    hybrid = model == "lfm2-hybrid"
    prompts, reference = (KV_PROMPTS, hf.kv_reference) if hybrid else (PROMPTS, hf.reference)
    kv = dict(block_size=KV_BLOCK, kv_blocks=64) if hybrid else {}
    server = start_prefill_node(hf.path, 2, num_pages=16,
                                config=FAST.replace(max_prefill_tokens=8),
                                launcher=prefill_hosts.launcher(), **kv)
    try:
        with DecodeNode(hf.path, 1, [server.address], num_pages=16, config=FAST,
                        launcher=decode_hosts.launcher(), **kv) as node:
            for _ in range(2):          # the second round queues behind nothing
                results = run_all(node.address, prompts)
                for prompt, result, expected in zip(prompts, results, reference):
                    assert result.tokens == list(expected), f"prompt of {len(prompt)} tokens"
                    assert not result.recomputed
        stats = server.stats()
        assert stats["pages_used"] == 0
    finally:
        server.close()


@pytest.mark.timeout(300)
def test_eight_concurrent_clients_get_independent_results(pools, hf_models):
    prefill_hosts, decode_hosts = pools
    hf = hf_models["mamba2-g1"]
    server = start_prefill_node(hf.path, 2, num_pages=16, config=FAST,
                                launcher=prefill_hosts.launcher())
    try:
        with DecodeNode(hf.path, 4, [server.address], num_pages=16, max_batch=3,
                        config=FAST, launcher=decode_hosts.launcher()) as node:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
            results = run_all(node.address, prompts)
            for i, result in enumerate(results):
                assert result.tokens == list(hf.reference[i % len(PROMPTS)])
            # Sampling with a seed gives the same tokens alone and inside a busy batch.
            alone = run_all(node.address, [PROMPTS[3]], temperature=0.8, top_p=0.9, seed=11)
            crowd = run_all(node.address, [PROMPTS[3]] * 6, temperature=0.8, top_p=0.9,
                            seed=11)
            assert all(r.tokens == alone[0].tokens for r in crowd)
            other_seed = run_all(node.address, [PROMPTS[3]] * 3, temperature=0.8, top_p=0.9,
                                 seed=12)
            assert len({tuple(r.tokens) for r in other_seed}) == 1
            # Bad requests get typed errors and the node serves on.
            with Client(node.address) as client:
                with pytest.raises(ConfigError, match="exceeds the limit"):
                    client.generate(list(range(9000)), max_new_tokens=2)
                with pytest.raises(ConfigError, match="prompt is empty"):
                    client.generate([], max_new_tokens=2)
                assert client.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS).tokens == \
                    list(hf.reference[1])
    finally:
        server.close()


def start_slow_prefill_node(model_dir: str, port: int) -> NodeProcess:
    os.environ["STATEBRIDGE_TEST_PREFILL_DELAY"] = "1.0"
    return NodeProcess(["prefill", "--model", model_dir, "--tp", "2", "--port", str(port),
                        "--peer-timeout", "1.5",
                        "--rank-model", "tests.e2e._helpers:SlowPrefillModel"], "prefill node")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["lfm2-hybrid"])      # (state and KV; lfm2 moves a subset)
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_killed_prefill_node_follows_the_policy(pools, hf_models, policy, model, monkeypatch):
    _, decode_hosts = pools
    hf = hf_models[model]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    prefill = start_slow_prefill_node(hf.path, free_port())
    address = prefill.lines[-1].split(" ready on ")[1].split()[0]
    with DecodeNode(hf.path, 2, [address], num_pages=16, config=FAST, policy=policy,
                    launcher=decode_hosts.launcher()) as node:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            def one(prompt):
                with Client(node.address, timeout=120) as client:
                    try:
                        return client.generate(prompt, max_new_tokens=NEW_TOKENS)
                    except PeerLostError as e:
                        return e
            futures = [pool.submit(one, p) for p in PROMPTS[1:]]
            time.sleep(0.5)                          # every request is in its slow prefill
            os.killpg(prefill.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            outcomes = [f.result(timeout=60) for f in futures]
        if policy == "fail":
            assert all(isinstance(o, PeerLostError) for o in outcomes), outcomes
            assert time.monotonic() - killed < FAST.peer_timeout + 10
        else:
            for o, expected in zip(outcomes, hf.reference[1:]):
                assert not isinstance(o, Exception), o
                assert o.recomputed and o.tokens == list(expected)
        wait_until(lambda: node.stats()["coordinator"]["pages_used"] == 0, 15,
                   "decode pages reclaimed")
        wait_until(lambda: node.stats()["coordinator"]["blocks_used"] == 0, 15,
                   "decode KV blocks reclaimed")
        # A prefill node comes back: later requests are served by it again.
        fresh = start_prefill_node(hf.path, 2, num_pages=8, config=FAST,
                                   launcher=pools[0].launcher())
        try:
            node.add_prefill(fresh.address)
            result = run_all(node.address, [PROMPTS[4]])[0]
            assert result.tokens == list(hf.reference[4]) and not result.recomputed
        finally:
            fresh.close()


def reference_tokens(path: str, prompts, new_tokens: int):
    """transformers' own greedy continuation (full forwards, no cache) of each prompt."""
    import transformers

    from tests.models.conftest import reference_greedy

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return [reference_greedy(model, p, new_tokens)[0] for p in prompts]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["lfm2-hybrid", "granite-hybrid"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_kv_block_exhaustion_during_decode_follows_the_policy(pools, hf_models, model, policy):
    """Six requests that each need 5 KV blocks by their last token share a decode pool of 8
    (admission needs only the prompt's block): growth runs out mid-decode. ``fail``: the
    requests that cannot grow get CacheFullError, the others' tokens are exact; ``recompute``:
    they are preempted and resumed, every request's tokens are exact. Nothing leaks on either
    node, and the node serves on."""
    from statebridge.errors import CacheFullError

    prefill_hosts, decode_hosts = pools
    hf = hf_models[model]
    new = 12
    prompts = [tuple((i * 7 + j * 13 + 3) % 120 for j in range(5)) for i in range(6)]
    expected = reference_tokens(hf.path, prompts, new)
    server = start_prefill_node(hf.path, 2, num_pages=16, config=FAST, block_size=KV_BLOCK,
                                kv_blocks=64, launcher=prefill_hosts.launcher())
    try:
        with DecodeNode(hf.path, 2, [server.address], num_pages=16, config=FAST, policy=policy,
                        block_size=KV_BLOCK, kv_blocks=8, launcher=decode_hosts.launcher()) \
                as node:
            def one(prompt):
                with Client(node.address, timeout=120) as client:
                    try:
                        return client.generate(prompt, max_new_tokens=new)
                    except CacheFullError as e:
                        return e
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                outcomes = list(pool.map(one, prompts))
            stats = node.stats()
            failed = [o for o in outcomes if isinstance(o, Exception)]
            if policy == "fail":
                assert failed and len(failed) < len(prompts), outcomes
                assert all("no KV block" in str(e) for e in failed), failed
                assert stats["finished_cache_full"] == len(failed)
            else:
                assert not failed, failed
                assert stats["preempted"] >= 1 and any(o.recomputed for o in outcomes)
            for o, want in zip(outcomes, expected):
                if not isinstance(o, Exception):
                    assert o.tokens == want
            # A request larger than the whole pool is refused at once, naming the numbers.
            with Client(node.address) as client:
                with pytest.raises(ConfigError, match=r"needs 9 KV blocks .* the pool has 8"):
                    client.generate(prompts[0], max_new_tokens=31)
                assert client.generate(prompts[1], max_new_tokens=new).tokens == expected[1]
            wait_until(lambda: node.stats()["coordinator"]["blocks_used"] == 0, 15,
                       "decode KV blocks reclaimed")
            assert node.stats()["coordinator"]["pages_used"] == 0
        wait_until(lambda: server.stats()["blocks_used"] == 0, 15, "prefill blocks reclaimed")
    finally:
        server.close()


@pytest.mark.timeout(600)
def test_demo_exits_zero():
    import subprocess
    out = subprocess.run([sys.executable, "-m", "statebridge.cli", "demo"], capture_output=True,
                         text=True, timeout=550)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "demo OK: every token matches" in out.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_a_node_down_without_orphans(hf_models, sig):
    node = NodeProcess(["prefill", "--model", hf_models["lfm2"].path, "--tp", "2",
                        "--port", str(free_port())], "prefill node")
    below = descendants(node.proc.pid)      # 2 ranks, the fork server, the resource tracker
    assert len([pid for pid in below if is_rank(pid)]) == 2, below
    node.proc.send_signal(sig)
    assert node.proc.wait(60) == 0
    for pid in below:
        wait_until(lambda: not alive(pid), 10, f"process {pid} below the node gone")
