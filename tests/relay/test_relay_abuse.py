"""Misbehaving peers against an in-process relay: each is throttled or disconnected while a
well-behaved device (a real bridge) keeps answering calls through the same relay."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import numpy as np
import pytest

from moeswarm.errors import Unreachable
from moeswarm.mobile_bridge import BridgeConfig, export_onnx, run_bridge, running_bridge
from moeswarm.net.client import ExpertClient
from moeswarm.protocol import (
    ExpertRequest,
    ExpertRows,
    Identity,
    Ping,
    check_response,
    frame,
    peer_id_from_str,
)
from moeswarm.relay import (
    Kind,
    MemoryDirectory,
    RelayConfig,
    RelayLimits,
    RelayServer,
    WSClose,
    pack,
    set_relay_ca,
)


@pytest.fixture(scope="module")
def shards(mixtral: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("abuse-shards")
    return out, export_onnx(mixtral[0], out, experts=(0, 1))


@contextlib.asynccontextmanager
async def relay_with_bridge(certs: Any, shards: tuple[Path, Any], **limits: Any) -> AsyncIterator[tuple[RelayServer, dict[str, Any]]]:
    relay = RelayServer(Identity.generate(), RelayConfig("127.0.0.1", 0, str(certs.cert), str(certs.key),
                                                         limits=RelayLimits(**limits)), MemoryDirectory())
    await relay.start()
    try:
        async with running_bridge(BridgeConfig(relay.url, str(shards[0]), str(certs.ca), max_backoff_s=0.5)) as info:
            yield relay, info
    finally:
        await relay.aclose(graceful=False)


async def call_latencies(info: dict[str, Any], model_id: str, n: int) -> list[float]:
    """``n`` checked expert calls through the relay to the good device; seconds each."""
    me = Identity.generate()
    device = peer_id_from_str(info["peer_id"])
    client = await ExpertClient.connect(info["endpoint"], me, expected_peer=device)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    times = []
    try:
        for i in range(n):
            request = ExpertRequest(os.urandom(16), model_id, 0, i + 1, x, (ExpertRows(1, np.array([0, 1], np.uint32)),))
            t0 = time.perf_counter()
            response = await client.call(request, 5.0)
            times.append(time.perf_counter() - t0)
            check_response(request, response, client=me.peer_id, server=device)
    finally:
        await client.aclose()
    return times


def errors(relay: RelayServer, kind: str) -> float:
    return relay.metrics.errors.labels(kind)._value.get()


def test_a_flooding_device_is_disconnected_while_another_device_keeps_serving(conformance: ModuleType, certs: Any, shards: Any) -> None:
    set_relay_ca(str(certs.ca))

    async def main() -> None:
        async with relay_with_bridge(certs, shards, device_frames_per_s=200, max_flood_s=0.3) as (relay, info):
            flooder = conformance.RawDevice(relay.url, str(certs.ca))
            assert type(await flooder.authenticate()).__name__ == "Welcome"
            frame = b"\x00\x00\x00\x01\x80"  # a tiny valid frame, for a stream that does not exist

            async def flood() -> WSClose | None:
                with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                    for _ in range(20_000):
                        await flooder.ws.send_bytes(pack(Kind.DATA, 7, frame))
                msg = await flooder.ws.receive(timeout=60)
                while msg.type is aiohttp.WSMsgType.BINARY:  # the relay's error explanation comes first
                    msg = await flooder.ws.receive(timeout=60)
                return msg.data if msg.type is aiohttp.WSMsgType.CLOSE else None

            try:
                flood_task = asyncio.create_task(flood())
                times = await call_latencies(info, shards[1].model_id, 100)  # while the flood runs
                code = await flood_task
            finally:
                await flooder.close()
            assert code == WSClose.POLICY
            assert errors(relay, "rate_limited") >= 1
            assert peer_id_from_str(info["peer_id"]) in relay.devices  # the good device is still there
            assert len(relay.devices) == 1
            assert len(times) == 100  # every call answered during the flood (the latency figures: benchmarks/relay.py)
            assert len(await call_latencies(info, shards[1].model_id, 5)) == 5

    asyncio.run(main())


@pytest.mark.parametrize("bad, close", [
    (pack(Kind.DATA, 7, b"\x00\x00\x00\x09abc"), WSClose.PROTOCOL_ERROR),  # length prefix disagrees
    (pack(Kind.DATA, 0, b"\x00\x00\x00\x01\x80"), WSClose.PROTOCOL_ERROR),  # DATA on stream 0
    (b"\x09\x00\x00\x00\x01", WSClose.PROTOCOL_ERROR),  # unknown envelope kind
    (pack(Kind.OPEN, 3, b""), WSClose.PROTOCOL_ERROR),  # devices do not open streams
    (pack(Kind.DATA, 7, (80 << 20).to_bytes(4, "big") + b"x"), WSClose.TOO_BIG),  # above max_frame
    ("hello", WSClose.UNSUPPORTED_DATA),  # a text message
], ids=["length-mismatch", "data-on-stream-0", "unknown-kind", "device-open", "frame-too-large", "text"])
def test_malformed_device_messages_disconnect_only_the_sender(conformance: ModuleType, certs: Any, shards: Any, bad: bytes | str,
                                                              close: WSClose) -> None:
    set_relay_ca(str(certs.ca))

    async def main() -> None:
        async with relay_with_bridge(certs, shards) as (relay, info):
            culprit = conformance.RawDevice(relay.url, str(certs.ca))
            await culprit.authenticate()
            await (culprit.ws.send_str(bad) if isinstance(bad, str) else culprit.ws.send_bytes(bad))
            msg = await culprit.ws.receive(timeout=10)
            while msg.type is aiohttp.WSMsgType.BINARY:  # the relay's error explanation comes first
                msg = await culprit.ws.receive(timeout=10)
            await culprit.close()
            assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == close, msg
            assert list(relay.devices) == [peer_id_from_str(info["peer_id"])]
            assert len(await call_latencies(info, shards[1].model_id, 3)) == 3

    asyncio.run(main())


def test_a_flooding_client_is_disconnected_and_the_device_keeps_serving(conformance: ModuleType, certs: Any, shards: Any) -> None:
    set_relay_ca(str(certs.ca))

    async def main() -> None:
        async with relay_with_bridge(certs, shards, client_frames_per_s=100, max_flood_s=0.3) as (relay, info):
            http, ws = await conformance.open_client(f"{relay.url}/{info['peer_id']}", str(certs.ca))
            try:
                await conformance.client_handshake(ws, Identity.generate(), peer_id_from_str(info["peer_id"]))
                with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                    for i in range(5000):  # valid pings, far above the client frame rate
                        await ws.send_bytes(frame(Ping(i)))
                msg = await ws.receive(timeout=60)
                while msg.type is aiohttp.WSMsgType.BINARY:  # the device's pongs
                    msg = await ws.receive(timeout=60)
                assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == WSClose.POLICY, msg
            finally:
                await ws.close()
                await http.close()
            # the limiter is per address: wait for its bucket to refill, then the device still answers
            await asyncio.sleep(1.5)
            assert len(await call_latencies(info, shards[1].model_id, 3)) == 3

    asyncio.run(main())


def test_untrusted_certificate_is_refused_by_bridge_and_client(certs: Any, other_ca: Any, shards: Any) -> None:
    async def main() -> None:
        async with relay_with_bridge(certs, shards) as (relay, info):
            with pytest.raises(Unreachable, match="certificate"):
                await asyncio.wait_for(run_bridge(BridgeConfig(relay.url, str(shards[0]), str(other_ca.ca))), 20)
            assert len(relay.devices) == 1  # only the trusted bridge
            set_relay_ca(str(other_ca.ca))
            try:
                t0 = time.monotonic()
                with pytest.raises(Unreachable, match="not trusted"):
                    await ExpertClient.connect(info["endpoint"], Identity.generate(), timeout=120)
                assert time.monotonic() - t0 < 60  # refused at once, not retried until the (long) timeout
            finally:
                set_relay_ca(str(certs.ca))

    asyncio.run(main())


def test_idle_streams_are_closed_and_the_client_reconnects(certs: Any, shards: Any) -> None:
    set_relay_ca(str(certs.ca))

    async def main() -> None:
        async with relay_with_bridge(certs, shards, idle_timeout_s=0.3) as (relay, info):
            client = await ExpertClient.connect(info["endpoint"], Identity.generate(),
                                                expected_peer=peer_id_from_str(info["peer_id"]))
            deadline = time.monotonic() + 5
            while not client.closed and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert client.closed and errors(relay, "idle") >= 1
            await client.aclose()
            assert len(await call_latencies(info, shards[1].model_id, 2)) == 2

    asyncio.run(main())


def test_a_client_over_its_byte_quota_is_cut_off(certs: Any, shards: Any) -> None:
    set_relay_ca(str(certs.ca))

    async def main() -> None:
        async with relay_with_bridge(certs, shards, client_quota_bytes=20_000) as (relay, info):
            with pytest.raises(Unreachable):  # the stream is closed (1008) once the quota is spent
                await call_latencies(info, shards[1].model_id, 100)
            assert errors(relay, "quota") >= 1
            assert peer_id_from_str(info["peer_id"]) in relay.devices
    asyncio.run(main())


def test_a_client_that_stops_reading_loses_its_stream_not_the_device(conformance: ModuleType, certs: Any, shards: Any) -> None:
    set_relay_ca(str(certs.ca))

    async def main() -> None:
        async with relay_with_bridge(certs, shards, queue_bytes=256 << 10) as (relay, info):
            device = peer_id_from_str(info["peer_id"])
            http, ws = await conformance.open_client(f"{relay.url}/{info['peer_id']}", str(certs.ca))
            try:
                await conformance.client_handshake(ws, Identity.generate(), device)
                x = np.ones((2048, 64), np.float32)  # each answer is 512 KiB
                rows = np.arange(2048, dtype=np.uint32)
                with contextlib.suppress(ConnectionError, aiohttp.ClientError):  # cut off while sending
                    for i in range(60):  # ... and this client never reads them
                        request = ExpertRequest(os.urandom(16), shards[1].model_id, 0, i + 1, x,
                                                (ExpertRows(0, rows),))
                        await ws.send_bytes(frame(request))
                deadline = time.monotonic() + 20
                while errors(relay, "slow_consumer") < 1 and time.monotonic() < deadline:
                    assert len(await call_latencies(info, shards[1].model_id, 1)) == 1  # others are served
            finally:
                await ws.close()
                await http.close()
            assert errors(relay, "slow_consumer") >= 1
            assert device in relay.devices
            assert len(await call_latencies(info, shards[1].model_id, 3)) == 3

    asyncio.run(main())
