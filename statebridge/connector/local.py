"""Control channels between a coordinator and its own rank processes: Unix stream sockets that
the loop thread reads and writes itself.

Why not zmq here: libzmq moves every message through I/O threads, so one control message
between two sleeping processes wakes three threads (the sender's I/O thread, the receiver's
I/O thread, then the receiver's loop thread), and a wake-up across cores costs more CPU than
the message itself: a control message to a sleeping peer costs both sides less over this
channel (``benchmarks/bench_control.py``; docs/measurements.md, "The ranks' local channel").
Ranks and their coordinator always share a machine (the coordinator starts them), and 10 of
the 11 control messages of a request travel between them.
Between nodes, and for clients, the zmq sockets (CURVE, reconnects) stay.

The channels mimic the two zmq socket kinds they replace, as far as :mod:`.control` uses them:

- :class:`LocalRouter` (coordinator): listens on an abstract Unix address, admits only
  connections from processes of its own user (``SO_PEERCRED``), gives each one an identity
  (``b"\\0L"`` + 8 bytes: zmq never hands out, nor lets a peer choose, identities that start
  with ``\\0`` and are that long), and receives ``[identity, frame, ...]`` like a ROUTER.
- :class:`LocalDealer` (rank): one connection, frames in and out like a DEALER.

Wire format: each frame is a little-endian u32 header (length in the low 31 bits, the top bit
set when more frames of the same message follow) and its bytes. A frame over ``max_frame``
closes the connection (zmq's ``MAXMSGSIZE`` does the same). Writes never block: what the
kernel does not take waits in the channel (at most ``max_queued`` bytes per connection, then
sends raise ``zmq.Again`` as a full zmq queue does) and leaves when the socket is writable.
Every channel polls its connections with one epoll object whose descriptor the event loop
watches (:meth:`fileno`); readiness of any connection, or room to write queued bytes, wakes
the loop, whose handler calls :meth:`recv_frames` until it returns None.

A peer that exits or closes is noticed at once (end of stream): its connection is dropped and
what is sent to it afterwards is discarded, like a ROUTER's messages to a gone peer. Liveness
is still decided by heartbeats (:class:`~statebridge.connector.control.PeerWatch`), as for
zmq peers, so a frozen peer is handled the same way.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import select
import socket
import struct
import uuid

import zmq

from statebridge.errors import ConfigError

__all__ = ["LocalChannel", "LocalRouter", "LocalDealer"]

log = logging.getLogger(__name__)

_MORE = 0x8000_0000
_LEN = 0x7FFF_FFFF
_HDR = struct.Struct("<I")
_CRED = struct.Struct("3i")            # struct ucred: pid, uid, gid
_READ = 1 << 18                        # bytes per recv() call
_READS_PER_SERVICE = 16                # then let the loop serve others (the epoll fd stays ready)
_IN = select.EPOLLIN | select.EPOLLRDHUP
_OUT = select.EPOLLOUT


class _Conn:
    """One stream: bytes read but not yet parsed, frames of a message being read, bytes
    waiting to be written."""

    __slots__ = ("sock", "fd", "identity", "inbuf", "frames", "out", "out_bytes", "writing")

    def __init__(self, sock: socket.socket, identity: bytes | None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.identity = identity
        self.inbuf = bytearray()
        self.frames: list[bytes] = []
        self.out: collections.deque[memoryview] = collections.deque()
        self.out_bytes = 0
        self.writing = False             # EPOLLOUT registered


def _encode(frames: list) -> bytes:
    last = len(frames) - 1
    parts = []
    for i, frame in enumerate(frames):
        parts.append(_HDR.pack(len(frame) | (_MORE if i < last else 0)))
        parts.append(frame)
    return b"".join(parts)


class LocalChannel:
    """What :class:`LocalRouter` and :class:`LocalDealer` share: the epoll object, reading,
    framing and non-blocking writes. Loop thread only."""

    def __init__(self, name: str, max_frame: int, max_queued: int) -> None:
        self.name = name
        self.max_frame = max_frame
        self.max_queued = max_queued
        self._ep = select.epoll()
        self._conns: dict[int, _Conn] = {}
        self._ready: collections.deque[list] = collections.deque()
        self.closed = False
        #: Connections dropped for a protocol violation (oversized frame) or refused.
        self.refused = 0

    def fileno(self) -> int:
        return self._ep.fileno()

    # -- reading ------------------------------------------------------------------------------
    def recv_frames(self) -> list | None:
        """The frames of the next complete message (a router puts the sender's identity
        first); None when none is waiting."""
        if not self._ready and not self.closed:
            self._service()
        return self._ready.popleft() if self._ready else None

    def _service(self) -> None:
        for fd, events in self._ep.poll(0):
            self._event(fd, events)

    def _event(self, fd: int, events: int) -> None:
        conn = self._conns.get(fd)
        if conn is None:
            return
        if events & _OUT and not self._flush(conn):
            return
        if events & (_IN | select.EPOLLHUP | select.EPOLLERR):
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        for _ in range(_READS_PER_SERVICE):
            try:
                data = conn.sock.recv(_READ)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self._drop(conn, f"read failed: {e}")
                return
            if not data:
                self._drop(conn, "closed by the peer")
                return
            conn.inbuf += data
            if not self._parse(conn):
                return
            if len(data) < _READ:
                break

    def _parse(self, conn: _Conn) -> bool:
        buf, pos, end = conn.inbuf, 0, len(conn.inbuf)
        while end - pos >= 4:
            (header,) = _HDR.unpack_from(buf, pos)
            length = header & _LEN
            if length > self.max_frame:
                self._drop(conn, f"frame of {length} bytes over the cap of {self.max_frame}",
                           violation=True)
                return False
            if end - pos - 4 < length:
                break
            conn.frames.append(bytes(buf[pos + 4:pos + 4 + length]))
            pos += 4 + length
            if not header & _MORE:
                frames, conn.frames = conn.frames, []
                self._ready.append(frames if conn.identity is None
                                   else [conn.identity, *frames])
        if pos:
            del buf[:pos]
        return True

    # -- writing ------------------------------------------------------------------------------
    def _write(self, conn: _Conn, frames: list) -> None:
        data = _encode(frames)
        if conn.out:
            if conn.out_bytes + len(data) > self.max_queued:
                raise zmq.Again(f"{self.name}: {conn.out_bytes} bytes already queued")
            conn.out.append(memoryview(data))
            conn.out_bytes += len(data)
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            self._drop(conn, f"write failed: {e}")
            return
        if sent < len(data):
            rest = memoryview(data)[sent:]
            conn.out.append(rest)
            conn.out_bytes += len(rest)
            conn.writing = True
            self._ep.modify(conn.fd, _IN | _OUT)

    def _flush(self, conn: _Conn) -> bool:
        """Write what waits for ``conn``; False when the connection was dropped."""
        while conn.out:
            chunk = conn.out[0]
            try:
                sent = conn.sock.send(chunk)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                self._drop(conn, f"write failed: {e}")
                return False
            conn.out_bytes -= sent
            if sent < len(chunk):
                conn.out[0] = chunk[sent:]
                return True
            conn.out.popleft()
        if conn.writing:
            conn.writing = False
            self._ep.modify(conn.fd, _IN)
        return True

    # -- connections --------------------------------------------------------------------------
    def _add(self, sock: socket.socket, identity: bytes | None) -> _Conn:
        sock.setblocking(False)
        conn = _Conn(sock, identity)
        self._conns[conn.fd] = conn
        self._ep.register(conn.fd, _IN)
        return conn

    def _drop(self, conn: _Conn, why: str, violation: bool = False) -> None:
        if self._conns.pop(conn.fd, None) is None:
            return
        try:
            self._ep.unregister(conn.fd)
        except OSError:
            pass
        conn.sock.close()
        if violation:
            self.refused += 1
            log.warning("%s: connection dropped: %s", self.name, why)
        else:
            log.debug("%s: connection %r dropped: %s", self.name, conn.identity, why)

    def close(self, linger: int = 0) -> None:
        """Close every connection and the channel (idempotent); unsent bytes are dropped."""
        if self.closed:
            return
        self.closed = True
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._conns.clear()
        self._ep.close()


class LocalRouter(LocalChannel):
    """The coordinator's end: accepts its ranks, routes by identity (see the module doc)."""

    def __init__(self, name: str, *, max_frame: int, max_queued: int = 64 << 20) -> None:
        super().__init__(name, max_frame, max_queued)
        #: The abstract Unix address (leading NUL) ranks connect to; unique per channel.
        self.address = f"\0statebridge/{name}/{os.getpid()}/{uuid.uuid4().hex}"
        self._listener = socket.socket(socket.AF_UNIX,
                                       socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            self._listener.bind(self.address)
            self._listener.listen(256)
            self._ep.register(self._listener.fileno(), select.EPOLLIN)
        except OSError as e:
            self._listener.close()
            self._ep.close()
            raise ConfigError(f"cannot listen on a local control socket: {e}") from None
        self._by_identity: dict[bytes, _Conn] = {}
        self._ids = itertools.count(1)
        self._uid = os.getuid()

    def _event(self, fd: int, events: int) -> None:
        if fd == self._listener.fileno():
            self._accept()
        else:
            super()._event(fd, events)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("%s: accept failed: %s", self.name, e)
                return
            pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       _CRED.size))
            if uid != self._uid:
                self.refused += 1
                log.warning("%s: refused a local connection from pid %d of uid %d (we are "
                            "uid %d)", self.name, pid, uid, self._uid)
                sock.close()
                continue
            identity = b"\0L" + next(self._ids).to_bytes(8, "big")
            self._by_identity[identity] = self._add(sock, identity)

    def _drop(self, conn: _Conn, why: str, violation: bool = False) -> None:
        self._by_identity.pop(conn.identity, None)
        super()._drop(conn, why, violation)

    def send_frames(self, frames: list) -> None:
        """``[identity, frame, ...]``: to that connection; dropped when it is gone (as a
        ROUTER drops messages to an unknown peer); ``zmq.Again`` when its queue is full."""
        conn = self._by_identity.get(frames[0])
        if conn is not None:
            self._write(conn, frames[1:])

    def close(self, linger: int = 0) -> None:
        if not self.closed:
            self._listener.close()
            self._by_identity.clear()
        super().close(linger)


class LocalDealer(LocalChannel):
    """A rank's end: one connection to its coordinator's :class:`LocalRouter`."""

    def __init__(self, address: str, *, name: str = "", max_frame: int,
                 max_queued: int = 64 << 20) -> None:
        super().__init__(name or "local-dealer", max_frame, max_queued)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(10.0)
            sock.connect(address)
        except OSError as e:
            sock.close()
            self._ep.close()
            raise ConfigError(f"cannot connect to the local control socket "
                              f"{address.lstrip(chr(0))!r}: {e}") from None
        self._conn = self._add(sock, None)

    @property
    def connected(self) -> bool:
        """False once the coordinator's end closed (its process exited, or it closed us)."""
        return self._conn.fd in self._conns

    def send_frames(self, frames: list) -> None:
        """One message; dropped once the coordinator has gone; ``zmq.Again`` when the
        queue is full."""
        if self._conn.fd in self._conns:
            self._write(self._conn, frames)
