"""The relay's command-line promises, on a real relay process: SIGTERM tells devices ``relay_goaway``
and the process exits after draining, SIGHUP swaps the certificate, ``--max-devices``,
``--max-streams-per-device`` / ``--max-streams-per-client`` refuse past their caps, and
``--heartbeat`` drops a device that stops answering pings, ``--max-devices-per-ip``, ``--max-streams``
and ``--max-publish-layers`` refuse past their caps, ``--drain-timeout`` lets an answer in flight
arrive.  Devices and clients are the
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
import numpy as np
import pytest

from moeswarm._tasks import cancel_and_wait
from moeswarm.protocol import Error, ExpertRequest, ExpertResponse, Identity, decode, encode, frame, sign_announcement
from moeswarm.relay import GoAway, Publish, Published, WSClose
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


def test_sigterm_sends_goaway_and_drains_the_answer_in_flight_before_exiting(certs: Any, spawn: Any,
                                                                             conformance: Any) -> None:
    """A client's request is at the device, whose answer takes 1.5 s, when the relay gets SIGTERM:
    the device is told ``relay_goaway``, the answer still reaches the client within
    ``--drain-timeout 5``, and the relay exits 0. Negative control (run by hand): with
    ``--drain-timeout 0.2`` the client's stream is closed without an answer."""
    proc, url = relay(spawn, certs, "--drain-timeout", "5")

    class SlowDevice(conformance.RawDevice):  # type: ignore[name-defined,misc]
        async def _answer(self, stream: int, msg: object) -> None:
            if isinstance(msg, ExpertRequest):
                await asyncio.sleep(1.5)
            await super()._answer(stream, msg)

    async def main() -> tuple[list[object], ExpertRequest, object]:
        device = SlowDevice(url, str(certs.ca))
        http, ws = None, None
        try:
            assert type(await device.authenticate()).__name__ == "Welcome"
            device.start_serving()
            http, ws = await conformance.open_client(f"{url}/{device.identity.peer_id_str}", str(certs.ca))
            await conformance.client_handshake(ws, Identity.generate(), device.identity.peer_id)
            request = conformance.toy_request("conformance", 0, 3, 8, 1)
            await ws.send_bytes(frame(request))
            await until(lambda: len(device.received) == 3, "the request did not reach the device")  # hello, auth, it
            proc.process.send_signal(signal.SIGTERM)
            answer = await ws.receive(timeout=DEADLINE_S)
            if answer.type is not aiohttp.WSMsgType.BINARY:
                return device.controls, request, answer  # cut: the assertion below says so
            await until(lambda: any(isinstance(c, GoAway) for c in device.controls), "no relay_goaway")
            assert device.ws is not None
            await until(lambda: device.ws.closed, "the device's session was not closed")  # type: ignore[union-attr]
            return device.controls, request, decode(answer.data[4:])
        finally:
            if ws is not None and http is not None:
                await ws.close()
                await http.close()
            await device.close()

    controls, request, answer = asyncio.run(main())
    assert isinstance(answer, ExpertResponse), f"the answer in flight was cut: {answer}"
    assert np.array_equal(answer.outputs, 2 * request.hidden + 3)
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


