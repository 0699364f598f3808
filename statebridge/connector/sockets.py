"""zmq sockets of the control plane: binding a ROUTER, dialing a DEALER (optionally with CURVE
keys), and turning a failed zmq handshake into an
:class:`~statebridge.errors.AuthenticationError` at once (:class:`HandshakeWatch`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Protocol

import zmq

from statebridge.connector.stats import Counters
from statebridge.errors import AuthenticationError, ConfigError

if TYPE_CHECKING:
    from statebridge.security import CurveKeys

__all__ = ["frame_cap", "bind_router", "connect_dealer", "dial_dealer", "HandshakeWatch",
           "ReaderLoop", "watch_handshake", "poll_dealer"]

log = logging.getLogger(__name__)


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


class ReaderLoop(Protocol):
    """What :func:`watch_handshake` needs of a loop (the control plane's
    :class:`~statebridge.connector.control.EventLoop`): readers on zmq sockets."""

    def add_reader(self, sock: zmq.Socket, handler: Callable[[], None]) -> None: ...

    def remove_reader(self, sock: zmq.Socket) -> None: ...


def watch_handshake(loop: ReaderLoop, watch: HandshakeWatch,
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
