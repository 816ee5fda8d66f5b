"""What the relay costs, on loopback: processes for the relay, the device(s) and the client.

1. expert-call round trip, direct (tcp+tls to the device) vs through the relay (wss to the
   relay, which forwards to the device's session): the same device process, the same ONNX
   expert server, calls alternating between the two paths; and data-plane pings;
2. forwarded MB/s with N concurrent devices: N echo devices (one process) and N clients (this
   process) push 1 MiB frames through the relay, 4 in flight per client; the relay's own
   /metrics count the bytes it forwarded (both directions).

    python benchmarks/relay.py [--calls 2000] [--devices 1,4,16] [--seconds 4] [--frame-kb 1024]

Both are measured twice: with the relay's shipped defaults (what an operator runs: 100 MB/s per
device and per client address) and, labelled, with those limits lifted (what the relay's code can do).

Goal (issue 5): the relay adds < 1 ms per call and forwards >= 200 MB/s.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import json
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from moeswarm.demo import CHECKPOINT
from moeswarm.mobile_bridge import (
    LinkConfig,
    OnnxExpertServer,
    OnnxShards,
    RelayLink,
    export_onnx,
)
from moeswarm.net.client import ExpertClient
from moeswarm.net.dataplane import DataPlaneServer, ServerConfig
from moeswarm.node.expert_server import ExpertServerConfig
from moeswarm.protocol import (
    ClientHandshake,
    ExpertRequest,
    ExpertRows,
    HelloAck,
    Identity,
)
from moeswarm.relay import (
    DEVICE_PATH,
    DEVICE_SUBPROTOCOL,
    Kind,
    Welcome,
    binding_of,
    decode_control,
    encode_control,
    pack,
    set_relay_ca,
    unpack,
)
from moeswarm.relay.devcerts import make_dev_certs


def _ready(info: dict[str, Any]) -> None:
    print("READY " + json.dumps(info), flush=True)


def start(args: list[str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY "):
            return proc, json.loads(line[6:])
    raise RuntimeError(f"{args} exited without READY")


# ---------------------------------------------------------------- roles run as child processes


async def role_device(relay_url: str, ca: str, shards_dir: str) -> None:
    """One device answering on tcp+tls directly and through the relay, with one expert server."""
    identity = Identity.generate()
    shards = OnnxShards(shards_dir)
    m = shards.manifest
    server = OnnxExpertServer(shards, identity, ExpertServerConfig(m.model_id, m.layers, m.experts))
    direct = DataPlaneServer(identity, server.handle, ServerConfig())  # listens: tcp+tls, channel-bound
    relayed = DataPlaneServer(identity, server.handle, ServerConfig(tls=False))  # relay streams: no binding
    await server.start()
    await direct.start()
    link = RelayLink(identity, LinkConfig(relay_url, ca), relayed._on_connection)
    async with link:
        welcome = await link.first_session()
        _ready({"direct": direct.endpoint, "relayed": welcome.endpoint, "peer_id": identity.peer_id_str,
                "model_id": m.model_id, "layer": m.moe_layers[0], "hidden": m.hidden_size})
        await asyncio.Event().wait()


async def _echo_device(relay_url: str, ctx: ssl.SSLContext, http: aiohttp.ClientSession) -> tuple[str, Any]:
    identity = Identity.generate()
    ws = await http.ws_connect(relay_url + DEVICE_PATH, ssl=ctx, protocols=(DEVICE_SUBPROTOCOL,),
                               max_msg_size=80 << 20, compress=0)
    ssl_obj = ws.get_extra_info("ssl_object")
    hs = ClientHandshake(identity, channel_binding=binding_of(ssl_obj.getpeercert(binary_form=True)))
    await ws.send_bytes(pack(Kind.CONTROL, 0, encode_control(hs.hello)))
    ack = decode_control(unpack(await ws.receive_bytes())[2])
    assert isinstance(ack, HelloAck)
    await ws.send_bytes(pack(Kind.CONTROL, 0, encode_control(hs.receive_ack(ack))))
    welcome = decode_control(unpack(await ws.receive_bytes())[2])
    assert isinstance(welcome, Welcome)
    return identity.peer_id_str, ws


async def _echo(ws: Any) -> None:
    async for msg in ws:
        if msg.type is aiohttp.WSMsgType.BINARY and msg.data[0] == Kind.DATA:
            await ws.send_bytes(msg.data)  # same stream, same frame: back to the client


async def role_echo_devices(relay_url: str, ca: str, n: int) -> None:
    ctx = ssl.create_default_context(cafile=ca)
    async with aiohttp.ClientSession() as http:
        devices = [await _echo_device(relay_url, ctx, http) for _ in range(n)]
        _ready({"peers": [p for p, _ in devices]})
        await asyncio.gather(*(_echo(ws) for _, ws in devices))


# ---------------------------------------------------------------- measurements


async def call_latency(info: dict[str, Any], calls: int) -> dict[str, list[float]]:
    me = Identity.generate()
    clients = {name: await ExpertClient.connect(info[name], me) for name in ("direct", "relayed")}
    x = np.random.default_rng(0).standard_normal((1, info["hidden"])).astype(np.float32)
    rows = np.zeros(1, np.uint32)
    times: dict[str, list[float]] = {f"{n} {k}": [] for n in clients for k in ("call", "ping")}
    seq = int(time.time() * 1e6)
    for i in range(calls + 200):
        for name, client in clients.items():
            seq += 1
            request = ExpertRequest(os.urandom(16), info["model_id"], info["layer"], seq, x,
                                    (ExpertRows(0, rows), ExpertRows(1, rows)))
            t0 = time.perf_counter()
            await client.call(request, 5)
            t1 = time.perf_counter()
            await client.ping()
            t2 = time.perf_counter()
            if i >= 200:  # warm-up done
                times[f"{name} call"].append(t1 - t0)
                times[f"{name} ping"].append(t2 - t1)
    for client in clients.values():
        await client.aclose()
    return times


async def forwarded_mb_s(relay_url: str, ca: str, peers: list[str], seconds: float, frame_kb: int) -> tuple[float, float]:
    """(client payload MB/s echoed, relay forwarded MB/s from its /metrics, both directions)."""
    ctx = ssl.create_default_context(cafile=ca)
    body = os.urandom(frame_kb * 1024)
    data = len(body).to_bytes(4, "big") + body
    http_url = relay_url.replace("wss://", "https://") + "/metrics"

    async def forwarded(http: aiohttp.ClientSession) -> float:
        async with http.get(http_url, ssl=ctx) as resp:
            text = await resp.text()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("moeswarm_relay_forwarded_bytes_total"))

    async def client(http: aiohttp.ClientSession, peer: str, stop_at: float) -> int:
        ws = await http.ws_connect(f"{relay_url}/{peer}", ssl=ctx, max_msg_size=80 << 20, compress=0)
        done, inflight = 0, 0
        while time.perf_counter() < stop_at or inflight:
            while inflight < 4 and time.perf_counter() < stop_at:
                await ws.send_bytes(data)
                inflight += 1
            await ws.receive_bytes()
            inflight -= 1
            done += len(data)
        await ws.close()
        return done

    async with aiohttp.ClientSession() as http:
        before = await forwarded(http)
        t0 = time.perf_counter()
        echoed = await asyncio.gather(*(client(http, p, t0 + seconds) for p in peers))
        elapsed = time.perf_counter() - t0
        after = await forwarded(http)
    return sum(echoed) / elapsed / 1e6, (after - before) / elapsed / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--devices", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--frame-kb", type=int, default=1024)
    parser.add_argument("--role", choices=["device", "echo-devices"], help=argparse.SUPPRESS)
    parser.add_argument("--relay", help=argparse.SUPPRESS)
    parser.add_argument("--ca", help=argparse.SUPPRESS)
    parser.add_argument("--shards", help=argparse.SUPPRESS)
    parser.add_argument("-n", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "device":
        asyncio.run(role_device(args.relay, args.ca, args.shards))
        return
    if args.role == "echo-devices":
        asyncio.run(role_echo_devices(args.relay, args.ca, args.n))
        return

    for label, flags in LIMITS:  # the shipped defaults first: what a relay operator runs
        print(f"\n=== relay with {label} ===")
        measure(args, flags)


LIMITS = [
    ("the shipped defaults (100 MB/s per device and per client address)", []),
    ("its limits lifted (--device-mbps 10000 --client-mbps 10000)", ["--device-mbps", "10000", "--client-mbps", "10000"]),
]


def measure(args: argparse.Namespace, flags: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="moeswarm-relay-bench-") as tmp:
        certs = make_dev_certs(Path(tmp) / "certs")
        export_onnx(CHECKPOINT, Path(tmp) / "shards", layers=(0, 0), experts=(0, 3))
        relay, rinfo = start(["-m", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(certs.cert),
                              "--key", str(certs.key), "--no-dht", *flags])
        url = rinfo["url"]
        procs = [relay]
        try:
            device, dinfo = start([__file__, "--role", "device", "--relay", url, "--ca", str(certs.ca),
                                   "--shards", str(Path(tmp) / "shards")])
            procs.append(device)
            set_relay_ca(str(certs.ca))
            times = asyncio.run(call_latency(dinfo, args.calls))
            device.terminate()
            print(f"\nexpert call round trip (demo checkpoint, 1 token x 2 experts, ONNX), {args.calls} calls each, ms")
            print(f"{'path':<16}{'median':>10}{'p90':>10}{'p99':>10}")
            for name, values in times.items():
                q = np.percentile(values, [50, 90, 99]) * 1000
                print(f"{name:<16}{q[0]:>10.3f}{q[1]:>10.3f}{q[2]:>10.3f}")
            for kind in ("call", "ping"):
                added = statistics.median(times[f"relayed {kind}"]) - statistics.median(times[f"direct {kind}"])
                print(f"relay adds {added * 1000:.3f} ms per {kind} (median)")

            print(f"\nforwarded through the relay, {args.frame_kb} KiB frames echoed, 4 in flight per client, "
                  f"{args.seconds:.0f} s")
            print(f"{'devices':>8}{'echoed MB/s':>14}{'relay forwarded MB/s':>22}")
            for n in (int(v) for v in args.devices.split(",")):
                echo, einfo = start([__file__, "--role", "echo-devices", "--relay", url, "--ca", str(certs.ca),
                                     "-n", str(n)])
                try:
                    echoed, forwarded = asyncio.run(forwarded_mb_s(url, str(certs.ca), einfo["peers"], args.seconds,
                                                                   args.frame_kb))
                finally:
                    echo.terminate()
                    echo.wait(10)
                print(f"{n:>8}{echoed:>14.1f}{forwarded:>22.1f}")
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)



if __name__ == "__main__":
    main()
