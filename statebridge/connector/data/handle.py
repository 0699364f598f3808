"""Transfer handles: one posted transfer of one rank pair, polled or waited by the rank.

Lifecycle::

    post_*() --> PENDING --(every UCX request completed OK [, staged scatter done])--> DONE
                    |
                    +--(a request failed, cancel(), fail_peer(), disconnect(), close())--> FAILED

A handle leaves PENDING exactly once; then :attr:`TransferHandle.error` says why it failed (or is
None) and its staging buffer goes back to the pool. Like its :class:`Transport`, a handle
belongs to the thread that owns the transport.

What a handle asks of its transport is :class:`HandleOwner` (implemented by ``Transport`` in
``transport.py``, which this module does not import): ``_drive(block_s, ready)`` one progress
round, ``_classify(handle, request)`` the error of a failed UCX request, ``_finished(handle,
staging, quiescent)`` the bookkeeping when it leaves flight, and ``_count_failure(kind)``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any, Callable, Protocol

import torch

from statebridge.errors import (
    AbortedError,
    ConfigError,
    TransferError,
    TransferTimeoutError,
)

__all__ = ["HandleOwner", "HandleState", "TransferHandle"]

#: UCX's status of a request that completed successfully (ucs/type/status.h).
UCS_OK = 0


class HandleState(enum.Enum):
    """Where a :class:`TransferHandle` is in its lifecycle."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


# Module aliases: the state checks run once per handle per poll.
_PENDING, _DONE, _FAILED = HandleState.PENDING, HandleState.DONE, HandleState.FAILED


class HandleOwner(Protocol):
    """What a :class:`TransferHandle` calls back into: the transport that posted it."""

    def _drive(self, block_s: float, ready: Callable[[], bool] | None) -> None:
        """One progress round, sleeping up to ``block_s`` unless ``ready()``."""

    def _classify(self, handle: "TransferHandle", request: Any) -> BaseException:
        """The error of ``request``, which completed with a non-OK status."""

    def _finished(self, handle: "TransferHandle", staging: torch.Tensor | None,
                  quiescent: bool) -> None:
        """Bookkeeping when ``handle`` leaves flight (its staging buffer back to the pool)."""

    def _count_failure(self, kind: str) -> None:
        """Count a failure of ``kind`` (e.g. "timeout")."""


