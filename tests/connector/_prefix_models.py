"""Rank models of the prefix cache tests (imported by rank processes too: no transformers)."""

from __future__ import annotations

from statebridge.connector.messages import Message, message
from statebridge.node.rank_model import ModelRankModel


@message
class CorruptPage(Message):
    """Test -> every prefill rank: overwrite ``page`` (a cached checkpoint) with finite junk."""
    page: int


class CorruptibleModel(ModelRankModel):
    """The real model; :class:`CorruptPage` overwrites a page of the rank's pool (on the compute
    thread, in order with the prefill steps: the next request sees it)."""

    def handlers(self) -> dict:
        return {**super().handlers(), CorruptPage: self.corrupt}

    def corrupt(self, msg: CorruptPage) -> None:
        self.cache.page_bytes(msg.page).fill_(0x3C)      # 0x3c3c...: small finite floats
        return None
