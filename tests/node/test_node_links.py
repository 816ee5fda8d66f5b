"""LinkMonitor's probes measure each direction of an asymmetric link separately: a data-plane
server in one network namespace, the prober in another, the veth between them shaped by the
kernel (tbf) to 89 Mbit/s one way and 49 Mbit/s the other (seed 000's office link) plus 3.4 ms
of round trip (benchmarks/_links.py).  The oracle is the kernel's shaping, not our own numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("network_namespaces"),
]

SERVER = """
import asyncio
from moeswarm.net.dataplane import DataPlaneServer, ServerConfig
from moeswarm.protocol import Identity
async def main():
    async def no_calls(client, request): raise RuntimeError("probes only")
    async with DataPlaneServer(Identity.generate(), no_calls, ServerConfig(host="127.0.0.1")) as srv:
        print(srv.port, flush=True)
        await asyncio.Event().wait()
asyncio.run(main())
"""

PROBER = """
import asyncio, json, sys
from moeswarm.net.client import ExpertClient
from moeswarm.node.links import ProbeConfig, measure
from moeswarm.protocol import Identity
async def main():
    client = await ExpertClient.connect(sys.argv[1], Identity.generate())
    config = ProbeConfig(target_s=0.15)
    previous = None
    out = []
    for _ in range(3):  # the estimate a monitor would keep: each probe sized from the last
        rtt, up, down = await measure(client, config, previous)
        out.append([rtt, up, down])
        from moeswarm.node.links import LinkEstimate
        previous = LinkEstimate(rtt, up, down, 0.0)
    await client.aclose()
    print(json.dumps(out), flush=True)
asyncio.run(main())
"""


def test_probes_measure_rtt_and_each_direction_of_an_asymmetric_link() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from _links import emulated_link
    finally:
        sys.path.remove(str(BENCHMARKS))

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    with emulated_link(rtt_ms=3.4, a_to_b_mbit=89, b_to_a_mbit=49) as link:
        server = link.run(link.ns_b, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, env=env)
        assert server.stdout is not None
        port = int(server.stdout.readline())
        proxy = link.delayed_port(port)
        probe = link.run(link.ns_a, [sys.executable, "-c", PROBER, f"tcp+tls://{link.addr_b}:{proxy}"],
                         stdout=subprocess.PIPE, text=True, env=env)
        out, _ = probe.communicate(timeout=120)
    assert probe.returncode == 0
    probes = json.loads(out)  # the link's figures are bounds: a busy machine can only fall short of them
    rtt, up, down = min(p[0] for p in probes), max(p[1] for p in probes), max(p[2] for p in probes)
    print(f"measured: rtt {rtt * 1e3:.2f} ms, up {up * 8e-6:.1f} Mbit/s, down {down * 8e-6:.1f} Mbit/s")
    assert rtt >= 3.2e-3, rtt  # at least the 3.4 ms the link adds (the figures: benchmarks/tiers.py)
    up_mbit, down_mbit = up * 8e-6, down * 8e-6
    # tbf counts Ethernet frames; TLS records and TCP headers ride along: goodput a few % lower
    assert 0 < up_mbit <= 1.1 * 89, (up_mbit, down_mbit)  # never more than the kernel lets through
    assert 0 < down_mbit <= 1.1 * 49, (up_mbit, down_mbit)
    assert up_mbit / down_mbit > 1.4  # the asymmetry is seen, in the right direction
