"""The control-plane codec: round trips, and every bad input is a typed error."""

from __future__ import annotations

import dataclasses
import re
import typing

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statebridge.connector import messages as m
from statebridge.errors import IncompatiblePeerError, ProtocolError


def _value(annotation):
    if annotation is m.Tokens:
        return m.pack_tokens((3, 0, -1, 2**31 - 1))
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        return (_value(item), _value(item))
    return {int: 7, str: "req-1", bytes: b"\x00\xffaddr", bool: True, float: 0.25}[annotation]


def example(cls) -> m.Message:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _value(hints[f.name]) for f in dataclasses.fields(cls)})


ALL_TYPES = sorted(m.MESSAGE_TYPES.values(), key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda c: c.__name__)
def test_round_trip_every_message_type(cls):
    msg = example(cls)
    data = m.encode(msg)
    assert m.decode(data) == msg
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(msg, dataclasses.fields(cls)[0].name, None)


def test_envelope_is_versioned_and_typed():
    data = msgpack.unpackb(m.encode(example(m.Heartbeat)))
    assert data == {"v": m.PROTOCOL_VERSION, "t": "Heartbeat", "b": {"node_id": "req-1", "seq": 7}}


def envelope(v=m.PROTOCOL_VERSION, t="Heartbeat", b=None, **extra):
    body = {"node_id": "n", "seq": 1} if b is None else b
    return msgpack.packb({"v": v, "t": t, "b": body, **extra})


@pytest.mark.parametrize("data,error,needle", [
    (b"", ProtocolError, "undecodable"),
    (b"\xc1", ProtocolError, "undecodable"),
    (m.encode(example(m.TransferRequest))[:-3], ProtocolError, "undecodable"),
    (msgpack.packb([1, 2, 3]), ProtocolError, "list"),
    (envelope(extra=1), ProtocolError, "'extra'"),
    (envelope(v=m.PROTOCOL_VERSION + 1), IncompatiblePeerError,
     f"version {m.PROTOCOL_VERSION + 1}"),
    (envelope(v="1"), IncompatiblePeerError, "'1'"),
    (envelope(t="Launch"), ProtocolError, "'Launch'"),
    (envelope(t=5), ProtocolError, "5"),
    (envelope(b=[1]), ProtocolError, "body must be a map"),
    (envelope(b={"node_id": "n"}), ProtocolError, "missing fields ['seq']"),
    (envelope(b={"node_id": "n", "seq": 1, "x": 2}), ProtocolError, "'x'"),
    (envelope(b={"node_id": 3, "seq": 1}), ProtocolError, "Heartbeat.node_id must be str"),
    (envelope(b={"node_id": "n", "seq": True}), ProtocolError, "Heartbeat.seq must be int"),
    (envelope(b={"node_id": "n", "seq": "1"}), ProtocolError, "got str '1'"),
    (envelope(t="TransferRequest", b={"request_id": "r", "generation": 1, "prompt": [1, 2],
                                      "kv_blocks": [], "prefix_cache": True}),
     ProtocolError, "TransferRequest.prompt must be int32 token ids (bytes, a multiple of 4 "
                    "long), got list [1, 2]"),
    (envelope(t="TransferRequest", b={"request_id": "r", "generation": 1, "prompt": b"\0" * 6,
                                      "kv_blocks": [], "prefix_cache": True}),
     ProtocolError, "got 6 bytes"),
    (envelope(t="TransferRequest", b={"request_id": "r", "generation": 1, "prompt": b"",
                                      "kv_blocks": [1, "x"], "prefix_cache": True}),
     ProtocolError, "kv_blocks must be int"),
    (envelope(t="TransferRequest", b={"request_id": "r", "generation": 1, "prompt": b"",
                                      "kv_blocks": 5, "prefix_cache": True}),
     ProtocolError, "kv_blocks must be a list"),
    (msgpack.packb({1: 2}), ProtocolError, "undecodable"),
], ids=["empty", "reserved-byte", "truncated", "not-a-map", "extra-key", "version",
        "version-type", "unknown-type", "type-not-str", "body-list", "missing", "unknown-field",
        "wrong-type", "bool-as-int", "str-as-int", "tokens-as-list", "tokens-odd-length",
        "list-item", "not-list", "int-keys"])
