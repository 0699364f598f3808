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
from typing import TYPE_CHECKING, Callable, Sequence

import zmq

from statebridge.connector import messages as m
from statebridge.connector.local import LocalChannel, LocalDealer, LocalRouter
from statebridge.connector.stats import Counters, ops
from statebridge.errors import (
    AuthenticationError,
    ClosedError,
    ConfigError,
    LoopTimeoutError,
    ProtocolError,
)

if TYPE_CHECKING:
    from statebridge.security import CurveKeys

__all__ = ["EventLoop", "PeerWatch", "bind_router", "connect_dealer", "flush",
           "dial_dealer", "HandshakeWatch", "watch_handshake", "poll_dealer"]

log = logging.getLogger(__name__)
_current = threading.local()        # .loop: the EventLoop running on this thread


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


_WILDCARDS = ("0.0.0.0", "::", "[::]", "*")


def _tcp_host(host: str) -> str:
    """``host`` as it goes into a ``tcp://`` endpoint (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def frame_cap(max_message_bytes: int) -> int:
    """Hard cap on one inbound zmq frame: 4x the message limit (at least 1 MiB more), so an
    absurd frame is never buffered whole, while a merely oversized one still gets an answer."""
    return 4 * max_message_bytes + (1 << 20)


def bind_router(context: zmq.Context, host: str, port: int = 0, *,
                keys: "CurveKeys | None" = None, counters: Counters | None = None,
                name: str = "", max_message_bytes: int | None = None) -> tuple[zmq.Socket, int]:
    """A ROUTER bound to ``host:port`` (0 picks a free port); returns (socket, port).

    With ``keys`` the socket is a CURVE server admitting only the public keys of
    ``keys.keys_dir`` (:func:`statebridge.security.secure_server`); refused handshakes are
    counted in ``counters`` as ``auth_refused``. Binding every interface logs a warning.
    With ``max_message_bytes`` a frame over :func:`frame_cap` of it makes zmq drop the
    connection before buffering it (frames between the limit and the cap are answered with a
    typed ``Error`` by the receiver's decode).
    """
    sock = context.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if max_message_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, frame_cap(max_message_bytes))
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        if keys is not None:
            from statebridge.security import secure_server

            secure_server(sock, keys, counters=counters, name=name)
        endpoint = f"tcp://{_tcp_host(host)}"
        if port:
            sock.bind(f"{endpoint}:{port}")
        else:
            port = sock.bind_to_random_port(endpoint)
    except zmq.ZMQError as e:
        sock.close(0)
        raise ConfigError(f"cannot bind a control socket to {host}:{port}: {e}") from None
    except BaseException:
        sock.close(0)
        raise
    if host in _WILDCARDS:
        if keys is None:
            log.warning("%s listens on ALL interfaces (%s:%d) WITHOUT AUTHENTICATION: anyone who "
                        "can reach this port can drive the node; create keys with `statebridge "
                        "keygen DIR` and pass --keys DIR, or bind one address with --host",
                        name or "control socket", host, port)
        else:
            log.warning("%s listens on all interfaces (%s:%d); CURVE authentication is on "
                        "(keys %s)", name or "control socket", host, port, keys.keys_dir)
    return sock, port


def connect_dealer(context: zmq.Context, address: str, identity: bytes | None = None, *,
                   keys: "CurveKeys | None" = None) -> zmq.Socket:
    """A DEALER connected to ``host:port`` (``tcp://`` added when missing); with ``keys`` a
    CURVE client holding ``keys``' own pair and the server public key. A wildcard host
    (``0.0.0.0``, ``::``) means this machine's loopback."""
    return _dealer(context, address, identity, keys, watch=False)[0]


def dial_dealer(context: zmq.Context, address: str, identity: bytes | None = None, *,
                keys: "CurveKeys | None" = None) -> tuple[zmq.Socket, "HandshakeWatch"]:
    """:func:`connect_dealer` plus a :class:`HandshakeWatch` attached before it connects, so no
    handshake event is missed."""
    sock, watch = _dealer(context, address, identity, keys, watch=True)
    assert watch is not None
    return sock, watch


def _dealer(context: zmq.Context, address: str, identity: bytes | None,
            keys: "CurveKeys | None", watch: bool) -> tuple[zmq.Socket, "HandshakeWatch | None"]:
    sock = context.socket(zmq.DEALER)
    handshake: HandshakeWatch | None = None
    given = address
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if keys is not None:
            from statebridge.security import secure_client

            secure_client(sock, keys)
        if not address.startswith(("tcp://", "ipc://", "inproc://")):
            host, sep, port = address.rpartition(":")
            if sep and host:
                host = {"0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "::1",
                        "[::]": "::1"}.get(host, host)
                if ":" in host:
                    sock.setsockopt(zmq.IPV6, 1)
                address = f"{_tcp_host(host)}:{port}"
            address = f"tcp://{address}"
        elif address.startswith("tcp://[") or address.count(":") > 2:
            sock.setsockopt(zmq.IPV6, 1)
        if watch:
            handshake = HandshakeWatch(sock, given, keyed=keys is not None)
        sock.connect(address)
    except zmq.ZMQError as e:
        if handshake is not None:
            handshake.close()
        sock.close(0)
        raise ConfigError(f"cannot connect a control socket to {address!r}: {e}") from None
    except BaseException:
        if handshake is not None:
            handshake.close()
        sock.close(0)
        raise
    return sock, handshake


# Why a dialer's handshake failed, by monitor event and by whether the dialer holds keys.
_HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: (
        "authentication refused: the server does not accept our public key (copy our NAME.key "
        "into the server's keys directory)",) * 2,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: (
        "authentication mismatch: the server requires CURVE keys and we have none (pass --keys "
        "DIR / set keys_dir)",
        "authentication mismatch: we use CURVE keys and the server has none (start it with "
        "--keys DIR), or it speaks another protocol"),
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: (
        "the server dropped the handshake: it probably requires CURVE keys and we have none "
        "(pass --keys DIR / set keys_dir)",
        "the server dropped the handshake: our server.key probably does not match the server's "
        "key pair (authentication)"),
}


class HandshakeWatch:
    """The socket monitor of one dialing socket, turning a failed zmq handshake into an
    :class:`~statebridge.errors.AuthenticationError` as soon as libzmq reports it (instead of a
    timeout). It ends itself on the first handshake that succeeds or fails; :meth:`close` is
    idempotent. Poll :attr:`socket` for readability, then call :meth:`check`. Attach it before
    the socket connects (:func:`dial_dealer` does): events before that are not seen."""

    def __init__(self, sock: zmq.Socket, address: str, *, keyed: bool) -> None:
        self.address = address
        self.keyed = keyed
        self._sock = sock
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_MONITOR_STOPPED
        for event in _HANDSHAKE_FAILURES:
            events |= event
        self.socket: zmq.Socket | None = sock.get_monitor_socket(events)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.succeeded = False

    def check(self) -> None:
        """Read pending events: raise AuthenticationError on a failed handshake."""
        from zmq.utils.monitor import parse_monitor_message

        while self.socket is not None:
            try:
                event = parse_monitor_message(self.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            except zmq.ZMQError:        # the watched socket or the context went away
                self.close()
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.succeeded = True
                self.close()
            elif kind in _HANDSHAKE_FAILURES:
                self.close()
                raise AuthenticationError(
                    f"handshake with {self.address} failed: "
                    f"{_HANDSHAKE_FAILURES[kind][int(self.keyed)]}", peer=self.address)
            elif kind == zmq.EVENT_MONITOR_STOPPED:
                self.close()

    def close(self) -> None:
        if self.socket is None:
            return
        monitor, self.socket = self.socket, None
        if not self._sock.closed:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
        monitor.close(0)


def watch_handshake(loop: EventLoop, watch: HandshakeWatch,
                    on_failure: Callable[[AuthenticationError], None]) -> None:
    """Call ``on_failure(error)`` on ``loop`` when the handshake ``watch`` follows fails (loop
    thread only). The watch leaves the loop after the first success or failure, or when its
    socket closes."""
    monitor = watch.socket
    if monitor is None:
        return

    def on_event() -> None:
        try:
            watch.check()
        except AuthenticationError as e:
            on_failure(e)
        finally:
            if watch.socket is None:
                loop.remove_reader(monitor)
    loop.add_reader(monitor, on_event)


def poll_dealer(sock: zmq.Socket, watch: HandshakeWatch | None, timeout: float,
                flags: int = zmq.POLLIN) -> bool:
    """Wait up to ``timeout`` seconds for ``sock`` to be readable (``flags``: or writable);
    AuthenticationError as soon as ``watch`` reports a failed handshake. (A DEALER whose
    handshake failed has no peer: a blocking send on it would wait forever.)"""
    deadline = time.monotonic() + timeout
    while True:
        if watch is not None:
            watch.check()
        if watch is None or watch.socket is None:
            return bool(sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), flags))
        poller = zmq.Poller()
        poller.register(sock, flags)
        poller.register(watch.socket, zmq.POLLIN)
        events = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
        if sock in events:
            return True
        if watch.socket not in events and time.monotonic() >= deadline:
            return False


