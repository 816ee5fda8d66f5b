"""Expert-call time of the browser device (the volunteer page in headless Chromium, onnxruntime-web
WebAssembly SIMD, one thread) next to the Python bridge (onnxruntime, one thread), both behind the
same relay on loopback, serving the same exported shards, called by the same client in this
process with calls alternating between the two devices (after an untimed warm-up).

    python benchmarks/browser_device.py [--calls 300] [--tokens 1,16]

Prints per request size: the round trip through the relay (median, p90) and the compute time
each device reports in its response (`compute_us`, median), in milliseconds.
Needs Debian's chromium (/usr/bin/chromium) and python playwright.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).resolve().parents[1] / "tests/relay")]

from browser_device import BrowserDevice  # noqa: E402

from moeswarm.demo import CHECKPOINT  # noqa: E402
from moeswarm.mobile_bridge import export_onnx  # noqa: E402
from moeswarm.net.client import ExpertClient  # noqa: E402
from moeswarm.protocol import ExpertRequest, ExpertRows, Identity  # noqa: E402
from moeswarm.relay import set_relay_ca  # noqa: E402
from moeswarm.relay.devcerts import make_dev_certs  # noqa: E402


def start(args: list[str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY "):
            return proc, json.loads(line[6:])
    raise RuntimeError(f"{args} exited without READY")


async def measure(endpoints: dict[str, str], model_id: str, layer: int, hidden: int, tokens: int,
                  calls: int) -> dict[str, tuple[list[float], list[float]]]:
    me = Identity.generate()
    clients = {name: await ExpertClient.connect(endpoint, me) for name, endpoint in endpoints.items()}
    x = np.random.default_rng(0).standard_normal((tokens, hidden)).astype(np.float32)
    rows = np.arange(tokens, dtype=np.uint32)
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in clients}
    seq = int(time.time() * 1e6)
    warmup = 30
    for i in range(calls + warmup):
        order = list(clients.items()) if i % 2 == 0 else list(reversed(clients.items()))  # alternate who goes first
        for name, client in order:
            seq += 1
            request = ExpertRequest(os.urandom(16), model_id, layer, seq, x, (ExpertRows(0, rows), ExpertRows(1, rows)))
            t0 = time.perf_counter()
            response = await client.call(request, 30)
            t1 = time.perf_counter()
            if i >= warmup:
                out[name][0].append(t1 - t0)
                out[name][1].append(response.compute_us / 1e6)
    for client in clients.values():
        await client.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--tokens", default="1,16")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moeswarm-browser-bench-") as tmp:
        certs = make_dev_certs(Path(tmp) / "certs")
        shards = Path(tmp) / "shards"
        manifest = export_onnx(CHECKPOINT, shards, layers=(0, 0), experts=(0, 3))
        relay, rinfo = start(["-m", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(certs.cert),
                              "--key", str(certs.key), "--no-dht", "--volunteer-shards", str(shards)])
        procs = [relay]
        try:
            url = rinfo["url"]
            bridge, binfo = start(["-m", "moeswarm.mobile_bridge.cli", "bridge", "--relay", url, "--ca", str(certs.ca),
                                   "--shards", str(shards)])
            procs.append(bridge)
            set_relay_ca(str(certs.ca))
            with BrowserDevice("https" + url[3:] + "/volunteer/") as browser:
                endpoints = {"python bridge": binfo["endpoint"], "browser (wasm)": browser.info["endpoint"]}
                print(f"expert call through the relay, demo checkpoint (H={manifest.hidden_size}, "
                      f"F={manifest.intermediate_size}), 2 experts x N tokens, {args.calls} calls each, alternating, ms")
                print(f"{'N':>4}  {'device':<16}{'call median':>12}{'call p90':>10}{'compute median':>16}")
                for tokens in (int(t) for t in args.tokens.split(",")):
                    result = asyncio.run(measure(endpoints, manifest.model_id, manifest.moe_layers[0],
                                                 manifest.hidden_size, tokens, args.calls))
                    for name, (rtt, compute) in result.items():
                        q = np.percentile(rtt, [50, 90]) * 1000
                        print(f"{tokens:>4}  {name:<16}{q[0]:>12.3f}{q[1]:>10.3f}{np.median(compute) * 1000:>16.3f}")
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