def test_bad_bytes_raise_typed_errors_with_the_value(data, error, needle):
    with pytest.raises(error) as info:
        m.decode(data)
    assert needle in str(info.value)


@pytest.mark.parametrize("tokens", [(), (0,), (5, 1, 2**31 - 1, -(2**31), 7), range(4099)])
def test_tokens_round_trip_as_little_endian_int32(tokens):
    packed = m.pack_tokens(tokens)
    # the wire format, from the standard library rather than from pack_tokens
    assert packed == b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens)
    assert m.unpack_tokens(packed) == tuple(tokens)
    assert m.token_count(packed) == len(tokens)
    import numpy as np
    assert m.pack_tokens(np.asarray(tokens, dtype=np.int64)) == packed


@pytest.mark.parametrize("bad,needle", [([1, "x"], "got 'x' (str)"), ([2.0], "got 2.0 (float)"),
                                        ([0, 2**31], "got 2147483648"),
                                        ([-(2**31) - 1], "got -2147483649"),
                                        (b"\x01\x00\x00\x00", "sequence of integers, got bytes"),
                                        ("hello", "got str of length 5"),
                                        (5, "sequence of integers, got int")])
def test_tokens_out_of_int32_or_not_integers_are_refused_with_the_value(bad, needle):
    with pytest.raises(ValueError, match="token ids must be") as info:
        m.pack_tokens(bad)
    assert needle in str(info.value)


def test_oversized_message_is_refused_before_decoding():
    msg = m.TransferRequest(request_id="r", generation=1, prompt=m.pack_tokens(range(5000)))
    data = m.encode(msg)
    with pytest.raises(ProtocolError, match=f"{len(data)} bytes exceeds the limit of 1000"):
        m.decode(data, max_bytes=1000)
    assert m.decode(data) == msg


def test_encode_refuses_unregistered_objects():
    @dataclasses.dataclass(frozen=True)
    class Fake:
        x: int = 1
    with pytest.raises(ProtocolError, match="Fake"):
        m.encode(Fake())


def test_compat_hash_depends_on_spec():
    assert m.compat_hash("{a}") != m.compat_hash("{b}")
    assert m.compat_hash("{a}") == m.compat_hash("{a}")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_protocol_error(data):
    try:
        msg = m.decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, m.Message)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ALL_TYPES), st.data())
def test_mutated_messages_only_ever_raise_protocol_error(cls, data):
    raw = bytearray(m.encode(example(cls)))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    try:
        msg = m.decode(bytes(raw))
    except ProtocolError:
        return
    assert type(msg) in m.MESSAGE_TYPES.values()


# -- row batches (Message.BATCH types inside a group) -------------------------------------------

BATCH_TYPES = [cls for cls in ALL_TYPES if cls.BATCH]


def _other(cls) -> m.Message:
    """An instance of ``cls`` with every field different from example(cls)."""
    hints = typing.get_type_hints(cls)
    alt = {int: 9, str: "req-2", bytes: b"other", bool: False, float: 1.5}

    def value(annotation):
        if annotation is m.Tokens:
            return m.pack_tokens((8, 9))
        if typing.get_origin(annotation) is tuple:
            return (value(typing.get_args(annotation)[0]),)
        return alt[annotation]
    return cls(**{f.name: value(hints[f.name]) for f in dataclasses.fields(cls)})


def test_the_per_request_messages_of_a_group_are_the_batch_types():
    # (and TransferTimes, between groups: one row per request, off the request's path)
    assert {c.__name__ for c in BATCH_TYPES} == {"RankPrefill", "RankRecv", "RankDone",
                                                 "RankProbe", "RankCancel", "TransferTimes",
                                                 "RankDigest"}


