"""Qwen3-Next (``qwen3_next``) in a real swarm on loopback: three expert nodes as separate processes
found through the libp2p DHT, the backbone (DeltaNet layers with their conv + recurrent state, the
gated attention layer with its KV cache, the dense layer, routers and gated shared experts) in this
process.  The swarm must give the single-process logits (prefill in calls of 27 over the cache,
then decode) and transformers' greedy tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(qwen3_next_checkpoints) -> None:
    folder, ref = qwen3_next_checkpoints.get("per_expert")
    single = load_model(folder)
    assert single.config.num_experts == 8 and single.config.moe_layers == (True, False, True)
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-2", "3-5", "6-7"], chunk=27)
