"""The nearest holder (issue 30 point 3): the backbone sends each expert call to the replica with
the least expected latency, measured round trip plus queue, and falls back when it dies.

Two real node processes hold every expert; the far one is announced behind a delay proxy
(``benchmarks/_delay.py``, 30 ms each way), the near one is dialled directly. No timing is
asserted: which replica served is."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.demo.swarm import expert_nodes
from moeswarm.model import SamplingParams, generate, load_model
from moeswarm.net.routing_table import Holder, plan_dispatch
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.market import NEAR_RTT_S
from moeswarm.node.config import BackboneConfig
from moeswarm.node.round_trips import measure_round_trips
from moeswarm.node.verify import VerifyConfig
from moeswarm.protocol import Identity, peer_id_from_str

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _delay import spawn_delay_proxy

pytestmark = pytest.mark.slow


def _holder(name: bytes, rtt_s: float, in_flight: int = 0, service_s: float | None = None) -> Holder:
    h = Holder(name, ("tcp://x",), "m", (0, 0), (0, 3), 2**62, 1, rtt_s=rtt_s)
    h.in_flight, h.service_s = in_flight, service_s
    return h


def test_expected_latency_is_round_trip_plus_the_calls_in_flight() -> None:
    near, far = _holder(b"a", 0.001), _holder(b"b", 0.060)
    assert plan_dispatch(0, [0, 1], [near, far])[0] == {b"a": [0, 1]}
    near.in_flight, near.service_s = 40, 0.002  # 40 of our calls queued there, 2 ms of compute each
    assert plan_dispatch(0, [0, 1], [near, far])[0] == {b"b": [0, 1]}
    near.in_flight = 20
    assert plan_dispatch(0, [0, 1], [near, far])[0] == {b"a": [0, 1]}
    near.probed(0.001)  # a probe never raises the estimate: it only pulls a stale one back
    far.rtt_s = None
    far.probed(0.060)
    assert far.rtt_s == 0.060 and near.rtt_s == 0.001


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_calls_go_to_the_nearer_replica_and_move_when_it_dies(oracle_checkpoints, tmp_path: Path) -> None:
    """On the code before (probes not used, an unmeasured holder assumed 5 ms, ties to the lower
    peer id) the far replica, given the lower peer id here, served the first call: this failed with
    ``served_by`` holding both peers."""
    folder, ref = oracle_checkpoints.get("mixtral", "packed")
    n = load_model(folder).config.num_experts
    expected = list(generate(load_model(folder), ref.prompt_ids, SamplingParams(max_new_tokens=8)))
    seeds = [bytes([i + 1]) * 32 for i in range(2)]
    seeds.sort(key=lambda s: Identity.from_seed(s).peer_id)  # the far one gets the lower peer id
    keys = []
    for i, seed in enumerate(seeds):
        keys.append(tmp_path / f"id{i}")
        keys[-1].write_bytes(seed)
    far_port = _free_port()
    proxy = spawn_delay_proxy("127.0.0.1:0", f"127.0.0.1:{far_port}", 0.030)
    args = [["--identity", str(keys[0]), "--port", str(far_port), "--announce-port", str(proxy.port)],
            ["--identity", str(keys[1])]]
    try:
        with expert_nodes(str(folder), [f"0-{n - 1}"] * 2, extra_args=lambda i: args[i]) as daemons:
            far, near = (peer_id_from_str(d.info["peer_id"]) for d in daemons)
            assert far < near
            config = BackboneConfig(SwarmConfig(str(folder), bootstrap=(daemons[0].info["multiaddrs"][0],),
                                                client_mode=True), coverage_timeout_s=60,
                                    verify=VerifyConfig(fraction=0.0), probe_interval_s=1.0)

            async def main() -> tuple[list[int], set[bytes], list[int], set[bytes]]:
                async with SwarmBackbone(config) as bb:
                    assert bb.model is not None and bb.executor is not None and bb.tiers is not None
                    links = bb.tiers.links.links
                    deadline = time.monotonic() + 60
                    while not (far in links and near in links) and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)  # bounded poll on the probes' first round
                    assert far in links and near in links, bb.tiers.links.errors
                    # what an --experts auto volunteer measures for the market's regions: its own pings
                    rtts = await measure_round_trips(Identity.generate(), list(bb.table.holders.values()))
                    assert rtts[near] <= NEAR_RTT_S < rtts[far], rtts
                    params = SamplingParams(max_new_tokens=4)
                    first = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
                    before = set(bb.executor.served_by)
                    bb.executor.served_by.clear()
                    os.kill(daemons[1].process.pid, signal.SIGKILL)  # the near replica dies
                    daemons[1].process.wait(10)
                    rest = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids + first, params)))  # type: ignore[arg-type]
                    return first, before, rest, set(bb.executor.served_by)

            first, before, rest, after = asyncio.run(main())
    finally:
        proxy.close()
    assert before == {near}  # every call of the first tokens: the near replica
    assert after == {far}  # after its death: the far one, the same greedy tokens
    assert first + rest == expected
