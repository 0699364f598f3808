"""Control-plane messages: frozen typed dataclasses and the ONE msgpack codec.

Every message on the wire is an envelope ``{"v": PROTOCOL_VERSION, "t": type name, "b": body}``
packed with msgpack (never pickle). :func:`decode` checks, in order: size, msgpack, envelope keys,
version, type, then every body field's presence and type -- each failure is a
:class:`~statebridge.errors.ProtocolError` naming the offending value, so a receiving loop can
count it and keep serving.

Handshake (decode group connects to a prefill group)::

    decode coordinator                           prefill server
      Hello(version, compat hash)  ------------>   checks version + compat_hash
                                   <------------   Hello | Reject
      GroupInfo(addresses, geometry) ---------->
                                   <------------   GroupInfo(addresses, geometry)

The compatibility hash (:func:`compat_hash`) covers the protocol version and the state spec
(model dims, segments, state_len, dtypes). Page layouts are NOT in it on purpose: the two sides
may use different layouts (the transfer plan stages those); they travel in ``GroupInfo``.

Per request (N-1 protocol, see DESIGN.md): ``TransferRequest`` decode -> prefill, then only
``TransferFailed`` / ``Abort`` (either way) when something fails; ``Heartbeat`` both ways. A
success needs no word between the nodes: the decode side learns it from its ranks, the
prefill side from its own (version 4 dropped ``TransferComplete``). For a spec with attention
KV (``spec.kv``) the request carries the decode block table and the prefill side takes one
contiguous range, so the decode ranks post the KV receives with the recurrent ones (version 4
dropped the ``TransferAccepted`` / ``RankKVRecv`` round trip of version 3).
Inside a group, the coordinator and its rank processes use the ``Rank*`` messages. A request
attempt is named on every process by its :class:`~statebridge.connector.ledger.RequestKey`:
the node on the other side of the transfer (``peer_node``), the request id, and the generation
the decode node gave the attempt.

Version 5: prompts travel as little-endian int32 token bytes (:class:`Tokens`), and the
per-request messages inside a group (:attr:`Message.BATCH` types) that an event loop queues to
one peer in one iteration leave as one frame of value rows (:func:`encode_rows`, read with
:func:`decode_frame`; readers outside the connector only ever get single messages).

Version 7: same-host shared-map reads (:class:`GroupInfo` ``shared_map*``). Version 8: a
hybrid link that reads shared maps moves attention KV (and every zero-copy recurrent pair)
that way too. Version 9: a reader answers in the prefill rank's memory, not with a message.
The "ready" notice a prefill rank sends per pair, and the answer word, are described in ONE
place: :class:`~statebridge.connector.data.shared.NoticeSlot`.

Version 10: a coordinator tells its ranks to connect to a peer group by forwarding the peer's
checked :class:`GroupInfo` as it came (``RankConnect``, a hand-made copy of its fields with a
``peer_`` prefix, is gone): one handshake record between groups and inside them.

Layers above the connector (the decode node's stepping and front door) declare their own
messages with :func:`message`; they travel through the same codec.
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
    "Hello", "Reject", "GroupInfo", "TransferRequest", "TransferFailed",
    "Abort", "Heartbeat", "Error", "Goodbye",
    "RankHello", "RankPrefill", "RankRecv", "RankDone", "RankCancel",
    "RankShutdown", "RankLocalPrefill", "RankFailed",
]

PROTOCOL_VERSION = 10
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
    (:func:`pack_tokens`). Version 5 moved prompts from msgpack int lists to this: a
    1,024-token prompt cost ~60 us to decode and check as a list, ~1 us as bytes. Values are
    plain ``bytes``; the codec checks the type and that the length is a multiple of 4."""


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


# -- between groups ----------------------------------------------------------------------------

@message
class Hello(Message):
    """Phase 1 of the handshake, both directions."""
    compat_hash: str
    node_id: str
    role: str                      # "prefill" | "decode"


@message
class Reject(Message):
    """The handshake was refused (incompatible peer, bad message, limits)."""
    code: str
    reason: str


@message
class GroupInfo(Message):
    """Phase 2: everything a peer needs to plan and connect (one entry per TP rank). Once
    checked, the coordinator forwards it as it came to its own ranks: their command to open
    UCX endpoints to that group and plan transfers with it."""
    node_id: str
    role: str
    tp_size: int
    layout: str
    page_size: int
    region_align: int
    num_pages: int
    spec_json: str
    rank_addresses: tuple[bytes, ...]
    #: The KV block pool of every rank (``num_blocks`` 0: no KV, the spec has none).
    kv_layout: str = "HB"
    block_size: int = 16
    num_blocks: int = 0
    #: :func:`statebridge.net.host_id` of the node's machine ("" unknown): a peer group on the
    #: same host moves state over shared memory, which the receiver reads by itself (a rank
    #: compares it with its own).
    host_id: str = ""
    #: Same-host shared-map reads (``connector/data/shared/``): this group takes part (a
    #: prefill group's rank buffers are memfds, a decode group reads them); a prefill group
    #: also lists each rank's pid and buffer descriptor. Protocol 7.
    shared_map: bool = False
    rank_pids: tuple[int, ...] = ()
    rank_shm_fds: tuple[int, ...] = ()
    #: A prefill group's ``ConnectorConfig.shared_map_min_bytes``: which pairs go that way.
    shared_map_min_bytes: int = 0


