"""The ONE msgpack codec of control-plane messages, and how a message type is declared.

Every message on the wire is an envelope ``{"v": PROTOCOL_VERSION, "t": type name, "b": body}``
packed with msgpack (never pickle). :func:`decode` checks, in order: size, msgpack, envelope keys,
version, type, then every body field's presence and type -- each failure is a
:class:`~statebridge.errors.ProtocolError` naming the offending value, so a receiving loop can
count it and keep serving.

A message type is a class decorated with :func:`message`: a frozen, slotted, keyword-only
dataclass of primitives and tuples of them, registered under its class name. Prompts travel as
little-endian int32 token bytes (:class:`Tokens`). The per-request messages inside a group
(:attr:`Message.BATCH` types) that an event loop queues to one peer in one iteration leave as
one frame of value rows (:func:`encode_rows`, read with :func:`decode_frame`; readers outside
the connector only ever get single messages).

The vocabulary (which messages exist, the protocol's versions) is
:mod:`statebridge.connector.messages`, which re-exports everything here.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import operator
import sys
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from statebridge.errors import IncompatiblePeerError, ProtocolError

__all__ = [
    "PROTOCOL_VERSION", "MAX_MESSAGE_BYTES", "Message", "message", "encode", "decode",
    "compat_hash", "MESSAGE_TYPES", "message_row", "encode_rows", "decode_frame",
    "MAX_BATCH_ROWS", "Tokens", "pack_tokens", "unpack_tokens", "token_count",
]

#: The version every envelope carries; a peer of another version is refused (see the history
#: in :mod:`statebridge.connector.messages`).
PROTOCOL_VERSION = 13
#: Default largest message accepted by :func:`decode` (a prompt of 1M tokens fits).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_FROZEN = dict(frozen=True, slots=True, kw_only=True)


class Message:
    """Base of every wire message; subclasses are registered by their class name."""

    TYPE: ClassVar[str]
    #: Sent in row batches (:func:`encode_rows`) when an event loop queues several to one
    #: peer in one iteration: the per-request messages inside a group, which only
    #: :func:`decode_frame` readers (the connector's loops) receive.
    BATCH: ClassVar[bool] = False


MESSAGE_TYPES: dict[str, type] = {}
_FIELDS: dict[type, dict[str, Any]] = {}


def message(cls):
    """Class decorator: ``cls`` (fields of primitives and tuples of them) becomes a frozen,
    slotted, keyword-only wire message registered under its class name."""
    if cls.__name__ in MESSAGE_TYPES:
        raise TypeError(f"message type {cls.__name__!r} is already registered")
    if "__post_init__" in cls.__dict__:
        raise TypeError(f"{cls.__name__}: messages are built by decode() without __init__; "
                        f"a __post_init__ would not run")
    cls = dataclass(**_FROZEN)(cls)
    cls.TYPE = cls.__name__
    hints = typing.get_type_hints(cls)
    _FIELDS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    _FIELD_SET[cls] = frozenset(_FIELDS[cls])
    # (field, slot setter, checker): decode fills a bare instance through the slots, which
    # costs half of calling the frozen dataclass's __init__ (no message has __post_init__).
    _CHECKERS[cls] = tuple((name, cls.__dict__[name].__set__,
                            _checker(cls.TYPE, name, annotation))
                           for name, annotation in _FIELDS[cls].items())
    names = tuple(_FIELDS[cls])
    _ROWS[cls] = (operator.attrgetter(*names) if len(names) > 1 else
                  (lambda msg, _name=names[0]: (getattr(msg, _name),)))
    MESSAGE_TYPES[cls.TYPE] = cls
    return cls


_FIELD_SET: dict[type, frozenset] = {}
_CHECKERS: dict[type, tuple] = {}
_ROWS: dict[type, Any] = {}          # message -> its field values in field order


def _checker(type_name: str, field: str, annotation: Any):
    """A function converting a decoded value to ``annotation`` or raising ProtocolError, built
    once per field: the common case (the exact type) costs one ``type() is`` test per value;
    everything else goes through :func:`_check`, which has the rules and the messages."""
    if typing.get_origin(annotation) is tuple:
        (item, _) = typing.get_args(annotation)

        def check_tuple(value):
            # (C-level loops: a prompt of 8k token ids is checked in microseconds)
            if type(value) is list and item in _EXACT and (not value or (
                    set(map(type, value)) == {item} and (
                        item is not int or _INT_MIN <= min(value) and max(value) < _INT_END))):
                return tuple(value)
            return _check(type_name, field, annotation, value)
        return check_tuple
    if annotation is Tokens:
        def check_tokens(value):
            if type(value) is bytes and not len(value) & 3:
                return value
            what = (f"{len(value)} bytes" if isinstance(value, bytes) else _short(value))
            raise ProtocolError(f"{type_name}.{field} must be int32 token ids (bytes, a "
                                f"multiple of 4 long), got {what}")
        return check_tokens
    if annotation is int:
        def check_int(value):
            if type(value) is int and _INT_MIN <= value < _INT_END:
                return value
            return _check(type_name, field, annotation, value)
        return check_int
    if annotation in _EXACT:
        def check_exact(value):
            if type(value) is annotation:
                return value
            return _check(type_name, field, annotation, value)
        return check_exact
    return lambda value: _check(type_name, field, annotation, value)


_EXACT = (int, str, bytes, bool, float)
_INT_MIN, _INT_END = -(1 << 63), 1 << 64


class Tokens(bytes):
    """Annotation of a field of token ids: little-endian int32 ids packed as bytes
    (:func:`pack_tokens`). Version 5 moved prompts from msgpack int lists to this: a list is
    decoded and checked item by item, bytes at once (docs/measurements.md, "Binary prompts and
    row batches"). Values are plain ``bytes``; the codec checks the type and that the length is
    a multiple of 4."""


_TOKEN_TYPE = "i"                   # C int: 4 bytes on every platform CPython supports here
if array.array(_TOKEN_TYPE).itemsize != 4:       # pragma: no cover -- no such platform here
    raise ImportError(f"array type {_TOKEN_TYPE!r} is not 4 bytes on this platform")
_SWAP = sys.byteorder != "little"


def pack_tokens(tokens) -> bytes:
    """Token ids (any iterable of integers, e.g. a tuple or a numpy array) as :class:`Tokens`
    bytes. Raises ValueError naming the first id that is not an integer in
    [-2**31, 2**31)."""
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"token ids must be a sequence of integers, got "
                         f"{type(tokens).__name__} of length {len(tokens)}")
    try:
        packed = array.array(_TOKEN_TYPE, tokens)
    except (TypeError, OverflowError) as e:
        try:
            bad = next((t for t in tokens if isinstance(t, (bool, float, str, bytes)) or not (
                hasattr(t, "__index__") and -(1 << 31) <= t.__index__() < (1 << 31))), None)
        except TypeError:                                 # not iterable at all
            raise ValueError(f"token ids must be a sequence of integers, got "
                             f"{type(tokens).__name__}") from None
        raise ValueError(f"token ids must be integers in [-2**31, 2**31), got {bad!r} "
                         f"({type(bad).__name__}): {e}") from None
    if _SWAP:                                     # pragma: no cover -- little-endian here
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> tuple[int, ...]:
    """The token ids of :class:`Tokens` bytes, as a tuple of ints."""
    packed = array.array(_TOKEN_TYPE)
    packed.frombytes(data)
    if _SWAP:                                     # pragma: no cover -- little-endian here
        packed.byteswap()
    return tuple(packed)


def token_count(data: bytes) -> int:
    """How many token ids :class:`Tokens` bytes hold."""
    return len(data) >> 2


# -- codec -------------------------------------------------------------------------------------

def encode(message: Message) -> bytes:
    """Envelope + msgpack of a registered message."""
    cls = type(message)
    if cls not in _FIELDS:
        raise ProtocolError(f"not a registered message type: {cls.__name__}")
    body = dict(zip(_FIELDS[cls], _ROWS[cls](message)))
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": cls.TYPE, "b": body}, use_bin_type=True)


def message_row(message: Message) -> tuple:
    """A registered message's field values in field order (a row of :func:`encode_rows`)."""
    getter = _ROWS.get(type(message))
    if getter is None:
        raise ProtocolError(f"not a registered message type: {type(message).__name__}")
    return getter(message)


#: Most messages in one row batch (a frame of :func:`encode_rows`).
MAX_BATCH_ROWS = 1024
_ROWS_KEYS = frozenset(("v", "t", "r"))


def encode_rows(cls: type, rows: "typing.Sequence[tuple]") -> bytes:
    """One frame holding several messages of type ``cls`` (a :attr:`Message.BATCH` type) as
    rows of field values (:func:`message_row`): ``{"v", "t", "r": [[...], ...]}``. Decoding
    it costs about half of decoding the messages one by one (no field names on the wire)."""
    if not getattr(cls, "BATCH", False) or cls not in _FIELDS:
        raise ProtocolError(f"{getattr(cls, '__name__', cls)!r} is not sent in row batches")
    if not 0 < len(rows) <= MAX_BATCH_ROWS:
        raise ProtocolError(f"a row batch holds 1 to {MAX_BATCH_ROWS} messages, got {len(rows)}")
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": cls.TYPE, "r": rows}, use_bin_type=True)


def decode_frame(data: bytes, *,
                 max_bytes: int = MAX_MESSAGE_BYTES) -> "list[Message | ProtocolError]":
    """The messages of one frame: a single message (:func:`encode`) or a row batch
    (:func:`encode_rows`). A bad frame raises like :func:`decode`; in a batch, a bad row
    becomes a :class:`ProtocolError` in its place and the other rows still decode."""
    envelope, cls = _envelope(data, max_bytes)
    if "b" in envelope:
        return [_from_body(cls, envelope["b"])]
    rows = envelope["r"]
    if not cls.BATCH:
        raise ProtocolError(f"{cls.TYPE} is not sent in row batches")
    if not isinstance(rows, list) or not 0 < len(rows) <= MAX_BATCH_ROWS:
        what = f"{len(rows)} rows" if isinstance(rows, list) else type(rows).__name__
        raise ProtocolError(f"{cls.TYPE}: a row batch holds 1 to {MAX_BATCH_ROWS} rows, got "
                            f"{what}")
    checkers = _CHECKERS[cls]
    width = len(checkers)
    out: list = []
    for i, row in enumerate(rows):
        if type(row) is not list or len(row) != width:
            out.append(ProtocolError(
                f"{cls.TYPE}: row {i} must be a list of {width} fields "
                f"({', '.join(_FIELDS[cls])}), got {_short(row)}"))
            continue
        message = _new(cls)
        try:
            for (_, set_slot, check), value in zip(checkers, row):
                set_slot(message, check(value))
        except ProtocolError as e:
            out.append(ProtocolError(f"row {i}: {e}"))
            continue
        out.append(message)
    return out


def decode(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message in ``data``; :class:`ProtocolError` for anything else (a row batch too:
    read those with :func:`decode_frame`)."""
    envelope, cls = _envelope(data, max_bytes)
    if "b" not in envelope:
        rows = envelope["r"]
        raise ProtocolError(f"{cls.TYPE}: a row batch"
                            f"{f' of {len(rows)}' if isinstance(rows, list) else ''} where one "
                            f"message was expected")
    return _from_body(cls, envelope["b"])


def _envelope(data: bytes, max_bytes: int) -> tuple[dict, type]:
    """The checked envelope of a frame (keys v, t and b or r; our version; a known type)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        envelope = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types (ExtraData, ValueError, TypeError, ...)
        raise ProtocolError(f"undecodable message ({type(e).__name__}: {e}): "
                            f"{bytes(data[:32])!r}") from None
    if not isinstance(envelope, dict) or envelope.keys() != _BODY_KEYS \
            and envelope.keys() != _ROWS_KEYS:
        shown = sorted(envelope) if isinstance(envelope, dict) else type(envelope).__name__
        raise ProtocolError(f"envelope must be a map with keys v, t, b (or v, t, r: a row "
                            f"batch); got {shown!r}")
    version, type_name = envelope["v"], envelope["t"]
    if version != PROTOCOL_VERSION:
        raise IncompatiblePeerError(f"protocol version {version!r} is not ours "
                                    f"({PROTOCOL_VERSION})")
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r}")
    return envelope, cls


_BODY_KEYS = frozenset(("v", "t", "b"))


def _from_body(cls: type, body: Any) -> Message:
    type_name = cls.TYPE
    if not isinstance(body, dict):
        raise ProtocolError(f"{type_name}: body must be a map, got {type(body).__name__}")
    if body.keys() != _FIELD_SET[cls]:
        fields = _FIELDS[cls]
        missing = sorted(set(fields) - set(body))
        unknown = sorted(map(repr, set(body) - set(fields)))
        raise ProtocolError(f"{type_name}: missing fields {missing}, unknown fields "
                            f"[{', '.join(unknown)}]")
    message = _new(cls)
    for name, set_slot, check in _CHECKERS[cls]:
        set_slot(message, check(body[name]))
    return message


_new = object.__new__


def _check(type_name: str, field: str, annotation: Any, value: Any) -> Any:
    """``value`` converted to ``annotation`` (lists -> tuples), or ProtocolError."""
    origin = typing.get_origin(annotation)
    if origin is tuple:
        (item, _) = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(f"{type_name}.{field} must be a list, got {_short(value)}")
        return tuple(_check(type_name, field, item, v) for v in value)
    if annotation is int and isinstance(value, bool) or not isinstance(value, annotation) or (
            annotation is float and isinstance(value, bool)):
        if annotation is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        raise ProtocolError(f"{type_name}.{field} must be {annotation.__name__}, got "
                            f"{_short(value)}")
    if annotation is int and not -(1 << 63) <= value < (1 << 64):
        raise ProtocolError(f"{type_name}.{field} out of range: {value}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:64]}{'...' if len(text) > 64 else ''}"


def compat_hash(spec_json: str) -> str:
    """Hash peers compare before anything else: protocol version + state spec."""
    return hashlib.sha256(f"statebridge/{PROTOCOL_VERSION}/{spec_json}".encode()).hexdigest()[:32]

