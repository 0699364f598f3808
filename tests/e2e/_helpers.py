"""Pieces of the end-to-end tests that rank processes import too (no transformers here)."""

from __future__ import annotations

import os
import time

from statebridge.config import ConnectorConfig
from statebridge.node.rank_model import ModelRankModel

FAST = ConnectorConfig(heartbeat_interval=0.1, peer_timeout=1.5, lease_timeout=30.0,
                       transfer_timeout=60.0, handshake_timeout=60.0)


class SlowPrefillModel(ModelRankModel):
    """The real model, with STATEBRIDGE_TEST_PREFILL_DELAY seconds added to every prefill (and
    every prefill step) so a test can kill the prefill node while requests are in flight."""

    def prefill(self, page, prompt, request_id, blocks=()) -> None:
        time.sleep(float(os.environ.get("STATEBRIDGE_TEST_PREFILL_DELAY", "1.0")))
        super().prefill(page, prompt, request_id, blocks)

    def prefill_chunks(self, chunks):
        time.sleep(float(os.environ.get("STATEBRIDGE_TEST_PREFILL_DELAY", "1.0")))
        return super().prefill_chunks(chunks)


class CorruptFirstModel(ModelRankModel):
    """The real model; decode rank 0 flips a byte of what landed for the first request it
    receives, just before it digests it (:mod:`statebridge.testing.corrupt`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from statebridge.testing import corrupt

        corrupt.install()
        self._corrupted = False

    def corrupt_landed(self, request_id: str) -> bool:
        if self.setup.role != "decode" or self.setup.tp_rank != 0 or self._corrupted:
            return False
        self._corrupted = True
        return True
