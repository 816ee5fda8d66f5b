"""Conformance checks for ``protocol_spec/relay.md``, runnable against any relay or device.

    python tests/relay/conformance.py relay  wss://HOST:PORT [--ca CA.pem]
    python tests/relay/conformance.py device relay+wss://HOST:PORT/<peer id> --model-id ID --layer L \
        --expert E --hidden H [--ca CA.pem]

``relay`` acts as a device (a toy expert, ``y = 2x + expert``) and as a client of that device,
and checks the relay: authentication, the welcome, publishing, forwarding unchanged bytes both
ways, stream open/close, refusals (bad identity, unknown device, malformed frames, text).
``device`` dials a device through its relay as a backbone would and checks the data plane:
handshake, ping, a well-formed answer with a valid receipt, and an ``unknown_expert`` error.
Exit status 0 when every check passes. Needs only aiohttp and the ``moeswarm.protocol`` binding.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from moeswarm.protocol import (
    Auth, ClientHandshake, Error, ErrorCode, ExpertRequest, ExpertResponse, ExpertRows, Hello, HelloAck, Identity,
    Ping, Pong, ServerHandshake, check_response, decode, encode, frame, make_receipt, sign_announcement,
)
from moeswarm.relay import (
    CLIENT_SUBPROTOCOL, DEVICE_PATH, DEVICE_SUBPROTOCOL, Kind, Publish, Published, Welcome, WSClose, binding_of,
    decode_control, encode_control, pack, parse_relay_endpoint, unpack,
)

TIMEOUT = 10.0


def ssl_for(url: str, ca: str | None) -> ssl.SSLContext | bool:
    return ssl.create_default_context(cafile=ca) if url.startswith(("wss://", "relay+wss://")) else False


class RawDevice:
    """A minimal device: authenticates, then answers streams with a toy expert (y = 2x + e)."""

    def __init__(self, relay_url: str, ca: str | None, identity: Identity | None = None) -> None:
        self.relay_url, self.ca = relay_url.rstrip("/"), ca
        self.identity = identity or Identity.generate()
        self.http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.welcome: Welcome | None = None
        self.relay_peer: bytes | None = None
        self.received: list[bytes] = []  # DATA frames as they arrived
        self.sent: list[bytes] = []  # DATA frames we sent
        self.events: list[tuple[Kind, int]] = []  # OPEN / CLOSE envelopes
        self.controls: list[object] = []
        self._streams: dict[int, ServerHandshake | bytes] = {}
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(self.relay_url + DEVICE_PATH, ssl=ssl_for(self.relay_url, self.ca),
                                             protocols=(DEVICE_SUBPROTOCOL,), compress=0, heartbeat=20)

    async def send_control(self, msg: object) -> None:
        assert self.ws is not None
        await self.ws.send_bytes(pack(Kind.CONTROL, 0, encode_control(msg)))  # type: ignore[arg-type]

    async def recv_control(self) -> object:
        assert self.ws is not None
        msg = await self.ws.receive(timeout=TIMEOUT)
        if msg.type is not aiohttp.WSMsgType.BINARY:
            return msg
        kind, _, payload = unpack(msg.data)
        return decode_control(payload) if kind is Kind.CONTROL else (kind, payload)

    async def authenticate(self, *, corrupt_sig: bool = False, hello: Hello | None = None) -> object:
        """Run the handshake; returns the relay's last answer (``Welcome`` on success)."""
        await self.open()
        assert self.ws is not None
        ssl_obj = self.ws.get_extra_info("ssl_object")
        cert = ssl_obj.getpeercert(binary_form=True) if ssl_obj is not None else None
        hs = ClientHandshake(self.identity, channel_binding=binding_of(cert))
        await self.send_control(hello or hs.hello)
        ack = await self.recv_control()
        if not isinstance(ack, HelloAck):
            return ack
        self.relay_peer = ack.peer_id
        auth = hs.receive_ack(ack)
        await self.send_control(Auth(bytes(64)) if corrupt_sig else auth)
        answer = await self.recv_control()
        if isinstance(answer, Welcome):
            self.welcome = answer
        return answer

    def start_serving(self) -> None:
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        assert self.ws is not None
        async for msg in self.ws:
            if msg.type is not aiohttp.WSMsgType.BINARY:
                break
            kind, stream, payload = unpack(msg.data)
            if kind in (Kind.OPEN, Kind.CLOSE):
                self.events.append((kind, stream))
                if kind is Kind.OPEN:
                    self._streams[stream] = ServerHandshake(self.identity)
            elif kind is Kind.DATA:
                self.received.append(bytes(payload))
                await self._answer(stream, decode(bytes(payload[4:])))
            else:
                self.controls.append(decode_control(payload))

    async def send_data(self, stream: int, data: bytes) -> None:
        assert self.ws is not None
        self.sent.append(data)
        await self.ws.send_bytes(pack(Kind.DATA, stream, data))

    async def _answer(self, stream: int, msg: object) -> None:
        state = self._streams.get(stream)
        if isinstance(msg, Hello) and isinstance(state, ServerHandshake):
            await self.send_data(stream, frame(state.receive_hello(msg)))
        elif isinstance(msg, Auth) and isinstance(state, ServerHandshake):
            self._streams[stream] = state.receive_auth(msg)
        elif isinstance(msg, Ping):
            await self.send_data(stream, frame(Pong(msg.ts)))
        elif isinstance(msg, ExpertRequest) and isinstance(state, bytes):
            outs = np.concatenate([2 * msg.hidden[e.rows] + e.expert for e in msg.experts]).astype(msg.hidden.dtype)
            receipt = make_receipt(self.identity, msg, outs, client=state, expert_flops=0,
                                   time_ms=int(time.time() * 1000))
            await self.send_data(stream, frame(ExpertResponse(msg.request_id, outs, receipt, 1, 0)))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.ws is not None:
            await self.ws.close()
        if self.http is not None:
            await self.http.close()


