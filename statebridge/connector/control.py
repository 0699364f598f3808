"""The zmq control plane: one event loop thread per component, codec-checked messages,
heartbeats, bounded waits.

Topology (every arrow a connection carrying :mod:`~statebridge.connector.messages`)::

    decode rank 0..D-1 --LocalDealer--> decode coordinator (LocalRouter)
                                        decode coordinator --DEALER--> prefill server (ROUTER)
    prefill rank 0..P-1 --LocalDealer---------------------------------> prefill server
                                                                        (LocalRouter)

Between nodes (and for clients) the connections are zmq. A coordinator and its own ranks share
a machine, and their channel is a Unix socket served by the two loop threads themselves
(:mod:`~statebridge.connector.local`: no zmq I/O threads, so a message wakes one thread, not
three); the benchmark's A/B switch ``local_ranks`` (:mod:`statebridge.bench.ab`) puts the
ranks on the zmq ROUTER instead. The send and receive helpers here take either kind of socket.

A component owns its sockets and touches them only from its loop thread (zmq sockets are not
thread-safe); other threads hand work to the loop with :meth:`EventLoop.call_soon`. Every
connection heartbeats; :class:`PeerWatch` declares a peer lost after ``peer_timeout`` seconds of
silence, which is how a SIGKILLed process or a cut link is noticed when UCX error handling is off.
Silence is counted in the watching loop's own running time: a loop that was itself stalled
(stopped by SIGSTOP, a handler that blocked, the GIL held elsewhere) does not blame its peers for
the messages it could not read meanwhile (:meth:`EventLoop.stalls`).
A message that fails to decode is counted, answered with ``Error`` where the sender is known, and
the loop keeps serving.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
import weakref
from typing import Callable

import zmq

from statebridge.connector.frames import (  # noqa: F401  (re-exported: the control plane's API)
    MAX_BATCH_FRAMES,
    _current,
    _frames,
    _NOBLOCK,
    _raw_send,
    _recv_frames,
    _send_frames,
    flush,
    recv_dealer,
    recv_router,
    send_dealer,
    send_router,
    send_router_many,
)
from statebridge.connector.sockets import (  # noqa: F401  (re-exported)
    HandshakeWatch,
    bind_router,
    connect_dealer,
    dial_dealer,
    frame_cap,
    poll_dealer,
    watch_handshake,
)
from statebridge.errors import ClosedError, LoopTimeoutError

__all__ = ["EventLoop", "PeerWatch", "bind_router", "connect_dealer", "flush",
           "dial_dealer", "HandshakeWatch", "watch_handshake", "poll_dealer", "frame_cap",
           "recv_router", "recv_dealer", "send_router", "send_router_many", "send_dealer"]

log = logging.getLogger(__name__)


class EventLoop:
    """A thread that polls zmq sockets, runs timers and thread-safe callbacks."""

    def __init__(self, name: str, context: zmq.Context | None = None) -> None:
        self.name = name
        self.context = context or zmq.Context.instance()
        self._poller = zmq.Poller()
        self._handlers: dict[zmq.Socket, Callable[[], None]] = {}
        self._calls: collections.deque[tuple[Callable, tuple]] = collections.deque()
        self._timers: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()
        self._wake_addr = f"inproc://wake-{name}-{id(self)}"
        self._wake_pull = self.context.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._wake_local = threading.local()
        self._wake_sockets: list[zmq.Socket] = []
        self._wake_lock = threading.Lock()
        self._poller.register(self._wake_pull, zmq.POLLIN)
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.idle_poll: float = 0.05           # seconds to sleep in poll when nothing is due
        self.on_idle: Callable[[], None] | None = None      # called every iteration
        #: Called before the loop sleeps: False, do not sleep now; True, sleep; a number,
        #: sleep at most that many seconds.
        self.before_sleep: Callable[[], "bool | float"] | None = None
        self.slow_handler = 0.25                            # log handlers slower than this
        #: Calls handed to this loop from other threads (call_soon / call): each is a wake-up
        #: and a thread switch; the decode node's per-request path makes none.
        self.handoffs = 0
        # (socket, identity or None) -> messages queued this iteration (see flush): encoded,
        # or (type, row) of a BATCH type (see _frames)
        self._outbox: dict[tuple[zmq.Socket, bytes | None], list] = {}
        #: A gap of at least this many seconds in the loop's own running (beyond the sleep it
        #: asked for) is a stall: its watches do not count it as their peers' silence.
        self.stall_threshold = 0.25
        #: Called with (seconds) on the loop thread after each stall, before any timer runs.
        self.on_stall: list[Callable[[float], None]] = []
        self._watches: "weakref.WeakSet[PeerWatch]" = weakref.WeakSet()
        self._mark = 0.0              # monotonic time the loop last checked for a stall
        #: Stalls seen and their seconds in all (loop thread writes; any thread may read).
        self.stalls = 0
        self.stalled_seconds = 0.0

    # -- registration (loop thread, or before start) ---------------------------------------
    def add_reader(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def add_fd(self, fd: int, handler: Callable[[], None]) -> None:
        """Poll a raw file descriptor (e.g. UCX's epoll fd) beside the sockets."""
        self._handlers[fd] = handler  # type: ignore[index]
        self._poller.register(fd, zmq.POLLIN)

    def watch_fd(self, fd: int, on: bool) -> None:
        """Poll an fd registered with :meth:`add_fd` (``on``), or leave it out of the poll
        until it is turned on again."""
        self._poller.register(fd, zmq.POLLIN if on else 0)

    def remove_reader(self, sock: zmq.Socket) -> None:
        if sock in self._handlers:
            del self._handlers[sock]
            self._poller.unregister(sock)

    def call_later(self, delay: float, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the loop after ``delay`` seconds (loop thread only)."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), fn, args))

    def call_every(self, interval: float, fn: Callable[[], None]) -> None:
        def tick() -> None:
            try:
                fn()
            finally:
                if not self._stop.is_set():
                    self.call_later(interval, tick)
        self.call_later(interval, tick)

    # -- thread-safe ----------------------------------------------------------------------
    def call_soon(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the loop thread soon; safe from any thread."""
        if self._closed:
            raise ClosedError(f"event loop {self.name!r} is closed")
        self._calls.append((fn, args))
        if threading.current_thread() is not self._thread:
            self.handoffs += 1
        self.wake()

    def call(self, fn: Callable, *args, timeout: float = 10.0):
        """Run ``fn(*args)`` on the loop and wait for its result (not from the loop thread)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        done = threading.Event()
        box: dict[str, object] = {}

        def run() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # handed back to the caller
                box["error"] = e
            finally:
                done.set()
        self.call_soon(run)
        if not done.wait(timeout):
            raise LoopTimeoutError(f"event loop {self.name!r} did not run {fn!r} within "
                                   f"{timeout} s")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("value")

    def wake(self) -> None:
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._wake_addr)
            self._wake_local.sock = sock
            with self._wake_lock:
                self._wake_sockets.append(sock)
        try:
            _raw_send(sock, b"", _NOBLOCK)
        except zmq.Again:
            pass

    # -- running --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"statebridge-{self.name}",
                                        daemon=True)
        self._thread.start()

    def run(self) -> None:
        _current.loop = self
        try:
            self._run()
        finally:
            self.flush()
            _current.loop = None

    def flush(self, sock: zmq.Socket | None = None) -> None:
        """Send the queued messages (of ``sock`` only, if given): one multipart zmq message per
        destination, at most :data:`MAX_BATCH_FRAMES` messages each. Loop thread only."""
        if not self._outbox:
            return
        keys = list(self._outbox) if sock is None else [k for k in self._outbox if k[0] is sock]
        for key in keys:
            frames = _frames(self._outbox.pop(key), self.name)
            s, identity = key
            for i in range(0, len(frames), MAX_BATCH_FRAMES):
                chunk = frames[i:i + MAX_BATCH_FRAMES]
                try:
                    _send_frames(s, chunk if identity is None else [identity, *chunk])
                except zmq.Again:
                    log.warning("%s: dropped %d message(s) to %r: queue full", self.name,
                                len(chunk), identity)
                except zmq.ZMQError as e:           # socket closed meanwhile
                    log.debug("%s: dropped %d queued message(s): %s", self.name, len(chunk), e)

    def _stalled(self, now: float, allowed: float) -> None:
        """The loop runs again at ``now``; it meant to be away at most ``allowed`` seconds
        (a poll's timeout) since its last check. A longer gap is a stall (see
        :attr:`stall_threshold`): every :class:`PeerWatch` of this loop forgives it, then the
        :attr:`on_stall` callbacks run."""
        gap = now - self._mark - allowed
        self._mark = now
        if gap < self.stall_threshold:
            return
        self.stalls += 1
        self.stalled_seconds += gap
        log.log(logging.WARNING if gap >= 1.0 else logging.DEBUG,
                "%s: the loop stalled for %.2f s (process stopped, or a handler or another "
                "thread held it); peers' silence meanwhile is not counted", self.name, gap)
        for watch in list(self._watches):
            watch.forgive(gap)
        for fn in list(self.on_stall):
            self._guard(fn, gap)

    def _run(self) -> None:
        self._mark = time.monotonic()
        while not self._stop.is_set():
            self.flush()
            now = time.monotonic()
            self._stalled(now, 0.0)
            timeout = self.idle_poll
            if self._timers:
                timeout = min(timeout, max(0.0, self._timers[0][0] - now))
            if self._calls:
                timeout = 0.0
            if timeout > 0 and self.before_sleep is not None:
                cap = self.before_sleep()
                if cap is False:
                    timeout = 0.0
                elif cap is not True:
                    timeout = min(timeout, cap)
            try:
                events = dict(self._poller.poll(int(timeout * 1000) if timeout >= 0.001 else
                                                (0 if timeout == 0 else 1)))
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    break
                log.error("%s: poll failed: %s", self.name, e)
                continue
            # (A process stopped while it slept shows up here, before its input is read.)
            self._stalled(time.monotonic(), max(timeout, 0.001))
            if self._wake_pull in events:
                while _recv_frames(self._wake_pull) is not None:
                    pass
            for sock, handler in list(self._handlers.items()):
                if sock in events:
                    self._guard(handler)
            while self._calls:
                fn, args = self._calls.popleft()
                self._guard(fn, *args)
            now = time.monotonic()
            self._stalled(now, 0.0)              # a handler blocked: before any watch expires
            while self._timers and self._timers[0][0] <= now:
                _, _, fn, args = heapq.heappop(self._timers)
                self._guard(fn, *args)
            if self.on_idle is not None:
                self._guard(self.on_idle)

    def _guard(self, fn: Callable, *args) -> None:
        start = time.monotonic()
        try:
            fn(*args)
        except Exception:  # one bad handler must not kill the loop
            log.exception("%s: handler %r failed", self.name, fn)
        took = time.monotonic() - start
        if took > self.slow_handler:
            log.warning("%s: handler %s took %.3f s (heartbeats stall meanwhile)", self.name,
                        getattr(fn, "__qualname__", fn), took)

    def request_stop(self) -> None:
        """Ask the loop to end after this iteration (safe from the loop thread itself)."""
        self._stop.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop thread (idempotent)."""
        self._stop.set()
        if self._closed:
            return
        try:
            self.wake()
        except zmq.ZMQError:
            pass
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._closed = True
        with self._wake_lock:
            for sock in self._wake_sockets:
                sock.close(0)
            self._wake_sockets.clear()
        self._wake_pull.close(0)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class PeerWatch:
    """Last-heard times of peers; reports the ones silent for longer than ``timeout``.

    With ``loop`` (the :class:`EventLoop` that reads the peers' messages) silence is counted in
    that loop's running time: a stall of the loop (:meth:`EventLoop._stalled`) is forgiven, so
    a process that was stopped, or whose loop was blocked, does not declare its peers lost for
    the messages it could not read meanwhile. A peer that really died is declared lost after
    ``timeout`` seconds of the loop running."""

    def __init__(self, timeout: float, loop: EventLoop | None = None) -> None:
        self.timeout = timeout
        self._seen: dict[object, float] = {}
        if loop is not None:
            loop._watches.add(self)

    def forgive(self, seconds: float) -> None:
        """Do not count the last ``seconds`` as anyone's silence (the watcher was away)."""
        now = time.monotonic()
        for peer, t in self._seen.items():
            self._seen[peer] = min(now, t + seconds)

    def heard(self, peer: object) -> None:
        self._seen[peer] = time.monotonic()

    def forget(self, peer: object) -> None:
        self._seen.pop(peer, None)

    def __contains__(self, peer: object) -> bool:
        return peer in self._seen

    def expired(self) -> list[object]:
        limit = time.monotonic() - self.timeout
        lost = [p for p, t in self._seen.items() if t < limit]
        for p in lost:
            del self._seen[p]
        return lost
