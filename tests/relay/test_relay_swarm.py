"""A real swarm on loopback with devices behind a relay: an expert node, a relay and two bridges
as processes (the bridges never listen), a backbone in this process. Experts 4-7 are held only
by the bridges. Generation must equal the single-process engine, also when the relay is killed
mid-generation and restarted on the same port."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.mobile_bridge import export_onnx
from moeswarm.model import SamplingParams, generate
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.node.dispatch import DispatchConfig
from moeswarm.protocol import peer_id_from_str
from moeswarm.relay import set_relay_ca

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def relayed_clients_closed(bb: SwarmBackbone) -> bool:
    assert bb.executor is not None
    clients = bb.executor.connections._clients  # test-only peek: which connections are still up
    return all(c.closed for p, c in clients.items() if any(e.startswith("relay+") for e in bb.table.holders[p].endpoints))


def test_bridges_behind_a_relay_generate_the_engine_tokens_across_a_relay_restart(
        mixtral: tuple[Path, Any], certs: Any, spawn: Any, tmp_path: Path) -> None:
    folder, ref = mixtral
    shards = [tmp_path / "shards-45", tmp_path / "shards-67"]
    export_onnx(folder, shards[0], experts=(4, 5))
    export_onnx(folder, shards[1], experts=(6, 7))

    node = spawn("node", "moeswarm.cli", "node", "--model", str(folder), "--experts", "0-3")
    boot = node.wait_ready()["multiaddrs"][0]
    port = free_port()
    relay_args = ["--listen", f"127.0.0.1:{port}", "--cert", str(certs.cert), "--key", str(certs.key),
                  "--bootstrap", boot, "--identity", str(tmp_path / "relay.key")]
    relays = [spawn("relay", "moeswarm.relay.cli", *relay_args)]
    url = relays[0].wait_ready()["url"]
    assert url == f"wss://127.0.0.1:{port}"
    bridges = [spawn(f"bridge{i}", "moeswarm.mobile_bridge.cli", "bridge", "--relay", url, "--ca", str(certs.ca),
                     "--shards", str(d), "--max-backoff", "0.5", "-v") for i, d in enumerate(shards)]
    infos = [b.wait_ready() for b in bridges]
    bridge_peers = {peer_id_from_str(i["peer_id"]) for i in infos}
    assert [i["experts"] for i in infos] == [[4, 5], [6, 7]]
    assert all(i["endpoint"] == f"relay+wss://127.0.0.1:{port}/{i['peer_id']}" for i in infos)
    set_relay_ca(str(certs.ca))
    params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))

    async def main() -> tuple[list[int], list[int], set[bytes], dict[bytes, float | None]]:
        config = BackboneConfig(SwarmConfig(str(folder), bootstrap=(boot,), client_mode=True), coverage_timeout_s=60,
                                discovery_interval_s=1.0, dispatch=DispatchConfig(timeout_s=30.0))
        async with SwarmBackbone(config) as bb:
            assert bb.model is not None and bb.executor is not None
            first = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
            used = set(bb.executor.served_by)
            rtts = {p: bb.table.holders[p].rtt_s for p in bridge_peers}
            steps = {"n": 0}

            def kill_relay_mid_generation(layer: int, ids: np.ndarray) -> None:
                if layer == 0:
                    steps["n"] += 1
                if steps["n"] == 4 and len(relays) == 1:  # prefill + 2 decode steps done
                    relays[0].stop(signal.SIGKILL)
                    deadline = time.monotonic() + 10
                    while not relayed_clients_closed(bb) and time.monotonic() < deadline:
                        time.sleep(0.01)  # the event loop notices the dead sockets
                    relays.append(spawn("relay2", "moeswarm.relay.cli", *relay_args))

            bb.model.observers.append(kill_relay_mid_generation)
            second = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
            return first, second, used, rtts

    first, second, used, rtts = asyncio.run(main())
    assert first == ref.greedy_tokens
    assert len(relays) == 2, "the relay was never killed"
    assert second == ref.greedy_tokens
    assert bridge_peers <= used  # experts 4-7 came from the bridges
    assert all(r is not None and r > 0 for r in rtts.values())  # the relay hop is measured like any other
    relays[1].wait_ready()
    for bridge in bridges:  # both bridges reconnected to the restarted relay
        assert "relay session 2 up" in bridge.stderr()
