"""The cluster wire format through its Python bindings: value round trips of every type,
frames split at random points, malformed and hostile input, unsupported values."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable
from decimal import Decimal

import pytest
from fastbroker_core import (
    FrameDecoder,
    FrameError,
    decode_value,
    encode_frame,
    encode_value,
)
from hypothesis import given, settings
from hypothesis import strategies as st

MAX_DEPTH = 64
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

# ---- strategies -------------------------------------------------------------------------

i64 = st.integers(I64_MIN, I64_MAX)
text = st.text(st.characters(codec="utf-8"), max_size=16)
# Every bit pattern, NaN payloads and signalling NaNs included.
float_bits = st.integers(0, 2**64 - 1).map(lambda b: struct.unpack(">d", b.to_bytes(8, "big"))[0])
floats = st.floats() | float_bits
scalars = st.none() | st.booleans() | i64 | floats | text | st.binary(max_size=16)

# Dict keys must hash: no NaN (never equal to itself), tuples instead of lists.
key_scalars = st.none() | st.booleans() | i64 | st.floats(allow_nan=False) | text | st.binary()
keys = st.recursive(key_scalars, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6)

values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
    ),
    max_leaves=24,
)
kinds = st.integers(0, 255)


def as_decoded(value: object, in_key: bool = False) -> object:
    """What decoding gives back: tuples become lists, except in dict keys, where they stay
    tuples."""
    if isinstance(value, list | tuple):
        items = [as_decoded(v, in_key) for v in value]
        return tuple(items) if in_key else items
    if isinstance(value, dict):
        return {as_decoded(k, True): as_decoded(v) for k, v in value.items()}
    if isinstance(value, bytearray):
        return bytes(value)
    return value


def same(a: object, b: object) -> bool:
    """Equal with the same types throughout (True is not 1) and floats equal bit for bit
    (NaN payloads, -0.0), dict items in the same order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)  # type: ignore[arg-type]
    if isinstance(a, list | tuple):
        assert isinstance(b, list | tuple)
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    return a == b


def feed_chunks(decoder: FrameDecoder, chunks: Iterable[bytes]) -> list[tuple[int, object]]:
    frames: list[tuple[int, object]] = []
    for chunk in chunks:
        frames.extend(decoder.feed(chunk))
    return frames


def nested(depth: int) -> object:
    value: object = None
    for _ in range(depth):
        value = [value]
    return value


# ---- round trips ------------------------------------------------------------------------


def test_same_tells_apart_what_the_wire_does() -> None:
    # The round-trip checks below are only as strict as this comparison.
    assert not same(True, 1)
    assert not same(1, 1.0)
    assert not same(0.0, -0.0)
    assert same(float("nan"), float("nan"))
    assert not same([1], (1,))
    assert not same({1: 2, 3: 4}, {3: 4, 1: 2})
    assert not same(b"a", "a")


def test_pinned_encodings() -> None:
    # The format is shared by every node: these bytes must not change.
    assert encode_value(None) == b"\x00"
    assert encode_value(False) == b"\x01"
    assert encode_value(True) == b"\x02"
    assert encode_value(0) == b"\x03\x00"
    assert encode_value(-1) == b"\x03\x01"
    assert encode_value(64) == b"\x03\x80\x01"
    assert encode_value(I64_MIN) == b"\x03" + b"\xff" * 9 + b"\x01"
    assert encode_value(1.5) == b"\x04" + struct.pack(">d", 1.5)
    assert encode_value("hé") == b"\x05\x03h\xc3\xa9"
    assert encode_value(b"\x00\xff") == b"\x06\x02\x00\xff"
    assert encode_value([1, None]) == b"\x07\x02\x03\x02\x00"
    assert encode_value({"a": True}) == b"\x08\x01\x05\x01a\x02"
    assert encode_frame(7, None) == b"\x00\x00\x00\x02\x07\x00"
    assert encode_frame(255, [1, None]) == b"\x00\x00\x00\x06\xff\x07\x02\x03\x02\x00"


@settings(max_examples=300, deadline=None)
@given(values)
def test_value_round_trip(value: object) -> None:
    data = encode_value(value)
    back = decode_value(data)
    assert same(back, as_decoded(value)), (value, back)
    # One encoding per value: re-encoding what was decoded gives the same bytes.
    assert encode_value(back) == data


