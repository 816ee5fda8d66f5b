"""Malformed frames at a live expert server over TLS: each gets a protocol error, nothing hangs,
and the server still answers a valid request afterwards."""

from __future__ import annotations

import asyncio
import os
import struct

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeswarm.model import load_weights
from moeswarm.net.client import ExpertClient
from moeswarm.net.dataplane import DataPlaneServer, close_writer, parse_endpoint
from moeswarm.net.tls import channel_binding, client_context
from moeswarm.node.expert_server import ExpertServer, ExpertServerConfig
from moeswarm.protocol import (
    FATAL_CODES,
    ClientHandshake,
    Error,
    ExpertRequest,
    ExpertResponse,
    ExpertRows,
    HelloAck,
    Identity,
    encode,
    read_message,
    write_message,
)

VALID = dict(request_id=b"\x01" * 16, model_id="m", layer=0, seq=1, hidden=np.ones((2, 64), np.float32),
             experts=(ExpertRows(1, np.array([0, 1], np.uint32)),))
VALID_BODY = encode(ExpertRequest(**VALID))  # type: ignore[arg-type]


def mutations() -> st.SearchStrategy[bytes]:
    """Frame bodies: random bytes, random msgpack, and valid requests with bytes flipped or cut."""
    flipped = st.tuples(st.integers(0, len(VALID_BODY) - 1), st.integers(1, 255)).map(
        lambda t: VALID_BODY[: t[0]] + bytes([VALID_BODY[t[0]] ^ t[1]]) + VALID_BODY[t[0] + 1 :])
    cut = st.integers(1, len(VALID_BODY) - 1).map(lambda n: VALID_BODY[:n])
    objects = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=64)
                           | st.text(max_size=32), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=6),
                           max_leaves=20)
    typed = st.dictionaries(st.sampled_from(["type", "request_id", "hidden", "experts", "layer", "model_id", "seq"]),
                            objects, max_size=7).map(lambda d: {"type": "expert_request", **d})
    packed = (objects | typed).map(lambda o: msgpack.packb(o, use_bin_type=True))
    return st.binary(min_size=1, max_size=200) | flipped | cut | packed


class Harness:
    def __init__(self, folder) -> None:  # type: ignore[no-untyped-def]
        self.identity = Identity.generate()
        server = ExpertServer(load_weights(folder), self.identity, ExpertServerConfig("m", (0, 1), (0, 7)))
        self.expert_server = server
        self.dataplane = DataPlaneServer(self.identity, server.handle, fast_handler=server.answer_now)  # as nodes serve

    async def raw_connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port, _ = parse_endpoint(self.dataplane.endpoint)
        reader, writer = await asyncio.open_connection(host, port, ssl=client_context())
        cert = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        hs = ClientHandshake(Identity.generate(), channel_binding=channel_binding(cert))
        await write_message(writer, hs.hello)
        ack = await read_message(reader)
        assert isinstance(ack, HelloAck)
        await write_message(writer, hs.receive_ack(ack))
        return reader, writer


def test_malformed_frames_get_errors_and_the_server_keeps_serving(oracle_checkpoints) -> None:
    folder, _ = oracle_checkpoints.get("mixtral", "packed")
    harness = Harness(folder)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(harness.expert_server.start())
    loop.run_until_complete(harness.dataplane.start())
    seen_codes: set[int] = set()

    async def one(body: bytes) -> None:
        reader, writer = await harness.raw_connection()
        try:
            writer.write(struct.pack(">I", len(body)) + body)
            await writer.drain()
            reply = await asyncio.wait_for(read_message(reader), 10)
            if isinstance(reply, ExpertResponse):  # the mutation happened to stay valid
                return
            assert isinstance(reply, Error), reply
            seen_codes.add(reply.code)
            if reply.code in FATAL_CODES:
                assert await asyncio.wait_for(reader.read(), 10) == b""  # closed cleanly
            else:  # the same connection still answers a valid request
                await write_message(writer, ExpertRequest(**{**VALID, "request_id": os.urandom(16)}))  # type: ignore[arg-type]
                assert isinstance(await asyncio.wait_for(read_message(reader), 10), ExpertResponse)
        finally:
            await close_writer(writer)  # the TLS goodbye finishes before the next example

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mutations())
    def fuzz(body: bytes) -> None:
        loop.run_until_complete(one(body))

    try:
        fuzz()
        # an oversized length prefix is refused before any body byte is sent
        async def oversized() -> int:
            reader, writer = await harness.raw_connection()
            writer.write(struct.pack(">I", 2**31))
            await writer.drain()
            reply = await asyncio.wait_for(read_message(reader), 10)
            await close_writer(writer)
            assert isinstance(reply, Error)
            return reply.code

        assert loop.run_until_complete(oversized()) == 3

        async def still_serving() -> None:
            client = await ExpertClient.connect(harness.dataplane.endpoint, Identity.generate())
            response = await client.call(ExpertRequest(**{**VALID, "request_id": os.urandom(16)}), timeout=10)  # type: ignore[arg-type]
            assert response.outputs.shape == (2, 64)
            await client.aclose()

        loop.run_until_complete(still_serving())
    finally:
        loop.run_until_complete(harness.dataplane.aclose())
        loop.run_until_complete(harness.expert_server.aclose())
        loop.close()
    assert {1, 4} <= seen_codes  # both malformed frames and bad fields were exercised
