"""DeepSeek-V4 (``deepseek_v4``) in a real swarm on loopback: three expert node processes found through
the libp2p DHT, the backbone in this process (sliding, CSA and HCA attention with their compressor
caches, hyper-connections, the routers: hash-routed layers 0-1 pick experts by token id, learned
``sqrtsoftplus`` layers 2-4; the shared experts).  The nodes compute the routed experts with V4's
clamped SwiGLU, read from the same config.json.  The swarm must give the single-process logits
(prefill in chunks of 5 over the cache, then decode) and transformers' greedy tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(dsv4_checkpoints) -> None:
    folder, ref = dsv4_checkpoints.get("per_expert")
    single = load_model(folder)
    assert single.config.family.hash_layers == (True, True, False, False, False)
    assert single.config.expert_activation == "limited_swiglu"
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-2", "3-5", "6-7"], chunk=5)
