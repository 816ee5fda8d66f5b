"""GLM-4.5 (``glm4_moe``) in a real swarm on loopback: three expert nodes as separate processes
found through the libp2p DHT, the backbone (partial-rotary GQA with its KV cache, the dense first
layer, routers and shared experts) in this process.  The swarm must give the single-process logits
(prefill in chunks of 5 over the cache, then decode) and transformers' greedy tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(glm4_checkpoints) -> None:
    folder, ref = glm4_checkpoints.get("glm4_moe", "per_expert")
    single = load_model(folder)
    assert single.config.num_experts == 16 and not single.config.moe_layers[0]
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-5", "6-10", "11-15"], chunk=5)
