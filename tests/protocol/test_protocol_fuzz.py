"""The decoder's contract: any bytes give a message or a ProtocolError, never anything else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import protocol_strategies as strategies
import pytest
from protocol_strategies import msgpack_values

from moeswarm import protocol as p
from moeswarm.errors import ProtocolError
from moeswarm.protocol._wire import unpack

VECTORS = Path(__file__).resolve().parents[2] / "protocol_spec" / "vectors"
VALID_BODIES = [bytes.fromhex(json.loads(f.read_text())["body_hex"])
                for f in sorted((VECTORS / "messages").glob("*.json"))]
CODES = {int(c) for c in p.ErrorCode}


def _check(body: bytes) -> p.Message | None:
    """Decode; on success the message must re-encode stably; on failure the code is known."""
    try:
        msg = p.decode(body)
    except ProtocolError as exc:
        assert exc.code in CODES, exc
        msg = None
    if msg is not None:
        again = p.encode(msg)
        assert p.encode(p.decode(again)) == again
    return msg


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=1024))
def test_arbitrary_bytes(body: bytes) -> None:
    _check(body)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64).map(lambda b: b"\x82\xa4type" + b))
def test_arbitrary_bytes_after_a_map_header(body: bytes) -> None:
    _check(body)


_mutation = st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]),
                      st.integers(0, 10_000), st.integers(0, 255))


def _mutate(body: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    data = bytearray(body)
    for op, pos, byte in ops:
        i = pos % (len(data) + 1)
        if op == "flip" and i < len(data):
            data[i] ^= 1 << (byte % 8)
        elif op == "set" and i < len(data):
            data[i] = byte
        elif op == "insert":
            data.insert(i, byte)
        elif op == "delete" and i < len(data):
            del data[i]
        elif op == "truncate":
            del data[i:]
    return bytes(data)


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from(VALID_BODIES), st.lists(_mutation, min_size=1, max_size=4))
def test_mutated_valid_frames(body: bytes, ops: list[tuple[str, int, int]]) -> None:
    _check(_mutate(body, ops))


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


_DELETE = object()


def _near(value: Any) -> st.SearchStrategy[Any]:
    """Values close to ``value``: the same type with an edge-case twist, most likely to slip by."""
    if type(value) is bytes:
        n = len(value)
        return st.binary(min_size=max(0, n - 5), max_size=n + 5) | st.integers(0, max(n - 1, 0)).map(
            lambda i: value[:i] + bytes([value[i] ^ 0x80]) + value[i + 1:] if value else b"\0")
    if type(value) is int:
        return st.sampled_from([-1, 0, 1, value - 1, value + 1, 2**16, 2**32 - 1, 2**32, 2**63,
                                2**64 - 1, -(2**63)]) | st.integers(-(2**63), 2**64 - 1)
    if type(value) is list:
        return st.sampled_from([[], value[:-1], value + value[-1:], value[::-1], value * 3])
    if type(value) is str:
        return st.text(max_size=300) | st.sampled_from(["", value + "/", " " + value, value * 40])
    if type(value) is dict:
        return st.sampled_from([{}] + [{k: v for k, v in value.items() if k != d} for d in value])
    return msgpack_values


def _replace(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    if value is _DELETE and isinstance(obj, dict):
        del obj[path[-1]]
    elif value is not _DELETE:
        obj[path[-1]] = value


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


STRATEGIES = {name: getattr(strategies, name) for name in (
    "hellos", "hello_acks", "auths", "errors", "pings", "countersigned", "announcements")}
STRATEGIES["expert_requests"] = strategies.expert_requests()
STRATEGIES["expert_responses"] = strategies.expert_responses()


def _edge_values(value: Any) -> list[Any]:
    """A fixed list of replacements for one field: every type, and near misses of its own type."""
    common: list[Any] = [_DELETE, None, True, 0, -1, 2**32, 2**64 - 1, -(2**63), 0.5, float("nan"),
                         "", "x" * 300, b"", b"\0" * 5, [], [0], [[]], {}, {"a": 1}]
    if type(value) is bytes:
        n = len(value)
        common += [value[:-1], value + b"\0", value[: n // 2], value * 2, b"\xff" * n,
                   bytes(max(n - 4, 0)), bytes(n + 4)]
    if type(value) is int:
        common += [value - 1, value + 1, 2**16, 2**32 - 1, 2**63]
    if type(value) is list:
        common += [value[:-1], value + value[-1:], value[::-1], value * 3, [None] * len(value)]
    if type(value) is str:
        common += [value + "/", " " + value, value.upper(), value * 40, "\u00e9"]
    if type(value) is dict:
        common += [{k: v for k, v in value.items() if k != d} for d in value]
    return common


def test_every_field_with_edge_values() -> None:
    """Deterministic sweep: each field of each vector message replaced by each edge value."""
    count = 0
    for body in VALID_BODIES:
        wire = unpack(body)
        for path in _paths(wire):
            for value in _edge_values(_get(wire, path)):
                mutated = unpack(body)
                _replace(mutated, path, value)
                _check(p.canonical(mutated))
                count += 1
    assert count > 3000


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_structured_field_corruption(kind: str, data: st.DataObject) -> None:
    wire = unpack(p.encode(data.draw(STRATEGIES[kind])))
    paths = _paths(wire)
    for _ in range(data.draw(st.integers(1, 2))):
        path = data.draw(st.sampled_from(paths))
        try:
            current = _get(wire, path)
            value = data.draw(st.just(_DELETE) | _near(current) | msgpack_values)
            _replace(wire, path, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier replacement changed the shape under this path
    _check(p.canonical(wire))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(t for t in ("hello", "hello_ack", "auth", "expert_request",
                                          "expert_response", "error", "ping", "pong",
                                          "countersigned_receipt", "announcement"))),
       st.dictionaries(st.sampled_from(["versions", "peer_id", "public_key", "nonce", "sig",
                                        "version", "request_id", "model_id", "layer", "seq",
                                        "hidden", "experts", "outputs", "receipt", "code",
                                        "message", "ts", "endpoints", "layers"]),
                       msgpack_values, max_size=8))
def test_random_maps_with_known_types(kind: str, fields: dict[str, Any]) -> None:
    _check(p.canonical({**fields, "type": kind}))
