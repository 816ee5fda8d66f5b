"""Round trips for every message type, canonical output, and tensor validation codes."""

from __future__ import annotations

import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_strategies import messages, tensors

from moeswarm import protocol as p
from moeswarm.errors import ConfigError, ProtocolError
from moeswarm.protocol._wire import unpack

E = p.ErrorCode


def _bits(a: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    return str(a.dtype), a.shape, a.tobytes()


def _same(a: Any, b: Any) -> None:
    """Field-by-field equality that also compares numpy arrays bit for bit."""
    assert type(a) is type(b)
    if isinstance(a, p.ExpertRequest):
        assert _bits(a.hidden) == _bits(b.hidden)
        assert [(e.expert, e.rows.tolist()) for e in a.experts] == [(e.expert, e.rows.tolist())
                                                                      for e in b.experts]
        assert (a.request_id, a.model_id, a.layer, a.seq, a.deadline_ms) == (
            b.request_id, b.model_id, b.layer, b.seq, b.deadline_ms)
    elif isinstance(a, p.ExpertResponse):
        assert _bits(a.outputs) == _bits(b.outputs)
        assert (a.request_id, a.receipt, a.compute_us, a.load_permille) == (
            b.request_id, b.receipt, b.compute_us, b.load_permille)
    elif isinstance(a, p.WeightsResponse):
        assert _bits(a.data) == _bits(b.data) and a.request_id == b.request_id
    else:
        assert a == b


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_message_round_trips_canonically(msg: Any) -> None:
    body = p.encode(msg)
    decoded = p.decode(body)
    _same(msg, decoded)
    assert p.encode(decoded) == body
    assert p.canonical(unpack(body)) == body  # the codec's output is canonical
    assert p.frame(msg) == struct.pack(">I", len(body)) + body


def test_ping_encoding_by_hand() -> None:
    # {"ts": 1, "type": "ping"}, keys sorted, shortest forms
    assert p.encode(p.Ping(1)).hex() == "82a2747301a474797065a470696e67"
    assert p.encode(p.Pong(2**32)).hex() == "82a27473cf0000000100000000a474797065a4706f6e67"


def test_decoded_tensor_is_a_zero_copy_view() -> None:
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4)
    req = p.ExpertRequest(bytes(16), "m", 0, 0, hidden, (p.ExpertRows(0, np.arange(3)),))
    got = p.decode(p.encode(req))
    assert isinstance(got, p.ExpertRequest)
    base = got.hidden
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    assert isinstance(base, bytes)  # a view of the bytes msgpack produced: no copy
    assert not got.hidden.flags.writeable
    np.testing.assert_array_equal(got.hidden, hidden)


def _tensor_map(**changes: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"data": struct.pack("<4f", 1, 2, 3, 4), "dtype": "f32", "shape": [2, 2]}
    m.update(changes)
    return m


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        (_tensor_map(), None),
        (_tensor_map(data=b"\0" * 15), E.BAD_TENSOR),
        (_tensor_map(data=b"\0" * 17), E.BAD_TENSOR),
        (_tensor_map(dtype="f64"), E.BAD_TENSOR),
        (_tensor_map(dtype=b"f32"), E.BAD_TENSOR),
        (_tensor_map(shape=[]), E.BAD_TENSOR),
        (_tensor_map(shape=[1] * 9 + [4]), E.BAD_TENSOR),
        (_tensor_map(shape=[4, True]), E.BAD_TENSOR),
        (_tensor_map(shape=[2**32, 0]), E.BAD_TENSOR),
        (_tensor_map(shape=[2**31, 2**31, 2**31]), E.BAD_TENSOR),
        (_tensor_map(data="text"), E.BAD_TENSOR),
        (_tensor_map(data=struct.pack("<4f", 1, float("nan"), 3, 4)), E.NON_FINITE),
        (_tensor_map(data=struct.pack("<4f", 1, 2, float("-inf"), 4)), E.NON_FINITE),
        (_tensor_map(dtype="f16", data=struct.pack("<4e", 1, 2, 3, float("inf")), shape=[4]), E.NON_FINITE),
        (_tensor_map(dtype="bf16", data=bytes.fromhex("803f" "c07f" "0000" "0000"), shape=[4]), E.NON_FINITE),
        ([1, 2], E.BAD_TENSOR),
    ],
)
def test_tensor_validation_codes(wire: Any, code: int | None) -> None:
    if code is None:
        np.testing.assert_array_equal(p.tensor_from_wire(wire), [[1, 2], [3, 4]])
        return
    with pytest.raises(ProtocolError) as info:
        p.tensor_from_wire(wire)
    assert info.value.code == code


