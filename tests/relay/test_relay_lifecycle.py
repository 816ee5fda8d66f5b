"""The relay's life: metrics and health, graceful shutdown that sends devices elsewhere for a
moment, a restart on the same port, dials that wait for a reconnecting device, pinning."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import numpy as np
import pytest

from moeswarm.errors import Unreachable
from moeswarm.mobile_bridge import BridgeConfig, export_onnx, run_bridge, running_bridge
from moeswarm.net.client import ExpertClient
from moeswarm.protocol import ExpertRequest, ExpertRows, Identity, peer_id_from_str
from moeswarm.relay import (
    GoAway,
    MemoryDirectory,
    RelayConfig,
    RelayLimits,
    RelayServer,
    WSClose,
    set_relay_ca,
)


@pytest.fixture(scope="module")
def shards(mixtral: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("lifecycle-shards")
    return out, export_onnx(mixtral[0], out, experts=(3, 3))


def new_relay(certs: Any, port: int = 0, **limits: Any) -> RelayServer:
    return RelayServer(Identity.generate(), RelayConfig("127.0.0.1", port, str(certs.cert), str(certs.key),
                                                        limits=RelayLimits(**limits)), MemoryDirectory())


async def one_call(client: ExpertClient, model_id: str, seq: int) -> None:
    x = np.ones((1, 64), np.float32)
    await client.call(ExpertRequest(os.urandom(16), model_id, 1, seq, x, (ExpertRows(3, np.zeros(1, np.uint32)),)), 5)


async def until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_metrics_and_health(certs: Any, shards: Any) -> None:
    set_relay_ca(str(certs.ca))

    async def main() -> tuple[str, dict[str, Any]]:
        relay = new_relay(certs)
        await relay.start()
        try:
            async with running_bridge(BridgeConfig(relay.url, str(shards[0]), str(certs.ca))) as info:
                metrics, health = await calls_and_scrape(relay, info)
        finally:
            await relay.aclose()
        return metrics, health

    async def calls_and_scrape(relay: RelayServer, info: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        client = await ExpertClient.connect(info["endpoint"], Identity.generate())
        for seq in range(1, 6):
            await one_call(client, shards[1].model_id, seq)
        ctx = ssl.create_default_context(cafile=str(certs.ca))
        http = relay.url.replace("wss://", "https://")
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{http}/metrics", ssl=ctx) as resp:
                metrics = await resp.text()
            async with session.get(f"{http}/healthz", ssl=ctx) as resp:
                health = await resp.json()
        await client.aclose()
        return metrics, health

    metrics, health = asyncio.run(main())
    assert health["status"] == "ok" and health["devices"] == 1 and health["streams"] == 1
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines() if line and line[0] != "#"}
    assert values["moeswarm_relay_devices"] == 1 and values["moeswarm_relay_streams"] == 1
    assert values['moeswarm_relay_sessions_total{role="device"}'] == 1
    assert values["moeswarm_relay_calls_total"] >= 6  # hello/hello_ack and the 5 calls
    assert values["moeswarm_relay_round_trip_seconds_count"] >= 6
    assert values['moeswarm_relay_forwarded_bytes_total{direction="to_device"}'] > 5 * 256
    assert values['moeswarm_relay_forwarded_frames_total{direction="to_client"}'] >= 6
    assert values["moeswarm_relay_published_records_total"] == 1
    assert values['moeswarm_relay_errors_total{kind="malformed"}'] == 0


def test_graceful_shutdown_sends_devices_away_and_they_return_to_the_restarted_relay(conformance: ModuleType, certs: Any, shards: Any) -> None:
    set_relay_ca(str(certs.ca))

    async def main() -> None:
        relay = new_relay(certs)
        await relay.start()
        port = relay.port
        raw = conformance.RawDevice(relay.url, str(certs.ca))
        bridge = running_bridge(BridgeConfig(relay.url, str(shards[0]), str(certs.ca), max_backoff_s=0.5))
        try:
            info = await bridge.__aenter__()
            await raw.authenticate()
            raw.start_serving()
            device = peer_id_from_str(info["peer_id"])
            client = await ExpertClient.connect(info["endpoint"], Identity.generate(), expected_peer=device)
            await one_call(client, shards[1].model_id, 1)

            await relay.aclose(graceful=True)
            assert any(isinstance(c, GoAway) for c in raw.controls)  # told to come back later
            assert raw.ws.close_code == WSClose.GOING_AWAY
            await until(lambda: client.closed)

            relay = new_relay(certs, port)  # same port; its startup grace answers 503 for now
            await relay.start()
            client2 = await ExpertClient.connect(info["endpoint"], Identity.generate(), expected_peer=device,
                                                 timeout=60)  # waits for the bridge to come back
            assert device in relay.devices
            await one_call(client2, shards[1].model_id, 2)
            await client2.aclose()
            await client.aclose()
        finally:
            await raw.close()
            await bridge.__aexit__(None, None, None)
            await relay.aclose()

    asyncio.run(main())


def test_unknown_device_fails_fast_and_a_pinned_relay_is_enforced(certs: Any, shards: Any) -> None:
    set_relay_ca(str(certs.ca))

    async def main() -> None:
        relay = new_relay(certs, startup_grace_s=0)
        await relay.start()
        try:
            stranger = Identity.generate()
            t0 = time.monotonic()
            with pytest.raises(Unreachable, match="404"):
                await ExpertClient.connect(f"relay+wss://127.0.0.1:{relay.port}/{stranger.peer_id_str}",
                                           Identity.generate(), timeout=120)
            assert time.monotonic() - t0 < 60  # answered 404 at once, not retried until the (long) timeout
            other = Identity.generate().peer_id_str
            with pytest.raises(Unreachable, match="refused"):
                await asyncio.wait_for(run_bridge(BridgeConfig(relay.url, str(shards[0]), str(certs.ca),
                                                               relay_peer=other)), 20)
            assert not relay.devices
        finally:
            await relay.aclose()

    asyncio.run(main())
