"""ERNIE 4.5 MoE (``ernie4_5_moe``) in a real swarm on loopback: three expert nodes as separate processes
found through the libp2p DHT, the backbone (interleaved-rope GQA with its KV cache, dense layers between
the MoE layers 1 and 3, the choice-biased softmax routers, shared experts, tied embeddings) in this
process.  The swarm must give the single-process logits (prefill in chunks of 5 over the cache, then
decode) and transformers' greedy tokens.  One family stands for the three of ``tests/families``: the
nodes compute plain SwiGLU experts for all of them; what differs is the backbone's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.demo.swarm import expert_nodes
from moeswarm.model import Model, SamplingParams, generate, load_model
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.protocol import peer_id_from_str

pytestmark = pytest.mark.slow


def run_logits(model: Model, prompt: list[int], decode: list[int], chunk: int) -> np.ndarray:
    cache = model.new_cache()
    out = [model.forward(np.asarray([prompt[i : i + chunk]]), cache)[0] for i in range(0, len(prompt), chunk)]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in decode]
    return np.concatenate(out)


def test_ernie_backbone_and_three_nodes_give_single_process_tokens(family_checkpoints) -> None:
    folder, ref = family_checkpoints.get("ernie4_5_moe", "per_expert")
    single = load_model(folder)
    assert single.config.num_experts == 16 and single.config.moe_layers == (False, True, False, True, False, False)
    expected = run_logits(single, ref.prompt_ids, ref.decode_tokens, chunk=5)
    single_tokens = list(generate(single, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens))))
    assert single_tokens == ref.greedy_tokens

    with expert_nodes(str(folder), ["0-5", "6-10", "11-15"]) as daemons:
        config = BackboneConfig(SwarmConfig(str(folder), bootstrap=(daemons[0].info["multiaddrs"][0],),
                                            client_mode=True), coverage_timeout_s=60)

        async def main() -> tuple[np.ndarray, list[int], set[bytes]]:
            async with SwarmBackbone(config) as bb:
                assert bb.model is not None and bb.executor is not None
                assert not any(bb.model.weights.experts.get(L) for L in range(single.config.num_layers))
                logits = await asyncio.to_thread(run_logits, bb.model, ref.prompt_ids, ref.decode_tokens, 5)
                params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
                return logits, tokens, set(bb.executor.served_by)

        logits, tokens, used = asyncio.run(main())
    assert np.abs(logits - expected).max() <= 1e-5
    assert tokens == single_tokens
    assert used == {peer_id_from_str(d.info["peer_id"]) for d in daemons}
