"""Issue 17, live: replicas follow demand with real processes.

Six ``moeswarm node --experts auto`` processes (CLI subprocesses, one after another) each offer
room for 8 of the demo checkpoint's 4 x 8 experts (1.5x the model) while no backbone has
reported demand: the market places them by coverage alone (every expert held once or twice,
the same count for hot and cold). Three backbones in this process (the market merges at least
three reports) then serve a workload whose routers pick experts 0-1 of every MoE layer 2.5x as
often as each other expert: the picks go through each backbone's router hook into its demand
counter, and its own publisher signs and stores the counts in the DHT. Every node re-evaluates
every ~8 s with the default hysteresis and cooldown.

Measured from the nodes' announcements in the DHT (not from the market's plans): afterwards
every hot expert has more holders than every cold one, where before it did not; the DHT lists a
holder for every expert at every poll from the backbones' start to the end; only nodes that
print a ``moved`` decision changed their block, each at most once, none before the reports. The
tokens the swarm generates after the moves equal the single-process engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import Daemon, start_daemon, stop_daemon
from moeswarm.market import (
    ModelShape,
    RebalanceConfig,
    fetch_announcements,
    model_shape,
    supply_from_holders,
)
from moeswarm.model import SamplingParams, Tokenizer, generate, load_config, load_model
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.node.verify import VerifyConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CFG = load_config(CHECKPOINT)
MOE = tuple(L for L in range(CFG.num_layers) if CFG.moe_layers[L])
NODES = 6
CELLS_PER_NODE = 8
HOT_EXPERTS = (0, 1)  # picked HOT_RATIO x as often as each other expert, in every MoE layer
HOT_RATIO = 2.5  # the hot experts carry 8 x 2.5 / (8 x 2.5 + 24) = 45% of the calls
BACKBONES = 3  # MergeConfig.min_reporters: fewer trusted reports leave demand uniform
PROMPT = "Blessed are the meek"
REBALANCE_S = 8  # each re-evaluation reads the DHT (~1 s of CPU over the swarm): not much more often


def skewed_picks(rounds: int) -> np.ndarray:
    """Routed experts of ``rounds`` rounds of a workload, ``(tokens, 2)`` like a top-2 router's ids."""
    per_round = [e for e in range(CFG.num_experts) for _ in range(5 if e in HOT_EXPERTS else 2)]
    return np.array(per_round * rounds, dtype=np.int64).reshape(-1, 2)


def node_args(capacity: int, bootstrap: str | None) -> list[str]:
    args = ["node", "--model", str(CHECKPOINT), "--experts", "auto", "--capacity", f"{capacity}B",
            "--rebalance-interval", str(REBALANCE_S), "--probe-interval", "0", "--status", "off"]
    return args + (["--bootstrap", bootstrap] if bootstrap else [])


def decisions(daemon: Daemon) -> list[dict[str, Any]]:
    return [json.loads(line[len("REBALANCE "):]) for line in list(daemon.lines) if line.startswith("REBALANCE ")]


