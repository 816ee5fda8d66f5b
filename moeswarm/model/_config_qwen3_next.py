"""config.json parser for Qwen3-Next (``qwen3_next``; Qwen3-Next-80B-A3B).

Read from transformers 5.24 (``models/qwen3_next``).  Qwen3-Next is Qwen3.5-MoE's text model
before Qwen3.5: the same hybrid of gated DeltaNet linear attention and gated full attention
(``layer_types``, default: every ``full_attention_interval``-th layer full), the same
zero-centred RMSNorms (``1 + weight``), per-head q/k norms, partial rotary (0.25), softmax
top-k router and sigmoid-gated shared expert.  What differs, and what this module adds:

* the DeltaNet input projections are two matrices grouped per key head:
  ``in_proj_qkvz`` rows are, for each key head, its q (``dk``), k (``dk``), then v and z of its
  ``num_v_heads // num_k_heads`` value heads; ``in_proj_ba`` rows, per key head, b then a of those
  value heads.  ``_attn_deltanet`` re-orders the projected activations (never the weights, which
  stay memory-mapped views) into Qwen3.5's q | k | v, z, b, a;
* plain RoPE (Qwen3.5's text positions are one multimodal RoPE section each, the same numbers);
* ``norm_topk_prob`` is read (Qwen3.5 always normalises);
* dense MLP layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say (``intermediate_size``).

A field a config.json leaves out takes the value transformers' ``Qwen3NextConfig`` gives it
(``_DEFAULTS``: Qwen3-Next-80B-A3B's).  The multi-token-prediction tensors (``mtp.*``) are not read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .config import ModelConfig, _qwen3_5_moe, _qwen_moe_layers, register_family
from .convert import RULES, Rule, _language_model

# Qwen3NextConfig's field defaults (transformers 5.24), the ones the engine reads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "head_dim": 256, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "decoder_sparse_step": 1, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512,
    "norm_topk_prob": True, "mlp_only_layers": [], "full_attention_interval": 4, "partial_rotary_factor": 0.25,
}


def _qwen3_next(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **raw}
    if t.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    base = _qwen3_5_moe(t, model_id, path)  # DeltaNet, gated attention, partial rotary, shared expert
    moe = _qwen_moe_layers(t, base.num_layers)
    return replace(base, arch="qwen3_next", raw=raw, moe_layers=moe, norm_topk_prob=bool(t["norm_topk_prob"]),
                   dense_intermediate_size=int(t["intermediate_size"]))


PARSERS = {"qwen3_next": _qwen3_next}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})
# Qwen3.5's rules (zero-centred norms, conv, A_log, ...) plus the two grouped DeltaNet projections
RULES["qwen3_next"] = _language_model((
    Rule(r"model\.layers\.(?P<L>\d+)\.linear_attn\.in_proj_(?P<p>qkvz|ba)\.weight", "{L}.attn.{p}"),
)) + RULES["qwen3_5_moe"]