@pytest.mark.parametrize(
    "value",
    [
        I64_MIN,
        I64_MAX,
        0,
        "",
        b"",
        [],
        {},
        "x" * 300,
        b"\x00" * 70_000,
        "\x00\U0010ffff",
        float("inf"),
        float("-inf"),
        -0.0,
        5e-324,
        nested(MAX_DEPTH),
        {None: 1, False: 2, 3: 4, 5.5: 6, "s": 7, b"b": 8, (1, (2, "x")): 9},
    ],
)
def test_boundaries_round_trip(value: object) -> None:
    assert same(decode_value(encode_value(value)), as_decoded(value))


def test_bool_and_int_stay_apart() -> None:
    assert encode_value(True) != encode_value(1)
    assert encode_value(False) != encode_value(0)
    assert decode_value(encode_value(True)) is True
    assert decode_value(encode_value(False)) is False
    one = decode_value(encode_value(1))
    assert type(one) is int and one == 1
    back = decode_value(encode_value({True: 1, 2: False, "l": [0, True, 1.0]}))
    assert same(back, {True: 1, 2: False, "l": [0, True, 1.0]})


def test_tuples_and_bytearrays() -> None:
    assert encode_value((1, "a")) == encode_value([1, "a"])
    assert decode_value(encode_value((1, (2,)))) == [1, [2]]
    # A list in a key comes back as a tuple (a list cannot be a key).
    assert encode_value({(1, 2): 3}) == b"\x08\x01\x07\x02\x03\x02\x03\x04\x03\x06"
    assert same(decode_value(encode_value({(1, (2,)): [3]})), {(1, (2,)): [3]})
    assert encode_value(bytearray(b"ab")) == encode_value(b"ab")
    assert decode_value(bytearray(encode_value("x"))) == "x"


# ---- frames -----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(st.tuples(kinds, values), max_size=6),
    cuts=st.lists(st.floats(0, 1), max_size=10),
)
def test_frames_split_at_random_points(frames: list[tuple[int, object]], cuts: list[float]) -> None:
    stream = b"".join(encode_frame(kind, value) for kind, value in frames)
    points = sorted({0, len(stream), *(int(c * len(stream)) for c in cuts)})
    chunks = [stream[a:b] for a, b in itertools.pairwise(points)]
    decoder = FrameDecoder()
    got = feed_chunks(decoder, chunks)
    assert [kind for kind, _ in got] == [kind for kind, _ in frames]
    for (_, value), (_, back) in zip(frames, got, strict=True):
        assert same(back, as_decoded(value))
    assert decoder.buffered == 0


def test_byte_by_byte_and_buffered() -> None:
    frame = encode_frame(3, {"term": 7, "entries": [b"x" * 200]})
    decoder = FrameDecoder()
    for i in range(len(frame) - 1):
        assert decoder.feed(frame[i : i + 1]) == []
        assert decoder.buffered == i + 1
    # The last byte, and the beginning of the next frame in the same read.
    nxt = encode_frame(4, None)
    assert decoder.feed(frame[-1:] + nxt[:2]) == [(3, {"term": 7, "entries": [b"x" * 200]})]
    assert decoder.buffered == 2
    assert decoder.feed(bytearray(nxt[2:])) == [(4, None)]
    assert decoder.buffered == 0


def test_oversized_frame_is_rejected_on_its_length_alone() -> None:
    decoder = FrameDecoder(max_frame=100)
    assert decoder.feed(b"\x00\x00\x00") == []
    with pytest.raises(FrameError, match="101 bytes is over the maximum of 100"):
        decoder.feed(b"\x65")  # the 4th byte of the length: 101; no body sent
    # The default limit, 16 MiB: 16 MiB waits for its body, one byte more is refused.
    decoder = FrameDecoder()
    assert decoder.feed(struct.pack(">I", 16 * 1024 * 1024)) == []
    assert decoder.buffered == 4
    with pytest.raises(FrameError):
        FrameDecoder().feed(struct.pack(">I", 16 * 1024 * 1024 + 1))
    with pytest.raises(FrameError):
        FrameDecoder().feed(b"\xff\xff\xff\xff")


def test_frame_of_exactly_max_frame_passes() -> None:
    frame = encode_frame(1, b"\x05" * 97)  # kind, tag, 1-byte length, 97 bytes: 100
    assert len(frame) == 104
    assert FrameDecoder(max_frame=100).feed(frame) == [(1, b"\x05" * 97)]
    with pytest.raises(FrameError):
        FrameDecoder(max_frame=99).feed(frame)


def test_a_broken_stream_stays_broken() -> None:
    decoder = FrameDecoder()
    with pytest.raises(FrameError, match="unknown value tag 0x63"):
        decoder.feed(encode_frame(1, "ok") + b"\x00\x00\x00\x02\x01\x63")
    for _ in range(2):
        with pytest.raises(FrameError, match="unknown value tag 0x63"):
            decoder.feed(encode_frame(1, "fine"))
    decoder = FrameDecoder(max_frame=10)
    for _ in range(2):
        with pytest.raises(FrameError, match="over the maximum"):
            decoder.feed(b"\x00\x00\x00\x0b")