@dataclass(slots=True, eq=False, repr=False)
class TransferHandle:
    """One posted transfer of one rank pair: a zero-copy run list or one staged message.

    Pollable: :meth:`done` says whether it is no longer in flight (it progresses the transport
    once, never sleeps); :meth:`finished` says the same without progressing; :meth:`wait`
    returns when it completed and raises when it failed. A staged receive is done only after its
    staging buffer was scattered into the page.
    """

    # The transport it calls back into (progress, error classification, bookkeeping).
    _transport: HandleOwner
    _: KW_ONLY
    direction: str                      # "send" | "recv"
    kind: str                           # "zero_copy" | "staged" | "notice"
    peer_id: str | None
    generation: int
    src_rank: int
    nbytes: int
    messages: int
    request_id: str | None
    requests: InitVar[list]             # the UCX requests, kept as _requests until it finishes
    staging: InitVar[torch.Tensor | None] = None
    on_success: InitVar[Callable[[], None] | None] = None   # e.g. the scatter of a staged recv
    posted_at: float = field(init=False, default_factory=time.monotonic)
    finished_at: float | None = field(init=False, default=None)
    _requests: list = field(init=False)
    _checked: int = field(init=False, default=0)    # requests[:_checked] known complete and OK
    _staging: torch.Tensor | None = field(init=False)
    _on_success: Callable[[], None] | None = field(init=False)
    _state: HandleState = field(init=False, default=HandleState.PENDING)
    _error: BaseException | None = field(init=False, default=None)
    _timed_out: bool = field(init=False, default=False)

    def __post_init__(self, requests: list, staging: torch.Tensor | None,
                      on_success: Callable[[], None] | None) -> None:
        self._requests = requests
        self._staging = staging
        self._on_success = on_success

    # -- public ------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once the transfer completed or failed (then :meth:`wait` returns or raises)."""
        if self._state is not _PENDING:
            return True
        self._transport._drive(0.0, None)
        return self._update()

    def finished(self) -> bool:
        """Like :meth:`done` without progressing UCX: for a caller that checks many handles
        after one :meth:`Transport.progress` (one progress per handle costs O(handles))."""
        if self._state is not _PENDING:
            return True
        reqs = self._requests
        if reqs and not reqs[-1].completed:     # the common "not yet": no loop
            return False
        return self._update()

    def wait(self, timeout: float) -> None:
        """Block until done, at most ``timeout`` seconds.

        Raises :class:`TransferTimeoutError` when still in flight after ``timeout`` (the handle
        stays posted: wait again or :meth:`cancel`), :class:`PeerLostError` when the peer was
        declared lost (or UCX saw it die), :class:`AbortedError` after :meth:`cancel`,
        :class:`ClosedError` after the transport was closed, :class:`TransferError` with the UCX
        error otherwise.
        """
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            raise ConfigError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
        deadline = time.monotonic() + timeout
        while not self._update():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._transport._drive(0.0, None)
                if self._update():
                    break
                self._note_timeout()
                raise TransferTimeoutError(
                    f"{self._describe()} not done after {timeout:g} s "
                    f"({self._checked}/{len(self._requests)} messages confirmed)",
                    request_id=self.request_id, peer=self.peer_id)
            self._transport._drive(min(remaining, 0.05), self._ready)
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Cancel the transfer (idempotent; no effect once done): its UCX requests are
        cancelled and :meth:`wait` raises :class:`AbortedError`. A receive that UCX had
        already matched may still finish writing its bytes."""
        self._fail(AbortedError(f"{self._describe()} cancelled", request_id=self.request_id,
                                peer=self.peer_id))

    @property
    def state(self) -> HandleState:
        return self._state

    @property
    def staged(self) -> bool:
        """Whether the bytes travel through a staging buffer (one message)."""
        return self.kind == "staged"

    @property
    def error(self) -> BaseException | None:
        """The failure once failed, else None."""
        return self._error

    @property
    def ok(self) -> bool:
        """True once completed successfully."""
        return self._state is _DONE

    @property
    def elapsed(self) -> float:
        """Seconds from posting to completion (or until now while in flight)."""
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.posted_at

    def __repr__(self) -> str:
        return (f"TransferHandle({self.direction} peer={self.peer_id!r} gen={self.generation} "
                f"src_rank={self.src_rank} {self.nbytes} B in {self.messages} {self.kind} msg, "
                f"{self._state.value})")

    # -- internals ----------------------------------------------------------------------------
    def _describe(self) -> str:
        peer = f" peer {self.peer_id!r}" if self.peer_id is not None else ""
        rid = f" request {self.request_id!r}" if self.request_id is not None else ""
        return (f"{self.kind.replace('_', '-')} {self.direction} of generation "
                f"{self.generation} src_rank {self.src_rank}{rid}{peer}")

    def _ready(self) -> bool:
        """Whether every UCX request has completed (cheap; no state change)."""
        if self._state is not _PENDING:
            return True
        reqs = self._requests
        i = self._checked
        while i < len(reqs) and reqs[i].completed:
            i += 1
        return i == len(reqs)

    def _update(self) -> bool:
        """Advance the state from the UCX requests; True once no longer in flight."""
        if self._state is not _PENDING:
            return True
        reqs = self._requests
        i = self._checked
        failed = None
        while i < len(reqs) and reqs[i].completed:
            if reqs[i].status != UCS_OK:
                failed = reqs[i]
                break
            i += 1
        self._checked = i
        if failed is not None:
            self._fail(self._transport._classify(self, failed))
            return True
        if i < len(reqs):
            return False
        if self._on_success is not None:
            try:
                self._on_success()
            except Exception as e:  # noqa: BLE001 -- becomes the handle's error
                self._finish(_FAILED, TransferError(
                    f"{self._describe()}: scatter into the page failed: {e}",
                    request_id=self.request_id, peer=self.peer_id), quiescent=True)
                return True
        self._finish(_DONE, None, quiescent=True)
        return True

    def _fail(self, error: BaseException) -> None:
        if self._state is not _PENDING:
            return
        # Dropping ucxx's request objects cancels them (ucp_request_cancel in __dealloc__).
        quiescent = all(r.completed for r in self._requests)
        self._finish(_FAILED, error, quiescent=quiescent)

    def _finish(self, state: HandleState, error: BaseException | None, *,
                quiescent: bool) -> None:
        self._state = state
        self._error = error
        self.finished_at = time.monotonic()
        self._requests = []
        self._on_success = None
        staging, self._staging = self._staging, None
        self._transport._finished(self, staging, quiescent)

    def _note_timeout(self) -> None:
        if not self._timed_out:
            self._timed_out = True
            self._transport._count_failure("timeout")
