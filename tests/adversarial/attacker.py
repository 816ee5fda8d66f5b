"""The attacker of ``tests/adversarial``: a separate process that attacks a victim over real
sockets (TLS where the victim speaks it) and prints what it saw as one JSON line.

    python tests/adversarial/attacker.py COMMAND ARGS...

It uses only the public wire format (``moeswarm.protocol`` encodes the honest parts of its
messages; the hostile parts are written byte by byte), so it runs the same against any commit.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import select
import socket
import ssl
import struct
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from moeswarm.protocol import (
    ClientHandshake,
    Error,
    ExpertRequest,
    ExpertRows,
    HelloAck,
    Identity,
    decode,
    encode,
)


def out(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)


def _tls(sock: socket.socket) -> ssl.SSLSocket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the data plane's identity is the Ed25519 handshake
    ctx.set_alpn_protocols(["moeswarm/1"])
    return ctx.wrap_socket(sock)


def _connect(endpoint: str, source: str | None = None, timeout: float = 10.0) -> ssl.SSLSocket:
    parts = urlsplit(endpoint)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout,
                                    source_address=(source, 0) if source else None)
    return _tls(sock)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _read_frame(sock: socket.socket) -> Any:
    header = _recv_exactly(sock, 4)
    if header is None:
        return None
    body = _recv_exactly(sock, int.from_bytes(header, "big"))
    return None if body is None else decode(body)


def _send(sock: socket.socket, body: bytes) -> None:
    sock.sendall(len(body).to_bytes(4, "big") + body)


def _handshake(sock: ssl.SSLSocket, identity: Identity) -> None:
    import hashlib

    cert = sock.getpeercert(binary_form=True)
    hs = ClientHandshake(identity, channel_binding=hashlib.sha256(cert).digest() if cert else b"")
    _send(sock, encode(hs.hello))
    ack = _read_frame(sock)
    if not isinstance(ack, HelloAck):
        raise SystemExit(f"handshake refused: {ack}")
    _send(sock, encode(hs.receive_ack(ack)))


def _nested_body(size: int, kind: str) -> bytes:
    """A map {type: kind, versions/pad: [[], [], ...]} of ``size`` bytes: each empty array is one
    byte on the wire and one Python list (56+ bytes) once decoded."""
    prefix = b"\x82\xa4type" + bytes([0xA0 | len(kind)]) + kind.encode() + b"\xa8versions\xdd"
    n = size - len(prefix) - 4
    return prefix + n.to_bytes(4, "big") + b"\x90" * n


def _error_code(reply: Any) -> int | None:
    return reply.code if isinstance(reply, Error) else None


# ---------------------------------------------------------------- attack 2: decoding


def hello_bomb(args: argparse.Namespace) -> None:
    """Send an 8 MiB Hello of nested empty arrays as the first frame (before any handshake), and
    the same as an authenticated frame; report what the victim answered."""
    result: dict[str, Any] = {}
    if args.phase == "after":
        return hello_bomb_after_auth(args)
    body = _nested_body(args.size, "hello")
    sock = _connect(args.endpoint)
    sock.sendall(len(body).to_bytes(4, "big"))
    sock.settimeout(2.0)
    try:  # a victim that checks the length answers before the body
        reply = _read_frame(sock)
    except (TimeoutError, socket.timeout):
        sock.settimeout(60.0)
        sock.sendall(body)
        reply = _read_frame(sock)
    except (ConnectionError, OSError):
        reply = None
    result["before_auth"] = {"code": _error_code(reply), "reply": type(reply).__name__}
    sock.close()
    out(result)


def hello_bomb_after_auth(args: argparse.Namespace) -> None:
    result: dict[str, Any] = {}
    sock = _connect(args.endpoint)
    _handshake(sock, Identity.generate())
    body = _nested_body(args.size, "ping")
    sock.settimeout(60.0)
    try:
        sock.sendall(len(body).to_bytes(4, "big") + body)
        reply = _read_frame(sock)
    except (ConnectionError, OSError):
        reply = None
    result["after_auth"] = {"code": _error_code(reply), "reply": type(reply).__name__}
    sock.close()
    out(result)


# ---------------------------------------------------------------- attack 6: expensive requests


def _request(model_id: str, tokens: int, width: int, experts: list[int], dtype: str) -> bytes:
    rows = np.arange(tokens, dtype=np.uint32)
    hidden = np.ones((tokens, width), dtype=dtype) * np.asarray(0.01, dtype=dtype)
    req = ExpertRequest(os.urandom(16), model_id, args_layer, int(time.time() * 1e6), hidden,
                        tuple(ExpertRows(e, rows) for e in experts))
    return encode(req)


args_layer = 0


def expensive(args: argparse.Namespace) -> None:
    """Two requests: every row routed to every expert (pairs far above tokens x top-k), and one
    within top-k whose answer (twice the input) cannot fit a 64 MiB frame."""
    sock = _connect(args.endpoint)
    _handshake(sock, Identity.generate())
    sock.settimeout(args.timeout)
    result: dict[str, Any] = {}
    for name, body in (
        ("every_expert", _request(args.model_id, 64, args.hidden, list(range(args.experts)), "float32")),
        ("too_big_to_answer", _request(args.model_id, args.big_tokens, args.hidden, [0, 1], "float16")),
    ):
        t0 = time.monotonic()
        _send(sock, body)
        try:
            reply = _read_frame(sock)
        except (TimeoutError, socket.timeout):
            reply = "timeout"
        result[name] = {"code": _error_code(reply), "reply": reply if isinstance(reply, str) else type(reply).__name__,
                        "seconds": round(time.monotonic() - t0, 2)}
        if reply == "timeout":
            break
    out(result)


# ---------------------------------------------------------------- attack 7: held connections


def _closed_by_victim(socks: list[socket.socket]) -> int:
    closed = 0
    for s in socks:
        s.setblocking(False)
        try:
            closed += s.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    return closed


def hold(args: argparse.Namespace) -> None:
    """Open ``count`` TCP connections from ``source`` (from each of ``sources``, if given) that never
    finish the TLS handshake, print HELD, and hold them until stdin closes (or sends an empty line);
    each other line is answered with how many of them the victim has closed so far, and so is the end."""
    parts = urlsplit(args.endpoint)
    socks = []
    for source in (args.sources or args.source).split(","):
        for _ in range(args.count):
            try:
                socks.append(socket.create_connection((parts.hostname, parts.port), timeout=5,
                                                      source_address=(source, 0)))
            except OSError:
                break
    out({"opened": len(socks)})
    while sys.stdin.readline().strip():  # the test measures the victim, then closes our stdin
        out({"closed_by_victim": _closed_by_victim(socks)})
    closed = _closed_by_victim(socks)
    for s in socks:
        s.close()
    out({"closed_by_victim": closed})


def slow_frame(args: argparse.Namespace) -> None:
    """Authenticate, announce a frame of ``size`` bytes, send 100 of them, and wait to see
    whether the victim gives up on the rest."""
    sock = _connect(args.endpoint)
    _handshake(sock, Identity.generate())
    sock.sendall(args.size.to_bytes(4, "big") + b"\x00" * 100)
    sock.settimeout(args.wait)
    t0 = time.monotonic()
    try:
        closed = sock.recv(1) == b""
    except (TimeoutError, socket.timeout):
        closed = False
    except OSError:
        closed = True
    out({"closed": closed, "after_s": round(time.monotonic() - t0, 1)})


def per_peer(args: argparse.Namespace) -> None:
    """Open ``count`` authenticated connections under one key; report how many were refused."""
    identity = Identity.generate()
    codes = []
    socks = []
    for _ in range(args.count):
        sock = _connect(args.endpoint)
        _handshake(sock, identity)
        sock.settimeout(1.0)
        try:
            reply = _read_frame(sock)
        except (TimeoutError, socket.timeout):
            reply = "open"
        except OSError:
            reply = None
        codes.append(reply if isinstance(reply, str) else _error_code(reply))
        socks.append(sock)
    out({"answers": codes})
    for s in socks:
        s.close()


# ---------------------------------------------------------------- attack 8: the relay


def _ws_upgrade(url: str, path: str, ca: str, source: str | None, protocol: str) -> ssl.SSLSocket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10,
                                    source_address=(source, 0) if source else None)
    ctx = ssl.create_default_context(cafile=ca)
    tls = ctx.wrap_socket(sock, server_hostname=parts.hostname)
    key = base64.b64encode(os.urandom(16)).decode()
    tls.sendall((f"GET {path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                 f"Sec-WebSocket-Protocol: {protocol}\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = tls.recv(4096)
        if not chunk:
            break
        head += chunk
    tls.status = int(head.split(b" ", 2)[1]) if head else 0  # type: ignore[attr-defined]
    return tls


def relay_preauth(args: argparse.Namespace) -> None:
    """Connect as a device and, before any handshake, start one 32 MiB binary message: send
    ``send`` bytes of it and watch whether the relay drops the connection."""
    tls = _ws_upgrade(args.url, "/device", args.ca, None, "moeswarm-device-v1")
    if tls.status != 101:  # type: ignore[attr-defined]
        out({"status": tls.status})  # type: ignore[attr-defined]
        return
    length = 32 << 20
    mask = os.urandom(4)
    tls.sendall(bytes([0x82, 0x80 | 127]) + struct.pack(">Q", length) + mask)
    sent, t0, dropped = 0, time.monotonic(), False
    chunk = bytes(64 * 1024)
    tls.settimeout(0.5)
    while sent < args.send and time.monotonic() - t0 < args.wait:
        try:
            tls.sendall(chunk)
            sent += len(chunk)
        except OSError:
            dropped = True
            break
    deadline = time.monotonic() + args.wait
    while not dropped and time.monotonic() < deadline:
        try:
            dropped = tls.recv(65536) == b""
        except (TimeoutError, socket.timeout):
            continue
        except OSError:
            dropped = True
    out({"status": 101, "sent": sent, "dropped": dropped, "after_s": round(time.monotonic() - t0, 1)})


def relay_devices(args: argparse.Namespace) -> None:
    """Open ``count`` device WebSockets from one address without authenticating; report statuses."""
    socks, statuses = [], []
    for _ in range(args.count):
        tls = _ws_upgrade(args.url, "/device", args.ca, None, "moeswarm-device-v1")
        statuses.append(tls.status)  # type: ignore[attr-defined]
        socks.append(tls)
    out({"statuses": statuses})
    for s in socks:
        s.close()


def relay_streams(args: argparse.Namespace) -> None:
    """Open ``per`` client streams to one device from each of ``sources``; print HELD, hold them
    until stdin closes (or sends an empty line). Each other line is answered with the indices (in
    opening order) of the streams the relay has closed or written to so far: the device never
    writes unasked, so those are the ones the relay let go."""
    socks, statuses = [], []
    for source in args.sources.split(","):
        for _ in range(args.per):
            tls = _ws_upgrade(args.url, f"/{args.peer}", args.ca, source, "moeswarm-v1")
            statuses.append(tls.status)  # type: ignore[attr-defined]
            socks.append(tls)
    out({"statuses": statuses})
    while sys.stdin.readline().strip():
        readable = set(select.select(socks, [], [], 0)[0])
        out({"closed": [i for i, s in enumerate(socks) if s in readable or s.pending()]})
    for s in socks:
        s.close()
    out({"released": len(socks)})


# ---------------------------------------------------------------- attack 3: the DHT


def dht_flood(args: argparse.Namespace) -> None:
    """Join the victim's DHT and store ``writes`` signed records at it under one key: first
    ``every_layer`` keys holding one record claiming every layer (valid under any layer key, if
    ranges are not bounded), then one record per made-up model."""
    from moeswarm.net.p2p import P2PConfig, P2PNode
    from moeswarm.protocol import announcement_key, peer_id_to_str, sign_announcement

    async def main() -> dict[str, Any]:
        identity = Identity.generate()
        now = int(time.time() * 1000)

        def record(model: str, layers: tuple[int, int]) -> bytes:
            return encode(sign_announcement(
                identity, model_id=model, layers=layers, experts=(0, 7), endpoints=("tcp+tls://127.0.0.9:1",),
                capacity_bytes=1, throughput=1, load_permille=0, software="attacker", seq=1,
                expires_at_ms=now + 3_600_000))

        async with P2PNode(identity, P2PConfig(bootstrap=(args.bootstrap,), client_mode=True)) as node:
            from libp2p.peer.id import ID

            victim = ID.from_base58(args.bootstrap.rsplit("/", 1)[-1])
            every_layer = record("flood", (0, 2**32 - 1))
            jobs = [(announcement_key("flood", i, identity.peer_id), every_layer) for i in range(args.every_layer)]
            jobs += [(announcement_key(f"flood{i}", 0, identity.peer_id), record(f"flood{i}", (0, 0)))
                     for i in range(args.writes - len(jobs))]
            stored = 0
            t0 = time.monotonic()
            for start in range(0, len(jobs), 100):
                batch = jobs[start:start + 100]

                async def put(batch: list[tuple[str, bytes]] = batch) -> int:
                    ok = 0
                    for key, value in batch:
                        ok += bool(await node._dht.value_store._store_at_peer(victim, key.encode(), value))
                    return ok

                stored += await node._call(put)
            return {"writes": len(jobs), "stored": stored, "peer_id": peer_id_to_str(identity.peer_id),
                    "seconds": round(time.monotonic() - t0, 1)}

    out(asyncio.run(main()))


def dht_sybils(args: argparse.Namespace) -> None:
    """From one address (``--source``, bound by patching trio's dialer) and one connection, store
    one signed announcement under each of ``keys`` fresh keys at the victim."""
    import trio

    from moeswarm.net.p2p import P2PConfig, P2PNode
    from moeswarm.protocol import announcement_key, sign_announcement

    open_tcp_stream = trio.open_tcp_stream

    async def from_source(host: str, port: int, **kwargs: Any) -> Any:
        return await open_tcp_stream(host, port, local_address=args.source, **kwargs)

    trio.open_tcp_stream = from_source  # type: ignore[assignment]

    async def main() -> dict[str, Any]:
        now = int(time.time() * 1000)
        jobs = []
        for _ in range(args.keys):
            sybil = Identity.generate()
            jobs.append((announcement_key(args.model, 0, sybil.peer_id), encode(sign_announcement(
                sybil, model_id=args.model, layers=(0, 0), experts=(0, 7), endpoints=("tcp+tls://127.0.0.9:1",),
                capacity_bytes=1, throughput=1, load_permille=0, software="attacker", seq=1,
                expires_at_ms=now + 3_600_000))))
        async with P2PNode(Identity.generate(), P2PConfig(bootstrap=(args.bootstrap,), client_mode=True)) as node:
            from libp2p.peer.id import ID

            victim = ID.from_base58(args.bootstrap.rsplit("/", 1)[-1])
            stored, t0 = 0, time.monotonic()
            for start in range(0, len(jobs), 100):
                batch = jobs[start:start + 100]

                async def put(batch: list[tuple[str, bytes]] = batch) -> int:
                    ok = 0
                    for key, value in batch:
                        ok += bool(await node._dht.value_store._store_at_peer(victim, key.encode(), value))
                    return ok

                stored += await node._call(put)
            return {"keys": len(jobs), "stored": stored,
                    "seconds": round(time.monotonic() - t0, 1)}

    out(asyncio.run(main()))


# ---------------------------------------------------------------- attack 9: the HTTP API


def http(args: argparse.Namespace) -> None:
    """The requests a web page on another site (or a DNS-rebinding page) can make to a local API."""
    import urllib.error
    import urllib.request

    body = json.dumps({"prompt": "hello", "max_tokens": 100000}).encode()
    small = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    cases = {
        "text_plain": ({"Content-Type": "text/plain"}, body),  # a cross-site form/fetch without preflight
        "rebinding_host": ({"Content-Type": "application/json", "Host": "evil.example:8000"}, small),
        "cross_origin": ({"Content-Type": "application/json", "Origin": "http://evil.example"}, small),
        "huge_max_tokens": ({"Content-Type": "application/json"}, body),
    }
    result = {}
    for name, (headers, data) in cases.items():
        req = urllib.request.Request(args.url + "/v1/completions", data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=args.timeout) as resp:
                result[name] = resp.status
        except urllib.error.HTTPError as e:
            result[name] = e.code
        except (TimeoutError, OSError):
            result[name] = "timeout"
    out(result)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hello-bomb")
    p.add_argument("endpoint")
    p.add_argument("--size", type=int, default=8 << 20)
    p.add_argument("--phase", choices=["before", "after"], default="before")
    p.set_defaults(fn=hello_bomb)
    p = sub.add_parser("expensive")
    p.add_argument("endpoint")
    p.add_argument("--model-id", required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--experts", type=int, required=True)
    p.add_argument("--big-tokens", type=int, default=130_000)
    p.add_argument("--timeout", type=float, default=120.0)
    p.set_defaults(fn=expensive)
    p = sub.add_parser("hold")
    p.add_argument("endpoint")
    p.add_argument("--source", default="127.0.0.2")
    p.add_argument("--sources", default="", help="comma-separated source addresses (instead of --source)")
    p.add_argument("--count", type=int, default=300)
    p.set_defaults(fn=hold)
    p = sub.add_parser("slow-frame")
    p.add_argument("endpoint")
    p.add_argument("--size", type=int, default=2 << 20)
    p.add_argument("--wait", type=float, default=20.0)
    p.set_defaults(fn=slow_frame)
    p = sub.add_parser("per-peer")
    p.add_argument("endpoint")
    p.add_argument("--count", type=int, default=8)
    p.set_defaults(fn=per_peer)
    p = sub.add_parser("relay-preauth")
    p.add_argument("url")
    p.add_argument("--ca", required=True)
    p.add_argument("--send", type=int, default=1 << 20)
    p.add_argument("--wait", type=float, default=5.0)
    p.set_defaults(fn=relay_preauth)
    p = sub.add_parser("relay-devices")
    p.add_argument("url")
    p.add_argument("--ca", required=True)
    p.add_argument("--count", type=int, default=20)
    p.set_defaults(fn=relay_devices)
    p = sub.add_parser("relay-streams")
    p.add_argument("url")
    p.add_argument("peer")
    p.add_argument("--ca", required=True)
    p.add_argument("--sources", default="127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5")
    p.add_argument("--per", type=int, default=64)
    p.set_defaults(fn=relay_streams)
    p = sub.add_parser("dht-flood")
    p.add_argument("bootstrap")
    p.add_argument("--writes", type=int, default=1500)
    p.add_argument("--every-layer", type=int, default=750)
    p.set_defaults(fn=dht_flood)
    p = sub.add_parser("dht-sybils")
    p.add_argument("bootstrap")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--model", default="honest/model")
    p.add_argument("--source", default="127.0.0.2")
    p.set_defaults(fn=dht_sybils)
    p = sub.add_parser("http")
    p.add_argument("url")
    p.add_argument("--timeout", type=float, default=30.0)
    p.set_defaults(fn=http)
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
