"""The zmq control plane: one event loop thread per component, codec-checked messages,
heartbeats, bounded waits.

Topology (every arrow a zmq connection carrying :mod:`~statebridge.connector.messages`)::

    decode rank 0..D-1 --DEALER--> decode coordinator (ROUTER)
                                   decode coordinator --DEALER--> prefill server (ROUTER)
    prefill rank 0..P-1 --DEALER----------------------------------> prefill server (ROUTER)

A component owns its sockets and touches them only from its loop thread (zmq sockets are not
thread-safe); other threads hand work to the loop with :meth:`EventLoop.call_soon`. Every
connection heartbeats; :class:`PeerWatch` declares a peer lost after ``peer_timeout`` seconds of
silence, which is how a SIGKILLed process or a cut link is noticed when UCX error handling is off.
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
from typing import Callable

import zmq

from statebridge.connector import messages as m
from statebridge.errors import ClosedError, ProtocolError

__all__ = ["EventLoop", "PeerWatch", "Counters", "bind_router", "connect_dealer"]

log = logging.getLogger(__name__)


class Counters:
    """Thread-safe named counters (failures by kind, messages, bytes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: collections.Counter[str] = collections.Counter()

    def add(self, name: str, value: int | float = 1) -> None:
        with self._lock:
            self._values[name] += value

    def get(self, name: str) -> int | float:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._values)


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
        self.busy_check: Callable[[], bool] | None = None   # when true, poll without sleeping long
        self.on_idle: Callable[[], None] | None = None      # called every iteration
        self.before_sleep: Callable[[], bool] | None = None  # False: not safe to sleep now
        self.slow_handler = 0.25                            # log handlers slower than this

    # -- registration (loop thread, or before start) ---------------------------------------
    def add_reader(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def add_fd(self, fd: int, handler: Callable[[], None]) -> None:
        """Poll a raw file descriptor (e.g. UCX's epoll fd) beside the sockets."""
        self._handlers[fd] = handler  # type: ignore[index]
        self._poller.register(fd, zmq.POLLIN)

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
            raise TimeoutError(f"event loop {self.name!r} did not run {fn!r} within {timeout} s")
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
            sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass

    # -- running --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"statebridge-{self.name}",
                                        daemon=True)
        self._thread.start()

    def run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = self.idle_poll
            if self._timers:
                timeout = min(timeout, max(0.0, self._timers[0][0] - now))
            if self._calls or (self.busy_check is not None and self.busy_check()):
                timeout = 0.0 if self._calls else min(timeout, 0.0005)
            if timeout > 0 and self.before_sleep is not None and not self.before_sleep():
                timeout = 0.0
            try:
                events = dict(self._poller.poll(int(timeout * 1000) if timeout >= 0.001 else
                                                (0 if timeout == 0 else 1)))
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    break
                log.error("%s: poll failed: %s", self.name, e)
                continue
            if self._wake_pull in events:
                while True:
                    try:
                        self._wake_pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            for sock, handler in list(self._handlers.items()):
                if sock in events:
                    self._guard(handler)
            while self._calls:
                fn, args = self._calls.popleft()
                self._guard(fn, *args)
            now = time.monotonic()
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
    """Last-heard times of peers; reports the ones silent for longer than ``timeout``."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._seen: dict[object, float] = {}

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


def bind_router(context: zmq.Context, host: str, port: int = 0) -> tuple[zmq.Socket, int]:
    """A ROUTER bound to ``host:port`` (0 picks a free port); returns (socket, port)."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, port


def connect_dealer(context: zmq.Context, address: str, identity: bytes | None = None) -> zmq.Socket:
    """A DEALER connected to ``host:port`` (``tcp://`` added when missing)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if not address.startswith(("tcp://", "ipc://", "inproc://")):
        address = f"tcp://{address}"
    sock.connect(address)
    return sock


def recv_router(sock: zmq.Socket, max_bytes: int) -> tuple[bytes, m.Message | ProtocolError] | None:
    """One ROUTER message as (identity, message or the ProtocolError it raised)."""
    try:
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
    except zmq.Again:
        return None
    if len(frames) != 2:
        return (frames[0] if frames else b""), ProtocolError(
            f"expected 2 frames (identity, message), got {len(frames)}")
    try:
        return frames[0], m.decode(frames[1], max_bytes=max_bytes)
    except ProtocolError as e:
        return frames[0], e


def recv_dealer(sock: zmq.Socket, max_bytes: int) -> m.Message | ProtocolError | None:
    try:
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
    except zmq.Again:
        return None
    if len(frames) != 1:
        return ProtocolError(f"expected 1 frame, got {len(frames)}")
    try:
        return m.decode(frames[0], max_bytes=max_bytes)
    except ProtocolError as e:
        return e


def send_router(sock: zmq.Socket, identity: bytes, message: m.Message) -> None:
    try:
        sock.send_multipart([identity, m.encode(message)], zmq.NOBLOCK)
    except zmq.Again:
        log.warning("dropped %s to %r: peer queue full", type(message).__name__, identity)


def send_dealer(sock: zmq.Socket, message: m.Message) -> None:
    try:
        sock.send(m.encode(message), zmq.NOBLOCK)
    except zmq.Again:
        log.warning("dropped %s: queue full", type(message).__name__)
