"""The relay's command-line promises, on a real relay process: SIGTERM tells devices ``relay_goaway``
and the process exits after draining, SIGHUP swaps the certificate, ``--max-devices``,
``--max-streams-per-device`` / ``--max-streams-per-client`` refuse past their caps, and
``--heartbeat`` drops a device that stops answering pings.  Devices and clients are the
conformance suite's raw implementations of protocol_spec/relay.md, over real TLS."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import signal
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from moeswarm.relay import DEVICE_PATH, DEVICE_SUBPROTOCOL, GoAway, WSClose
from moeswarm.relay.devcerts import make_dev_certs

DEADLINE_S = 60.0  # bound on every wait below (a loaded machine is slow, never this slow)


def relay(spawn: Any, certs: Any, *flags: str, cert: Path | None = None, key: Path | None = None) -> tuple[Any, str]:
    proc = spawn("relay", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(cert or certs.cert),
                 "--key", str(key or certs.key), "--no-dht", *flags)
    return proc, proc.wait_ready()["url"]


async def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_sigterm_sends_goaway_to_devices_and_the_relay_exits_after_draining(certs: Any, spawn: Any,
                                                                            conformance: Any) -> None:
    proc, url = relay(spawn, certs, "--drain-timeout", "2")

    async def main() -> list[object]:
        device = conformance.RawDevice(url, str(certs.ca))
        try:
            assert type(await device.authenticate()).__name__ == "Welcome"
            device.start_serving()
            proc.process.send_signal(signal.SIGTERM)
            await until(lambda: any(isinstance(c, GoAway) for c in device.controls), "no relay_goaway")
            assert device.ws is not None
            await until(lambda: device.ws.closed, "the device's session was not closed")  # type: ignore[union-attr]
            return device.controls
        finally:
            await device.close()

    controls = asyncio.run(main())
    goaway = next(c for c in controls if isinstance(c, GoAway))
    assert goaway.retry_after_ms > 0  # told when to come back
    assert proc.process.wait(DEADLINE_S) == 0  # drained and exited cleanly


def test_sighup_reloads_the_certificate_files(certs: Any, spawn: Any, tmp_path: Path) -> None:
    cert, key = tmp_path / "fullchain.pem", tmp_path / "privkey.pem"
    shutil.copy(certs.cert, cert)
    shutil.copy(certs.key, key)
    proc, url = relay(spawn, certs, cert=cert, key=key)
    port = int(url.rsplit(":", 1)[1])

    def served() -> str:  # the fingerprint of the leaf certificate the relay presents now
        pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=10)
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()

    before = served()
    renewed = make_dev_certs(tmp_path / "renewed", ca_name="renewed CA")
    shutil.copy(renewed.cert, cert)  # certbot renews the files in place
    shutil.copy(renewed.key, key)
    assert served() == before  # nothing changes until the operator says so
    proc.process.send_signal(signal.SIGHUP)
    expected = hashlib.sha256(ssl.PEM_cert_to_DER_cert(renewed.cert.read_text().split("-----END CERTIFICATE-----")[0]
                                                       + "-----END CERTIFICATE-----\n")).hexdigest()
    deadline = time.monotonic() + DEADLINE_S
    while served() != expected:
        assert time.monotonic() < deadline, "the renewed certificate was not served"
        time.sleep(0.1)
    assert proc.process.poll() is None  # reloaded, not restarted


def test_max_devices_refuses_the_device_past_the_cap(certs: Any, spawn: Any, conformance: Any) -> None:
    _, url = relay(spawn, certs, "--max-devices", "1")

    async def main() -> tuple[object, object, int | None]:
        first, second = conformance.RawDevice(url, str(certs.ca)), conformance.RawDevice(url, str(certs.ca))
        try:
            welcomed = await first.authenticate()
            refused = await second.authenticate()
            assert second.ws is not None
            closing = await second.ws.receive(timeout=DEADLINE_S)
            assert closing.type is aiohttp.WSMsgType.CLOSE, closing
            return welcomed, refused, closing.data
        finally:
            await first.close()
            await second.close()

    welcomed, refused, code = asyncio.run(main())
    assert type(welcomed).__name__ == "Welcome"
    assert type(refused).__name__ == "Error" and "full" in refused.message  # type: ignore[attr-defined]
    assert code == WSClose.TRY_AGAIN_LATER


@pytest.mark.parametrize(("flag", "status"), [("--max-streams-per-device", 503), ("--max-streams-per-client", 429)])
def test_stream_caps_refuse_the_stream_past_the_cap(certs: Any, spawn: Any, conformance: Any, flag: str,
                                                    status: int) -> None:
    _, url = relay(spawn, certs, flag, "1")

    async def main() -> int:
        device = conformance.RawDevice(url, str(certs.ca))
        clients: list[Any] = []
        try:
            await device.authenticate()
            device.start_serving()
            endpoint = f"{url}/{device.identity.peer_id_str}"
            clients.append(await conformance.open_client(endpoint, str(certs.ca)))  # the one allowed
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                clients.append(await conformance.open_client(endpoint, str(certs.ca)))
            return refused.value.status
        finally:
            for http, ws in clients:
                await ws.close()
                await http.close()
            await device.close()

    assert asyncio.run(main()) == status


def test_heartbeat_drops_a_device_that_stops_answering_pings(certs: Any, spawn: Any, conformance: Any) -> None:
    _, url = relay(spawn, certs, "--heartbeat", "1")

    async def main() -> tuple[int, bool]:
        device = conformance.RawDevice(url, str(certs.ca))
        device.http = aiohttp.ClientSession()
        try:  # a device whose WebSocket never answers pings (autoping off), e.g. a frozen phone
            device.ws = await device.http.ws_connect(url + DEVICE_PATH, ssl=conformance.ssl_for(url, str(certs.ca)),
                                                     protocols=(DEVICE_SUBPROTOCOL,), autoping=False)
            pings = 0
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline:
                msg = await device.ws.receive(timeout=DEADLINE_S)
                if msg.type is aiohttp.WSMsgType.PING:
                    pings += 1
                elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                    return pings, True
            return pings, False
        finally:
            await device.close()

    pings, dropped = asyncio.run(main())
    assert pings >= 1 and dropped  # pinged at the --heartbeat period, then dropped for not answering
