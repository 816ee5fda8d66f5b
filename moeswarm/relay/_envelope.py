"""The relay session's wire format (``protocol_spec/relay.md``): envelopes and control messages.

A device holds one WebSocket to the relay. Every binary WebSocket message on it is an envelope

    kind: u8 | stream: u32 big-endian | payload

    kind 0 CONTROL  stream 0    payload: one canonical msgpack map with a str "type"
    kind 1 OPEN     relay->dev  payload: canonical msgpack {"remote": str} (client address, informative)
    kind 2 DATA     both ways   payload: exactly one data-plane frame, 4-byte length prefix included
    kind 3 CLOSE    both ways   payload: empty, or canonical msgpack {"code": u32, "message": str}

Client connections (``wss://HOST:PORT/<device peer id>``) carry bare data-plane frames, one per
binary WebSocket message, exactly as ``protocol_spec/README.md`` section 5 says; the relay wraps
them into DATA envelopes and unwraps the answers, never looking past the 4-byte length prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final

import msgpack

from ..errors import ProtocolError
from ..protocol import ErrorCode, Message, canonical, decode, encode, is_peer_id

HEADER: Final = 5  # kind byte + stream id
FRAME_HEADER: Final = 4
DEVICE_PATH: Final = "/device"  # where devices open their session
DEVICE_SUBPROTOCOL: Final = "moeswarm-relay.v1"
CLIENT_SUBPROTOCOL: Final = "moeswarm.v1"
RELAY_SCHEME: Final = "relay+wss"
_TEXT_RE: Final = re.compile(r"[\x20-\x7e]*")


class Kind(IntEnum):
    CONTROL = 0
    OPEN = 1
    DATA = 2
    CLOSE = 3


class CloseCode(IntEnum):
    """Why a relayed stream ended (CLOSE payload ``code``)."""

    NORMAL = 0  # the other side closed it
    PROTOCOL = 1  # malformed frame or envelope
    RATE_LIMITED = 2  # rate limit or quota exceeded
    SLOW_CONSUMER = 3  # the receiver did not keep up; its bounded queue overflowed
    IDLE = 4  # nothing sent either way for the idle timeout
    SHUTDOWN = 5  # the relay is going away
    DEVICE_GONE = 6  # the device's session ended


class WSClose(IntEnum):
    """WebSocket close codes the relay sends (RFC 6455 section 7.4, plus 4000-4999)."""

    NORMAL = 1000
    GOING_AWAY = 1001  # relay shutting down: reconnect later
    PROTOCOL_ERROR = 1002  # malformed envelope or frame
    UNSUPPORTED_DATA = 1003  # a text message
    POLICY = 1008  # authentication failed, rate limit or quota exceeded
    TOO_BIG = 1009  # a frame above the relay's max_frame
    INTERNAL = 1011
    TRY_AGAIN_LATER = 1013  # session limit reached
    REPLACED = 4000  # the same device opened a newer session
    SLOW_CONSUMER = 4001  # the peer did not read fast enough
    IDLE = 4002  # idle timeout


def pack(kind: Kind, stream: int, payload: bytes = b"") -> bytes:
    return bytes((kind,)) + stream.to_bytes(4, "big") + payload


def unpack(data: bytes) -> tuple[Kind, int, bytes]:
    """``(kind, stream, payload)``; ``ProtocolError`` code 1 for anything else."""
    if len(data) < HEADER:
        raise ProtocolError("envelope shorter than 5 bytes", code=ErrorCode.MALFORMED_FRAME)
    try:
        kind = Kind(data[0])
    except ValueError:
        raise ProtocolError(f"unknown envelope kind {data[0]}", code=ErrorCode.MALFORMED_FRAME) from None
    stream = int.from_bytes(data[1:5], "big")
    if (kind is Kind.CONTROL) != (stream == 0):
        raise ProtocolError("stream 0 is for CONTROL envelopes only", code=ErrorCode.MALFORMED_FRAME)
    return kind, stream, data[5:]


def check_frame(frame: bytes | memoryview, max_frame: int, offset: int = 0) -> None:
    """A data-plane frame starting at ``offset`` fills the rest of ``frame`` and fits the limit."""
    size = len(frame) - offset - FRAME_HEADER
    if size < 0:
        raise ProtocolError("message shorter than a frame header", code=ErrorCode.MALFORMED_FRAME)
    length = int.from_bytes(frame[offset : offset + FRAME_HEADER], "big")
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds {max_frame}", code=ErrorCode.FRAME_TOO_LARGE)
    if length == 0 or length != size:
        raise ProtocolError(f"frame header says {length} bytes, message holds {size}", code=ErrorCode.MALFORMED_FRAME)


# ---------------------------------------------------------------- control messages


@dataclass(frozen=True)
class Welcome:
    """Relay -> device after authentication: where clients reach the device, and the limits."""

    TYPE = "relay_welcome"
    endpoint: str  # relay+wss://HOST:PORT/<device peer id>, for the device's announcement
    relay_peer: bytes  # the relay's peer ID (also authenticated by the handshake)
    max_frame: int  # largest data-plane frame body the relay forwards, bytes
    max_streams: int  # concurrent client streams the relay opens to this device
    heartbeat_s: int  # the relay pings this often; a silent session closes after twice that


@dataclass(frozen=True)
class Publish:
    """Device -> relay: store this announcement (signed by the device) under these layers' keys."""

    TYPE = "relay_publish"
    record: bytes  # canonical encoding of the device's signed announcement
    layers: tuple[int, ...]  # MoE layers to store it under (each within record.layers)


