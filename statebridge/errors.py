"""The one exception tree of statebridge.

Every public function raises a subclass of :class:`StatebridgeError` with the offending value in
the message. The tree says who caused the error:

- :class:`ConfigError` -- the caller's configuration (model config, TP size, layout) is wrong.
- :class:`CacheError` -- misuse or exhaustion of a :class:`~statebridge.state.cache.StateCache`.
- :class:`ProtocolError` -- the peer sent bytes we cannot accept (malformed, unknown type, wrong
  version); :class:`IncompatiblePeerError` -- a well-formed peer serving another model or geometry.
- :class:`TransferError` -- a request's transfer failed: :class:`PeerLostError` (the peer or the
  network broke it), :class:`TransferTimeoutError` (it took too long), :class:`AbortedError`
  (someone aborted it). They carry ``request_id`` and ``peer`` where known.
- :class:`ClosedError` -- we closed the object being used.
- :class:`AuthenticationError` -- the CURVE handshake with a peer failed (our key refused, keys
  on one side only, or the wrong server key).

A failed request crosses processes as a :class:`FailureKind` (its wire name) and a message;
:func:`kind_of` and :func:`error_for` are the one table between kinds and exception classes:

==================  ===========================  ==========================================
kind                exception                    who caused it
==================  ===========================  ==========================================
``transfer_error``  :class:`TransferError`       the data plane or a model failed
``peer_lost``       :class:`PeerLostError`       the peer or the network died
``timeout``         :class:`TransferTimeoutError`  it took too long
``aborted``         :class:`AbortedError`        one of the two sides aborted it
``busy``            :class:`BusyError`           the peer refused it: its limit is reached
``not_ready``       :class:`NotReadyError`       no peer to serve it is connected (yet)
``invalid_request`` :class:`InvalidRequestError`  the caller's request is malformed
``closed``          :class:`ClosedError`         we closed the object it used
``cache_full``      :class:`CacheFullError`      no page or KV block left (decode growth)
``internal``        :class:`InternalError`       the server: a model step failed (HTTP 500)
==================  ===========================  ==========================================
"""

from __future__ import annotations

import enum

__all__ = [
    "FailureKind",
    "kind_of",
    "error_for",
    "StatebridgeError",
    "ConfigError",
    "UnsupportedModelError",
    "LayoutError",
    "CacheError",
    "CacheFullError",
    "DoubleFreeError",
    "UnknownPageError",
    "ShapeError",
    "ProtocolError",
    "IncompatiblePeerError",
    "TransferError",
    "PeerLostError",
    "TransferTimeoutError",
    "AbortedError",
    "BusyError",
    "NotReadyError",
    "InvalidRequestError",
    "InternalError",
    "ClosedError",
    "LoopTimeoutError",
    "StartupError",
    "AuthenticationError",
]


class StatebridgeError(Exception):
    """Base class of every error statebridge raises on purpose."""


class ConfigError(StatebridgeError, ValueError):
    """A configuration value is invalid: the message names the value and why."""


class UnsupportedModelError(ConfigError):
    """The model config describes an architecture or layer type statebridge cannot serve."""


class LayoutError(ConfigError):
    """An unknown or malformed page layout name."""


class CacheError(StatebridgeError):
    """Misuse or exhaustion of a state cache."""


class CacheFullError(CacheError):
    """Every page of the cache (or KV block of the pool) is in use (back-pressure, not a
    crash)."""


class DoubleFreeError(CacheError):
    """A page was freed that is not allocated."""


class UnknownPageError(CacheError):
    """A page id outside the cache."""


class ShapeError(StatebridgeError, ValueError):
    """A tensor handed to a kernel or layer has the wrong shape, dtype or strides."""


class ProtocolError(StatebridgeError):
    """Bytes from a peer that are not a valid message: the message names the offending value."""


class IncompatiblePeerError(ProtocolError):
    """A peer speaking another protocol version or serving an incompatible state spec."""


