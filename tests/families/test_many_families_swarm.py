"""One swarm serving several models at once, as a public swarm does: one libp2p DHT, two expert
node processes for each of dots.llm1 (``dots1``), ERNIE 4.5 MoE (``ernie4_5_moe``), Hunyuan-A13B
(``hunyuan_v1_moe``), GLM-4.7-Flash (``glm4_moe_lite``) and Granite MoE (``granitemoe``), each pair
splitting its model's experts.  The first node is the bootstrap peer of all the others, which start
together once it is READY.  Then, for each model in turn, a backbone in this process (dots1's dense
first layer and sliding layers; ERNIE's interleaved-rope GQA, dense layers between MoE layers 1 and 3,
choice-biased routers and tied embeddings; Hunyuan's dynamic-alpha rope and per-head q/k norms; GLM's
MLA attention and group-limited router; Granite's multipliers) must give the single-process logits
(prefill in chunks of 5 over the cache, then decode) and transformers' greedy tokens, every node of
its own model must have served it, and no node of another model may have: each backbone finds its
holders under its own model id."""

from __future__ import annotations

from typing import Any

import pytest
from swarm_support import assert_backbone_gives, single_process_run

from moeswarm.demo.swarm import start_daemons, stop_daemons
from moeswarm.model import load_model
from moeswarm.protocol import peer_id_from_str

pytestmark = pytest.mark.slow

# family -> the experts of each of its two node processes
_RANGES = {"dots1": ("0-7", "8-15"), "ernie4_5_moe": ("0-7", "8-15"), "hunyuan_v1_moe": ("0-3", "4-7"),
           "glm4_moe_lite": ("0-7", "8-15"), "granitemoe": ("0-3", "4-7")}


def test_one_swarm_serves_five_models_each_from_its_own_nodes(family_checkpoints: Any, glm4_checkpoints: Any,
                                                              granite_checkpoints: Any) -> None:
    checkpoints = {"dots1": family_checkpoints, "ernie4_5_moe": family_checkpoints,
                   "hunyuan_v1_moe": family_checkpoints, "glm4_moe_lite": glm4_checkpoints, "granitemoe": granite_checkpoints}
    runs = {}
    for arch, ranges in _RANGES.items():
        folder, ref = checkpoints[arch].get(arch, "per_expert")
        single = load_model(folder)
        assert single.config.num_experts == int(ranges[-1].split("-")[1]) + 1  # the two nodes split them all
        runs[arch] = (folder, ref, *single_process_run(single, ref, chunk=5))

    commands = [(f"{arch} node {i}", ["node", "--model", str(runs[arch][0]), "--experts", r])
                for arch, ranges in _RANGES.items() for i, r in enumerate(ranges)]
    daemons = start_daemons(commands[:1])
    try:
        daemons += start_daemons([(name, args + ["--bootstrap", daemons[0].info["multiaddrs"][0]])
                                  for name, args in commands[1:]])
        nodes = {arch: daemons[2 * k : 2 * k + 2] for k, arch in enumerate(_RANGES)}
        peers = {arch: {peer_id_from_str(d.info["peer_id"]) for d in ds} for arch, ds in nodes.items()}
        assert len(set().union(*peers.values())) == len(daemons)
        for arch, (folder, ref, expected, tokens) in runs.items():
            used = assert_backbone_gives(expected, tokens, folder, ref, 5, daemons[0], nodes[arch])
            assert not used & set().union(*(p for other, p in peers.items() if other != arch)), arch
    finally:
        stop_daemons(daemons[::-1])