def test_tensor_rank_is_enforced_per_field() -> None:
    with pytest.raises(ProtocolError) as info:
        p.tensor_from_wire(_tensor_map(shape=[4]), rank=2)
    assert info.value.code == E.BAD_TENSOR


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**16 - 1), st.sampled_from(["f16", "bf16"]))
def test_non_finite_16_bit_patterns_match_numpy(bits: int, name: str) -> None:
    raw = struct.pack("<H", bits)
    as_float = float(np.frombuffer(raw, dtype=p.WIRE_DTYPES[name])[0])
    wire = {"data": raw, "dtype": name, "shape": [1]}
    if np.isfinite(as_float):
        assert p.tensor_from_wire(wire).tobytes() == raw
    else:
        with pytest.raises(ProtocolError) as info:
            p.tensor_from_wire(wire)
        assert info.value.code == E.NON_FINITE


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_non_finite_f32_patterns_match_numpy(bits: int) -> None:
    raw = struct.pack("<I", bits)
    wire = {"data": raw, "dtype": "f32", "shape": [1]}
    if np.isfinite(struct.unpack("<f", raw)[0]):
        assert p.tensor_from_wire(wire).tobytes() == raw
    else:
        with pytest.raises(ProtocolError):
            p.tensor_from_wire(wire)


@settings(max_examples=100, deadline=None)
@given(tensors())
def test_tensor_bytes_are_little_endian_row_major(arr: np.ndarray) -> None:
    wire = p.tensor_to_wire(arr)
    expected = arr.astype(arr.dtype.newbyteorder("<")).tobytes() if arr.dtype != ml_dtypes.bfloat16 \
        else arr.view(np.uint16).astype("<u2").tobytes()
    assert bytes(wire["data"]) == expected
    assert wire["shape"] == list(arr.shape)
    back = p.tensor_from_wire({**wire, "data": bytes(wire["data"])})
    assert back.dtype == arr.dtype and back.tobytes() == arr.tobytes()


def test_encode_rejects_local_misuse() -> None:
    with pytest.raises(ConfigError):
        p.tensor_to_wire(np.zeros((2, 2), dtype=np.float64))
    with pytest.raises(ConfigError):
        p.tensor_to_wire(np.zeros((), dtype=np.float32))
    with pytest.raises(ConfigError):
        p.encode("ping")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        p.encode(p.Ping(-1))
    with pytest.raises(ConfigError):
        p.encode(p.Ping(1.5))  # type: ignore[arg-type]
    req = p.ExpertRequest(bytes(16), "m", 0, 0, np.zeros((1, 1), np.float32),
                          (p.ExpertRows(0, np.array([0.5])),))
    with pytest.raises(ConfigError):
        p.encode(req)


def test_expert_request_rules() -> None:
    hidden = np.ones((3, 2), dtype=np.float16)
    ok = p.ExpertRequest(bytes(16), "org/m", 1, 9, hidden,
                         (p.ExpertRows(4, np.array([0, 2])), p.ExpertRows(2, np.array([1, 2]))))
    got = p.decode(p.encode(ok))
    assert isinstance(got, p.ExpertRequest) and got.pairs == 4
    assert [e.expert for e in got.experts] == [4, 2]  # request order is kept, not sorted
    assert got.experts[0].rows.dtype == np.dtype("<u4")


def test_peek_request_id() -> None:
    body = p.encode(p.Error(4, "x", b"r" * 16))
    assert p.peek_request_id(body) == b"r" * 16
    assert p.peek_request_id(body[:-1]) is None
    assert p.peek_request_id(p.encode(p.Ping(1))) is None
