"""The decode node's scheduler: each request from its prompt's state to its last token.

A request (:class:`_Gen`) gets a page (and KV blocks) and its prompt's state from a prefill
node -- or, under the ``recompute`` policy, from a local prefill -- and then joins the running
batch; one decode step at a time goes to every decode rank (at most ``max_batch`` requests,
round robin beyond), each step's tokens go back to the clients, and a request that runs out of
KV blocks fails ``cache_full`` or is preempted and resumed (``recompute``). Requests that find
no page wait in arrival order. Everything here runs on the node's loop thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from statebridge.connector.decode import TransferResult
from statebridge.errors import CacheFullError, FailureKind, TransferError, kind_of
from statebridge.node import messages as nm

if TYPE_CHECKING:
    from statebridge.node.decode_node import FrontDoorClient

log = logging.getLogger("statebridge.node.decode_node")

__all__ = ["DecodeScheduler"]


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

    def sequence(self) -> tuple[int, ...]:
        """The prompt and the tokens generated so far: what a (re)start prefills, but for
        its last token, which the next step decodes."""
        return self.prompt + tuple(self.generated)


class DecodeScheduler:
    """The scheduling half of :class:`~statebridge.node.decode_node.DecodeNode` (its base
    class). The node sets what these methods use: ``coordinator``, ``config``, ``node_config``,
    ``policy``, ``kv``, ``counters``, ``gens`` (request id -> request), ``waiting`` (a deque),
    ``running`` (a list), ``step_in_flight``, ``_steps``, ``_step_started``, ``_closed``, and
    ``_reply`` (answers a request's client)."""

    # -- the prompt's state ------------------------------------------------------------------
    def _start_transfer(self, gen: _Gen, local: bool = False, *, retry: bool = False) -> bool:
        """Start ``gen``'s transfer; False when no page (or KV block) is free: it waits, in
        arrival order (a retry goes back to the front)."""
        gen.local = local
        try:
            # (A preempted request's queue time starts when it is resumed.)
            self.coordinator.start(gen.request_id, gen.sequence()[:-1],
                                   lambda result, error: self._transfer_done(gen, result, error),
                                   local=local,
                                   arrived_at=time.time() if gen.preemptions else gen.arrived_at)
        except CacheFullError:
            if retry:
                self.waiting.appendleft(gen)
            else:
                self.waiting.append(gen)          # back-pressure: retried when space frees
            return False
        except TransferError as e:
            self._transfer_failed(gen, e)
            return True
        gen.recomputed = local
        return True

    def _start_waiting(self) -> None:
        while self.waiting:
            gen = self.waiting[0]
            if self.gens.get(gen.request_id) is not gen:
                self.waiting.popleft()
                continue
            if gen.preemptions and self.running and not self._room_to_resume(gen):
                return                            # the running requests need the blocks
            self.waiting.popleft()
            if not self._start_transfer(gen, local=gen.local, retry=True):
                return                            # still full: the rest waits too

    def _room_to_resume(self, gen: _Gen) -> bool:
        """A preempted request resumes while others run only if it leaves one free block per
        running request (else it would take back the blocks it was preempted for)."""
        co = self.coordinator
        return co.free_blocks() >= co.blocks_for(len(gen.sequence())) + len(self.running)

    def _transfer_done(self, gen: _Gen, result: TransferResult | None,
                       error: TransferError | None) -> None:
        if self.gens.get(gen.request_id) is not gen:          # finished meanwhile (closing)
            if result is not None:
                self.coordinator.free(gen.request_id)
            return
        if error is not None:
            self._transfer_failed(gen, error)
            return
        gen.transfer = result
        gen.page = result.page
        gen.blocks = result.blocks
        gen.next_token = gen.sequence()[-1]
        self.running.append(gen)
        self._maybe_step()

    def _transfer_failed(self, gen: _Gen, error: BaseException) -> None:
        kind = kind_of(error)
        self.counters.add(f"transfer_failed_{kind}")
        if self.policy == "recompute" and not gen.local and kind is not FailureKind.INVALID_REQUEST:
            log.warning("%s: transfer failed (%s), recomputing locally", gen.request_id, error)
            self._start_transfer(gen, local=True)
            return
        self._finish(gen, kind, str(error))

    # -- decode steps -------------------------------------------------------------------------
    def _maybe_step(self) -> None:
        if self.step_in_flight is not None or not self.running or self._closed:
            return
        if self.kv:
            self._grow_blocks(self.running[:self.node_config.max_batch])
            if not self.running:
                return
        batch = self.running[:self.node_config.max_batch]
        step = next(self._steps)
        self.step_in_flight = (step, batch)
        self._step_started = time.monotonic()
        self.coordinator.to_ranks(nm.RankStep(
            step=step, request_ids=tuple(g.request_id for g in batch),
            pages=tuple(g.page for g in batch), tokens=tuple(g.next_token for g in batch),
            positions=tuple(len(g.prompt) + len(g.generated) - 1 for g in batch),
            temperatures=tuple(float(g.temperature) for g in batch),
            top_ps=tuple(float(g.top_p) for g in batch),
            seeds=tuple(int(g.seed) for g in batch),
            blocks=tuple(g.blocks for g in batch) if self.kv else (),
            logprobs=tuple(g.logprobs for g in batch)
            if any(g.logprobs >= 0 for g in batch) else ()))

    def _grow_blocks(self, batch: list[_Gen]) -> None:
        """Give each request of the next step's batch a block for its next token's K/V; one
        that cannot get one follows the policy (see the module docstring)."""
        size = self.coordinator.block_size
        for gen in batch:
            tokens = len(gen.prompt) + len(gen.generated)      # after this step's token
            if len(gen.blocks) * size >= tokens:
                continue
            try:
                gen.blocks = self.coordinator.grow(gen.request_id, tokens)
            except CacheFullError as e:
                self.counters.add("kv_grow_refused")
                self.running.remove(gen)
                if self.policy == "recompute":
                    self._preempt(gen)
                else:
                    self._finish(gen, FailureKind.CACHE_FULL,
                                 f"{gen.request_id}: no KV block for token {tokens}: {e}")

    def _preempt(self, gen: _Gen) -> None:
        """Free ``gen``'s page and blocks; it resumes first when space frees, by a local
        prefill of everything but its next token."""
        self.counters.add("preempted")
        gen.preemptions += 1
        log.info("%s: preempted at %d tokens (no free KV block), resumes by recompute",
                 gen.request_id, len(gen.sequence()))
        if gen.transfer is not None:
            self.coordinator.free(gen.request_id)
        gen.transfer, gen.page, gen.blocks = None, -1, ()
        gen.local = True
        self.waiting.appendleft(gen)

    def _check_step(self) -> None:
        """A step whose result does not come (a rank's model hangs while its loop still
        heartbeats) fails its batch after ``transfer_timeout``; a late result is ignored."""
        if self.step_in_flight is None:
            return
        took = time.monotonic() - self._step_started
        if took <= self.config.transfer_timeout:
            return
        step, batch = self.step_in_flight
        self.step_in_flight = None
        self.counters.add("steps_timed_out")
        for gen in batch:
            self._finish(gen, FailureKind.TIMEOUT, f"decode step {step} got no result within "
                                                   f"{self.config.transfer_timeout} s")
        self._maybe_step()

    def _on_rank_lost(self, rank: int) -> None:
        for gen in list(self.running):
            self._finish(gen, FailureKind.PEER_LOST, f"decode rank {rank} died", release=False)
        self.step_in_flight = None

    def _on_step_result(self, rank: int, msg: nm.RankStepResult) -> None:
        if self.step_in_flight is None:
            return
        step, batch = self.step_in_flight
        if msg.step != step:
            self.counters.add("stale_step_results")
            return
        self.step_in_flight = None
        if msg.kind:
            # The step failed as a whole: every request of it (their states may be half
            # updated). A model's failure is the server's (internal, HTTP 500).
            self.counters.add(f"steps_failed_{msg.kind}")
            for gen in batch:
                self._finish(gen, FailureKind.parse(msg.kind),
                             f"decode step {step} failed: {msg.message}")
            self._maybe_step()
            return
        failed = {row: (kind, why) for row, kind, why in zip(
            msg.failed_rows, msg.failed_kinds, msg.failed_messages)}
        if len(msg.tokens) != len(batch) or len(failed) != len(msg.failed_rows) or \
                not all(0 <= row < len(batch) for row in failed):
            self.counters.add("malformed_step_results")
            for gen in batch:
                self._finish(gen, FailureKind.INTERNAL, f"decode step {step}: rank {rank} "
                             f"answered {len(msg.tokens)} tokens and failed rows "
                             f"{msg.failed_rows} for {len(batch)} requests")
            self._maybe_step()
            return
        now = time.perf_counter()
        asked = len(msg.logprobs) == len(batch) == len(msg.top_ids) == len(msg.top_logprobs)
        # Requests that finish are taken out first; the rest rotate to the back so a batch
        # larger than max_batch is served round robin. A failed row finishes its request
        # only (its page is untouched by the step or belongs to it alone).
        for row, (gen, token) in enumerate(zip(batch, msg.tokens)):
            if gen.aborted:
                self._finish(gen, FailureKind.ABORTED, gen.aborted)
                continue
            if row in failed:
                kind, why = failed[row]
                self.counters.add("step_rows_failed")
                self._finish(gen, FailureKind.parse(kind),
                             f"decode step {step}: {gen.request_id}: {why}")
                continue
            if not gen.generated:
                gen.ttft = now - gen.arrived
            gen.generated.append(token)
            gen.next_token = token
            logprobs = ((msg.logprobs[row],), (msg.top_ids[row],), (msg.top_logprobs[row],)) \
                if asked and gen.logprobs >= 0 else ()
            if len(gen.generated) >= gen.max_new_tokens:
                self._finish(gen, "", "", last=(token,), logprobs=logprobs)
            else:
                self._reply(gen, (token,), False, logprobs=logprobs)
        served = set(map(id, batch))
        kept = [g for g in batch if g in self.running]
        self.running = [g for g in self.running if id(g) not in served] + kept
        self._maybe_step()

    def _finish(self, gen: _Gen, kind: "FailureKind | str", message: str, *,
                last: tuple[int, ...] = (), release: bool = True, logprobs: tuple = ()) -> None:
        if gen in self.running:
            self.running.remove(gen)
        if self.gens.get(gen.request_id) is gen:
            del self.gens[gen.request_id]
        if gen.transfer is not None and release and not self.coordinator.free(gen.request_id):
            log.warning("%s: its page was not held any more", gen.request_id)
        self.counters.add("finished_ok" if not kind else f"finished_{kind}")
        self._reply(gen, last, True, kind, message, logprobs)
        self._start_waiting()
