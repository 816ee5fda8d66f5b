"""Llama 4 (``llama4``, the vision-language checkpoint's text model) in a real swarm on loopback: three
expert node processes found through the libp2p DHT, the backbone (chunked RoPE layers and NoPE layers
with their KV caches, dense layers between the MoE layers 1 and 3, the top-k sigmoid routers and shared
experts) in this process.  The experts compute on inputs the backbone has already scaled by the router
(one row per token and choice, weight 1), so the nodes run plain SwiGLU experts.  The swarm must give
the single-process logits (prefill in chunks of 5 over the cache, then decode) and transformers'
greedy tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(llama4_checkpoints) -> None:
    folder, ref = llama4_checkpoints.get("vision")
    single = load_model(folder)
    assert single.config.expert_input_scaled and single.config.moe_layers == (False, True, False, True)
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-2", "3-5", "6-7"], chunk=5)
