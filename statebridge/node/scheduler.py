"""The decode node's scheduler: each request from its prompt's state to its last token.

A request (:class:`~statebridge.node.requests._Gen`) gets a page (and KV blocks) and its
prompt's state from a prefill node -- or, under the ``recompute`` policy, from a local prefill
-- and then joins the running batch; one decode step at a time goes to every decode rank (at
most ``max_batch`` requests, round robin beyond), each step's tokens go back to the clients,
and a request that runs out of KV blocks fails ``cache_full`` or is preempted and resumed
(``recompute``). Requests that find no page wait in arrival order. Everything here runs on the
node's loop thread.

A request's last message says how many of its prompt tokens the prefill node's prefix cache
served (``cached_tokens``, from the request's
:class:`~statebridge.connector.request_timing.RequestTiming`, :meth:`on_timing`). The prefill
node's half of the timing may come after the last token: the last message then waits for it
(:attr:`DecodeScheduler.held`), at most the node's ``peer_timeout``, after which it goes with
0 (counted: ``cached_tokens_late``). Each request whose count is settled adds its prompt tokens
and its cached ones to the ``prefix_cache_queries`` / ``prefix_cache_hits`` counters (vLLM's
``prefix_cache_queries`` / ``prefix_cache_hits``, in tokens).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time

from statebridge.config import ConnectorConfig, NodeConfig
from statebridge.connector.decode import DecodeCoordinator, TransferResult
from statebridge.connector.stats import Counters
from statebridge.errors import CacheFullError, FailureKind, TransferError, kind_of
from statebridge.node import messages as nm
from statebridge.node.requests import _Gen

log = logging.getLogger("statebridge.node.decode_node")

__all__ = ["DecodeScheduler"]


class DecodeScheduler:
    """The decode node's requests from their transfer to their last token, on the node's loop
    thread: :attr:`~statebridge.node.decode_node.DecodeNode.scheduler`. The node hands it each
    admitted request (:meth:`submit`), a client's abort (:meth:`abort`), the rank group's step
    results and losses (:meth:`on_step_result`, :meth:`on_rank_lost`) and its timers
    (:meth:`start_waiting`, :meth:`check_step`); every answer goes to the request's client
    (:meth:`_Gen.reply`)."""

    def __init__(self, coordinator: DecodeCoordinator, node_config: NodeConfig,
                 config: ConnectorConfig, *, kv: bool, counters: Counters) -> None:
        self.coordinator, self.node_config, self.config = coordinator, node_config, config
        self.kv = kv                      # attention KV: requests own block tables
        self.counters = counters          # the node's
        self.gens: dict[str, _Gen] = {}   # request id -> request
        self.waiting: collections.deque[_Gen] = collections.deque()   # no free page yet
        self.running: list[_Gen] = []
        self.step_in_flight: tuple[int, list[_Gen]] | None = None
        self._step_started = 0.0
        self._steps = itertools.count(1)
        self.closed = False
        #: Requests done whose last message waits for their timing: request id -> (request,
        #: the deadline, the last message's arguments).
        self.held: dict[str, tuple[_Gen, float, tuple]] = {}

    @property
    def policy(self) -> str:
        return self.node_config.policy

    def submit(self, gen: _Gen, local: bool = False) -> None:
        """Serve ``gen`` (a request the node admitted): its transfer starts, or it waits for a
        page; ``local``: a local prefill (``recompute`` with no prefill node)."""
        self.gens[gen.request_id] = gen
        self.counters.add("requests")
        self._start_transfer(gen, local=local)

    def abort(self, gen: _Gen, why: str) -> None:
        """Drop ``gen`` wherever it is. Decoding in the step in flight: it finishes when the
        step's result comes (its ranks still write its page); transferring: the transfer is
        cancelled (its page frees once every rank confirmed)."""
        if self.step_in_flight is not None and gen in self.step_in_flight[1]:
            gen.aborted = why
            return
        transferring = gen.transfer is None and gen not in self.waiting and \
            gen not in self.running
        self.finish(gen, FailureKind.ABORTED, why)
        if transferring:
            self.coordinator.cancel(gen.request_id, why)

    def close(self) -> None:
        """Fail every request (clients hear ``aborted``); no step starts after."""
        self.closed = True
        self.waiting.clear()
        for gen, _, args in list(self.held.values()):
            self._release_held(gen, args)
        for gen in list(self.gens.values()):
            self.finish(gen, FailureKind.ABORTED, "decode node shutting down", release=False)

    # -- the prompt's state ------------------------------------------------------------------
    def _start_transfer(self, gen: _Gen, local: bool = False, *, retry: bool = False) -> bool:
        """Start ``gen``'s transfer; False when no page (or KV block) is free: it waits, in
        arrival order (a retry goes back to the front)."""
        gen.local = local
        gen.cached_tokens = 0 if local else None       # a local prefill reads no cache
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

    def start_waiting(self) -> None:
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
        self.finish(gen, kind, str(error))

    # -- decode steps -------------------------------------------------------------------------
    def _maybe_step(self) -> None:
        if self.step_in_flight is not None or not self.running or self.closed:
            return
        if self.kv:
            self._grow_blocks(self.running[:self.node_config.max_batch])
            if not self.running:
                return
        batch = self.running[:self.node_config.max_batch]
        step = next(self._steps)
        self.step_in_flight = (step, batch)
        self._step_started = time.monotonic()
        self.coordinator.group.to_ranks(nm.RankStep(
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
        size = self.coordinator.group.block_size
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
                    self.finish(gen, FailureKind.CACHE_FULL,
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

    def check_step(self) -> None:
        """A step whose result does not come (a rank's model hangs while its loop still
        heartbeats) fails its batch after ``transfer_timeout``; a late result is ignored.
        A last message held for a timing that did not come within ``peer_timeout`` goes
        (``cached_tokens`` 0)."""
        if self.held:
            now = time.monotonic()
            for gen, deadline, args in [h for h in self.held.values() if h[1] <= now]:
                self.counters.add("cached_tokens_late")
                log.debug("%s: no prefill timing within %s s: cached_tokens 0",
                          gen.request_id, self.config.peer_timeout)
                self._release_held(gen, args)
        if self.step_in_flight is None:
            return
        took = time.monotonic() - self._step_started
        if took <= self.config.transfer_timeout:
            return
        step, batch = self.step_in_flight
        self.step_in_flight = None
        self.counters.add("steps_timed_out")
        for gen in batch:
            self.finish(gen, FailureKind.TIMEOUT, f"decode step {step} got no result within "
                                                  f"{self.config.transfer_timeout} s")
        self._maybe_step()

    def on_rank_lost(self, rank: int) -> None:
        for gen in list(self.running):
            self.finish(gen, FailureKind.PEER_LOST, f"decode rank {rank} died", release=False)
        self.step_in_flight = None

    def on_step_result(self, rank: int, msg: nm.RankStepResult) -> None:
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
                self.finish(gen, FailureKind.parse(msg.kind),
                            f"decode step {step} failed: {msg.message}")
            self._maybe_step()
            return
        failed = {row: (kind, why) for row, kind, why in zip(
            msg.failed_rows, msg.failed_kinds, msg.failed_messages)}
        if len(msg.tokens) != len(batch) or len(failed) != len(msg.failed_rows) or \
                not all(0 <= row < len(batch) for row in failed):
            self.counters.add("malformed_step_results")
            for gen in batch:
                self.finish(gen, FailureKind.INTERNAL, f"decode step {step}: rank {rank} "
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
                self.finish(gen, FailureKind.ABORTED, gen.aborted)
                continue
            if row in failed:
                kind, why = failed[row]
                self.counters.add("step_rows_failed")
                self.finish(gen, FailureKind.parse(kind),
                            f"decode step {step}: {gen.request_id}: {why}")
                continue
            if not gen.generated:
                gen.ttft = now - gen.arrived
            gen.generated.append(token)
            gen.next_token = token
            logprobs = ((msg.logprobs[row],), (msg.top_ids[row],), (msg.top_logprobs[row],)) \
                if asked and gen.logprobs >= 0 else ()
            if len(gen.generated) >= gen.max_new_tokens:
                self.finish(gen, "", "", last=(token,), logprobs=logprobs)
            else:
                gen.reply((token,), False, logprobs=logprobs)
        served = set(map(id, batch))
        kept = [g for g in batch if g in self.running]
        self.running = [g for g in self.running if id(g) not in served] + kept
        self._maybe_step()

    def finish(self, gen: _Gen, kind: "FailureKind | str", message: str, *,
               last: tuple[int, ...] = (), release: bool = True, logprobs: tuple = ()) -> None:
        if gen in self.running:
            self.running.remove(gen)
        if self.gens.get(gen.request_id) is gen:
            del self.gens[gen.request_id]
        if gen.transfer is not None and release and not self.coordinator.free(gen.request_id):
            log.warning("%s: its page was not held any more", gen.request_id)
        self.counters.add("finished_ok" if not kind else f"finished_{kind}")
        args = (last, True, kind, message, logprobs)
        if not kind and gen.cached_tokens is None and not self.closed:
            # (Its page and blocks are free already: only the message waits.)
            self.held[gen.request_id] = (gen, time.monotonic() + self.config.peer_timeout,
                                         args)
        elif not kind:
            self._release_held(gen, args)
        else:
            gen.reply(*args)
        self.start_waiting()

    # -- what the prefix cache served ---------------------------------------------------------
    def on_timing(self, request_id: str, cached_tokens: int) -> None:
        """A request's timing came (:class:`~statebridge.connector.request_timing.RequestTiming`):
        note the prompt tokens the prefill node's cache served; a last message held for it
        goes now. A timing of a request no longer here (it failed) is ignored."""
        held = self.held.get(request_id)
        gen = held[0] if held is not None else self.gens.get(request_id)
        if gen is None:
            return
        gen.cached_tokens = cached_tokens
        if held is not None:
            self._release_held(gen, held[2])

    def _release_held(self, gen: _Gen, args: tuple) -> None:
        """Send a successful request's last message (``cached_tokens`` as known, else 0) and
        count its prompt and cached tokens."""
        self.held.pop(gen.request_id, None)
        self.counters.add("prefix_cache_queries", len(gen.prompt))
        self.counters.add("prefix_cache_hits", gen.cached_tokens or 0)
        gen.reply(*args)
