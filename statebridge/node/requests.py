"""The decode node's record of a client request and the client it answers: what the front
doors (:mod:`statebridge.node.decode_node`) and the scheduler
(:mod:`statebridge.node.scheduler`) both hold."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from statebridge.connector import messages as m
from statebridge.connector.decode import TransferResult
from statebridge.node import messages as nm

__all__ = ["FrontDoorClient"]


class FrontDoorClient(Protocol):
    """Who sent a front-door message: the node answers it through ``deliver``, on the loop
    thread, never blocking. Equal clients are the same client (only the client that sent a
    request may abort it)."""

    def deliver(self, message: m.Message) -> None: ...


@dataclass(eq=False)
class _Gen:
    """One client request inside the decode node."""

    request_id: str
    client: FrontDoorClient
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    logprobs: int = -1                # top log-probabilities per token (-1: none)
    arrived: float = field(default_factory=time.perf_counter)
    arrived_at: float = field(default_factory=time.time)     # wall clock, for RequestTiming
    page: int = -1
    next_token: int = 0
    generated: list[int] = field(default_factory=list)
    ttft: float = 0.0
    transfer: TransferResult | None = None
    recomputed: bool = False
    local: bool = False               # the current attempt is a local recompute
    blocks: tuple[int, ...] = ()      # KV block table (attention models)
    preemptions: int = 0
    aborted: str = ""                 # the client aborted it while its step was in flight
    #: Prompt tokens the prefill node took from its prefix cache (its RequestTiming's); None
    #: until the timing of the request's current transfer came.
    cached_tokens: int | None = None

    def sequence(self) -> tuple[int, ...]:
        """The prompt and the tokens generated so far: what a (re)start prefills, but for
        its last token, which the next step decodes."""
        return self.prompt + tuple(self.generated)

    def reply(self, tokens: tuple[int, ...], done: bool, kind: str = "", message: str = "",
              logprobs: tuple = ()) -> None:
        """Answer the client: ``tokens`` (``done`` with the last), or the failure ``kind``
        with its ``message``. ``logprobs``: ``(logprobs, top_ids, top_logprobs)`` of
        ``tokens`` (a request that asked for them)."""
        t = self.transfer
        lp, top_ids, top_lps = logprobs or ((), (), ())
        self.client.deliver(nm.GenerateTokens(
            request_id=self.request_id, tokens=tokens, done=done, kind=str(kind),
            message=message, ttft=self.ttft, transfer_seconds=t.seconds if t else 0.0,
            transfer_bytes=t.nbytes if t else 0, recomputed=self.recomputed,
            logprobs=lp, top_ids=top_ids, top_logprobs=top_lps,
            cached_tokens=self.cached_tokens or 0))
