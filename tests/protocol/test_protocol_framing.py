"""Frames on asyncio streams: limits checked before the body, clean and unclean ends."""

from __future__ import annotations

import asyncio
import socket
import struct

import msgpack
import numpy as np
import pytest

from moeswarm import protocol as p
from moeswarm.errors import ConfigError, NetworkError, ProtocolError


def _reader(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_oversize_frame_rejected_before_reading_the_body() -> None:
    async def run() -> None:
        # header announces 1 MiB + 1 bytes; only 10 body bytes are there and no EOF:
        # a reader that tried to read the body would hang until wait_for fires
        reader = _reader(struct.pack(">I", 2**20 + 1) + b"x" * 10, eof=False)
        with pytest.raises(ProtocolError) as info:
            await asyncio.wait_for(p.read_frame(reader, max_size=2**20), 1.0)
        assert info.value.code == p.ErrorCode.FRAME_TOO_LARGE
        assert await reader.readexactly(10) == b"x" * 10  # the body was left unread

    asyncio.run(run())


def test_default_limit_is_64_mib() -> None:
    assert p.DEFAULT_MAX_FRAME == 64 * 2**20
    assert p.parse_frame_header(struct.pack(">I", 64 * 2**20)) == 64 * 2**20
    with pytest.raises(ProtocolError) as info:
        p.parse_frame_header(struct.pack(">I", 64 * 2**20 + 1))
    assert info.value.code == p.ErrorCode.FRAME_TOO_LARGE


def test_frames_back_to_back_then_clean_eof() -> None:
    msgs: list[p.Message] = [p.Ping(1), p.Pong(1), p.Error(8, "busy", bytes(16))]

    async def run() -> None:
        reader = _reader(b"".join(p.frame(m) for m in msgs))
        for m in msgs:
            assert await p.read_message(reader) == m
        assert await p.read_frame(reader) is None
        assert await p.read_message(reader) is None

    asyncio.run(run())


@pytest.mark.parametrize("data", [b"\x00\x00", p.frame(p.Ping(5))[:-1]])
def test_end_of_stream_inside_a_frame_is_a_network_error(data: bytes) -> None:
    async def run() -> None:
        with pytest.raises(NetworkError):
            await p.read_frame(_reader(data))

    asyncio.run(run())


def test_zero_length_frame_is_malformed() -> None:
    async def run() -> None:
        with pytest.raises(ProtocolError) as info:
            await p.read_frame(_reader(b"\x00\x00\x00\x00"))
        assert info.value.code == p.ErrorCode.MALFORMED_FRAME

    asyncio.run(run())


def test_valid_frame_with_bad_body_raises_protocol_error() -> None:
    async def run() -> None:
        with pytest.raises(ProtocolError) as info:
            await p.read_message(_reader(p.frame_body(b"\x91\x01")))
        assert info.value.code == p.ErrorCode.MALFORMED_FRAME

    asyncio.run(run())


def test_sender_refuses_frames_over_its_limit() -> None:
    with pytest.raises(ConfigError):
        p.frame_body(b"x" * 101, max_size=100)
    with pytest.raises(ConfigError):
        p.frame_body(b"")


def test_write_and_read_over_a_socket_pair() -> None:
    hidden = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float16)
    req = p.ExpertRequest(bytes(16), "m", 0, 1, hidden, (p.ExpertRows(3, np.arange(64)),))

    async def run() -> None:
        a, b = socket.socketpair()
        _, writer = await asyncio.open_connection(sock=a)
        reader, other = await asyncio.open_connection(sock=b)
        try:
            await p.write_message(writer, req)
            await p.write_message(writer, p.Ping(9))
            got = await p.read_message(reader)
            assert isinstance(got, p.ExpertRequest)
            assert got.hidden.tobytes() == hidden.tobytes()
            assert await p.read_message(reader) == p.Ping(9)
            writer.close()
            await writer.wait_closed()
            assert await p.read_message(reader) is None
        finally:
            other.close()
            await other.wait_closed()

    asyncio.run(run())


@pytest.mark.parametrize("rows", [1, 127, 128, 300])  # 4 KiB rows: 128 of them are LARGE_BIN, in one piece
def test_a_large_tensor_frame_is_the_canonical_encoding_built_in_one_buffer(rows: int) -> None:
    """``frame`` assembles a message with a large tensor from pieces (the tensor's bytes copied once):
    the frame is exactly the length prefix and the one codec's body (msgpack's own packing of the
    wire map), for requests, responses and weight fetches, float32 and float16, and it decodes back."""
    from moeswarm.protocol._wire import LARGE_BIN

    assert 127 * 4096 < LARGE_BIN <= 128 * 4096
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 1024)).astype(np.float32)
    messages = [
        p.ExpertRequest(bytes(16), "m", 1, 7, x, (p.ExpertRows(3, np.arange(rows, dtype=np.uint32)),), signed=True),
        p.ExpertResponse(bytes(range(16)), x, None, 12, 3),
        p.ExpertResponse(bytes(range(16)), np.concatenate([x, x]).astype(np.float16), None, 1, 0),
        p.WeightsResponse(bytes(16), x),
    ]
    for msg in messages:
        data = p.frame(msg)
        body = msgpack.packb(p.to_wire(msg), use_bin_type=True)
        assert data == len(body).to_bytes(4, "big") + body
        again = p.decode(data[4:])
        assert type(again) is type(msg)
    with pytest.raises(ConfigError, match="outside"):
        p.frame(messages[1], max_size=len(p.encode(messages[1])) - 1)
