"""A rank model that takes its time to start and then fails (for the rank host tests)."""

from __future__ import annotations

import time

from statebridge.testing.models import SyntheticModel


class SlowFailingModel(SyntheticModel):
    def __init__(self, setup, cache, kv=None) -> None:
        time.sleep(1.5)
        raise RuntimeError("slow model gave up")
