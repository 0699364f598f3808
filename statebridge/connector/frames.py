"""Framing of control messages on zmq (and local) sockets: a loop thread's sends to one
destination leave coalesced in one multipart message, row batches of
:attr:`~statebridge.connector.messages.Message.BATCH` types are packed once, and receivers hand
the frames out one message at a time."""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import Sequence

import zmq

from statebridge.connector import messages as m
from statebridge.connector.local import LocalChannel, LocalDealer, LocalRouter
from statebridge.connector.stats import ops
from statebridge.errors import ProtocolError

__all__ = ["recv_router", "recv_dealer", "send_router", "send_router_many", "send_dealer",
           "flush", "MAX_BATCH_FRAMES"]

log = logging.getLogger(__name__)
_current = threading.local()        # .loop: the EventLoop running on this thread


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
