"""config.json parser for PhiMoE (``phimoe``: Phi-3.5-MoE).

Read from transformers 5.24 (``models/phimoe``): Mixtral's decoder (GQA with q/k/v/o biases when
``attention_bias``, a sliding window on every layer when ``sliding_window``, every layer MoE) with
three differences:

* LayerNorms *with* bias (eps ``rms_norm_eps``) before each block and at the end
  (``ModelConfig.norm = "layer"``, ``norm_bias``), and an LM head with a bias when ``lm_head_bias``.
* The ``sparsemixer`` router (``routing._sparsemixer``): always two experts, each weighted by a
  softmax over the experts whose logit is within ``2 * router_jitter_noise`` (relative) of its own.
* ``longrope``: transformers 5.24's PhiMoE always rotates with the *short* factors (its rotary
  embedding calls the init function without a sequence length) and only switches the cos/sin scale,
  ``short_mscale`` or ``long_mscale``, on whether a forward pass reaches past
  ``original_max_position_embeddings``; the engine does the same, per pass (``attention.Rope``).

The hub names (``block_sparse_moe.gate``, ``experts.E.w1/w2/w3``) and transformers' runtime names
(``mlp.router``, ``experts.gate_up_proj``) both load.  A field a config.json leaves out takes
``PhimoeConfig``'s default (``_DEFAULTS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import ModelConfig, RopeConfig, _common, register_family
from .convert import RULES, Rule

# PhimoeConfig's field defaults (transformers 5.24) that the engine reads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "sliding_window": None,
    "num_experts_per_tok": 2, "num_local_experts": 16, "router_jitter_noise": 0.01, "attention_bias": False,
    "lm_head_bias": False, "rope_theta": 1_000_000.0,
}


@dataclass(frozen=True)
class PhimoeSettings:
    """What only PhiMoE's router reads (``ModelConfig.family``)."""

    router_jitter: float  # router_jitter_noise: sparsemixer keeps experts within 2x this (relative) of the best


def _rope(t: dict[str, Any], dim: int) -> RopeConfig:
    params = {**(t.get("rope_scaling") or {}), **(t.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", t["rope_theta"]))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta, dim=dim)
    if kind != "longrope":
        raise ValueError(f"rope type {kind!r} is not supported (default, longrope)")
    short = tuple(float(f) for f in params["short_factor"])
    if len(short) != dim // 2:
        raise ValueError(f"short_factor has {len(short)} values; head_dim {dim} needs {dim // 2}")
    return RopeConfig(theta=theta, dim=dim, kind="longrope", factors=short,
                      attention_factor=float(params["short_mscale"]), long_mscale=float(params["long_mscale"]),
                      original_max_position=int(params["original_max_position_embeddings"]))


def _phimoe(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **raw}
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    if int(t["num_experts_per_tok"]) != 2:  # sparsemixer picks two, whatever the config says
        raise ValueError(f"num_experts_per_tok={t['num_experts_per_tok']} is not supported (PhiMoE's router picks 2)")
    c = _common(t, "phimoe", model_id)
    c.update(raw=raw, head_dim=c["hidden_size"] // c["num_heads"])
    n, bias, window = c["num_layers"], bool(t["attention_bias"]), t["sliding_window"]
    return ModelConfig(
        **c,
        rope=_rope(t, c["head_dim"]),
        moe_layers=(True,) * n,
        sliding_windows=(int(window) if window else None,) * n,
        qkv_bias=bias,
        o_bias=bias,
        num_experts=int(t["num_local_experts"]),
        top_k=2,
        moe_intermediate_size=int(t["intermediate_size"]),
        router="sparsemixer",
        norm="layer",
        norm_bias=True,
        lm_head_bias=bool(t["lm_head_bias"]),
        family=PhimoeSettings(router_jitter=float(t["router_jitter_noise"])),
    )


PARSERS = {"phimoe": _phimoe}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})

_L = r"model\.layers\.(?P<L>\d+)\."
RULES.update(phimoe=(
    Rule(r"model\.norm\.bias", "final_norm_bias"),
    Rule(r"lm_head\.bias", "lm_head_bias"),
    Rule(_L + r"input_layernorm\.bias", "{L}.attn_norm_bias"),
    Rule(_L + r"post_attention_layernorm\.bias", "{L}.mlp_norm_bias"),
) + RULES["mixtral"])  # attention, norms' weights, embeddings, router and experts in either layout
