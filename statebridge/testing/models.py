"""Stand-in rank models for tests and benchmarks."""

from __future__ import annotations

from statebridge.connector._rank import RankModel
from statebridge.testing.synthetic import fill_page, global_state, request_seed

__all__ = ["SyntheticModel"]


class SyntheticModel(RankModel):
    """The request's deterministic synthetic state as its prefill (tests, benchmarks)."""

    def prefill(self, page: int, prompt: tuple[int, ...], request_id: str) -> None:
        fill_page(self.cache, page,
                  global_state(self.cache.geometry.spec, request_seed(request_id)),
                  self.setup.tp_rank)
