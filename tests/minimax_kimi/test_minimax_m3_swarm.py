"""MiniMax M3 in a real swarm on loopback: three expert nodes as separate processes, the backbone
(attention with the lightning indexer and its index-key cache, dense layers, shared experts) in
this process.  The swarm must give the single-process logits and transformers' greedy tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(family_checkpoints) -> None:
    folder, ref = family_checkpoints.get("minimax_m3_vl", "per_expert")
    single = load_model(folder)
    assert single.config.num_experts == 8 and any(single.config.sparse_layers)
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-2", "3-5", "6-7"], chunk=5)
