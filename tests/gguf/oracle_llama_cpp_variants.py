"""Tiny checkpoints for llama.cpp's converter: a family oracle's (tests/oracle_families.py) config with what
llama.cpp's architecture cannot express switched off.  ``dots1``: llama.cpp's dots1 has no sliding-window
layers, so every layer attends fully (``layer_types`` all ``full_attention``).  ``hunyuan_v1_moe``: llama.cpp's
converter takes the hub's per-layer lists (``moe_intermediate_size``, ``moe_topk``, ``num_shared_expert``) and
converts the NTK ``alpha`` only at Hunyuan-A13B's own values (alpha 1000, head 128), so plain RoPE; llama.cpp's
hunyuan-moe has no attention output bias (Hunyuan-A13B has no attention biases), so none.  ``phimoe``:
llama.cpp has no key for sparsemixer's jitter (the published 0.01 here) and one cos/sin scale for longrope, the
one its converter computes from the context lengths (sqrt(1 + ln(256 / 32) / ln 32)), here both of transformers'.
``qwen3_next``: llama.cpp's qwen3next has no dense layers (its converter cannot name them) and always renormalises
the chosen experts' weights, so every layer MoE and ``norm_topk_prob``.  ``mimo_v2_flash``: llama.cpp's mimo2
reads no routed scaling factor (the published checkpoint's is 1), so 1.  ``kimi_linear``: llama.cpp's converter
writes no expert group count (the published checkpoint has one group), so one group.  ``glm4_moe_lite``: llama.cpp's
deepseek2 runs dense layers only before the first MoE one (the oracle's dense layer between two MoE ones: its
converter writes it, the engine reads it from its file, llama.cpp's runtime refuses it), so dense first."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import oracle
import oracle_families
import oracle_glm4
import oracle_kimi_linear
import oracle_mimo
import oracle_mistral4
import oracle_phimoe
import oracle_qwen3_next
from oracle import PROMPT  # noqa: F401  (OracleCheckpoints reads it here)

SOURCES: dict[str, Any] = {"dots1": oracle_families.CONFIGS["dots1"],
                           "ernie4_5_moe": oracle_families.CONFIGS["ernie4_5_moe"], "mistral4": oracle_mistral4.CONFIG,
                           "hunyuan_v1_moe": oracle_families.CONFIGS["hunyuan_v1_moe"], "phimoe": oracle_phimoe.CONFIG,
                           "qwen3_next": oracle_qwen3_next.make_config, "mimo_v2_flash": oracle_mimo.CONFIG,
                           "kimi_linear": oracle_kimi_linear.CONFIG,
                           "glm4_moe_lite": oracle_glm4.CONFIGS["glm4_moe_lite"]}
HUB_CLASS = {"phimoe": "PhiMoEForCausalLM"}  # transformers 5.24 saves PhimoeForCausalLM
PHIMOE_MSCALE = math.sqrt(1 + math.log(256 / 32) / math.log(32))
OVERRIDES: dict[str, dict[str, Any]] = {
    "mistral4": {"rope_parameters": {**oracle_mistral4.ROPE, "original_max_position_embeddings": 64}},
    "ernie4_5_moe": {"moe_layer_interval": 1, "moe_layer_end_index": -1, "num_key_value_heads": 4},
    "dots1": {"sliding_window": None, "layer_types": ["full_attention"] * 3, "num_key_value_heads": 4,
              "attention_bias": False},
    "hunyuan_v1_moe": {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
                       "moe_intermediate_size": [32, 32], "moe_topk": [2, 2], "num_shared_expert": [1, 1],
                       "attention_bias": False},
    "phimoe": {"router_jitter_noise": 0.01,
               "rope_parameters": {**oracle_phimoe.CONFIG().rope_parameters, "short_mscale": PHIMOE_MSCALE,
                                   "long_mscale": PHIMOE_MSCALE}},
    "qwen3_next": {"mlp_only_layers": [], "norm_topk_prob": True},
    "mimo_v2_flash": {"routed_scaling_factor": 1.0},
    "kimi_linear": {"num_expert_group": 1},  # KimiLinearConfig.to_dict's name for n_group
    "glm4_moe_lite": {"mlp_layer_types": ["dense", "sparse", "sparse"]},
}


def build_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> Path:
    def config() -> Any:
        cfg = SOURCES[arch]()  # rebuilt, so that what the config derives follows the overrides
        return type(cfg).from_dict({**cfg.to_dict(), **OVERRIDES[arch]})

    if arch == "mistral4":  # no AutoModelForCausalLM class: oracle_mistral4's builder on the new config
        def build() -> Any:
            with oracle._quiet():
                oracle.torch.manual_seed(seed)
                model = oracle_mistral4.Mistral4ForCausalLM._from_config(
                    config(), attn_implementation="eager", dtype=oracle.torch.float32, experts_implementation="eager")
            model.eval()
            oracle.reinit_hot(model, seed)
            return model

        return oracle.save_in_layout(build, "per_expert", out_dir)
    folder = oracle.save_in_layout(lambda: oracle.build_from_config(config, seed), "per_expert", out_dir)
    if arch in HUB_CLASS:  # the class name the hub's config.json gives, the one llama.cpp's converter registers
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, "architectures": [HUB_CLASS[arch]]}, indent=2))
    return folder


def reference_run(folder: Path, prompt: list[int], n_decode: int = 8) -> Any:
    mistral4 = '"mistral4"' in (Path(folder) / "config.json").read_text()
    return (oracle_mistral4.reference_run if mistral4 else oracle.reference_run)(folder, prompt, n_decode)
