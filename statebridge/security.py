"""CurveZMQ on the control plane: key files, who may connect, and the ZAP handler that says so.

The scheme (one directory per deployment, written by ``statebridge keygen DIR``)::

    DIR/server.key  server.key_secret     ONE pair shared by every listening (ROUTER) socket:
                                          prefill servers, decode coordinators, decode front doors
    DIR/node.key    node.key_secret       the pair the nodes dial with (decode coordinator ->
                                          prefill server, rank processes -> their coordinator)
    DIR/client.key  client.key_secret     one pair per client (``keygen DIR --name client-a``)

- A listening socket uses ``server.key_secret`` and accepts a peer only when the peer's public
  key is one of the ``*.key`` files in DIR (zmq.auth's certificate format, the files that
  :func:`zmq.auth.create_certificates` writes). Adding a client is dropping its public
  ``NAME.key`` into DIR; the directory is re-read when it changes, no restart needed. Removing a
  file revokes the key for new connections.
- A dialing socket uses its own pair ``NAME.key``/``NAME.key_secret`` (``--key-name``, default
  ``node`` for nodes, ``client`` for ``statebridge generate``) and the server public key
  ``server.key``.
- What to copy where: the node hosts get the whole DIR. A client host needs only
  ``server.key`` and its own pair; its public ``NAME.key`` goes into the nodes' DIR. Secret files
  are written with mode 0600; keep them so.

Mechanics: ZAP (ZeroMQ's authentication protocol) is served per zmq context, so each context
that has a keyed ROUTER gets ONE handler thread from this module (``statebridge-zap``, a daemon
that lives as long as the context; the nodes all use ``zmq.Context.instance()``). Each keys
directory is its own ZAP domain, so sockets of one process may use different directories. The
same thread watches every keyed ROUTER's socket monitor: failed handshakes (an unknown key, a
peer without keys, a peer holding the wrong server key) are counted in the owner's
``Counters`` as ``auth_refused`` and logged at WARNING (at most one line per socket every
:data:`LOG_EVERY` seconds, with the number refused meanwhile).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from statebridge.errors import ConfigError, StatebridgeError

__all__ = ["CurveKeys", "SERVER_NAME", "generate_keys", "key_files", "check_key_name",
           "authorized_keys", "secure_server", "secure_client", "LOG_EVERY"]

log = logging.getLogger(__name__)

SERVER_NAME = "server"
LOG_EVERY = 10.0            # seconds between two refusal log lines of one socket
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


def check_key_name(name: str) -> str:
    """``name`` if it is a valid key name (letters, digits, ``_.-``; not ``*.key`` tricks)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.endswith((".key",)):
        raise ConfigError(f"key name must be 1-64 letters, digits, '_', '.' or '-' (starting "
                          f"with a letter or digit), got {name!r}")
    return name


def key_files(keys_dir: str | os.PathLike, name: str) -> tuple[str, str]:
    """(public, secret) file paths of key pair ``name`` in ``keys_dir``."""
    check_key_name(name)
    base = os.path.join(os.fspath(keys_dir), name)
    return base + ".key", base + ".key_secret"


