"""A rank's compute thread: the model's work in arrival order, results back to the loop in
batches.

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

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable

from statebridge.connector import messages as m
from statebridge.connector.ledger import RequestKey
from statebridge.errors import ConfigError, StatebridgeError
from statebridge.state.kv import blocks_for

if TYPE_CHECKING:
    from statebridge.connector.control import EventLoop
    from statebridge.connector.rank import KVBlocks, RankModel
    from statebridge.connector.stats import Counters

log = logging.getLogger(__name__)

__all__ = ["ComputeThread", "check_blocks", "key_of"]

#: Longest a compute result waits for later ones before the batch goes to the loop.
_RESULT_HOLD_S = 0.0005


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


class ComputeThread:
    """Runs ``model`` on its own thread: prefills (:meth:`submit`) and the model's own messages
    (:meth:`submit_model`, :meth:`RankModel.handlers`), in arrival order -- every rank of a group
    sees the same order, which collective ops across ranks need.

    Results go back to ``loop``: ``on_computed(msg, error, final_at, started_at)`` for a
    prefill (error None, or why the model failed; when its compute ended and began,
    ``time.monotonic()``), ``on_reply(reply)`` for a model handler's reply. Both run on the
    loop thread.
    """

    def __init__(self, name: str, model: "RankModel", loop: "EventLoop", counters: "Counters",
                 *, on_computed: Callable, on_reply: Callable[[m.Message], None]) -> None:
        self.name = name
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
        real model), and once the first held result is that old -- a result waits at most
        about one cheap item.
        """
        results: list = []
        first_at = took = 0.0
        model_handlers = self.model_handlers

        def hand_over() -> bool:
            nonlocal results
            try:
                self.loop.call_soon(_run_all, results)
            except StatebridgeError:                      # loop closed
                return False
            results = []
            return True

        while True:
            if results and self._queue.empty() and not hand_over():
                return
            msg = self._queue.get()
            model_handler = None if msg is None else model_handlers.get(type(msg))
            if results and (msg is None or model_handler is not None or took >= _RESULT_HOLD_S
                            or time.perf_counter() - first_at >= _RESULT_HOLD_S) \
                    and not hand_over():
                return
            if msg is None:
                self.model.close()
                return
            started, started_at = time.perf_counter(), time.monotonic()
            if model_handler is not None:
                reply = None
                try:
                    reply = model_handler(msg)
                except Exception:  # noqa: BLE001 -- the handler's own failure: logged
                    log.exception("%s: %s failed", self.name, type(msg).__name__)
                    self.counters.add("model_handler_errors")
                callback, args = (self._on_reply, (reply,)) if reply is not None else (None, ())
            else:
                error = None
                if not self._was_cancelled(key_of(msg)):      # not cancelled while queued
                    error = self._prefill(msg)
                # CLOCK_MONOTONIC is one clock for every process of the machine: the moment
                # the state is final, compared with the decode ranks' held_at (low-load latency).
                callback, args = self._on_computed, (msg, error, time.monotonic(), started_at)
            took = time.perf_counter() - started
            self.counters.add("compute_seconds", took)
            if callback is not None:
                if not results:
                    first_at = time.perf_counter()
                results.append((callback, args))

    def _prefill(self, msg: "m.RankPrefill | m.RankLocalPrefill") -> str | None:
        """Run the model's prefill of ``msg``; None, or why it failed (the request fails, the
        rank serves on)."""
        if isinstance(msg, m.RankPrefill):
            page, blocks, tokens = msg.src_page, msg.src_blocks, msg.kv_tokens
        else:
            page, blocks, tokens = msg.page, msg.blocks, m.token_count(msg.prompt)
        try:
            if blocks:
                check_blocks(self.model.kv, blocks, tokens)
            self.model.prefill(page, m.unpack_tokens(msg.prompt), msg.request_id, tuple(blocks))
        except Exception as e:  # noqa: BLE001 -- the model failed: the request fails
            log.exception("%s: computing %s failed", self.name, msg.request_id)
            return f"prefill failed: {type(e).__name__}: {e}"
        return None


def _run_all(calls: list) -> None:
    """Run a compute thread's batch of results on the loop, in order; one failing result does
    not drop the others."""
    for fn, args in calls:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 -- logged like the loop's own handlers
            log.exception("handling the result of %r failed", fn)