def test_heartbeat_drops_an_authenticated_device_that_stops_answering_pings(certs: Any, spawn: Any,
                                                                           conformance: Any) -> None:
    """Two devices authenticate (so the 10 s handshake timeout no longer applies to either); then
    one stops answering pings, like a frozen phone, and the other keeps answering them by hand.
    The silent one is dropped after being pinged at the ``--heartbeat`` period; the one that answers
    is still connected after answering three more pings. Negative control (run by hand): a relay
    whose device sockets send no pings (heartbeat=None in ``_server.py``) fails it: TimeoutError, the
    silent device is never dropped within 60 s."""
    _, url = relay(spawn, certs, "--heartbeat", "1")

    async def main() -> tuple[int, float, int, bool]:
        silent, awake = conformance.RawDevice(url, str(certs.ca)), conformance.RawDevice(url, str(certs.ca))
        try:
            assert type(await silent.authenticate()).__name__ == "Welcome"
            assert type(await awake.authenticate()).__name__ == "Welcome"
            assert silent.ws is not None and awake.ws is not None
            silent.ws._autoping = awake.ws._autoping = False  # from now on pings reach us; nobody answers them
            answered = 0

            async def answer_pings(ws: aiohttp.ClientWebSocketResponse) -> None:
                nonlocal answered
                async for msg in ws:
                    if msg.type is aiohttp.WSMsgType.PING:
                        await ws.pong(msg.data)
                        answered += 1

            answering = asyncio.create_task(answer_pings(awake.ws))
            try:
                pings, started = 0, time.monotonic()
                async with asyncio.timeout(DEADLINE_S):
                    while (msg := await silent.ws.receive()).type in (aiohttp.WSMsgType.PING, aiohttp.WSMsgType.PONG):
                        pings += msg.type is aiohttp.WSMsgType.PING  # a PONG answers our own client heartbeat
                silent_for = time.monotonic() - started
                answered_then = answered
                await until(lambda: answered >= answered_then + 3 or awake.ws.closed,  # type: ignore[union-attr]
                            "the answering device was not pinged")
                return pings, silent_for, answered, not awake.ws.closed
            finally:
                await cancel_and_wait(answering)
        finally:
            await silent.close()
            await awake.close()

    pings, silent_for, answered, awake_connected = asyncio.run(main())
    assert pings >= 1, "dropped without a ping: not the heartbeat"
    assert awake_connected and answered >= 3, "a device answering pings was dropped too"
    print(f"silent device dropped after {pings} pings, {silent_for:.1f} s; the other answered {answered} pings")


def test_stream_device_and_publish_caps(certs: Any, spawn: Any, conformance: Any) -> None:
    """One relay started with ``--max-devices-per-ip 2 --max-streams 1 --max-publish-layers 2``:
    a third device from 127.0.0.1 is refused (429); with one client stream open to device A, a
    stream to device B (which holds none, far under ``--max-streams-per-device``) is refused
    (503); a publish under 2 layers is stored, under 3 refused. Negative control (run by hand):
    the same test against a relay started without the three flags fails at the third device."""
    _, url = relay(spawn, certs, "--max-devices-per-ip", "2", "--max-streams", "1", "--max-publish-layers", "2")

    async def main() -> tuple[int, int, list[object]]:
        a, b, c = (conformance.RawDevice(url, str(certs.ca)) for _ in range(3))
        clients: list[Any] = []
        try:
            assert type(await a.authenticate()).__name__ == "Welcome"
            assert type(await b.authenticate()).__name__ == "Welcome"
            with pytest.raises(aiohttp.WSServerHandshakeError) as third:
                await c.authenticate()
            a.start_serving()
            b.start_serving()
            clients.append(await conformance.open_client(f"{url}/{a.identity.peer_id_str}", str(certs.ca)))
            with pytest.raises(aiohttp.WSServerHandshakeError) as second_stream:
                clients.append(await conformance.open_client(f"{url}/{b.identity.peer_id_str}", str(certs.ca)))
            assert a.welcome is not None
            now = int(time.time() * 1000)
            for layers in ((0, 1), (0, 1, 2)):
                record = sign_announcement(a.identity, model_id="caps", layers=(0, 2), experts=(0, 0),
                                           endpoints=(a.welcome.endpoint,), capacity_bytes=1, throughput=0,
                                           load_permille=0, software="test/1", seq=now + len(layers),
                                           expires_at_ms=now + 60_000)
                await a.send_control(Publish(encode(record), layers))
            await until(lambda: len(a.controls) >= 2, "no answer to the publishes")
            return third.value.status, second_stream.value.status, a.controls
        finally:
            for http, ws in clients:
                await ws.close()
                await http.close()
            for device in (a, b, c):
                await device.close()
            await asyncio.sleep(0.25)  # aiohttp: let the TLS transports of closed sessions finish closing

    third, second_stream, controls = asyncio.run(main())
    assert third == 429  # --max-devices-per-ip
    assert second_stream == 503  # --max-streams, all devices together
    assert isinstance(controls[0], Published), controls
    assert isinstance(controls[1], Error) and "at most 2" in controls[1].message, controls