@dataclass(frozen=True)
class Published:
    """Relay -> device: the announcement with this seq was stored under ``keys`` keys."""

    TYPE = "relay_published"
    seq: int
    keys: int


@dataclass(frozen=True)
class GoAway:
    """Relay -> device: the relay is going away; reconnect after ``retry_after_ms`` (plus jitter)."""

    TYPE = "relay_goaway"
    reason: str
    retry_after_ms: int


@dataclass(frozen=True)
class UnknownControl:
    """A control message of a type this implementation does not know: ignored (forward compatibility)."""

    type: str


Control = Welcome | Publish | Published | GoAway | UnknownControl | Message


def encode_control(msg: Control) -> bytes:
    if isinstance(msg, Welcome):
        return canonical({"type": msg.TYPE, "endpoint": msg.endpoint, "relay_peer": msg.relay_peer,
                          "max_frame": msg.max_frame, "max_streams": msg.max_streams,
                          "heartbeat_s": msg.heartbeat_s})
    if isinstance(msg, Publish):
        return canonical({"type": msg.TYPE, "record": msg.record, "layers": list(msg.layers)})
    if isinstance(msg, Published):
        return canonical({"type": msg.TYPE, "seq": msg.seq, "keys": msg.keys})
    if isinstance(msg, GoAway):
        return canonical({"type": msg.TYPE, "reason": msg.reason, "retry_after_ms": msg.retry_after_ms})
    if isinstance(msg, UnknownControl):
        return canonical({"type": msg.type})
    return encode(msg)


def _bad(message: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.BAD_FIELD)


def _field(m: dict[str, Any], name: str, kind: type) -> Any:
    value = m.get(name)
    if type(value) is not kind:
        raise _bad(f"{m.get('type')}.{name} is missing or not {kind.__name__}")
    return value


def _uint(m: dict[str, Any], name: str, hi: int = 2**32 - 1) -> int:
    value = _field(m, name, int)
    if not 0 <= value <= hi:
        raise _bad(f"{m.get('type')}.{name} = {value} is out of range")
    return int(value)


def decode_control(body: bytes) -> Control:
    """A CONTROL payload: relay messages here, data-plane messages through ``protocol.decode``."""
    try:
        m = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types for garbage
        raise ProtocolError(f"control payload is not msgpack: {e}", code=ErrorCode.MALFORMED_FRAME) from None
    if type(m) is not dict or type(m.get("type")) is not str:
        raise ProtocolError("control payload is not a map with a str type", code=ErrorCode.MALFORMED_FRAME)
    kind = m["type"]
    if kind == Welcome.TYPE:
        endpoint, peer = _field(m, "endpoint", str), _field(m, "relay_peer", bytes)
        if not is_peer_id(peer) or len(endpoint) > 256 or not _TEXT_RE.fullmatch(endpoint):
            raise _bad("relay_welcome has a bad endpoint or relay_peer")
        return Welcome(endpoint, peer, _uint(m, "max_frame"), _uint(m, "max_streams"), _uint(m, "heartbeat_s"))
    if kind == Publish.TYPE:
        layers = _field(m, "layers", list)
        if not 1 <= len(layers) <= 4096 or any(type(x) is not int or not 0 <= x < 2**32 for x in layers):
            raise _bad("relay_publish.layers must hold 1..4096 u32")
        record = _field(m, "record", bytes)
        if len(record) > 8192:
            raise ProtocolError("relay_publish.record exceeds 8192 bytes", code=ErrorCode.FRAME_TOO_LARGE)
        return Publish(record, tuple(layers))
    if kind == Published.TYPE:
        return Published(_uint(m, "seq", 2**64 - 1), _uint(m, "keys"))
    if kind == GoAway.TYPE:
        reason = _field(m, "reason", str)
        return GoAway(reason[:256], _uint(m, "retry_after_ms"))
    try:
        return decode(body)
    except ProtocolError as e:
        if e.code == ErrorCode.UNKNOWN_MESSAGE:
            return UnknownControl(kind[:64])
        raise


def close_payload(code: CloseCode, message: str = "") -> bytes:
    return canonical({"code": int(code), "message": message[:256]})


def parse_close(payload: bytes) -> tuple[int, str]:
    """``(code, message)`` of a CLOSE payload; tolerant: unknown shapes read as ``(0, "")``."""
    if not payload:
        return 0, ""
    try:
        m = msgpack.unpackb(payload, raw=False)
    except Exception:  # noqa: BLE001 - a CLOSE is honoured whatever its payload
        return 0, ""
    if type(m) is not dict:
        return 0, ""
    code, message = m.get("code"), m.get("message")
    return (code if type(code) is int else 0), (message if type(message) is str else "")
