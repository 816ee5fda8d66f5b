"""Every family's swarm test, three swarms of several models each, as a public swarm serves them: one
libp2p DHT per swarm, two expert node processes per model splitting its experts.  The first node is
the bootstrap peer of all the others, which start together once it is READY.  Then, for each model in
turn, a backbone in this process must give the single-process logits (prefill in chunks over the
cache, then decode) and transformers' greedy tokens, every node of its own model must have served it,
and no node of another model may have: each backbone finds its holders under its own model id.

One swarm per family (a bootstrap, three nodes, its own waits) cost 10-18 s each, fourteen times;
here a family costs its two nodes and its backbone.  What each family's backbone exercises is in
``FAMILIES``; each row's ``check`` holds the checkpoint to it (a tiny random config could lose it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from engine_support import OracleCheckpoints
from swarm_support import assert_backbone_gives, single_process_run

from moeswarm.demo.swarm import start_daemons, stop_daemons
from moeswarm.model import load_model
from moeswarm.model.config import ModelConfig
from moeswarm.protocol import peer_id_from_str

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Family:
    name: str
    oracle: str  # the tests/oracle_*.py module building its checkpoint and transformers' reference
    key: tuple[str, ...]  # OracleCheckpoints.get's key: (arch, layout), (layout,) or ()
    experts: tuple[str, str]  # the experts of each of its two node processes
    check: Callable[[ModelConfig], bool]  # the checkpoint has what the backbone should exercise
    chunk: int = 5


_PER_EXPERT = ("per_expert",)
FAMILIES = {f.name: f for f in [
    # dots1's dense first layer and sliding layers
    Family("dots1", "oracle_families", ("dots1", "per_expert"), ("0-7", "8-15"), lambda c: c.num_experts == 16),
    # ERNIE's interleaved-rope GQA, dense layers between MoE layers 1 and 3, choice-biased routers, tied embeddings
    Family("ernie4_5_moe", "oracle_families", ("ernie4_5_moe", "per_expert"), ("0-7", "8-15"),
           lambda c: c.num_experts == 16),
    # Hunyuan's dynamic-alpha rope and per-head q/k norms
    Family("hunyuan_v1_moe", "oracle_families", ("hunyuan_v1_moe", "per_expert"), ("0-3", "4-7"),
           lambda c: c.num_experts == 8),
    # GLM-4.7-Flash's MLA attention and group-limited router
    Family("glm4_moe_lite", "oracle_glm4", ("glm4_moe_lite", "per_expert"), ("0-7", "8-15"),
           lambda c: c.num_experts == 16),
    # GLM-4.5: partial-rotary GQA with its KV cache, the dense first layer, routers and shared experts
    Family("glm4_moe", "oracle_glm4", ("glm4_moe", "per_expert"), ("0-7", "8-15"),
           lambda c: c.num_experts == 16 and not c.moe_layers[0]),
    # Granite's multipliers
    Family("granitemoe", "oracle_granite", ("granitemoe", "per_expert"), ("0-3", "4-7"), lambda c: c.num_experts == 8),
    # Granite shared: GQA with biases and the attention multiplier, embedding and residual multipliers, shared MLPs
    Family("granitemoeshared", "oracle_granite", ("granitemoeshared", "per_expert"), ("0-3", "4-7"),
           lambda c: c.residual_multiplier == 0.4 and c.shared_intermediate_size == 48),
    # PhiMoE: LayerNorms with biases, GQA with biases and a sliding window, longrope, sparsemixer, the LM head's bias
    Family("phimoe", "oracle_phimoe", ("packed",), ("0-3", "4-7"), lambda c: c.router == "sparsemixer" and c.norm_bias),
    # DBRX: nodes cut their experts out of the flat [E * I, H] tensors; LayerNorms, the fused clamped Wqkv
    Family("dbrx", "oracle_dbrx", (), ("0-3", "4-7"), lambda c: c.norm == "layer" and c.num_experts == 8),
    # Kimi Linear: Kimi delta attention with its recurrent state, MLA without RoPE, sigmoid group routers
    Family("kimi_linear", "oracle_kimi_linear", ("packed",), ("0-3", "4-7"),
           lambda c: c.family.linear == (True, False, True)),
    # MiniMax-Text-01: lightning attention with its decayed state, softmax GQA, the alpha / beta residual
    Family("minimax", "oracle_minimax_text01", ("packed",), ("0-3", "4-7"),
           lambda c: c.family.linear == (False, True, False, True)),
    # LongCat-Flash: nodes hold the 8 routed experts only; two MLA sublayers, the MoE shortcut, zero experts
    Family("longcat_flash", "oracle_longcat", ("packed",), ("0-3", "4-7"),
           lambda c: (c.num_experts, c.zero_experts) == (8, 4)),
    # MiMo-V2-Flash: full and sliding layers with their own kv heads, RoPE and sinks, scaled values
    Family("mimo_v2_flash", "oracle_mimo", ("packed",), ("0-3", "4-7"),
           lambda c: c.moe_layers == (False, True, True, True) and c.family.sliding[1]),
    # Qwen3-Next: DeltaNet layers with conv + recurrent state, gated attention, gated shared experts
    Family("qwen3_next", "oracle_qwen3_next", _PER_EXPERT, ("0-3", "4-7"),
           lambda c: c.num_experts == 8 and c.moe_layers == (True, False, True), chunk=27),
    # Llama 4 (the vision checkpoint's text model): chunked RoPE and NoPE layers, sigmoid routers scaling inputs
    Family("llama4", "oracle_llama4", ("vision",), ("0-3", "4-7"),
           lambda c: c.expert_input_scaled and c.moe_layers == (False, True, False, True)),
    # DeepSeek-V4: sliding, CSA and HCA attention, hyper-connections, hash-routed layers 0-1, clamped SwiGLU
    Family("deepseek_v4", "oracle_dsv4", _PER_EXPERT, ("0-3", "4-7"),
           lambda c: c.family.hash_layers == (True, True, False, False, False)
           and c.expert_activation == "limited_swiglu"),
    # MiniMax M3: the lightning indexer and its index-key cache, dense layers, shared experts
    Family("minimax_m3_vl", "oracle_minimax_kimi", ("minimax_m3_vl", "per_expert"), ("0-3", "4-7"),
           lambda c: c.num_experts == 8 and any(c.sparse_layers)),
    # Mistral Small 4: MLA with the position-scaled query, softmax group-limited routers, shared experts
    Family("mistral4", "oracle_mistral4", (), ("0-7", "8-15"),
           lambda c: c.router == "softmax_group" and c.moe_layers == (False, True, True)),
    # Mistral Large 4 from the hub layout: NoPE layers, shared latent KV, the shared indexer, ssmax, LeRoPE
    Family("mistral_large4", "oracle_mistral_large4", ("native",), ("0-7", "8-15"),
           lambda c: c.family.kv_source == (0, 0, 2, 2) and c.moe_layers == (False, True, True, True)),
]}

# three swarms of about equal cost, so the two pytest-xdist workers can share them
SWARMS = {
    "dots1-ernie-hunyuan-glm-granite": ["dots1", "ernie4_5_moe", "hunyuan_v1_moe", "glm4_moe_lite", "glm4_moe",
                                        "granitemoe", "granitemoeshared"],
    "phimoe-dbrx-linear-longcat-mimo-qwen3next": ["phimoe", "dbrx", "kimi_linear", "minimax", "longcat_flash",
                                                  "mimo_v2_flash", "qwen3_next"],
    "llama4-dsv4-m3-mistral": ["llama4", "deepseek_v4", "minimax_m3_vl", "mistral4", "mistral_large4"],
}


def test_every_family_is_in_a_swarm() -> None:
    assert sorted(n for names in SWARMS.values() for n in names) == sorted(FAMILIES)


@pytest.mark.parametrize("swarm", list(SWARMS))
def test_one_swarm_serves_several_models_each_from_its_own_nodes(swarm: str,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    families = [FAMILIES[name] for name in SWARMS[swarm]]
    runs: dict[str, tuple[Any, ...]] = {}
    for f in families:
        folder, ref = OracleCheckpoints(f.oracle, tmp_path_factory).get(*f.key)
        single = load_model(folder)
        assert f.check(single.config), f.name
        assert single.config.num_experts == int(f.experts[-1].split("-")[1]) + 1  # the two nodes split them all
        runs[f.name] = (folder, ref, f.chunk, *single_process_run(single, ref, chunk=f.chunk))

    commands = [(f"{f.name} node {i}", ["node", "--model", str(runs[f.name][0]), "--experts", r])
                for f in families for i, r in enumerate(f.experts)]
    daemons = start_daemons(commands[:1])
    try:
        daemons += start_daemons([(name, args + ["--bootstrap", daemons[0].info["multiaddrs"][0]])
                                  for name, args in commands[1:]])
        nodes = {f.name: daemons[2 * k : 2 * k + 2] for k, f in enumerate(families)}
        peers = {name: {peer_id_from_str(d.info["peer_id"]) for d in ds} for name, ds in nodes.items()}
        assert len(set().union(*peers.values())) == len(daemons)
        for name, (folder, ref, chunk, expected, tokens) in runs.items():
            used = assert_backbone_gives(expected, tokens, folder, ref, chunk, daemons[0], nodes[name])
            assert not used & set().union(*(p for other, p in peers.items() if other != name)), name
    finally:
        stop_daemons(daemons[::-1])
