"""Real swarms on loopback: expert nodes as separate processes, found through the libp2p DHT,
a backbone in this process.  Every wait is on a READY line or a bounded poll, never a sleep."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.demo.swarm import Daemon, expert_nodes
from moeswarm.model import SamplingParams, generate, load_model
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.protocol import peer_id_from_str

pytestmark = pytest.mark.slow


def nodes(folder: Path, ranges: list[str], bootstrap: str | None = None) -> AbstractContextManager[list[Daemon]]:
    return expert_nodes(str(folder), ranges, bootstrap=bootstrap)


def backbone_config(folder: Path, bootstrap: str, **kw) -> BackboneConfig:  # type: ignore[no-untyped-def]
    return BackboneConfig(SwarmConfig(str(folder), bootstrap=(bootstrap,), client_mode=True), coverage_timeout_s=60, **kw)


def run_logits(model, prompt: list[int], decode: list[int]) -> np.ndarray:  # type: ignore[no-untyped-def]
    cache = model.new_cache()
    out = [model.forward(np.asarray([prompt]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in decode]
    return np.concatenate(out)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_four_nodes_give_single_process_logits(oracle_checkpoints, arch: str) -> None:
    folder, ref = oracle_checkpoints.get(arch, "packed")
    n = load_model(folder).config.num_experts
    q = n // 4
    ranges = [f"{i * q}-{(i + 1) * q - 1}" for i in range(4)]
    expected = run_logits(load_model(folder), ref.prompt_ids, ref.decode_tokens)

    with nodes(folder, ranges) as daemons:
        async def main() -> tuple[np.ndarray, list[int], set[bytes]]:
            async with SwarmBackbone(backbone_config(folder, daemons[0].info["multiaddrs"][0])) as bb:
                logits = await asyncio.to_thread(run_logits, bb.model, ref.prompt_ids, ref.decode_tokens)
                params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
                assert bb.executor is not None
                return logits, tokens, set(bb.executor.served_by)

        logits, tokens, used = asyncio.run(main())
    assert np.abs(logits - expected).max() <= 1e-5
    assert tokens == ref.greedy_tokens
    assert used == {peer_id_from_str(d.info["peer_id"]) for d in daemons}


def test_sigkill_mid_generation_fails_over_and_late_joiner_is_used(oracle_checkpoints) -> None:
    folder, ref = oracle_checkpoints.get("mixtral", "per_expert")
    params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))
    with nodes(folder, ["0-3", "4-7", "4-7"]) as daemons:
        pids = {peer_id_from_str(d.info["peer_id"]): d.process.pid for d in daemons}
        boot = daemons[0].info["multiaddrs"][0]

        async def main() -> tuple[list[int], bytes, set[bytes]]:
            async with SwarmBackbone(backbone_config(folder, boot)) as bb:
                assert bb.model is not None and bb.executor is not None
                executor, killed = bb.executor, []
                steps = {"n": 0}

                def kill_after_three_tokens(layer: int, ids: np.ndarray) -> None:
                    if layer == 0:
                        steps["n"] += 1
                    if steps["n"] == 4 and not killed:  # prefill + 3 decode steps done
                        victim = next(p for p, s in executor.served_by.items() if any(e >= 4 for _, e in s))
                        os.kill(pids[victim], signal.SIGKILL)
                        killed.append(victim)

                bb.model.observers.append(kill_after_three_tokens)
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
                return tokens, killed[0], set(executor.served_by)

        tokens, victim, used = asyncio.run(main())
        assert tokens == ref.greedy_tokens
        survivors = set(pids) - {victim}
        assert survivors <= used  # the other replica of 4-7 took over

        # A node that joins later is discovered and used: it holds everything; the others are killed.
        with nodes(folder, ["0-7"], bootstrap=boot) as late:
            late_peer = peer_id_from_str(late[0].info["peer_id"])

            async def with_late_joiner() -> tuple[list[int], set[bytes]]:
                config = backbone_config(folder, boot, discovery_interval_s=0.5)
                async with SwarmBackbone(config) as bb:
                    deadline = time.monotonic() + 30
                    while late_peer not in bb.table.holders and time.monotonic() < deadline:
                        await bb.discovery.refresh()
                    for d in daemons:
                        if d.process.poll() is None:
                            d.process.send_signal(signal.SIGKILL)
                    tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
                    assert bb.executor is not None
                    return tokens, set(bb.executor.served_by)

            tokens, used = asyncio.run(with_late_joiner())
    assert tokens == ref.greedy_tokens
    assert late_peer in used
