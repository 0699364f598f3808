"""What a new user hits first: a decode node started before its prefill node, a broken
checkpoint, a node that never hands a request or a token to another thread."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

from statebridge.errors import ConfigError, NotReadyError, ShapeError
from statebridge.node.client import Client
from statebridge.node.decode_node import DecodeNode
from statebridge.node.prefill_node import start_prefill_node

from tests.models._helpers import NEW_TOKENS, PROMPTS


from ._helpers import FAST

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def pools(shared_pools):
    """The session's rank hosts (tests/conftest.py)."""
    return shared_pools


@pytest.mark.timeout(300)
def test_decode_node_started_first_answers_not_ready_then_serves(pools, hf_models):
    prefill_hosts, decode_hosts = pools
    hf = hf_models["lfm2"]
    # Hold the prefill node's port (bound, not listening) while the decode node takes its
    # own ports from the kernel, so none of them can be this one.
    reservation = socket.socket()
    reservation.bind(("127.0.0.1", 0))
    port = reservation.getsockname()[1]
    address = f"127.0.0.1:{port}"
    with reservation, DecodeNode(hf.path, 2, [address], num_pages=8, config=FAST, wait_prefill=0,
                    launcher=decode_hosts.launcher()) as node, \
            Client(node.address, timeout=60) as client:
        status = client.status()
        assert not status.ready and address in status.reason
        assert status.prefill_nodes == ()
        with pytest.raises(NotReadyError, match="no prefill server connected"):
            client.generate(PROMPTS[1], max_new_tokens=2)
        assert node.ready_after == 0.0                    # not served yet
        reservation.close()
        server = start_prefill_node(hf.path, 2, port=port, num_pages=8, config=FAST,
                                    launcher=prefill_hosts.launcher())
        try:
            client.wait_ready(60)
            assert client.status().prefill_nodes == (server.node_id,)
            # Served from the handshake on: "ready in N s" counts from the node's start.
            assert node.ready_after > 0.0
            before = node.loop.handoffs                 # (read without a hand-off)
            for prompt, expected in zip(PROMPTS, hf.reference):
                assert client.generate(prompt, max_new_tokens=NEW_TOKENS).tokens == \
                    list(expected)
            # One event loop: no request and no token crossed a thread boundary inside the
            # node (the old design: 5 per request, 2 per token).
            assert node.loop.handoffs == before
        finally:
            server.close()


def _broken_copy(src: str, dst, how: str) -> str:
    shutil.copytree(src, dst)
    if how == "missing-shard":
        weights = load_file(f"{dst}/model.safetensors")
        (dst / "model.safetensors").unlink()
        names = sorted(weights)
        save_file({n: weights[n] for n in names[:3]}, f"{dst}/model-00001-of-00002.safetensors")
        index = {"metadata": {}, "weight_map": {
            n: "model-00001-of-00002.safetensors" if i < 3 else
            "model-00002-of-00002.safetensors" for i, n in enumerate(names)}}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        weights = load_file(f"{dst}/model.safetensors")
        name = next(n for n in sorted(weights) if n.endswith("feed_forward.w1.weight"))
        weights[name] = torch.zeros(weights[name].shape[0] + 1, weights[name].shape[1])
        save_file(weights, f"{dst}/model.safetensors")
    return str(dst)


@pytest.mark.parametrize("how,error,needle", [
    ("missing-shard", ConfigError, "model-00002-of-00002.safetensors"),
    ("wrong-shape", ShapeError, "feed_forward.w1.weight"),
])
def test_a_broken_checkpoint_fails_in_the_node_before_any_rank_starts(hf_models, tmp_path,
                                                                      how, error, needle):
    model_dir = _broken_copy(hf_models["lfm2"].path, tmp_path / how, how)
    launched = []

    def launcher(setups):
        launched.append(setups)
        raise AssertionError("no rank may start for a broken checkpoint")
    with pytest.raises(error, match=needle):
        DecodeNode(model_dir, 2, ["127.0.0.1:9"], config=FAST, launcher=launcher)
    with pytest.raises(error, match=needle):
        start_prefill_node(model_dir, 2, config=FAST, launcher=launcher)
    assert launched == []