def test_hot_experts_gain_replicas_while_every_expert_stays_held() -> None:
    shape0 = model_shape(str(CHECKPOINT), CFG, "probe")
    capacity = CELLS_PER_NODE * shape0.expert_bytes + shape0.expert_bytes // 2
    hot = np.zeros((len(MOE), CFG.num_experts), dtype=bool)
    hot[:, list(HOT_EXPERTS)] = True
    tok = Tokenizer.from_folder(CHECKPOINT, CFG.bos_token_id)
    ids = tok.encode(PROMPT)
    expected = list(generate(load_model(str(CHECKPOINT)), ids, SamplingParams(max_new_tokens=10)))
    daemons: list[Daemon] = []
    t0 = time.monotonic()
    try:
        for i in range(NODES):
            boot = daemons[0].info["multiaddrs"][0] if daemons else None
            daemons.append(start_daemon(f"follow{i}", node_args(capacity, boot)))
        joined = [d.info["blocks"] for d in daemons]
        print(f"{time.monotonic() - t0:.1f} s: {NODES} nodes up: {joined}", flush=True)

        async def run() -> dict[str, Any]:
            boot = (daemons[0].info["multiaddrs"][0],)
            async with contextlib.AsyncExitStack() as stack:
                base = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=boot, client_mode=True),
                                      demand_interval_s=2.0, discovery_interval_s=60.0, probe_interval_s=0.0,
                                      verify=VerifyConfig(evidence_interval_s=60.0))
                # the first generates (its holders' outputs checked as usual), the others only report demand
                configs = [base] + [replace(base, verify=VerifyConfig(fraction=0.0))] * (BACKBONES - 1)
                bbs = list(await asyncio.gather(*(stack.enter_async_context(SwarmBackbone(c)) for c in configs)))
                shape = ModelShape(bbs[0].model_id, MOE, CFG.num_experts, shape0.expert_bytes)
                samples: list[tuple[float, np.ndarray]] = []  # (monotonic time, replicas per expert)

                async def poll() -> None:  # what the DHT lists, from the backbones' start to the end
                    while True:
                        found = await fetch_announcements(bbs[0].p2p, shape)
                        samples.append((time.monotonic(), supply_from_holders(shape, found).replicas))
                        await asyncio.sleep(1.0)  # pacing only (a DHT read costs the swarm ~1 s of CPU)

                poller = asyncio.create_task(poll())
                try:
                    deadline = time.monotonic() + 60
                    while not samples and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                    assert samples, "no DHT sample within 60 s"
                    before = samples[-1][1]
                    fed_ms = int(time.time() * 1000)
                    for bb in bbs:  # the workload, through each backbone's router hook
                        for layer in MOE:
                            bb.demand.observe(layer, skewed_picks(100))
                    fed = time.monotonic()
                    print(f"{fed - t0:.1f} s: backbones up, demand fed; replicas\n{before}", flush=True)
                    deadline = fed + 120  # a loaded machine reads the DHT slowly
                    while time.monotonic() < deadline:  # bounded: the nodes re-evaluate every ~8 s
                        now = samples[-1][1]
                        if now[hot].min() > now[~hot].max():
                            break
                        await asyncio.sleep(0.2)
                    after = samples[-1][1]
                    print(f"{time.monotonic() - t0:.1f} s: replicas\n{after}", flush=True)
                    await bbs[0].discovery.refresh()  # its routing table as the DHT lists holders now
                    got = await asyncio.to_thread(lambda: list(generate(bbs[0].model, ids,  # type: ignore[arg-type]
                                                                         SamplingParams(max_new_tokens=10))))
                    count, until = len(samples), time.monotonic() + 60
                    while len(samples) < count + 2 and time.monotonic() < until:
                        await asyncio.sleep(0.1)  # two more polls after generating
                finally:
                    poller.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await poller
                return {"before": before, "after": after, "samples": samples, "fed": fed, "fed_ms": fed_ms,
                        "tokens": got}

        out = asyncio.run(run())
        print(f"{time.monotonic() - t0:.1f} s: done", flush=True)
    finally:
        with ThreadPoolExecutor(NODES) as pool:  # each withdraws its announcement: together, not in turn
            list(pool.map(stop_daemon, daemons))

    before, after, samples = out["before"], out["after"], out["samples"]
    assert before[hot].min() <= before[~hot].max(), f"the placement followed demand before any report:\n{before}"
    assert after[hot].min() > after[~hot].max(), \
        (f"hot experts do not hold more replicas than cold ones:\n{after}", {d.name: decisions(d)[-3:] for d in daemons})
    assert int(after.sum()) == NODES * CELLS_PER_NODE  # every node still announces a full block
    late = [t for t, _ in samples if t > out["fed"]]
    assert len(late) >= 4, f"only {len(late)} DHT samples after the reports"
    for t, replicas in samples:
        assert replicas.min() >= 1, f"an expert had no holder in the DHT at {t - out['fed']:+.1f} s:\n{replicas}"

    moved = {d.name: [x for x in decisions(d) if x["action"] == "moved"] for d in daemons}
    assert sum(len(m) for m in moved.values()) >= 1, {d.name: decisions(d) for d in daemons}
    for d in daemons:
        for m in moved[d.name]:
            assert m["time_ms"] >= out["fed_ms"], f"{d.name} moved before the demand reports: {m}"
            assert m["gain"] is not None and m["gain"] != "inf" and m["gain"] > RebalanceConfig().hysteresis
        assert len(moved[d.name]) <= 1, f"{d.name} moved twice (cooldown): {moved[d.name]}"
        last = decisions(d)[-1] if decisions(d) else None
        final = ([[*last["layers"], *last["experts"]]] + [[*L, *E] for L, E in last["more_blocks"]]) if last \
            else d.info["blocks"]
        assert (sorted(final) != sorted(d.info["blocks"])) == bool(moved[d.name]), (d.name, decisions(d))
    assert out["tokens"] == expected