# A sender's loop coalesces the messages it sends to one destination in one loop iteration
# into one multipart zmq message (one frame per message; ROUTER: identity first). Receivers
# hand them out one at a time; the frames left over wait here, per socket.
MAX_BATCH_FRAMES = 1024
_leftover: "weakref.WeakKeyDictionary[zmq.Socket, collections.deque]" = weakref.WeakKeyDictionary()


# pyzmq's Python layer (send, send_multipart, recv_multipart) spends time on every call turning
# flags into enums; the loops below call its backend with plain int flags (same semantics:
# a multipart message is accepted or refused as a whole on its first frame).
_raw_send = zmq.backend.Socket.send
_raw_recv = zmq.backend.Socket.recv
_raw_get = zmq.backend.Socket.get
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_LOCAL = (LocalRouter, LocalDealer)
_count = ops.add              # the process's control_sent / control_received (connector.stats)


def _send_frames(sock: "zmq.Socket | LocalChannel", frames: list) -> None:
    """Send ``frames`` as one zmq message without blocking (zmq.Again when the peer's queue
    is full). A :class:`~statebridge.connector.local.LocalChannel` takes them itself."""
    if type(sock) in _LOCAL:
        sock.send_frames(frames)
        return
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _raw_send(sock, frame, _NOBLOCK if i == last else _MORE_NOBLOCK)


