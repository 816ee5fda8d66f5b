"""Issue 17, live: replicas follow demand with real processes.

Six ``moeswarm node --experts auto`` processes (CLI subprocesses) join one by one, each offering
room for 8 of the demo checkpoint's 32 experts (1.5x the model), while nobody has reported
demand yet: the market places them by coverage alone. Three backbones in this process then
generate from different prompts; their routers count which experts they pick (real routing,
which is skewed on this model) and publish signed reports. Every node re-evaluates every 2 s.

Checked, against the backbones' own counts (not the market's merge): the quarter of experts the
routers picked most ends up with more replicas than the quarter they picked least, and by more
than before the reports; the DHT lists a holder for every expert at every poll while nodes move;
and the tokens the swarm generates afterwards equal the single-process engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import numpy as np
import pytest

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.market import ModelShape, fetch_state
from moeswarm.model import SamplingParams, Tokenizer, generate, load_config, load_model
from moeswarm.node.daemon import BackboneConfig, SwarmBackbone, SwarmConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ("And it came to pass", "The LORD is my shepherd", "In the beginning God created")
NODES = 6
CELLS_PER_NODE = 8


def _quarters(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Masks of the most and the least picked quarter of experts (ties broken by position)."""
    flat = counts.reshape(-1)
    order = np.argsort(-flat, kind="stable")
    q = flat.size // 4
    hot, cold = np.zeros(flat.size, dtype=bool), np.zeros(flat.size, dtype=bool)
    hot[order[:q]], cold[order[-q:]] = True, True
    return hot.reshape(counts.shape), cold.reshape(counts.shape)


def test_hot_experts_gain_replicas_while_every_expert_stays_held() -> None:
    cfg = load_config(CHECKPOINT)
    moe = tuple(L for L in range(cfg.num_layers) if cfg.moe_layers[L])
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2  # float16, as the node loads them
    daemons = []
    t0 = time.monotonic()
    try:
        for i in range(NODES):
            args = ["node", "--model", str(CHECKPOINT), "--experts", "auto", "--capacity",
                    f"{CELLS_PER_NODE * expert_bytes}B", "--rebalance-interval", "2", "--probe-interval", "0",
                    "--status", "off"]
            if daemons:
                args += ["--bootstrap", daemons[0].info["multiaddrs"][0]]
            daemons.append(start_daemon(f"follow{i}", args))
        first = {tuple(d.info["layers"]) + tuple(d.info["experts"]) for d in daemons}
        local = load_model(str(CHECKPOINT))
        tok = Tokenizer.from_folder(CHECKPOINT, cfg.bos_token_id)
        check_ids = tok.encode("Blessed are the meek")
        expected = list(generate(local, check_ids, SamplingParams(max_new_tokens=10)))

        async def run() -> dict:
            boot = (daemons[0].info["multiaddrs"][0],)
            async with contextlib.AsyncExitStack() as stack:
                bbs = []
                for _ in PROMPTS:
                    config = replace(BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=boot, client_mode=True)),
                                     demand_interval_s=0.5)
                    bbs.append(await stack.enter_async_context(SwarmBackbone(config)))
                shape = ModelShape(bbs[0].model_id, moe, cfg.num_experts, expert_bytes)
                coverage: list[float] = []

                async def replicas() -> np.ndarray:
                    state = await fetch_state(bbs[0].p2p, shape)
                    coverage.append(state.supply.coverage())
                    return state.supply.replicas.copy()

                before = await replicas()
                print(f"{time.monotonic() - t0:.0f} s: nodes up, replicas\n{before}", flush=True)
                for bb, prompt in zip(bbs, PROMPTS):
                    ids = tok.encode(prompt)
                    await asyncio.to_thread(lambda m=bb.model, i=ids: list(generate(m, i, SamplingParams(max_new_tokens=24))))
                counts = sum(bb.demand.snapshot() for bb in bbs)
                hot, cold = _quarters(counts)
                gap_before = float(before[hot].mean() - before[cold].mean())
                print(f"{time.monotonic() - t0:.0f} s: demand counted\n{counts}", flush=True)
                deadline = time.monotonic() + 120
                now = before
                while time.monotonic() < deadline:  # bounded: the nodes re-evaluate every second
                    now = await replicas()
                    if now[hot].mean() > now[cold].mean() and now[hot].mean() - now[cold].mean() > gap_before:
                        break
                    print(f"{time.monotonic() - t0:.0f} s: replicas\n{now}", flush=True)
                    await asyncio.sleep(1.0)
                for _ in range(5):  # a few more polls while moved nodes finish their grace period
                    coverage.append((await fetch_state(bbs[0].p2p, shape)).supply.coverage())
                got = await asyncio.to_thread(lambda: list(generate(bbs[0].model, check_ids,  # type: ignore[arg-type]
                                                                     SamplingParams(max_new_tokens=10))))
                return {"before": before, "after": now, "hot": hot, "cold": cold, "gap_before": gap_before,
                        "coverage": coverage, "tokens": got}

        out = asyncio.run(run())
    finally:
        for d in daemons:
            stop_daemon(d)
    after, hot, cold = out["after"], out["hot"], out["cold"]
    assert len(first) > 1, "every node took the same block"
    assert min(out["coverage"]) == 1.0, f"an expert lost its last holder: coverage {out['coverage']}"
    assert after[hot].mean() > after[cold].mean(), (after, out["hot"])
    assert after[hot].mean() - after[cold].mean() > out["gap_before"], (out["before"], after)
    assert out["tokens"] == expected
