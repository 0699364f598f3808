"""Shared pieces of the multi-process connector tests (imported by rank processes too)."""

from __future__ import annotations

import hashlib
import logging
import os
import time

import numpy as np

from statebridge.config import ConnectorConfig
from statebridge.connector.messages import Message, message
from statebridge.node import messages as nm
from statebridge.state.layout import PageGeometry
from statebridge.state.spec import StateSpec
from statebridge.testing.models import SyntheticModel
from statebridge.testing.synthetic import global_state, request_seed

from tests.state._oracle import page_of_rank

#: The stand-in model a test's groups run (groups have no model unless named).
SYNTHETIC = "statebridge.testing.models:SyntheticModel"

# Fast liveness for tests: a dead peer is noticed within ~1 s.
FAST = ConnectorConfig(heartbeat_interval=0.1, peer_timeout=1.0, lease_timeout=30.0,
                       transfer_timeout=30.0, handshake_timeout=30.0)

#: The peer timeout of a round of transfers that loses no peer (``steady``).
STEADY_PEER_TIMEOUT = 5.0


def steady(config: ConnectorConfig) -> ConnectorConfig:
    """``config`` for a round that kills, freezes and loses nothing: a peer is taken for lost
    after STEADY_PEER_TIMEOUT of silence, not FAST's 1 s. On a loaded machine (parallel test
    workers) a rank busy polling or staging its transfers stalls its heartbeats for ~1 s, and
    its group would restart under the round (PeerLostError, "rank 2 lost (silent for 1 s)")."""
    return config.replace(peer_timeout=max(config.peer_timeout, STEADY_PEER_TIMEOUT))

SPECS = {
    "shortconv": StateSpec.from_config(
        {"model_type": "lfm2", "hidden_size": 40, "conv_L_cache": 3, "torch_dtype": "bfloat16",
         "num_attention_heads": 4, "num_key_value_heads": 2,
         "layer_types": ["conv", "full_attention", "conv", "conv"]}),
    "mamba2-g1": StateSpec.from_config(
        {"model_type": "mamba2", "hidden_size": 16, "expand": 2, "head_dim": 4, "state_size": 6,
         "n_groups": 1, "conv_kernel": 4, "num_hidden_layers": 3, "torch_dtype": "bfloat16"},
        ssm_dtype="float32"),
    "mamba2-g8": StateSpec.from_config(
        {"model_type": "mamba2", "hidden_size": 16, "expand": 2, "head_dim": 4, "state_size": 5,
         "n_groups": 8, "conv_kernel": 3, "num_hidden_layers": 2, "torch_dtype": "float16"}),
}


def log_to_stderr() -> None:
    """Rank host initializer (``RankHostPool(n, initializer=log_to_stderr)``): the hosts' log
    records go to stderr, where pytest shows them with a failure."""
    logging.basicConfig(level=os.environ.get("STATEBRIDGE_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s host %(levelname)s %(name)s: %(message)s")


def expected_checksum(geometry: PageGeometry, request_id: str, tp_rank: int) -> str:
    """What decode rank ``tp_rank`` must hold for ``request_id``, from the test oracle."""
    state = {k: v.view({1: __import__("torch").uint8, 2: __import__("torch").int16,
                        4: __import__("torch").int32}[v.element_size()]).numpy()
             for k, v in global_state(geometry.spec, request_seed(request_id)).items()}
    page, data = page_of_rank(geometry, state, tp_rank)
    h = hashlib.blake2b(digest_size=16)
    h.update(page[data].tobytes())
    return h.hexdigest()


class SlowModel(SyntheticModel):
    """A "model" whose prefill takes STATEBRIDGE_TEST_PREFILL_DELAY seconds (default 0.5)."""

    def prefill(self, page, prompt, request_id, blocks=()) -> None:
        time.sleep(float(os.environ.get("STATEBRIDGE_TEST_PREFILL_DELAY", "0.5")))
        super().prefill(page, prompt, request_id, blocks)


class SlowStepModel(SyntheticModel):
    """Cheap prefills and decode steps that take 0.3 s (each answers token 7)."""

    def handlers(self):
        return {nm.RankStep: self.step}

    def step(self, msg):
        time.sleep(0.3)
        return nm.RankStepResult(step=msg.step, tp_rank=self.setup.tp_rank,
                                 tokens=(7,) * len(msg.request_ids), kind="", message="")


def wait_until(predicate, timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; returns the seconds it took, fails after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"{what}: not true after {timeout} s")


def thaw(*pids: int) -> None:
    """SIGCONT every process of ``pids`` that still exists (a test's cleanup after SIGSTOP)."""
    import os
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def random_prompt(rng: np.random.Generator) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(0, 1000, size=int(rng.integers(1, 9))))


