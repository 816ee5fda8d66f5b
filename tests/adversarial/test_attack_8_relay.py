"""Attack 8 of issue 12: relay lockout.

A ``moeswarm relay`` process (real TLS, a private CA) with one authenticated device. An attacker
process then: (1) connects as a device and, before authenticating, starts a 32 MiB WebSocket
message; (2) opens 20 unauthenticated device connections from one address; (3) opens 64 client
streams to the device from each of 4 addresses (127.0.0.2-5), filling its 256 streams. On the
base commit 7895ee0: (1) the relay kept reading (it buffers a message up to 64 MiB before its
16 KiB check) until its 10 s handshake timeout; (2) all 20 were admitted; (3) an honest client
from 127.0.0.1 got 503. Now (1) the connection is dropped after 16 KiB, (2) the 17th device
connection of one address gets 429, (3) the honest client gets its fair share (101) and the
heaviest address loses its oldest stream: the attacker reports which of its streams the relay let
go (negative control, run by hand: a relay closing the heaviest address's newest stream instead
fails with [63]).
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from adversarial_support import attack, finish, first_line, start_attacker

from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.protocol import Identity
from moeswarm.relay.devcerts import make_dev_certs


async def _hold_device(url: str, ca: str, ready: asyncio.Event, stop: asyncio.Event, info: dict[str, Any]) -> None:
    """An honest device: authenticates (the tests/relay conformance device) and stays connected."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("relay_conformance",
                                                  Path(__file__).parents[1] / "relay" / "conformance.py")
    assert spec is not None and spec.loader is not None
    conformance = sys.modules.setdefault("relay_conformance", importlib.util.module_from_spec(spec))
    if not hasattr(conformance, "RawDevice"):
        spec.loader.exec_module(conformance)
    device = conformance.RawDevice(url, ca, Identity.generate())
    welcome = await device.authenticate()
    assert type(welcome).__name__ == "Welcome", welcome
    info["peer"] = device.identity.peer_id_str
    device.start_serving()
    ready.set()
    await stop.wait()
    await device.close()


def let_go(streams: subprocess.Popen[str]) -> list[int]:
    """The attacker's streams the relay has closed, once it has closed any (bounded wait)."""
    assert streams.stdin is not None
    deadline = time.monotonic() + 30
    while True:
        streams.stdin.write("closed?\n")
        streams.stdin.flush()
        closed: list[int] = first_line(streams)["closed"]
        if closed or time.monotonic() > deadline:
            return closed
        time.sleep(0.05)


def test_relay_admits_devices_fairly_and_drops_unauthenticated_floods(tmp_path: Path) -> None:
    certs = make_dev_certs(tmp_path / "certs")
    relay = start_daemon("relay", ["relay", "--listen", "127.0.0.1:0", "--cert", str(certs.cert),
                                   "--key", str(certs.key), "--no-dht"],
                         env={})
    try:
        url = f"wss://127.0.0.1:{relay.info['port']}"
        ca = str(certs.ca)

        pre = attack("relay-preauth", url, "--ca", ca, "--send", str(1 << 20), "--wait", "5")
        assert pre["status"] == 101 and pre["dropped"], pre

        devices = attack("relay-devices", url, "--ca", ca, "--count", "20")["statuses"]
        assert devices == [101] * 16 + [429] * 4, devices

        async def main() -> tuple[int, list[int]]:
            ready, stop, info = asyncio.Event(), asyncio.Event(), {}
            holder = asyncio.create_task(_hold_device(url, ca, ready, stop, info))
            await asyncio.wait_for(ready.wait(), 30)
            streams = start_attacker("relay-streams", url, info["peer"], "--ca", ca, "--per", "64")
            try:
                statuses = (await asyncio.to_thread(first_line, streams))["statuses"]
                assert statuses == [101] * 256, statuses
                async with aiohttp.ClientSession() as http:
                    try:
                        ws = await http.ws_connect(f"{url}/{info['peer']}", ssl=ssl.create_default_context(cafile=ca),
                                                   protocols=("moeswarm-v1",))
                        await ws.close()
                        status = 101
                    except aiohttp.WSServerHandshakeError as e:
                        status = e.status
                closed = await asyncio.to_thread(let_go, streams)
            finally:
                await asyncio.to_thread(finish, streams)
                stop.set()
                await holder
            return status, closed

        status, closed = asyncio.run(main())
        assert status == 101  # the honest address gets a stream: fair share
        # paid for by exactly one attacker stream: the oldest of an address holding the most (all four
        # hold 64; streams are numbered in opening order, 64 per address)
        assert len(closed) == 1 and closed[0] % 64 == 0, closed
    finally:
        stop_daemon(relay)
