"""A rank's compute thread: the model's work in arrival order, prefills batched into steps,
results back to the loop in batches.

Prefill steps. Queued prefills run together as one step of at most
``config.max_prefill_tokens`` tokens (:class:`PrefillBatcher`): a prompt longer than what is
left of a step runs in chunks over several steps when the model takes chunks
(:attr:`RankModel.chunked_prefill`); each request's result goes to the loop right after the
step that ran its last token, so its transfer starts then, not when the others' do. A step
never reaches past a model message (a decode step): those run in arrival order between
steps. What a step holds depends on which messages had arrived, which differs between the
ranks of a group, so before each step the ranks agree (:meth:`RankModel.agree_max`) on how
many new prefills it takes and which queued ones were cancelled: every rank runs the same
steps, and collective ops line up.

Prefix cache (:mod:`statebridge.connector.rank.prefix`). A request that hits
(``RankPrefill.cached_tokens``) has its cached state and KV copied into its page and blocks when
it is taken into the batcher, and begins at that token; a step ends at each of its
``checkpoint_at`` counts, and after such a step the rank copies the request's page (and partial
block) to the checkpoint -- before the request's result goes to the loop.

The thread rule: :class:`ComputeThread`'s bookkeeping of the requests queued or computing --
which one is, and why it was cancelled -- belongs to the loop thread. Only one thread (the
first that uses it: the loop's) reads it for decisions or changes it: :meth:`~ComputeThread.submit`,
:meth:`~ComputeThread.cancel`, :meth:`~ComputeThread.finish` and ``in`` raise
:class:`~statebridge.errors.StatebridgeError` from any other. The compute thread asks one
question, whether a request was cancelled while it queued, of a separate set guarded by a
lock. ``len()`` may be read anywhere (a moment stale). Results go back to the loop only
through :meth:`~statebridge.connector.control.EventLoop.call_soon`.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from statebridge.connector import messages as m
from statebridge.connector.ledger import RequestKey
from statebridge.connector.rank.model import PrefillChunk
from statebridge.connector.rank.prefix import PrefixPlan, prefix_plan, settle
from statebridge.errors import ConfigError, StatebridgeError
from statebridge.state.kv import blocks_for

if TYPE_CHECKING:
    from statebridge.connector.control import EventLoop
    from statebridge.connector.rank.model import KVBlocks, RankModel
    from statebridge.connector.stats import Counters

log = logging.getLogger(__name__)

__all__ = ["ComputeThread", "PrefillBatcher", "PrefillJob", "check_blocks", "key_of"]

#: Longest a compute result waits for later ones before the batch goes to the loop.
_RESULT_HOLD_S = 0.0005
#: Most requests in one prefill step (and in the batcher): bounds the agreement vector.
MAX_STEP_REQUESTS = 256


def key_of(msg: "m.RankPrefill | m.RankLocalPrefill") -> RequestKey:
    """The request a prefill message names (a local prefill has no peer node)."""
    peer = msg.peer_node if isinstance(msg, m.RankPrefill) else ""
    return RequestKey(peer, msg.request_id, msg.generation)


def check_blocks(kv: "KVBlocks | None", blocks, tokens: int) -> None:
    """:class:`ConfigError` naming them unless ``blocks`` (a block table) holds ``tokens``
    tokens of the rank's KV pool ``kv``."""
    if kv is None:
        raise ConfigError(f"KV blocks {list(blocks)[:4]} for a rank without a KV pool")
    need = blocks_for(tokens, kv.geometry.block_size)
    if len(blocks) < need or min(blocks) < 0 or max(blocks) >= kv.geometry.num_blocks:
        raise ConfigError(f"block table {list(blocks)[:8]} ({len(blocks)} blocks) does not "
                          f"hold {tokens} tokens in a pool of "
                          f"{kv.geometry.num_blocks} blocks")