class FailingModel(SyntheticModel):
    """Rank 1 cannot load its model (rank 0 starts normally)."""

    def __init__(self, setup, cache, kv=None) -> None:
        if setup.tp_rank == 1:
            raise RuntimeError("no such weight file /nowhere/model.safetensors")
        super().__init__(setup, cache, kv)


class ExitingModel(SyntheticModel):
    """Rank 1's process dies while starting, saying nothing (rank 0 starts normally)."""

    def __init__(self, setup, cache, kv=None) -> None:
        if setup.tp_rank == 1:
            os._exit(3)
        super().__init__(setup, cache, kv)


@message
class PageQuery(Message):
    """Test -> every decode rank: report what ``page`` and ``blocks`` hold right now."""
    query: int
    page: int
    blocks: tuple[int, ...]
    tokens: int


@message
class PageReport(Message):
    query: int
    tp_rank: int
    checksum: str
    kv_checksum: str


class QueryModel(SyntheticModel):
    """The synthetic model, answering :class:`PageQuery` with the page's and the blocks' checksums
    as they are at that moment (long after the request that filled them completed)."""

    def handlers(self) -> dict:
        return {**super().handlers(), PageQuery: self.report}

    def report(self, msg: PageQuery) -> PageReport:
        from statebridge.connector.rank import kv_checksum
        from statebridge.state.cache import page_checksum

        return PageReport(query=msg.query, tp_rank=self.setup.tp_rank,
                          checksum=page_checksum(self.cache.geometry,
                                                 self.cache.page_bytes(msg.page)),
                          kv_checksum=kv_checksum(self.kv, msg.blocks, msg.tokens)
                          if msg.blocks else "")


class FailsOnceFlaggedModel(SyntheticModel):
    """Starts normally until the file named by STATEBRIDGE_TEST_FAIL_FLAG exists; from then on
    every rank that starts fails (a restart that cannot succeed)."""

    def __init__(self, setup, cache, kv=None) -> None:
        flag = os.environ.get("STATEBRIDGE_TEST_FAIL_FLAG", "")
        if flag and os.path.exists(flag):
            raise RuntimeError(f"cannot load the model: {flag} says so")
        super().__init__(setup, cache, kv)


class HangingModel(SyntheticModel):
    """Never finishes starting (a TP rendezvous that hangs)."""

    def __init__(self, setup, cache, kv=None) -> None:
        time.sleep(3600)


class CorruptingModel(SyntheticModel):
    """Decode rank 0 flips a byte of what landed for each request whose id starts with
    ``corrupt-``, just before it digests it (:mod:`statebridge.testing.corrupt`)."""

    def __init__(self, setup, cache, kv=None) -> None:
        super().__init__(setup, cache, kv)
        from statebridge.testing import corrupt

        corrupt.install()

    def corrupt_landed(self, request_id: str) -> bool:
        return self.setup.role == "decode" and self.setup.tp_rank == 0 \
            and request_id.startswith("corrupt-")


class DigestFailsModel(CorruptingModel):
    """Decode rank 1's digest pass raises for requests whose id starts with ``raise-``."""

    def corrupt_landed(self, request_id: str) -> bool:
        if self.setup.role == "decode" and self.setup.tp_rank == 1 \
                and request_id.startswith("raise-"):
            raise RuntimeError("digest pass broke")
        return False
