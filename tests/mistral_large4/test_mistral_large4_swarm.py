"""Mistral Large 4 (``mistral_large4``) in a real swarm on loopback: two expert node processes found
through the libp2p DHT, serving the experts from the hub-layout (Mistral-native names) checkpoint; the
backbone (NoPE layers, layers reading another's latent KV, the shared indexer, ssmax, LeRoPE, the
soft-capped logits) in this process.  The swarm must give the single-process logits (prefill in chunks
of 5 over the cache, then decode) and transformers' greedy tokens."""

from __future__ import annotations

import pytest
from swarm_support import assert_swarm_gives_single_process_tokens

from moeswarm.model import load_model

pytestmark = pytest.mark.slow


def test_backbone_and_two_nodes_give_single_process_tokens(ml4_checkpoints) -> None:
    folder, ref = ml4_checkpoints.get("native")
    single = load_model(folder)
    assert single.config.family.kv_source == (0, 0, 2, 2) and single.config.moe_layers == (False, True, True, True)
    assert_swarm_gives_single_process_tokens(single, folder, ref, ["0-7", "8-15"], chunk=5)
