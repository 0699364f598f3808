"""The HTTP server's link to the decode node in its process: front-door messages in through the
node loop's thread-safe inbox, answers moved to the server's event loop."""

from __future__ import annotations

import asyncio
import collections
import logging

from statebridge.connector import messages as m
from statebridge.errors import ClosedError, FailureKind, ProtocolError, StatebridgeError
from statebridge.node import messages as nm
from statebridge.node.http.errors import ApiError

log = logging.getLogger(__name__)

__all__ = ["NodeLink", "NodeStream"]


class NodeLink:
    """The HTTP side's link to the decode node in this process: a front-door client of it.

    Messages go in through ``node.post(self, message)`` (any thread; the node's loop inbox).
    The node answers through :meth:`deliver` on its loop thread; the answers are moved to the
    server's event loop in one ``call_soon_threadsafe`` per batch and routed there: token
    messages to their request's queue by request id, NodeStats to the oldest stats query.
    ``node`` is anything with ``post(client, message)``, e.g. a
    :class:`~statebridge.node.decode_node.DecodeNode`."""

    def __init__(self, node, *, name: str = "decode node") -> None:
        self.node = node
        self.name = name
        self._streams: dict[str, asyncio.Queue] = {}
        self._queries: collections.deque[asyncio.Future] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Answers from the node's loop thread, waiting for the server's loop. Only the node's
        # loop thread appends; _drain clears _scheduled BEFORE it empties the deque, so an
        # answer appended after the drain started either is taken by it or schedules the next.
        self._inbox: collections.deque[m.Message] = collections.deque()
        self._scheduled = False
        self._closed = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._inbox.clear()
        self._scheduled = self._closed = False

    async def close(self) -> None:
        """Abort at the node every request still open here; later answers are dropped."""
        self._closed = True
        for request_id, queue in self._streams.items():
            self.send(nm.AbortRequest(request_id=request_id, reason="HTTP server closing"))
            queue.put_nowait(self._closing(request_id))
        self._streams.clear()
        for waiter in self._queries:
            waiter.cancel()
        self._queries.clear()

    def send(self, message: m.Message) -> bool:
        """Hand ``message`` to the node now (never waits); False when the node is closed.
        Safe in a ``finally`` of a cancelled task."""
        try:
            self.node.post(self, message)
        except StatebridgeError as e:           # ClosedError: the node's loop is gone
            log.debug("%s: %s not delivered: %s", self.name, type(message).__name__, e)
            return False
        return True

    def deliver(self, message: m.Message) -> None:
        """The node's answer, on the node's loop thread (never blocks)."""
        if self._closed or self._loop is None:
            return
        self._inbox.append(message)
        if self._scheduled:
            return
        self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:                    # the server's loop closed meanwhile
            self._closed = True

    def _drain(self) -> None:
        self._scheduled = False
        inbox = self._inbox
        while inbox:
            msg = inbox.popleft()
            if isinstance(msg, nm.GenerateTokens):
                queue = self._streams.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(msg)
            elif isinstance(msg, (nm.NodeStats, m.Error)):
                while self._queries:
                    waiter = self._queries.popleft()
                    if waiter.done():
                        continue
                    if isinstance(msg, m.Error):
                        waiter.set_exception(ProtocolError(
                            f"{self.name}: {msg.kind}: {msg.message}"))
                    else:
                        waiter.set_result(msg)
                    break

    async def stats(self, timeout: float) -> nm.NodeStats:
        """The node's NodeStats; asyncio.TimeoutError when it does not answer in time,
        ClosedError when it is closed."""
        waiter = asyncio.get_running_loop().create_future()
        self._queries.append(waiter)
        if not self.send(nm.StatsQuery(client="http")):
            self._queries.remove(waiter)
            raise ClosedError(f"{self.name} is closed")
        return await asyncio.wait_for(waiter, timeout)

    def open(self, request: nm.GenerateRequest) -> "NodeStream":
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = queue
        if self._closed or not self.send(request):
            queue.put_nowait(self._closing(request.request_id))
        return NodeStream(self, request.request_id, queue)

    def _closing(self, request_id: str) -> nm.GenerateTokens:
        """The last message of a request that the node cannot answer any more."""
        return nm.GenerateTokens(request_id=request_id, tokens=(), done=True,
                                 kind=str(FailureKind.CLOSED), message=f"{self.name} is closed",
                                 ttft=0.0, transfer_seconds=0.0, transfer_bytes=0,
                                 recomputed=False)


class NodeStream:
    """One request's GenerateTokens messages; :meth:`close` aborts it at the node unless the
    node already said done."""

    def __init__(self, link: NodeLink, request_id: str, queue: asyncio.Queue) -> None:
        self.link, self.request_id, self.queue = link, request_id, queue
        self.done = False

    async def next(self, timeout: float) -> nm.GenerateTokens:
        try:
            # (Already there -- tokens come in steps, often ahead of the reader -- no task.)
            msg = self.queue.get_nowait() if not self.queue.empty() else \
                await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise ApiError(503, f"{self.link.name} sent nothing for {timeout} s",
                           "service_unavailable_error", retry_after=1.0) from None
        if msg.done:
            self.done = True
        return msg

    def close(self, reason: str = "") -> None:
        self.link._streams.pop(self.request_id, None)
        if not self.done:
            self.done = True
            self.link.send(nm.AbortRequest(request_id=self.request_id, reason=reason))
