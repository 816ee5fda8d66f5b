"""MiniMax-Text-01 (``minimax``) in a real swarm on loopback: three expert node processes found through
the libp2p DHT, the backbone (lightning attention with its decayed state, softmax GQA, the normed
residual stream with its alpha / beta factors, the routers) in this process.  The swarm must give the
single-process logits (prefill in chunks of 5 over the caches, then decode) and transformers' greedy
tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(minimax_checkpoints) -> None:
    folder, ref = minimax_checkpoints.get("packed")
    single = load_model(folder)
    assert single.config.family.linear == (False, True, False, True)
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-2", "3-5", "6-7"], chunk=5)
