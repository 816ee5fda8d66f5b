"""config.json parser for Mistral Small 4 (``mistral4``).

Read from transformers 5.24 (``models/mistral4``): DeepSeek-V3's multi-head latent attention
(``q_lora_rank``, ``kv_lora_rank``, interleaved rope on ``qk_rope_head_dim``, YaRN with
``mscale_all_dim`` folded into the softmax scale) and MoE block (``first_k_dense_replace`` dense
layers, ``n_shared_experts``, ``n_group`` / ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``), with two differences, both new here:

* the router scores are a *softmax* over the experts, not a sigmoid, and carry no correction
  bias; groups are still scored by the sum of their two best (``router="softmax_group"``);
* after RoPE, the query at position p is multiplied by
  ``1 + llama_4_scaling_beta * log(1 + floor(p / original_max_position_embeddings))``, both read from
  ``rope_parameters`` (``ModelConfig.q_position_scale``).

A field a config.json leaves out takes the value transformers' ``Mistral4Config`` gives it (``_DEFAULTS``,
and ``_DEFAULT_ROPE`` when it has no ``rope_parameters`` / ``rope_scaling``).  The experts are stored as
transformers runs them (``gate_up_proj [E, 2I, H]``), DeepSeek-V3's names otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .config import ModelConfig, _deepseek_v3, register_family
from .convert import RULES

# Mistral4Config's field defaults (transformers 5.24) that the engine reads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 32, "n_shared_experts": 1,
    "n_routed_experts": 128, "routed_scaling_factor": 1.0, "kv_lora_rank": 256, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 4, "first_k_dense_replace": 0, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "pad_token_id": 11, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False,
}
_DEFAULT_ROPE: dict[str, Any] = {
    "type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
}


def _mistral4(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **raw}
    if not t.get("rope_parameters") and not t.get("rope_scaling"):
        t["rope_parameters"] = dict(_DEFAULT_ROPE)
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    experts, n_group = int(t["n_routed_experts"]), int(t["n_group"] or 1)
    if experts % n_group:
        raise ValueError(f"n_group={n_group} must divide n_routed_experts={experts}")
    params = {**(t.get("rope_scaling") or {}), **(t.get("rope_parameters") or {})}
    beta = params.get("llama_4_scaling_beta")
    scale = None
    if beta is not None:
        scale = (float(beta), int(params.get("original_max_position_embeddings") or t["max_position_embeddings"]))
    cfg = _deepseek_v3(t, model_id, path)
    return replace(cfg, arch="mistral4", raw=raw, router="softmax_group", q_position_scale=scale)


PARSERS = {"mistral4": _mistral4}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})
RULES.update(mistral4=RULES["deepseek_v3"])