def _recv_frames(sock: zmq.Socket) -> list | None:
    """The frames of the next zmq message (bytes); None when none is waiting. (Asking
    ZMQ_EVENTS first: a recv that finds nothing raises zmq.Again, and building that exception
    costs more than the question -- every drain of a socket ends with one.)"""
    if type(sock) in _LOCAL:
        return sock.recv_frames()
    if not _raw_get(sock, _EVENTS) & _POLLIN:
        return None
    try:
        frames = [_raw_recv(sock, _NOBLOCK)]
    except zmq.Again:
        return None
    while _raw_get(sock, _RCVMORE):
        frames.append(_raw_recv(sock, _NOBLOCK))
    return frames


def _decode_batch(frames: list, max_bytes: int) -> list:
    if not frames:
        return [ProtocolError("empty zmq message (no message frame)")]
    if len(frames) > MAX_BATCH_FRAMES:
        return [ProtocolError(f"{len(frames)} message frames in one zmq message; at most "
                              f"{MAX_BATCH_FRAMES}")]
    out: list = []
    for frame in frames:
        try:
            out.extend(m.decode_frame(frame, max_bytes=max_bytes))
        except ProtocolError as e:
            out.append(e)
    _count("control_received", len(out))
    return out


#: A row batch (see :func:`_frames`) is split until its frame is at most this long (or holds
#: one message): well under any receiver's ``max_message_bytes`` (64 KiB in the fuzz tests).
BATCH_FRAME_BYTES = 32 * 1024


def _frames(items: list, name: str = "") -> list[bytes]:
    """The frames of an outbox's queued items, in order: encoded messages as they are, and
    each run of consecutive rows of one :attr:`~statebridge.connector.messages.Message.BATCH`
    type as one row batch (``(type, row)`` items, see :func:`send_router_many`). A row that
    msgpack cannot pack (a field out of its range) is logged and dropped, the others leave."""
    try:
        return _batched(items)
    except Exception:  # noqa: BLE001 -- find the bad row; never let flush kill the loop
        out = []
        for item in items:
            try:
                out.append(item if type(item) is bytes else m.encode_rows(item[0], [item[1]]))
            except Exception as e:  # noqa: BLE001
                log.error("%s: dropped a %s that cannot be encoded: %s", name,
                          item[0].__name__, e)
        return out


