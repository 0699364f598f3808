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
"""

from __future__ import annotations

__all__ = [
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
    "ClosedError",
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
    """Every page of the cache is in use (back-pressure, not a crash)."""


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
    def kind(self) -> str:
        """Stable short name of the failure kind (used on the wire and in counters)."""
        return _KINDS.get(type(self), "transfer_error")


class PeerLostError(TransferError):
    """The peer (or the network to it) died while the request depended on it."""


class TransferTimeoutError(TransferError):
    """The transfer did not complete within its bound."""


class AbortedError(TransferError):
    """The request was aborted by one of the two sides."""


class ClosedError(StatebridgeError):
    """The object was closed by us; no further use is possible."""


class AuthenticationError(StatebridgeError):
    """The control-plane handshake with ``peer`` failed authentication: the peer refused our
    public key, one side has CURVE keys and the other none, or we hold the wrong server key."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


_KINDS = {TransferError: "transfer_error", PeerLostError: "peer_lost",
          TransferTimeoutError: "timeout", AbortedError: "aborted"}


def transfer_error(kind: str, message: str, *, request_id: str | None = None,
                   peer: str | None = None) -> TransferError:
    """The :class:`TransferError` subclass named by ``kind`` (the wire form of an error)."""
    cls = {v: k for k, v in _KINDS.items()}.get(kind, TransferError)
    return cls(message, request_id=request_id, peer=peer)