# -- keygen ---------------------------------------------------------------------------------------
def generate_keys(keys_dir: str | os.PathLike, names: tuple[str, ...] | list[str] = ("node",), *,
                  force: bool = False) -> list[str]:
    """Write CURVE key pairs into ``keys_dir`` (created, mode 0700, when missing).

    The server pair is written too when ``server.key`` is missing. A pair that already exists is
    an error (ConfigError naming the file) unless ``force``; nothing is written in that case.
    Returns the paths written, public then secret per pair. Secret files get mode 0600.
    """
    keys_dir = os.fspath(keys_dir)
    wanted = [check_key_name(n) for n in names]
    if len(set(wanted)) != len(wanted):
        raise ConfigError(f"key names repeat: {wanted}")
    if os.path.exists(keys_dir) and not os.path.isdir(keys_dir):
        raise ConfigError(f"keys directory {keys_dir!r} exists and is not a directory")
    if SERVER_NAME not in wanted and not os.path.exists(key_files(keys_dir, SERVER_NAME)[0]):
        wanted.insert(0, SERVER_NAME)
    if not force:
        for name in wanted:
            for path in key_files(keys_dir, name):
                if os.path.exists(path):
                    raise ConfigError(f"{path} exists; refusing to overwrite keys (use --force "
                                      f"to replace them: peers holding the old key are then "
                                      f"refused)")
    os.makedirs(keys_dir, mode=0o700, exist_ok=True)
    written: list[str] = []
    old_umask = os.umask(0o077)     # the secret never exists with wider permissions
    try:
        for name in wanted:
            public, secret = key_files(keys_dir, name)
            for path in (public, secret):
                if os.path.exists(path):
                    os.unlink(path)
            zmq.auth.create_certificates(keys_dir, name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            written += [public, secret]
    finally:
        os.umask(old_umask)
    return written


# -- loading --------------------------------------------------------------------------------------
def _load(path: str, want_secret: bool) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise ConfigError(f"key file {path} does not exist (create keys with "
                          f"`statebridge keygen {os.path.dirname(path) or '.'}`)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"key file {path} is not a CURVE certificate: {e}") from None
    if len(public or b"") != 40 or (want_secret and len(secret or b"") != 40):
        raise ConfigError(f"key file {path} does not hold a "
                          f"{'secret' if want_secret else 'public'} CURVE key")
    if want_secret:
        mode = os.stat(path).st_mode & 0o777
        if mode & 0o077:
            log.warning("secret key file %s is readable by others (mode %o); chmod 600 it",
                        path, mode)
    return public, secret


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The keys one process uses: its own pair (to dial), the server public key (to know whom
    it dials) and, on nodes, the server secret key (to listen). Keys are Z85 text (40 bytes)."""

    keys_dir: str
    name: str
    public: bytes
    secret: bytes = dataclasses.field(repr=False)
    server_public: bytes
    server_secret: bytes | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def load(cls, keys_dir: str | os.PathLike, name: str = "node", *,
             listen: bool = False) -> "CurveKeys":
        """Read pair ``name`` and the server key from ``keys_dir``; ``listen`` also needs
        ``server.key_secret``. ConfigError naming the path when something is missing."""
        keys_dir = os.path.abspath(os.fspath(keys_dir))
        if not os.path.isdir(keys_dir):
            raise ConfigError(f"keys directory {keys_dir} does not exist or is not a directory")
        public, secret = _load(key_files(keys_dir, name)[1], True)
        server_file = key_files(keys_dir, SERVER_NAME)[1 if listen else 0]
        server_public, server_secret = _load(server_file, listen)
        return cls(keys_dir=keys_dir, name=name, public=public, secret=secret,  # type: ignore[arg-type]
                   server_public=server_public,
                   server_secret=server_secret if listen else None)

    @classmethod
    def from_config(cls, config, *, listen: bool = False) -> "CurveKeys | None":
        """The keys a :class:`~statebridge.config.ConnectorConfig` names, or None (no keys)."""
        if not config.keys_dir:
            return None
        return cls.load(config.keys_dir, config.key_name, listen=listen)

    @property
    def domain(self) -> bytes:
        """The ZAP domain of this keys directory (one per directory)."""
        return b"statebridge-" + hashlib.sha256(self.keys_dir.encode()).hexdigest()[:16].encode()


def authorized_keys(keys_dir: str | os.PathLike) -> frozenset[bytes]:
    """The Z85 public keys of every ``*.key`` file in ``keys_dir``: who may connect."""
    return frozenset(zmq.auth.load_certificates(os.fspath(keys_dir)))


# -- sockets --------------------------------------------------------------------------------------
class _Counter(Protocol):
    def add(self, name: str, value: int | float = 1) -> None: ...


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make a dialing socket a CURVE client (before ``connect``)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def secure_server(sock: zmq.Socket, keys: CurveKeys, *, counters: _Counter | None = None,
                  name: str = "") -> None:
    """Make a listening socket a CURVE server that admits only DIR's public keys (before
    ``bind``). Failed handshakes are counted in ``counters`` as ``auth_refused`` and logged."""
    if keys.server_secret is None:
        raise ConfigError(f"keys of {keys.keys_dir} were loaded without the server secret key; "
                          f"a listening socket needs {key_files(keys.keys_dir, SERVER_NAME)[1]}")
    guard = _guard(sock.context)
    guard.add_domain(keys.domain, keys.keys_dir)
    sock.setsockopt(zmq.ZAP_DOMAIN, keys.domain)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    guard.watch(sock, name or keys.domain.decode(), counters)


# -- the ZAP handler + refusal watch (one thread per context) ------------------------------------
_GUARDS: dict[zmq.Context, "_Guard"] = {}
_GUARDS_LOCK = threading.Lock()

_REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused by authentication (key not in the keys directory)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error (a peer without keys, or with the wrong "
                                         "server key)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed (no detail)",
}


def _guard(context: zmq.Context) -> "_Guard":
    with _GUARDS_LOCK:
        guard = _GUARDS.get(context)
        if guard is None or not guard.is_alive():
            guard = _Guard(context)
            guard.start_and_wait()
            _GUARDS[context] = guard
        return guard


@dataclass
class _Domain:
    keys_dir: str
    allowed: frozenset[bytes] = frozenset()
    stamp: tuple = ()
    refused: int = 0
    last_log: float = 0.0


@dataclass
class _Watched:
    name: str
    counters: _Counter | None
    refused: int = 0
    last_log: float = float("-inf")


class _Guard(threading.Thread):
    """Serves ZAP for one context and reads the monitors of its keyed ROUTERs."""

    def __init__(self, context: zmq.Context) -> None:
        super().__init__(name="statebridge-zap", daemon=True)
        self.context = context
        self._lock = threading.Lock()
        self._domains: dict[bytes, _Domain] = {}
        self._pending: list[tuple[zmq.Socket, _Watched]] = []
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start_and_wait(self) -> None:
        self.start()
        self._ready.wait(10.0)
        if self._error is not None:
            raise StatebridgeError(f"cannot serve ZAP in this zmq context: {self._error} "
                                   f"(another authenticator already bound {_ZAP_ENDPOINT}?)")

    def add_domain(self, domain: bytes, keys_dir: str) -> None:
        with self._lock:
            d = self._domains.setdefault(domain, _Domain(keys_dir))
            self._refresh(d)
            if not d.allowed:
                log.warning("keys directory %s holds no public keys: every peer is refused",
                            keys_dir)

    def watch(self, sock: zmq.Socket, name: str, counters: _Counter | None) -> None:
        events = zmq.EVENT_MONITOR_STOPPED
        for event in _REFUSALS:
            events |= event
        # Created here, connected before the ROUTER binds (no event is lost), then handed to
        # the guard thread, which alone uses it from now on.
        monitor = sock.get_monitor_socket(events)
        monitor.setsockopt(zmq.LINGER, 0)
        with self._lock:
            self._pending.append((monitor, _Watched(name, counters)))

    # -- thread -------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            zap = self.context.socket(zmq.REP)
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        monitors: dict[zmq.Socket, _Watched] = {}
        try:
            while True:
                with self._lock:
                    pending, self._pending = self._pending, []
                for monitor, watched in pending:
                    monitors[monitor] = watched
                    poller.register(monitor, zmq.POLLIN)
                events = dict(poller.poll(100))
                if zap in events:
                    self._on_zap(zap)
                for monitor in [s for s in events if s in monitors]:
                    if not self._on_monitor(monitor, monitors[monitor]):
                        poller.unregister(monitor)
                        del monitors[monitor]
                        monitor.close(0)
        except zmq.ContextTerminated:
            pass
        finally:
            for monitor in monitors:
                monitor.close(0)
            zap.close(0)

    def _refresh(self, d: _Domain) -> None:
        """Re-read the keys directory when it changed (lock held)."""
        try:
            st = os.stat(d.keys_dir)
            stamp = (st.st_mtime_ns, st.st_ino)
        except OSError:
            stamp = ()
        if stamp and stamp == d.stamp:
            return
        try:
            d.allowed = authorized_keys(d.keys_dir)
            d.stamp = stamp
        except (OSError, ValueError) as e:
            log.error("cannot read keys directory %s (%s); keeping the %d keys read before",
                      d.keys_dir, e, len(d.allowed))

    def _on_zap(self, zap: zmq.Socket) -> None:
        frames = zap.recv_multipart()
        if len(frames) < 6:
            if len(frames) >= 2:
                zap.send_multipart([b"1.0", frames[1], b"400", b"bad ZAP request", b"", b""])
            else:
                zap.send_multipart([b"1.0", b"", b"400", b"bad ZAP request", b"", b""])
            return
        _version, request_id, domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        with self._lock:
            d = self._domains.get(domain)
            if d is not None:
                self._refresh(d)
            allowed = d.allowed if d is not None else frozenset()
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and len(credentials) == 1 \
            and len(credentials[0]) == 32 else b""
        if d is not None and key and key in allowed:
            zap.send_multipart([b"1.0", request_id, b"200", b"OK", key, b""])
            return
        if d is None and not domain and mechanism == b"NULL":
            # A keyless socket of this context (libzmq < 4.3 asks ZAP about those too): not
            # ours to police.
            zap.send_multipart([b"1.0", request_id, b"200", b"OK", b"anonymous", b""])
            return
        reason = ("unknown ZAP domain" if d is None else
                  f"mechanism {mechanism.decode(errors='replace')}" if not key else
                  "public key not in the keys directory")
        zap.send_multipart([b"1.0", request_id, b"400", reason.encode(), b"", b""])
        now = time.monotonic()
        if d is not None:
            d.refused += 1
            if now - d.last_log < LOG_EVERY:
                return
            d.last_log = now
        log.warning("refused %s from %s: %s (public key %s; keys directory %s)",
                    mechanism.decode(errors="replace"), address.decode(errors="replace"),
                    reason, key.decode() or "-", d.keys_dir if d else domain.decode("replace"))

    def _on_monitor(self, monitor: zmq.Socket, watched: _Watched) -> bool:
        """Read one monitor's events; False once the watched socket has closed."""
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return True
            kind = event["event"]
            if kind == zmq.EVENT_MONITOR_STOPPED:
                return False
            if kind not in _REFUSALS:
                continue
            watched.refused += 1
            if watched.counters is not None:
                watched.counters.add("auth_refused")
            now = time.monotonic()
            if kind != zmq.EVENT_HANDSHAKE_FAILED_AUTH and now - watched.last_log >= LOG_EVERY:
                # ZAP refusals are logged by _on_zap with the peer's address and key.
                log.warning("%s: refused a connection on %s: handshake %s (%d refused so far)",
                            watched.name, event["endpoint"].decode(errors="replace"),
                            _REFUSALS[kind], watched.refused)
                watched.last_log = now
