"""DBRX (``dbrx``) in a real swarm on loopback: three expert node processes found through the libp2p DHT
(each cutting its experts out of the flat ``[E * I, H]`` tensors), the backbone (LayerNorms, the fused
and clamped Wqkv, the renormalised softmax routers) in this process.  The swarm must give the
single-process logits (prefill in chunks of 5 over the cache, then decode) and transformers' greedy
tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_three_nodes_give_single_process_tokens(dbrx_checkpoint) -> None:
    folder, ref = dbrx_checkpoint.get()
    single = load_model(folder)
    assert single.config.norm == "layer" and single.config.num_experts == 8
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-2", "3-5", "6-7"], chunk=5)