async def open_client(url: str, ca: str | None) -> tuple[aiohttp.ClientSession, aiohttp.ClientWebSocketResponse]:
    http = aiohttp.ClientSession()
    try:
        ws = await http.ws_connect(url, ssl=ssl_for(url, ca), protocols=(CLIENT_SUBPROTOCOL,), compress=0)
    except BaseException:
        await http.close()
        raise
    return http, ws


async def client_handshake(ws: aiohttp.ClientWebSocketResponse, identity: Identity, device: bytes) -> list[bytes]:
    """The data-plane handshake through the relay (empty channel binding); returns frames sent."""
    hs = ClientHandshake(identity, expected_server=device)
    sent = [frame(hs.hello)]
    await ws.send_bytes(sent[0])
    ack = decode((await ws.receive_bytes(timeout=TIMEOUT))[4:])
    assert isinstance(ack, HelloAck), f"expected hello_ack through the relay, got {ack}"
    sent.append(frame(hs.receive_ack(ack)))
    await ws.send_bytes(sent[1])
    return sent


def toy_request(model_id: str, layer: int, expert: int, hidden: int, seq: int) -> ExpertRequest:
    x = np.arange(2 * hidden, dtype=np.float32).reshape(2, hidden) / hidden
    return ExpertRequest(os.urandom(16), model_id, layer, seq, x, (ExpertRows(expert, np.array([0, 1], np.uint32)),))


# ---------------------------------------------------------------- the checks


