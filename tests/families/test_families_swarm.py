"""ERNIE 4.5 MoE (``ernie4_5_moe``) in a real swarm on loopback: three expert nodes as separate processes
found through the libp2p DHT, the backbone (interleaved-rope GQA with its KV cache, dense layers between
the MoE layers 1 and 3, the choice-biased softmax routers, shared experts, tied embeddings) in this
process.  The swarm must give the single-process logits (prefill in chunks of 5 over the cache, then
decode) and transformers' greedy tokens.  One family stands for the three of ``tests/families``: the
nodes compute plain SwiGLU experts for all of them; what differs is the backbone's."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_ernie_backbone_and_three_nodes_give_single_process_tokens(family_checkpoints) -> None:
    folder, ref = family_checkpoints.get("ernie4_5_moe", "per_expert")
    single = load_model(folder)
    assert single.config.num_experts == 16 and single.config.moe_layers == (False, True, False, True, False, False)
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-5", "6-10", "11-15"], chunk=5)
