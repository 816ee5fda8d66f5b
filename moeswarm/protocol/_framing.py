"""Frames on a byte stream: a 4-byte big-endian body length, then one msgpack map.

The length is checked against the receiver's limit before a single body byte is read.
"""

from __future__ import annotations

import asyncio

from moeswarm.errors import ConfigError, NetworkError, ProtocolError

from ._codec import decode, encode, to_wire
from ._limits import DEFAULT_MAX_FRAME, FRAME_HEADER_SIZE, ErrorCode
from ._messages import ExpertRequest, ExpertResponse, Message, WeightsResponse
from ._wire import LARGE_BIN, pack_parts

_TENSOR_FIELD = {ExpertRequest: "hidden", ExpertResponse: "outputs", WeightsResponse: "data"}  # messages with a tensor


def frame_body(body: bytes, *, max_size: int = DEFAULT_MAX_FRAME) -> bytes:
    """Prefix an encoded body with its length; ``ConfigError`` if it exceeds ``max_size``."""
    if not 1 <= len(body) <= max_size:
        raise ConfigError(f"frame body of {len(body)} bytes is outside 1..{max_size}")
    return len(body).to_bytes(FRAME_HEADER_SIZE, "big") + body


def frame(msg: Message, *, max_size: int = DEFAULT_MAX_FRAME) -> bytes:
    """The complete frame (length prefix + canonical body) of ``msg``. A message carrying a large
    tensor is assembled in one buffer, the tensor's bytes copied into it once from its own array
    (``pack_parts``); small ones are packed whole (fewer Python steps)."""
    tensor = getattr(msg, _TENSOR_FIELD.get(type(msg), ""), None)
    if tensor is None or tensor.nbytes < LARGE_BIN:
        return frame_body(encode(msg), max_size=max_size)
    wire = to_wire(msg)
    parts: list[bytes | memoryview] = [b""]
    try:
        pack_parts(wire, parts)
    except ConfigError as exc:
        raise ConfigError(f"cannot encode message: {exc}") from exc
    length = sum(len(p) if type(p) is bytes else p.nbytes for p in parts)
    if not 1 <= length <= max_size:
        raise ConfigError(f"frame body of {length} bytes is outside 1..{max_size}")
    parts[0] = length.to_bytes(FRAME_HEADER_SIZE, "big")
    return b"".join(parts)


def parse_frame_header(header: bytes, *, max_size: int = DEFAULT_MAX_FRAME) -> int:
    """The body length announced by a 4-byte header, checked against ``max_size``.

    Raises ``ProtocolError`` code 1 for a zero length and code 3 above ``max_size``.
    """
    if len(header) != FRAME_HEADER_SIZE:
        raise ProtocolError("a frame header is 4 bytes", code=ErrorCode.MALFORMED_FRAME)
    length = int.from_bytes(header, "big")
    if length == 0:
        raise ProtocolError("empty frame", code=ErrorCode.MALFORMED_FRAME)
    if length > max_size:
        raise ProtocolError(
            f"frame of {length} bytes exceeds the limit of {max_size}", code=ErrorCode.FRAME_TOO_LARGE
        )
    return length


async def _read_exactly(reader: asyncio.StreamReader, n: int, *, at_boundary: bool) -> bytes | None:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        if at_boundary and not exc.partial:
            return None
        raise NetworkError("connection closed in the middle of a frame") from None
    except (ConnectionError, OSError) as exc:
        raise NetworkError(f"connection failed while reading a frame: {exc}") from exc


async def read_frame(
    reader: asyncio.StreamReader, *, max_size: int = DEFAULT_MAX_FRAME
) -> bytes | None:
    """Read one frame body; ``None`` on a clean end of stream between frames.

    ``ProtocolError`` (1 or 3) for a bad header, raised before the body is read;
    ``NetworkError`` when the stream ends or fails inside a frame.
    """
    header = await _read_exactly(reader, FRAME_HEADER_SIZE, at_boundary=True)
    if header is None:
        return None
    length = parse_frame_header(header, max_size=max_size)
    return await _read_exactly(reader, length, at_boundary=False)


async def read_message(
    reader: asyncio.StreamReader, *, max_size: int = DEFAULT_MAX_FRAME
) -> Message | None:
    """``read_frame`` then ``decode``; ``None`` on a clean end of stream."""
    body = await read_frame(reader, max_size=max_size)
    return None if body is None else decode(body)


async def write_message(
    writer: asyncio.StreamWriter, msg: Message, *, max_size: int = DEFAULT_MAX_FRAME
) -> None:
    """Write one framed message and wait for the transport's buffer to drain."""
    data = frame(msg, max_size=max_size)
    try:
        writer.write(data)
        await writer.drain()
    except (ConnectionError, OSError) as exc:
        raise NetworkError(f"connection failed while writing a frame: {exc}") from exc
