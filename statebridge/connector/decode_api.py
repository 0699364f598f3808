"""The decode coordinator's thread-safe request API: each call is one hand-off to the
coordinator's loop thread, where :meth:`~statebridge.connector.decode.DecodeCoordinator.start`,
``free`` and ``cancel`` run; results come back as futures (a
:class:`~statebridge.connector.decode.TransferResult`, or a typed error).

:class:`ThreadSafeRequests` is a part of
:class:`~statebridge.connector.decode.DecodeCoordinator` (its base class).
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Sequence

from statebridge.connector import messages as m
from statebridge.errors import InvalidRequestError

if TYPE_CHECKING:
    from statebridge.connector.decode import OnDone, TransferResult
    from statebridge.errors import TransferError

__all__ = ["ThreadSafeRequests"]


class ThreadSafeRequests:
    """Futures over the coordinator's loop-thread calls (module docstring)."""

    def submit(self, request_id: str, prompt: Sequence[int], *,
               prefill: str | None = None) -> concurrent.futures.Future:
        """:meth:`start` from any thread; the future resolves to a :class:`TransferResult` or
        a typed error. Refusals raise here (one thread hand-off)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        prompt = _packed(request_id, prompt)
        self.loop.call(lambda: self._start(request_id, prompt, _resolver(future),
                                           prefill=prefill))
        return future

    def submit_local(self, request_id: str, prompt: Sequence[int]) -> concurrent.futures.Future:
        """Compute the state of ``prompt`` on the decode ranks themselves (the ``recompute``
        policy when a transfer failed); resolves like :meth:`submit`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        prompt = _packed(request_id, prompt)
        self.loop.call(lambda: self._start(request_id, prompt, _resolver(future), local=True))
        return future

    def abort(self, request_id: str, reason: str = "aborted by caller") -> None:
        """Abort a request in flight: its future fails with AbortedError."""
        self.loop.call(self.cancel, request_id, reason)

    def release(self, result: "TransferResult | str") -> None:
        """The caller is done with a completed request's page."""
        self.release_many([result])

    def release_many(self, results: Sequence["TransferResult | str"]) -> None:
        """:meth:`release` for many completed requests in one hop to the loop thread; raises
        InvalidRequestError naming the ids that were not completed requests (the others are
        freed)."""
        ids = [r if isinstance(r, str) else r.request_id for r in results]

        def run() -> None:
            unknown = [rid for rid in ids if not self.free(rid)]
            if unknown:
                raise InvalidRequestError(
                    f"no completed request {unknown[:5]!r}"
                    f"{f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else ''} to release")
        if ids:
            self.loop.call(run)

def _resolver(future: concurrent.futures.Future) -> OnDone:
    def on_done(result: "TransferResult | None", error: "TransferError | None") -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    return on_done


def _packed(request_id: str, prompt: Sequence[int]) -> bytes:
    """A caller's prompt as token bytes (:func:`~statebridge.connector.messages.pack_tokens`),
    or InvalidRequestError naming the request and the first bad id."""
    try:
        return m.pack_tokens(prompt)
    except ValueError as e:
        raise InvalidRequestError(f"prompt of {request_id!r}: {e}",
                                  request_id=str(request_id)) from None