@message
class TransferRequest(Message):
    """Decode -> prefill: compute ``prompt`` and send its state to the decode ranks (which
    posted their receives under this generation's tags)."""
    request_id: str
    generation: int
    prompt: Tokens
    #: The decode side's block table for the prompt's KV (``blocks_for(len(prompt),
    #: block_size)`` ids); empty for a spec without KV.
    kv_blocks: tuple[int, ...] = ()


@message
class TransferFailed(Message):
    """Either way: the request's transfer failed; ``kind`` is a TransferError kind."""
    request_id: str
    generation: int
    kind: str
    message: str


@message
class Abort(Message):
    """Either way: stop working on the request and release what it holds."""
    request_id: str
    generation: int
    reason: str


@message
class Heartbeat(Message):
    """Every connection, both ways, every ``heartbeat_interval``: the sender is alive.
    ``seq`` counts the sender's heartbeats on that connection (informational)."""
    node_id: str
    seq: int


@message
class Error(Message):
    """Reply to a message that could not be accepted (the sender keeps its connection)."""
    kind: str
    message: str


@message
class Goodbye(Message):
    """Clean shutdown of a node: its peers fail what is in flight without waiting."""
    node_id: str


# -- inside a group (coordinator <-> rank processes) -------------------------------------------

@message
class RankHello(Message):
    """Rank -> its coordinator at start: who it is and its UCX worker address."""
    tp_rank: int
    address: bytes
    pid: int
    #: The rank's page buffer as a memfd a same-host reader may map (-1: not shared).
    shm_fd: int = -1


@message
class RankPrefill(Message):
    """Prefill coordinator -> rank: compute the state of ``prompt`` into ``src_page`` and send
    it to the ranks of decode node ``peer_node``."""
    BATCH = True
    request_id: str
    generation: int
    prompt: Tokens
    src_page: int
    peer_node: str
    #: KV of the first ``kv_tokens`` tokens: computed into ``src_blocks``, sent to the
    #: decode ranks' ``dst_blocks`` (empty without KV).
    src_blocks: tuple[int, ...] = ()
    dst_blocks: tuple[int, ...] = ()
    kv_tokens: int = 0


@message
class RankRecv(Message):
    """Decode coordinator -> rank: post the receives of a request from prefill node
    ``peer_node`` into ``page``, and with ``blocks`` (the request's KV block table, KV of
    ``kv_tokens`` tokens) the KV receives too (the source table is one contiguous range)."""
    BATCH = True
    request_id: str
    generation: int
    page: int
    peer_node: str
    blocks: tuple[int, ...] = ()
    kv_tokens: int = 0


@message
class RankDone(Message):
    """Rank -> coordinator: this rank finished its part (``kind`` empty) or failed it (``kind``
    a :class:`~statebridge.errors.FailureKind` name). Sent once per request, only when nothing
    of it can still touch the page."""
    BATCH = True
    tp_rank: int
    peer_node: str
    request_id: str
    generation: int
    kind: str
    message: str
    checksum: str
    seconds: float
    nbytes: int
    messages: int
    staging_bytes: int
    #: Decode ranks with checksums on and a request with KV: blake2b of the request's K and
    #: V for tokens < kv_tokens (see rank.kv_checksum).
    kv_checksum: str = ""
    #: ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for the machine's processes) when a
    #: prefill rank's state of the request was final (0 on decode ranks and failures) ...
    state_final_at: float = 0.0
    #: ... and when a decode rank held all of it (0 on prefill ranks and failures).
    held_at: float = 0.0


@message
class RankCancel(Message):
    """Coordinator -> rank: cancel the request's transfers; reply RankDone once nothing of it
    can still touch the page. ``lost_node`` (may be empty) names a dead peer node whose
    endpoints the rank must fail."""
    BATCH = True
    peer_node: str
    request_id: str
    generation: int
    kind: str
    reason: str
    lost_node: str


@message
class RankShutdown(Message):
    reason: str


@message
class RankLocalPrefill(Message):
    """Decode coordinator -> rank: compute the state of ``prompt`` into ``page`` locally (the
    ``recompute`` failure policy); answered with RankDone."""
    request_id: str
    generation: int
    prompt: Tokens
    page: int
    blocks: tuple[int, ...] = ()        # the KV of ``prompt`` goes here (spec with KV)


@message
class RankFailed(Message):
    """Rank -> coordinator: the rank could not start (its model, checkpoint or UCX failed);
    ``message`` is the error. The rank process exits after sending it."""
    tp_rank: int
    message: str


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

