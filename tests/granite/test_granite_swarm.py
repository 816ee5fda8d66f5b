"""Granite MoE shared (``granitemoeshared``) in a real swarm on loopback: three expert node processes
found through the libp2p DHT, the backbone (GQA with biases and Granite's attention multiplier, the
embedding and residual multipliers, the top-k softmax routers, shared MLPs, the logits scaling) in this
process.  The swarm must give the single-process logits (prefill in chunks of 5 over the cache, then
decode) and transformers' greedy tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(granite_checkpoints) -> None:
    folder, ref = granite_checkpoints.get("granitemoeshared", "per_expert")
    single = load_model(folder)
    assert single.config.residual_multiplier == 0.4 and single.config.shared_intermediate_size == 48
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-2", "3-5", "6-7"], chunk=5)