def _batched(items: list) -> list[bytes]:
    out: list[bytes] = []
    i, n = 0, len(items)
    while i < n:
        item = items[i]
        if type(item) is bytes:
            out.append(item)
            i += 1
            continue
        cls = item[0]
        j = i + 1
        while j < n and j - i < m.MAX_BATCH_ROWS and type(items[j]) is tuple \
                and items[j][0] is cls:
            j += 1
        _pack_rows(cls, [row for _, row in items[i:j]], out)
        i = j
    return out


def _pack_rows(cls: type, rows: list, out: list[bytes]) -> None:
    frame = m.encode_rows(cls, rows)
    if len(frame) <= BATCH_FRAME_BYTES or len(rows) == 1:
        out.append(frame)
        return
    half = len(rows) // 2
    _pack_rows(cls, rows[:half], out)
    _pack_rows(cls, rows[half:], out)


def _next(sock: zmq.Socket) -> "tuple[object | None, list | None]":
    """(a message left over from an earlier batch, None) or (None, the next zmq message's
    frames, None when nothing is waiting)."""
    left = _leftover.get(sock)
    if left:
        return left.popleft(), None
    return None, _recv_frames(sock)


def _hand_out(sock: zmq.Socket, items: list):
    """The first of a batch's items; the rest wait in the socket's leftovers."""
    if len(items) > 1:
        _leftover.setdefault(sock, collections.deque()).extend(items[1:])
    return items[0]


def recv_router(sock: zmq.Socket, max_bytes: int) -> tuple[bytes, m.Message | ProtocolError] | None:
    """One message from a ROUTER as (identity, message or the ProtocolError it raised); None
    when nothing is waiting. A batch (identity, message, message, ...) is handed out one
    message per call."""
    left, frames = _next(sock)
    if frames is None:
        return left
    if len(frames) < 2:
        return (frames[0] if frames else b""), ProtocolError(
            f"expected an identity frame and at least one message frame, got {len(frames)} "
            f"frame(s)")
    identity = frames[0]
    return _hand_out(sock, [(identity, x) for x in _decode_batch(frames[1:], max_bytes)])


def recv_dealer(sock: zmq.Socket, max_bytes: int) -> m.Message | ProtocolError | None:
    """One message from a DEALER (or the ProtocolError it raised); None when nothing is
    waiting. A batch of several frames is handed out one message per call."""
    left, frames = _next(sock)
    if frames is None:
        return left
    return _hand_out(sock, _decode_batch(frames, max_bytes))


def send_router(sock: zmq.Socket, identity: bytes, message: m.Message) -> None:
    """Send to the peer ``identity``; from an event loop's thread the message is queued and
    leaves, coalesced with the others to the same peer, at the end of the loop iteration."""
    send_router_many(sock, (identity,), message)


def send_router_many(sock: zmq.Socket, identities: Sequence[bytes], message: m.Message) -> None:
    """:func:`send_router` of one message to several peers, encoded once (a
    :attr:`~statebridge.connector.messages.Message.BATCH` message queued on a loop thread
    leaves in a row batch with the others of its type queued to the same peer)."""
    _count("control_sent", len(identities))
    loop = getattr(_current, "loop", None)
    if loop is not None and getattr(message, "BATCH", False):
        item = (type(message), m.message_row(message))
        for identity in identities:
            loop._outbox.setdefault((sock, identity), []).append(item)
        return
    data = m.encode(message)
    for identity in identities:
        if loop is not None:
            loop._outbox.setdefault((sock, identity), []).append(data)
            continue
        try:
            _send_frames(sock, [identity, data])
        except zmq.Again:
            log.warning("dropped %s to %r: peer queue full", type(message).__name__, identity)


def send_dealer(sock: zmq.Socket, message: m.Message) -> None:
    """Send on a DEALER; queued and coalesced like :func:`send_router` on a loop thread."""
    _count("control_sent")
    loop = getattr(_current, "loop", None)
    if loop is not None:
        loop._outbox.setdefault((sock, None), []).append(
            (type(message), m.message_row(message)) if getattr(message, "BATCH", False)
            else m.encode(message))
        return
    data = m.encode(message)
    try:
        _send_frames(sock, [data])
    except zmq.Again:
        log.warning("dropped %s: queue full", type(message).__name__)


def flush(sock: zmq.Socket) -> None:
    """Send what this thread's event loop queued for ``sock`` now (call before closing it)."""
    loop = getattr(_current, "loop", None)
    if loop is not None:
        loop.flush(sock)