@dataclass
class Report:
    results: list[tuple[str, bool, str]] = field(default_factory=list)

    async def check(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        try:
            await asyncio.wait_for(fn(), 3 * TIMEOUT)
            self.results.append((name, True, ""))
        except Exception as e:  # noqa: BLE001 - a check's failure is reported, the others still run
            self.results.append((name, False, f"{type(e).__name__}: {e}"))

    @property
    def ok(self) -> bool:
        return all(passed for _, passed, _ in self.results)

    def print(self) -> None:
        for name, passed, why in self.results:
            print(f"{'PASS' if passed else 'FAIL'}  {name}{'  -- ' + why if why else ''}")


async def check_relay(url: str, ca: str | None) -> Report:
    url = url.rstrip("/")
    report = Report()
    device = RawDevice(url, ca)

    async def authenticates() -> None:
        answer = await device.authenticate()
        assert isinstance(answer, Welcome), f"expected relay_welcome, got {answer}"
        netloc = urlsplit(url).netloc
        assert answer.endpoint == f"relay+{urlsplit(url).scheme}://{netloc}/{device.identity.peer_id_str}", answer.endpoint
        assert answer.relay_peer == device.relay_peer and answer.max_frame >= 1 << 20
        device.start_serving()

    async def publishes_own_record_only() -> None:
        assert device.welcome is not None
        good = sign_announcement(device.identity, model_id="conformance", layers=(0, 0), experts=(0, 0),
                                 endpoints=(device.welcome.endpoint,), capacity_bytes=1, throughput=0,
                                 load_permille=0, software="conformance/1", seq=int(time.time() * 1000),
                                 expires_at_ms=int(time.time() * 1000) + 60_000)
        await device.send_control(Publish(encode(good), (0,)))
        other = sign_announcement(Identity.generate(), model_id="conformance", layers=(0, 0), experts=(0, 0),
                                  endpoints=(device.welcome.endpoint,), capacity_bytes=1, throughput=0,
                                  load_permille=0, software="conformance/1", seq=1,
                                  expires_at_ms=int(time.time() * 1000) + 60_000)
        await device.send_control(Publish(encode(other), (0,)))
        deadline = time.monotonic() + 3 * TIMEOUT
        while len(device.controls) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert any(isinstance(c, Published) and c.seq == good.seq for c in device.controls), device.controls
        assert any(isinstance(c, Error) and c.code == ErrorCode.AUTH_FAILED for c in device.controls), device.controls

    async def forwards_unchanged_both_ways() -> None:
        client = Identity.generate()
        http, ws = await open_client(f"{url}/{device.identity.peer_id_str}", ca)
        try:
            sent = await client_handshake(ws, client, device.identity.peer_id)
            request = toy_request("conformance", 0, 3, 8, 1)
            sent.append(frame(request))
            await ws.send_bytes(sent[-1])
            answer = await ws.receive_bytes(timeout=TIMEOUT)
            response = decode(answer[4:])
            assert isinstance(response, ExpertResponse), response
            check_response(request, response, client=client.peer_id, server=device.identity.peer_id)
            assert np.array_equal(response.outputs, 2 * request.hidden + 3)
            assert device.received == sent, "the device did not receive the client's frames byte for byte"
            assert answer == device.sent[-1], "the client did not receive the device's frame byte for byte"
            assert device.events[-1][0] is Kind.OPEN
        finally:
            await ws.close()
            await http.close()
        stream = device.events[-1][1]
        deadline = time.monotonic() + TIMEOUT
        while (Kind.CLOSE, stream) not in device.events and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert (Kind.CLOSE, stream) in device.events, "closing the client did not CLOSE the stream"

    async def device_close_ends_the_client() -> None:
        http, ws = await open_client(f"{url}/{device.identity.peer_id_str}", ca)
        try:
            await client_handshake(ws, Identity.generate(), device.identity.peer_id)
            stream = [s for k, s in device.events if k is Kind.OPEN][-1]
            assert device.ws is not None
            await device.ws.send_bytes(pack(Kind.CLOSE, stream))
            msg = await ws.receive(timeout=TIMEOUT)
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg
        finally:
            await ws.close()
            await http.close()

    async def refuses_bad_client_frames() -> None:
        for bad, expected in ((b"\x00\x00\x00\x09abc", WSClose.PROTOCOL_ERROR), ("text", WSClose.UNSUPPORTED_DATA)):
            http, ws = await open_client(f"{url}/{device.identity.peer_id_str}", ca)
            try:
                await (ws.send_bytes(bad) if isinstance(bad, bytes) else ws.send_str(bad))
                msg = await ws.receive(timeout=TIMEOUT)
                assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == expected, (bad, msg)
            finally:
                await ws.close()
                await http.close()

    async def unknown_device_is_404() -> None:
        try:
            http, ws = await open_client(f"{url}/{Identity.generate().peer_id_str}", ca)
        except aiohttp.WSServerHandshakeError as e:
            assert e.status in (404, 503), e.status  # 503 only within the relay's startup grace
            return
        await ws.close()
        await http.close()
        raise AssertionError("the relay accepted a stream to a device it does not hold")

    async def refuses_forged_identity() -> None:
        impostor = RawDevice(url, ca)
        try:
            answer = await impostor.authenticate(corrupt_sig=True)
            assert isinstance(answer, Error) and answer.code == ErrorCode.AUTH_FAILED, answer
        finally:
            await impostor.close()
        thief = RawDevice(url, ca)  # claims the first device's peer ID with its own key
        stolen = Hello((1,), device.identity.peer_id, thief.identity.public_key, os.urandom(32))
        try:
            answer = await thief.authenticate(hello=stolen)
            assert isinstance(answer, Error) and answer.code == ErrorCode.AUTH_FAILED, answer
        finally:
            await thief.close()

    async def healthz() -> None:
        http_url = url.replace("wss://", "https://").replace("ws://", "http://") + "/healthz"
        async with aiohttp.ClientSession() as http, http.get(http_url, ssl=ssl_for(url, ca)) as resp:
            body = await resp.json()
            assert resp.status == 200 and body.get("status") == "ok", body

    try:
        for name, fn in [("device authenticates and is welcomed", authenticates),
                         ("publish: own record stored, another peer's refused", publishes_own_record_only),
                         ("frames forwarded unchanged both ways; close propagates", forwards_unchanged_both_ways),
                         ("device CLOSE ends the client's WebSocket", device_close_ends_the_client),
                         ("malformed and text client frames refused", refuses_bad_client_frames),
                         ("unknown device refused (404)", unknown_device_is_404),
                         ("forged device identities refused", refuses_forged_identity),
                         ("/healthz", healthz)]:
            await report.check(name, fn)
    finally:
        await device.close()
    return report


async def check_device(endpoint: str, ca: str | None, model_id: str, layer: int, expert: int, hidden: int) -> Report:
    report = Report()
    url, device = parse_relay_endpoint(endpoint)
    client = Identity.generate()
    http, ws = await open_client(url, ca)

    async def handshake() -> None:
        await client_handshake(ws, client, device)

    async def ping() -> None:
        await ws.send_bytes(frame(Ping(12345)))
        pong = decode((await ws.receive_bytes(timeout=TIMEOUT))[4:])
        assert isinstance(pong, Pong) and pong.ts == 12345, pong

    async def serves() -> None:
        request = toy_request(model_id, layer, expert, hidden, int(time.time() * 1e6))
        await ws.send_bytes(frame(request))
        response = decode((await ws.receive_bytes(timeout=TIMEOUT))[4:])
        assert isinstance(response, ExpertResponse), response
        check_response(request, response, client=client.peer_id, server=device)

    async def unknown_expert() -> None:
        request = toy_request(model_id, layer, 2**32 - 1, hidden, int(time.time() * 1e6) + 1)
        await ws.send_bytes(frame(request))
        error = decode((await ws.receive_bytes(timeout=TIMEOUT))[4:])
        assert isinstance(error, Error) and error.code == ErrorCode.UNKNOWN_EXPERT, error

    try:
        for name, fn in [("handshake through the relay", handshake), ("ping/pong", ping),
                         ("expert_request answered with a valid receipt", serves),
                         ("unknown expert refused with code 7", unknown_expert)]:
            await report.check(name, fn)
    finally:
        await ws.close()
        await http.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    relay = sub.add_parser("relay", help="check a relay")
    relay.add_argument("url")
    device = sub.add_parser("device", help="check a device through its relay")
    device.add_argument("endpoint")
    for name in ("--model-id",):
        device.add_argument(name, required=True)
    for name in ("--layer", "--expert", "--hidden"):
        device.add_argument(name, required=True, type=int)
    for p in (relay, device):
        p.add_argument("--ca", default=None, help="CA file for the relay's certificate (default: system store)")
    args = parser.parse_args(argv)
    if args.what == "relay":
        report = asyncio.run(check_relay(args.url, args.ca))
    else:
        report = asyncio.run(check_device(args.endpoint, args.ca, args.model_id, args.layer, args.expert, args.hidden))
    report.print()
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
