"""Stand-in rank models for tests and benchmarks."""

from __future__ import annotations

from statebridge.connector.rank import RankModel
from statebridge.errors import FailureKind
from statebridge.node import messages as nm
from statebridge.testing.synthetic import fill_kv, fill_page, global_kv, global_state, \
    request_seed

__all__ = ["SyntheticModel"]


class SyntheticModel(RankModel):
    """The request's deterministic synthetic state (and attention KV, for specs with KV) as
    its prefill (tests, benchmarks). It cannot decode: a decode step gets a typed failure from
    rank 0."""

    def handlers(self) -> dict:
        def cannot_decode(msg: nm.RankStep) -> nm.RankStepResult | None:
            if self.setup.tp_rank != 0:
                return None
            return nm.RankStepResult(step=msg.step, tp_rank=0, tokens=(),
                                     kind=FailureKind.TRANSFER_ERROR.value,
                                     message=f"{type(self).__name__} cannot decode")
        return {nm.RankStep: cannot_decode}

    def prefill(self, page: int, prompt: tuple[int, ...], request_id: str,
                blocks: tuple[int, ...] = ()) -> None:
        fill_page(self.cache, page,
                  global_state(self.cache.geometry.spec, request_seed(request_id)),
                  self.setup.tp_rank)
        if blocks:
            self.prefill_kv(blocks, len(prompt), request_id)

    def prefill_kv(self, blocks: tuple[int, ...], tokens: int, request_id: str) -> None:
        """The request's synthetic K and V of ``tokens`` tokens into ``blocks``."""
        fill_kv(self.kv, blocks, global_kv(self.kv.geometry.kv, request_seed(request_id), tokens),
                self.setup.tp_rank)
