"""Kimi Linear (``kimi_linear``) in a real swarm on loopback: three expert node processes found through
the libp2p DHT, the backbone (Kimi delta attention with its recurrent state, MLA without RoPE, the
dense first layer, the sigmoid group routers, the shared experts) in this process.  The swarm must give
the single-process logits (prefill in chunks of 5 over the caches, then decode) and transformers'
greedy tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(kimi_linear_checkpoints) -> None:
    folder, ref = kimi_linear_checkpoints.get("packed")
    single = load_model(folder)
    assert single.config.family.linear == (True, False, True)
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-2", "3-5", "6-7"], chunk=5)