class TransferError(StatebridgeError):
    """A request's state transfer failed. ``request_id`` and ``peer`` name what it touched."""

    def __init__(self, message: str, *, request_id: str | None = None,
                 peer: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.peer = peer

    @property
    def kind(self) -> "FailureKind":
        """The failure kind (its value travels on the wire and names counters)."""
        return kind_of(self)


class PeerLostError(TransferError):
    """The peer (or the network to it) died while the request depended on it."""


class TransferTimeoutError(TransferError):
    """The transfer did not complete within its bound."""


class AbortedError(TransferError):
    """The request was aborted by one of the two sides."""


class BusyError(TransferError):
    """The peer refused the request because a limit is reached (requests in flight and
    queued per peer): back-pressure, retry later."""


class NotReadyError(PeerLostError):
    """No peer that could serve the request is connected: not yet (a node still dialling its
    configured peers) or not any more (re-dialling a lost one). Retry later."""


class InvalidRequestError(TransferError, ConfigError):
    """The request itself is malformed (empty or too long prompt, bad sampling parameters, a
    duplicate request id): the caller's mistake, never retried."""


class InternalError(TransferError):
    """The server failed a request it should have served: a decode step of the model raised
    for the whole batch. Not the caller's mistake and not the network's; retrying the same
    request is not expected to help (HTTP 500). The node logs the step's error."""


class ClosedError(StatebridgeError):
    """The object was closed by us; no further use is possible."""


class StartupError(StatebridgeError):
    """A node could not start: a rank process failed while starting (the message carries the
    rank's own error, e.g. the checkpoint file or layer it could not load) or never came up."""


class LoopTimeoutError(StatebridgeError, TimeoutError):
    """A call handed to an event loop thread did not run within its bound (the loop is busy
    or stuck)."""


class AuthenticationError(StatebridgeError):
    """The control-plane handshake with ``peer`` failed authentication: the peer refused our
    public key, one side has CURVE keys and the other none, or we hold the wrong server key."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class FailureKind(str, enum.Enum):
    """Why a request failed: the wire name of a failure (see the table in the module
    docstring). ``str(kind)`` and f-strings give the wire name."""

    TRANSFER_ERROR = "transfer_error"
    PEER_LOST = "peer_lost"
    TIMEOUT = "timeout"
    ABORTED = "aborted"
    BUSY = "busy"
    NOT_READY = "not_ready"
    INVALID_REQUEST = "invalid_request"
    CLOSED = "closed"
    CACHE_FULL = "cache_full"
    INTERNAL = "internal"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, name: str) -> "FailureKind":
        """The kind named ``name`` (from the wire); an unknown name is a plain transfer error,
        so a newer peer's kind still fails the request rather than the connection."""
        try:
            return cls(name)
        except ValueError:
            return cls.TRANSFER_ERROR


#: The one kind <-> exception table (most specific class first: subclasses before bases).
_ERRORS: dict[FailureKind, type[StatebridgeError]] = {
    FailureKind.NOT_READY: NotReadyError,
    FailureKind.PEER_LOST: PeerLostError,
    FailureKind.TIMEOUT: TransferTimeoutError,
    FailureKind.ABORTED: AbortedError,
    FailureKind.BUSY: BusyError,
    FailureKind.INVALID_REQUEST: InvalidRequestError,
    FailureKind.TRANSFER_ERROR: TransferError,
    FailureKind.CLOSED: ClosedError,
    FailureKind.CACHE_FULL: CacheFullError,
    FailureKind.INTERNAL: InternalError,
}
_KINDS = {cls: kind for kind, cls in _ERRORS.items()}


def kind_of(error: BaseException) -> FailureKind:
    """The failure kind of ``error``: its class's kind, or ``transfer_error`` for anything
    else (a model's exception, a UCX error)."""
    for cls in type(error).__mro__:
        kind = _KINDS.get(cls)
        if kind is not None:
            return kind
    return FailureKind.TRANSFER_ERROR


def error_for(kind: "FailureKind | str", message: str, *, request_id: str | None = None,
              peer: str | None = None) -> StatebridgeError:
    """The exception of ``kind`` (the wire form of an error) with ``message``."""
    cls = _ERRORS[FailureKind.parse(kind) if not isinstance(kind, FailureKind) else kind]
    if issubclass(cls, TransferError):
        return cls(message, request_id=request_id, peer=peer)
    return cls(message)
