"""config.json parsers for GLM-4.5 / 4.6 (``glm4_moe``) and GLM-4.7-Flash (``glm4_moe_lite``).

Read from transformers 5.24 (``models/glm4_moe``, ``models/glm4_moe_lite``):

* ``glm4_moe``: GQA with q/k/v biases when ``attention_bias`` (never on ``o_proj``), per-head
  q/k RMSNorm before RoPE when ``use_qk_norm``, partial rotary over the first
  ``partial_rotary_factor`` of each head (halves layout; 0.5 when the config says nothing, also
  inside ``rope_parameters``); the first ``first_k_dense_replace`` layers have a dense SwiGLU MLP,
  the others DeepSeek-V3's router (sigmoid, ``e_score_correction_bias`` on the choice only,
  ``n_group`` / ``topk_group`` group-limited top-k, ``norm_topk_prob``,
  ``routed_scaling_factor``) plus ``n_shared_experts`` shared experts.  Every piece exists in
  the engine already: this module only names them.
* ``glm4_moe_lite``: DeepSeek-V3's multi-head latent attention with the same MoE block; which
  layers are MoE follows ``mlp_layer_types`` (default: dense first, then sparse; transformers does
  not read ``first_k_dense_replace`` for this family).

A field a config.json leaves out takes the value transformers' config class gives it (``_DEFAULTS``),
so both read one file the same way.  The multi-token-prediction layer (``num_nextn_predict_layers``,
stored as layer ``num_hidden_layers``) is not used to generate; its tensors are not read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .config import ModelConfig, _common, _deepseek_v3, _rope, register_family
from .convert import RULES

# Glm4MoeConfig's field defaults (transformers 5.24), the ones the engine reads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False,
}
# Glm4MoeLiteConfig's (GLM-4.7-Flash's values)
_LITE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240, "moe_intermediate_size": 1536,
    "num_hidden_layers": 47, "num_attention_heads": 20, "num_key_value_heads": 20, "n_shared_experts": 1,
    "n_routed_experts": 64, "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768,
    "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 4, "norm_topk_prob": True, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "rope_interleave": True,
    "attention_bias": False,
}


def _with_defaults(raw: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with transformers' defaults for the fields it leaves out (an explicit null stays null)."""
    return {**defaults, **raw}


def _partial_rotary_factor(raw: dict[str, Any], default: float) -> float:
    """``rope_parameters.partial_rotary_factor`` wins over the top-level field, as in transformers."""
    params = raw.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    return float(default if factor is None else factor)


def _glm4_moe(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = _with_defaults(raw, _DEFAULTS)
    c = _common(t, "glm4_moe", model_id)
    c["raw"] = raw
    n, head_dim = c["num_layers"], c["head_dim"]
    rotary = int(head_dim * _partial_rotary_factor(t, 0.5))
    if rotary <= 0 or rotary % 2 or rotary > head_dim:
        raise ValueError(f"rotary width {rotary} must be even and in (0, head_dim={head_dim}]")
    experts, n_group = int(t["n_routed_experts"]), int(t["n_group"] or 1)
    if experts % n_group:
        raise ValueError(f"n_group={n_group} must divide n_routed_experts={experts}")
    first_dense = int(t["first_k_dense_replace"])
    return ModelConfig(
        **c,
        rope=_rope(t, "glm4_moe", rotary),
        moe_layers=tuple(i >= first_dense for i in range(n)),
        sliding_windows=(None,) * n,
        qkv_bias=bool(t["attention_bias"]),
        o_bias=False,
        qk_norm="head" if t["use_qk_norm"] else None,
        num_experts=experts,
        top_k=int(t["num_experts_per_tok"]),
        moe_intermediate_size=int(t["moe_intermediate_size"]),
        dense_intermediate_size=int(t["intermediate_size"]),
        router="sigmoid_group",
        norm_topk_prob=bool(t["norm_topk_prob"]),
        routed_scaling_factor=float(t["routed_scaling_factor"]),
        n_group=n_group,
        topk_group=int(t["topk_group"] or 1),
        shared_intermediate_size=int(t["moe_intermediate_size"]) * int(t["n_shared_experts"] or 0),
    )


def _glm4_moe_lite(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = _with_defaults(raw, _LITE_DEFAULTS)
    if _partial_rotary_factor(t, 1.0) != 1.0:
        raise ValueError("partial_rotary_factor must be 1 for glm4_moe_lite (MLA rotates qk_rope_head_dim)")
    n = int(t["num_hidden_layers"])
    types = t.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
    if len(types) < n or any(k not in ("dense", "sparse") for k in types):
        raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of {n} layers")
    cfg = _deepseek_v3(t, model_id, path)
    return replace(cfg, arch="glm4_moe_lite", raw=raw, moe_layers=tuple(k == "sparse" for k in types[:n]))


PARSERS = {"glm4_moe": _glm4_moe, "glm4_moe_lite": _glm4_moe_lite}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})
# the checkpoint keys are DeepSeek-V3's: GQA's q/k/v/o_proj (+ biases, q/k_norm) or MLA's, mlp.gate
# (+ e_score_correction_bias), mlp.shared_experts.*, per-expert or packed experts
RULES.update(glm4_moe=RULES["deepseek_v3"], glm4_moe_lite=RULES["deepseek_v3"])