def test_max_frame_must_be_positive() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(max_frame=0)


# ---- malformed input --------------------------------------------------------------------

MALFORMED_VALUES = [
    (b"", "truncated"),
    (b"\x09", "unknown value tag 0x09"),
    (b"\xff", "unknown value tag 0xff"),
    (b"\x03", "truncated"),
    (b"\x03\x80", "truncated"),
    (b"\x04\x00\x00", "truncated"),
    (b"\x05\x02a", "truncated"),
    (b"\x05\x02\xc3\x28", "UTF-8"),
    (b"\x05\x03\xed\xa0\x80", "UTF-8"),  # an encoded surrogate
    (b"\x06\x01", "truncated"),
    (b"\x07\x02\x00", "truncated"),
    (b"\x08\x01\x00", "truncated"),
    (b"\x07" + b"\xff" * 8 + b"\x7f", "truncated"),  # a huge count, nothing behind it
    (b"\x00\x00", "trailing bytes"),
    (b"\x03\x80\x00", "overlong varint"),
    (b"\x03" + b"\xff" * 9 + b"\x02", "overflows 64 bits"),
    (b"\x03" + b"\x80" * 10 + b"\x01", "overflows 64 bits"),
    (b"\x07\x01" * (MAX_DEPTH + 1) + b"\x00", "nested deeper than 64"),
    (b"\x07\x01" * 100_000, "nested deeper than 64"),
    (b"\x08\x01\x08\x00\x00", "unusable dict key"),  # {{}: None}
    (b"\x08\x01\x07\x01\x08\x00\x00", "unusable dict key"),  # {[{}]: None}
]


@pytest.mark.parametrize(("data", "why"), MALFORMED_VALUES)
def test_malformed_values_raise(data: bytes, why: str) -> None:
    with pytest.raises(FrameError, match=why):
        decode_value(data)
    # The same value inside a frame breaks the stream.
    with pytest.raises(FrameError, match=why):
        FrameDecoder().feed(struct.pack(">IB", len(data) + 1, 0) + data)


def test_malformed_frames_raise() -> None:
    with pytest.raises(FrameError, match="empty frame"):
        FrameDecoder().feed(b"\x00\x00\x00\x00")
    # A value running past its frame's end, into the next frame.
    with pytest.raises(FrameError, match="truncated"):
        FrameDecoder().feed(b"\x00\x00\x00\x03\x07\x05\x02" + encode_frame(1, None))
    assert issubclass(FrameError, ValueError)


@settings(max_examples=500, deadline=None)
@given(
    data=st.lists(st.integers(0, 11) | st.integers(0, 255), max_size=80).map(bytes),
    max_frame=st.integers(1, 64),
    cuts=st.lists(st.integers(0, 80), max_size=4),
)
def test_random_bytes_never_crash(data: bytes, max_frame: int, cuts: list[int]) -> None:
    try:
        decode_value(data)
    except FrameError:
        pass
    points = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    decoder = FrameDecoder(max_frame)
    try:
        for a, b in itertools.pairwise(points):
            decoder.feed(data[a:b])
    except FrameError:
        pass
    else:
        assert decoder.buffered <= len(data)


# ---- what cannot be encoded -------------------------------------------------------------


def self_holding_list() -> list[object]:
    items: list[object] = []
    items.append(items)
    return items


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({1}, "type set"),
        (frozenset(), "type frozenset"),
        (object(), "type object"),
        (1j, "type complex"),
        (Decimal(1), "type Decimal"),
        ([1, {2}], "type set"),
        ({"k": object()}, "type object"),
        ({frozenset(): 1}, "type frozenset"),
        (I64_MAX + 1, "i64"),
        (I64_MIN - 1, "i64"),
        ("\ud800", "surrogate"),
        (nested(MAX_DEPTH + 1), "deeper than 64"),
        ({"k": nested(MAX_DEPTH)}, "deeper than 64"),
        (self_holding_list(), "deeper than 64"),
    ],
)
def test_unsupported_values_are_rejected(value: object, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        encode_value(value)
    with pytest.raises(ValueError, match=why):
        encode_frame(1, value)


@pytest.mark.parametrize("kind", [-1, 256, 2**70, "1", None, 1.0])
def test_bad_kind_is_rejected(kind: object) -> None:
    with pytest.raises(ValueError, match="kind"):
        encode_frame(kind, None)  # type: ignore[arg-type]
