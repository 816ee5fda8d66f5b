"""Mistral Small 4 (``mistral4``) in a real swarm on loopback: three expert node processes found through
the libp2p DHT, the backbone (MLA with the position-scaled query and its KV cache, the dense first layer,
the softmax group-limited routers and shared experts) in this process.  The swarm must give the
single-process logits (prefill in chunks of 5 over the cache, then decode) and transformers' greedy
tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(mistral4_checkpoint) -> None:
    folder, ref = mistral4_checkpoint.get()
    single = load_model(folder)
    assert single.config.router == "softmax_group" and single.config.moe_layers == (False, True, True)
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-5", "6-10", "11-15"], chunk=5)
