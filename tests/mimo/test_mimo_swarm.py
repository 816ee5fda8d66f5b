"""MiMo-V2-Flash (``mimo_v2_flash``) in a real swarm on loopback: three expert node processes found
through the libp2p DHT, the backbone (full and sliding attention layers with their own kv heads, RoPE
and sinks, the scaled values, the dense first layer, the sigmoid group routers) in this process.  The
swarm must give the single-process logits (prefill in chunks of 5 over the cache, then decode) and
transformers' greedy tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(mimo_checkpoints) -> None:
    folder, ref = mimo_checkpoints.get("packed")
    single = load_model(folder)
    assert single.config.moe_layers == (False, True, True, True) and single.config.family.sliding[1]
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-2", "3-5", "6-7"], chunk=5)