@pytest.mark.parametrize("value", [0, 1, 2**63, 2**64 - 1])
def test_digests_travel_as_unsigned_64_bit_numbers(value):
    """Transfer digests are numbers mod 2**64: every one survives the codec, alone and in row
    batches; RankDone's -1 says "none"."""
    msgs = [m.TransferDigest(request_id="r", generation=3, digests=(value, 0)),
            m.RankDone(tp_rank=1, peer_node="p", request_id="r", generation=3, kind="",
                       message="", digest=value)]
    for msg in msgs:
        assert m.decode(m.encode(msg)) == msg
    row = m.RankDigest(tp_rank=0, peer_node="d", request_id="r", generation=3,
                       digests=(value, value))
    assert m.decode_frame(m.encode_rows(m.RankDigest, [m.message_row(row)] * 2)) == [row, row]
    assert m.RankDone(tp_rank=1, peer_node="p", request_id="r", generation=3, kind="",
                      message="").digest == -1


@pytest.mark.parametrize("cls", BATCH_TYPES, ids=lambda c: c.__name__)
def test_row_batches_round_trip_in_order(cls):
    msgs = [example(cls), _other(cls), example(cls)]
    frame = m.encode_rows(cls, [m.message_row(x) for x in msgs])
    assert m.decode_frame(frame) == msgs
    # no field names on the wire: the rows are the values in field order
    raw = msgpack.unpackb(frame)
    assert set(raw) == {"v", "t", "r"} and raw["t"] == cls.TYPE and len(raw["r"]) == 3
    assert len(raw["r"][0]) == len(dataclasses.fields(cls))
    assert m.decode_frame(m.encode(msgs[1])) == [msgs[1]]      # single frames too
    with pytest.raises(ProtocolError, match=f"{cls.TYPE}: a row batch of 3 where one message"):
        m.decode(frame)


def test_a_bad_row_is_an_error_in_its_place_and_the_others_decode():
    good, other = example(m.RankDone), _other(m.RankDone)
    row = list(m.message_row(other))
    row[3] = "seven"                                   # generation
    frame = msgpack.packb({"v": m.PROTOCOL_VERSION, "t": "RankDone",
                           "r": [list(m.message_row(good)), [1, 2], row,
                                 list(m.message_row(other))]}, use_bin_type=True)
    out = m.decode_frame(frame)
    assert out[0] == good and out[3] == other
    assert isinstance(out[1], ProtocolError)
    assert f"row 1 must be a list of {len(row)} fields" in str(out[1])
    assert isinstance(out[2], ProtocolError)
    assert "row 2: RankDone.generation must be int, got str 'seven'" in str(out[2])


@pytest.mark.parametrize("body,needle", [
    ({"t": "Heartbeat", "r": [["n", 1]]}, "Heartbeat is not sent in row batches"),
    ({"t": "RankDone", "r": []}, "a row batch holds 1 to 1024 rows, got 0 rows"),
    ({"t": "RankDone", "r": [[0]] * 1025}, "got 1025 rows"),
    ({"t": "RankDone", "r": {"a": 1}}, "got dict"),
    ({"t": "RankDone", "r": [], "b": {}}, "keys v, t, b (or v, t, r: a row batch)"),
])
def test_bad_row_batches_raise_typed_errors(body, needle):
    frame = msgpack.packb({"v": m.PROTOCOL_VERSION, **body})
    with pytest.raises(ProtocolError, match=re.escape(needle)):
        m.decode_frame(frame)


def test_only_batch_types_are_encoded_as_rows():
    with pytest.raises(ProtocolError, match="'Heartbeat' is not sent in row batches"):
        m.encode_rows(m.Heartbeat, [("n", 1)])
    with pytest.raises(ProtocolError, match="1 to 1024 messages, got 0"):
        m.encode_rows(m.RankDone, [])
