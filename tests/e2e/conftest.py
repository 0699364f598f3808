"""The transformers-made checkpoints and their reference tokens (shared with tests/models), and
the live pairs of the HTTP tests: rank host pools for a prefill node (TP 1) and a decode node
(TP 2), and a pair of nodes started on them."""

from __future__ import annotations

import contextlib

import pytest

from statebridge.node.decode_node import DecodeNode
from statebridge.node.prefill_node import start_prefill_node
from statebridge.testing.hosts import RankHostPool

from tests.connector._helpers import log_to_stderr
from tests.models.conftest import hf_models, one_cpu_thread, transformers_module  # noqa: F401

from ._helpers import FAST


@pytest.fixture(scope="module")
def pools():
    """The module's rank host processes: (prefill hosts for TP 1, decode hosts for TP 2)."""
    with RankHostPool(1, initializer=log_to_stderr) as prefill_hosts, \
            RankHostPool(2, initializer=log_to_stderr) as decode_hosts:
        yield prefill_hosts, decode_hosts


@pytest.fixture(scope="module")
def live_pair(pools):
    """Starts a pair on the module's ``pools``: ``with live_pair(model, num_pages=N,
    kv_blocks=K, **decode) as (server, node)`` gives a prefill node (TP 1) and a decode node
    (TP 2, ``decode``: more of DecodeNode's arguments) that serves, both with ``FAST``
    timings; both are closed when the block ends. ``prefill_model``: the prefill ranks'
    ``rank_model``."""
    prefill_hosts, decode_hosts = pools

    @contextlib.contextmanager
    def start(model: str, *, num_pages: int, kv_blocks: int, prefill_model: str | None = None,
              **decode):
        extra = {} if prefill_model is None else {"rank_model": prefill_model}
        server = start_prefill_node(model, 1, num_pages=num_pages, config=FAST,
                                    kv_blocks=kv_blocks, launcher=prefill_hosts.launcher(),
                                    **extra)
        try:
            with DecodeNode(model, 2, [server.address], num_pages=num_pages, config=FAST,
                            kv_blocks=kv_blocks, launcher=decode_hosts.launcher(),
                            **decode) as node:
                node.wait_ready(60)
                yield server, node
        finally:
            server.close()

    return start
