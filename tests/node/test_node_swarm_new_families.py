"""Qwen3.5-MoE and GLM-5 through a real swarm on loopback: three expert nodes as separate processes
found through the libp2p DHT, a backbone in this process keeping the DeltaNet / gated-attention
layers (conv, recurrent and KV caches) or the DSA layers (KV and indexer-key caches) local.  It must
give the single-process tokens and logits (Qwen3.5: over a prompt longer than one 64-token DeltaNet
prefill chunk; GLM-5: with an indexer top-k of 6 under a 16-token prompt)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.demo.swarm import expert_nodes
from moeswarm.model import SamplingParams, generate, load_model
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.protocol import peer_id_from_str

pytestmark = pytest.mark.slow


def run_logits(model, prompt: list[int], decode: list[int]) -> np.ndarray:  # type: ignore[no-untyped-def]
    cache = model.new_cache()
    out = [model.forward(np.asarray([prompt]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in decode]
    return np.concatenate(out)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "glm_moe_dsa"])
def test_backbone_and_three_expert_nodes_give_single_process_tokens(oracle_checkpoints, arch: str) -> None:
    folder, _ = oracle_checkpoints.get(arch, "packed")
    o = oracle_checkpoints.oracle
    length = o.QWEN3_5_PROMPT_LEN if arch == "qwen3_5_moe" else len(o.PROMPT)
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, 512, length)]
    single = load_model(folder)
    params = SamplingParams(max_new_tokens=8)
    expected_tokens = list(generate(single, prompt, params))
    expected = run_logits(single, prompt, expected_tokens[:-1])
    ref = o.reference_run(folder, prompt, n_decode=len(expected_tokens) - 1)
    assert expected_tokens == ref.greedy_tokens  # the single process is itself the oracle's

    n = single.config.num_experts  # three uneven ranges (qwen3.5: 3, 3 and 2 of 8 experts)
    a, b = -(-n // 3), 2 * -(-n // 3)
    ranges = [f"0-{a - 1}", f"{a}-{b - 1}", f"{b}-{n - 1}"]
    with expert_nodes(str(folder), ranges) as daemons:
        boot = daemons[0].info["multiaddrs"][0]

        async def main() -> tuple[np.ndarray, list[int], set[bytes]]:
            config = BackboneConfig(SwarmConfig(str(folder), bootstrap=(boot,), client_mode=True),
                                    coverage_timeout_s=60)
            async with SwarmBackbone(config) as bb:
                assert bb.model is not None and bb.executor is not None
                logits = await asyncio.to_thread(run_logits, bb.model, prompt, expected_tokens[:-1])
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, prompt, params)))  # type: ignore[arg-type]
                return logits, tokens, set(bb.executor.served_by)

        logits, tokens, used = asyncio.run(main())
    assert tokens == expected_tokens
    assert np.abs(logits - expected).max() <= 1e-5
    assert used == {peer_id_from_str(d.info["peer_id"]) for d in daemons}