@dataclass(eq=False)
class PrefillJob:
    """A queued prefill: ``tokens`` of the request ``msg``, ``done`` of them run so far.

    ``start``: tokens it does not compute (a prefix cache hit restored them; ``done`` begins
    there); ``stops``: token counts, increasing, a step of it must end at (its checkpoints);
    ``prefix``: the copies those ask for (None: none)."""

    msg: "m.RankPrefill | m.RankLocalPrefill"
    key: RequestKey
    page: int
    tokens: tuple[int, ...]
    blocks: tuple[int, ...] = ()
    done: int = 0
    started_at: float = 0.0            # time.monotonic() when its first step began
    start: int = 0
    stops: tuple[int, ...] = ()
    prefix: PrefixPlan | None = None

    def __post_init__(self) -> None:
        self.done = max(self.done, self.start)

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done

    @property
    def begun(self) -> bool:
        """Whether a step ran some of it (a restored job that has not run is new)."""
        return self.done > self.start

    def stop(self, at: int) -> int:
        """Where a step that runs it from token ``at`` ends at the latest: its first stop
        after ``at``, else the end of the prompt."""
        for n in self.stops:
            if n > at:
                return n
        return len(self.tokens)


class PrefillBatcher:
    """Which tokens of which queued prefills the next step runs (no threads, no model).

    Jobs keep their arrival order. A step fills ``budget`` tokens: first the jobs already
    begun (chunked), then new ones in order; with ``chunked`` the job that does not fit is cut
    at the budget (the next step continues it), without it a step takes whole prompts only (a
    prompt over the budget runs alone). A step of a job ends at each of its ``stops`` (a job
    begins at its ``start``). So that a long prompt does not hold back the ones
    behind it, begun jobs take at most half the budget while new jobs wait: a waiting job
    gets at least ``budget // 2`` tokens of the next step, and a short prompt at the head of
    the queue finishes in the step after the one it arrived in.
    ``budget=None``: one whole prompt per step (batching off).
    """

    def __init__(self, budget: int | None, *, chunked: bool) -> None:
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 1):
            raise ConfigError(f"prefill token budget must be a positive integer, got {budget!r}")
        self.budget = budget
        self.chunked = chunked and budget is not None
        self.jobs: list[PrefillJob] = []

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, job: PrefillJob) -> None:
        self.jobs.append(job)

    def drop(self, job: PrefillJob) -> None:
        self.jobs.remove(job)

    def plan(self) -> list[tuple[PrefillJob, int, int]]:
        """The next step: ``(job, start, end)`` token ranges, in job order. Does not change
        the jobs (:meth:`ran` does)."""
        if not self.jobs:
            return []
        if self.budget is None:
            job = self.jobs[0]
            return [(job, job.done, job.stop(job.done))]
        begun = [j for j in self.jobs if j.begun]
        fresh = [j for j in self.jobs if not j.begun]
        room = self.budget
        begun_room = max(1, self.budget // 2) if fresh else self.budget
        step: list[tuple[PrefillJob, int, int]] = []
        for job in begun:
            take = min(job.stop(job.done) - job.done, begun_room, room)
            if take <= 0:
                break
            step.append((job, job.done, job.done + take))
            room -= take
            begun_room -= take
        n_begun = len(step)
        for job in fresh:
            if len(step) >= MAX_STEP_REQUESTS:
                break
            first, end = job.done, job.stop(job.done)
            if end - first <= room:
                step.append((job, first, end))
                room -= end - first
            elif self.chunked and room > 0:
                step.append((job, first, first + room))
                room = 0
            elif not step:                      # whole prompts only: a long one runs alone
                step.append((job, first, end))
                room = 0
            else:
                break
            if room <= 0:
                break
        for i in range(n_begun):                # room the new jobs left: begun ones
            if room <= 0:
                break
            job, start, end = step[i]
            more = min(job.stop(start) - end, room)
            step[i] = (job, start, end + more)
            room -= more
        return step

    def ran(self, step: list[tuple[PrefillJob, int, int]]) -> list[PrefillJob]:
        """``step`` ran: advance its jobs; returns (and forgets) those that are complete."""
        finished = []
        for job, _, end in step:
            job.done = end
            if job.done >= len(job.tokens):
                finished.append(job)
                self.jobs.remove(job)
        return finished


class ComputeThread:
    """Runs ``model`` on its own thread: prefills (:meth:`submit`) and the model's own messages
    (:meth:`submit_model`, :meth:`RankModel.handlers`), in arrival order -- every rank of a group
    sees the same order, which collective ops across ranks need.

    Prefills run in steps of at most ``max_prefill_tokens`` tokens (None: one whole prompt per
    step; see the module docstring).

    Results go back to ``loop``: ``on_computed(msg, error, final_at, started_at)`` for a
    prefill (error None, or why the model failed; when its compute ended and when its first
    step began, ``time.monotonic()``), ``on_reply(reply)`` for a model handler's reply. Both
    run on the loop thread.
    """

    def __init__(self, name: str, model: "RankModel", loop: "EventLoop", counters: "Counters",
                 *, on_computed: Callable, on_reply: Callable[[m.Message], None],
                 max_prefill_tokens: int | None = 2048) -> None:
        self.name = name
        self.chunked = bool(getattr(model, "chunked_prefill", False))
        self.batcher = PrefillBatcher(max_prefill_tokens, chunked=self.chunked)
        self.model = model
        self.loop = loop
        self.counters = counters
        self._on_computed = on_computed
        self._on_reply = on_reply
        self.model_handlers = model.handlers()
        #: Loop thread: requests queued for or on the compute thread -> None, or why they
        #: were cancelled (kind, reason).
        self._computing: dict[RequestKey, tuple[str, str] | None] = {}
        self._owner: int | None = None             # the loop thread, once it used them
        #: What the compute thread may ask: the requests cancelled while queued.
        self._cancelled: set[RequestKey] = set()
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"{name}-compute")
        self._thread.start()

    # -- loop thread ---------------------------------------------------------------------------
    def _check_thread(self) -> None:
        ident = threading.get_ident()
        if ident != self._owner:
            if self._owner is not None:
                raise StatebridgeError(f"{self.name}: compute bookkeeping used from thread "
                                       f"{threading.current_thread().name!r}, not the loop's")
            self._owner = ident

    def __len__(self) -> int:
        return len(self._computing)

    def __contains__(self, key: RequestKey) -> bool:
        self._check_thread()
        return key in self._computing

    def submit(self, msg: "m.RankPrefill | m.RankLocalPrefill") -> None:
        """Queue a prefill; :meth:`finish` of its key when its result comes back."""
        self._check_thread()
        self._computing[key_of(msg)] = None
        self._queue.put(msg)

    def submit_model(self, msg: m.Message) -> None:
        """Queue a message of the model's own (a type in :attr:`model_handlers`)."""
        self._queue.put(msg)

    def cancel(self, key: RequestKey, kind: str, reason: str) -> bool:
        """Cancel ``key`` if it is queued or computing (then True: it is answered when its
        result comes back, and not computed if it has not started)."""
        self._check_thread()
        if key not in self._computing:
            return False
        self._computing[key] = (kind, reason)
        with self._lock:
            self._cancelled.add(key)
        return True

    def finish(self, key: RequestKey) -> tuple[str, str] | None:
        """``key``'s result came back: forget it; why it was cancelled meanwhile, or None."""
        self._check_thread()
        cancelled = self._computing.pop(key, None)
        if cancelled is not None:
            with self._lock:
                self._cancelled.discard(key)
        return cancelled

    def close(self) -> None:
        """Stop the thread after the queued work (it closes the model)."""
        self._queue.put(None)

    # -- compute thread ------------------------------------------------------------------------
    def _was_cancelled(self, key: RequestKey) -> bool:
        with self._lock:
            return key in self._cancelled

    def _main(self) -> None:
        """Model work in arrival order; results go back to the loop.

        Results go back in batches (one loop wake-up each), so a backlog of cheap work (a
        stand-in model) costs one hand-off. Held results go to the loop before the thread
        blocks on an empty queue, before a model message (a decode step is latency-bound),
        after work that took :data:`_RESULT_HOLD_S` or more (the next is likely as slow: a
        real model; so each prefill step's finished requests go out as soon as it ends), and
        once the first held result is that old -- a result waits at most about one cheap item.
        """
        results: list = []
        first_at = took = 0.0
        model_handlers = self.model_handlers
        buffer: collections.deque = collections.deque()   # taken off the queue, in order
        batcher = self.batcher

        def hand_over() -> bool:
            nonlocal results
            try:
                self.loop.call_soon(_run_all, results)
            except StatebridgeError:                      # loop closed
                return False
            results = []
            return True

        def held(callback, args) -> None:
            nonlocal first_at
            if not results:
                first_at = time.perf_counter()
            results.append((callback, args))

        while True:
            idle = not buffer and not batcher and self._queue.empty()
            if results and idle and not hand_over():
                return
            if not buffer and not batcher:
                buffer.append(self._queue.get())
            while True:
                try:
                    buffer.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            msg = buffer[0] if buffer else _NOTHING
            prefill_next = bool(batcher) or _is_prefill(msg)
            model_handler = None if prefill_next or msg is None else model_handlers.get(type(msg))
            if results and (msg is None and not batcher or model_handler is not None
                            or took >= _RESULT_HOLD_S
                            or time.perf_counter() - first_at >= _RESULT_HOLD_S) \
                    and not hand_over():
                return
            started = time.perf_counter()
            if prefill_next:
                for args in self._prefill_step(buffer):
                    held(self._on_computed, args)
            else:
                buffer.popleft()
                if msg is None:
                    self.model.close()
                    return
                reply = None
                try:
                    reply = model_handler(msg)
                except Exception:  # noqa: BLE001 -- the handler's own failure: logged
                    log.exception("%s: %s failed", self.name, type(msg).__name__)
                    self.counters.add("model_handler_errors")
                if reply is not None:
                    held(self._on_reply, (reply,))
            took = time.perf_counter() - started
            self.counters.add("compute_seconds", took)

    def _job(self, msg: "m.RankPrefill | m.RankLocalPrefill") -> PrefillJob | str:
        """The job of a prefill message, or why it cannot run (its request fails)."""
        if isinstance(msg, m.RankPrefill):
            page, blocks, kv_tokens = msg.src_page, msg.src_blocks, msg.kv_tokens
        else:
            page, blocks, kv_tokens = msg.page, msg.blocks, m.token_count(msg.prompt)
        plan = None
        try:
            if blocks:
                check_blocks(self.model.kv, blocks, kv_tokens)
            tokens = tuple(m.unpack_tokens(msg.prompt))
            if isinstance(msg, m.RankPrefill):
                plan = prefix_plan(msg, len(tokens), getattr(self.model, "cache", None),
                                   self.model.kv, chunked=self.chunked)
                if plan is not None:
                    plan.restore(self.model.cache, self.model.kv, page)
        except Exception as e:  # noqa: BLE001 -- a bad request fails alone
            log.warning("%s: %s cannot be computed: %s", self.name, msg.request_id, e)
            return f"prefill failed: {type(e).__name__}: {e}"
        if plan is None:
            return PrefillJob(msg, key_of(msg), page, tokens, tuple(blocks))
        return PrefillJob(msg, key_of(msg), page, tokens, tuple(blocks), start=plan.cached,
                          stops=plan.stops, prefix=plan)

    def _prefill_step(self, buffer: collections.deque) -> list[tuple]:
        """Take the prefills the group agrees on off ``buffer``, run one step; the
        ``on_computed`` arguments of every request it finished or failed, in order."""
        batcher = self.batcher
        avail = 0
        for msg in buffer:
            if not _is_prefill(msg) or len(batcher) + avail >= MAX_STEP_REQUESTS:
                break
            avail += 1
        candidates = [job.key for job in batcher.jobs] + \
                     [key_of(buffer[i]) for i in range(avail)]
        with self._lock:
            flags = [int(key in self._cancelled) for key in candidates]
        # One agreement per step: the fewest new prefills any rank has, and any rank's cancels.
        try:
            agreed = self.model.agree_max(
                [-avail] + flags + [0] * (MAX_STEP_REQUESTS - len(flags)))
        except Exception as e:  # noqa: BLE001 -- the group is broken: nothing can run in step
            log.exception("%s: the ranks could not agree on a prefill step", self.name)
            self.counters.add("prefill_agreement_errors")
            why, now = f"prefill failed: the ranks could not agree: {type(e).__name__}: {e}", \
                time.monotonic()
            out = [(job.msg, why, now, job.started_at or now) for job in batcher.jobs]
            for job in list(batcher.jobs):
                batcher.drop(job)
            out += [(buffer.popleft(), why, now, now) for _ in range(avail)]
            return out
        take = -int(agreed[0])
        cancelled = [bool(x) for x in agreed[1:1 + len(candidates)]]
        out: list[tuple] = []
        now = time.monotonic()
        for job, gone in zip(list(batcher.jobs), cancelled):
            if gone:
                batcher.drop(job)
                out.append((job.msg, _CANCELLED, now, job.started_at or now))
        for i in range(take):
            msg = buffer.popleft()
            if cancelled[len(candidates) - avail + i]:
                out.append((msg, _CANCELLED, now, now))
                continue
            job = self._job(msg)
            if isinstance(job, str):
                out.append((msg, job, now, now))
            else:
                batcher.add(job)
        plan = batcher.plan()
        if not plan:
            return out
        step_at = time.monotonic()
        for job, _, _ in plan:
            if not job.started_at:
                job.started_at = step_at
        chunks = [PrefillChunk(request_id=job.msg.request_id, page=job.page,
                               tokens=job.tokens[start:end], start=start,
                               last=end == len(job.tokens), blocks=job.blocks)
                  for job, start, end in plan]
        try:
            errors = list(self.model.prefill_chunks(chunks))
            if len(errors) != len(chunks):
                raise StatebridgeError(f"prefill_chunks answered {len(errors)} results for "
                                       f"{len(chunks)} chunks")
        except Exception as e:  # noqa: BLE001 -- the step failed: its requests fail
            log.exception("%s: a prefill step of %d requests failed", self.name, len(chunks))
            errors = [f"prefill failed: {type(e).__name__}: {e}"] * len(chunks)
        # CLOCK_MONOTONIC is one clock for every process of the machine: the moment the
        # states are final, compared with the decode ranks' held_at (low-load latency).
        final_at = time.monotonic()
        self.counters.add("prefill_steps")
        self.counters.add("prefill_step_tokens", sum(len(c.tokens) for c in chunks))
        ran = []
        for (job, start, end), error in zip(plan, errors):
            if error is None and job.prefix is not None:
                error = self._checkpoint(job, end)
            if error is None:
                ran.append((job, start, end))
            else:
                batcher.drop(job)
                out.append((job.msg, error, final_at, job.started_at))
        for job in batcher.ran(ran):
            out.append((job.msg, None, final_at, job.started_at))
        return out

    def _checkpoint(self, job: PrefillJob, tokens: int) -> str | None:
        """After a step of ``job`` that ended at ``tokens``: its checkpoint there, if it asked
        for one, complete before this returns; None, or why it failed (its request fails)."""
        try:
            if job.prefix.checkpoint(self.model.cache, self.model.kv, job.page, tokens):
                settle(self.model.cache.buffer)
        except Exception as e:  # noqa: BLE001 -- this request fails alone
            log.exception("%s: the checkpoint of %s at %d tokens failed", self.name,
                          job.msg.request_id, tokens)
            return f"prefill failed: checkpoint at {tokens} tokens: {type(e).__name__}: {e}"
        return None


_NOTHING = object()

#: Why a request cancelled on another rank of the group failed here (the loop answers with
#: its own reason when it heard the cancel too).
_CANCELLED = "cancelled while queued (on a rank of the group)"


def _is_prefill(msg) -> bool:
    return isinstance(msg, (m.RankPrefill, m.RankLocalPrefill))


def _run_all(calls: list) -> None:
    """Run a compute thread's batch of results on the loop, in order; one failing result does
    not drop the others."""
    for fn, args in calls:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 -- logged like the loop's own handlers
            log.exception("handling the result of %r failed", fn)
