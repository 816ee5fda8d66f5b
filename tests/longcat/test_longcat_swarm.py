"""LongCat-Flash (``longcat_flash``) in a real swarm on loopback: three expert node processes found
through the libp2p DHT holding the 8 routed experts only, the backbone (two MLA sublayers with the
LoRA scales, two dense MLPs, the MoE shortcut, the router with its correction bias and scaling, the
zero-computation experts) in this process.  The swarm must give the single-process logits (prefill in
chunks of 5 over the cache, then decode) and transformers' greedy tokens: no node holds a
zero-computation expert and none is asked for one."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(longcat_checkpoints) -> None:
    folder, ref = longcat_checkpoints.get("packed")
    single = load_model(folder)
    assert (single.config.num_experts, single.config.zero_experts) == (8, 4)
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-2", "3-5", "6-7"], chunk=5)
