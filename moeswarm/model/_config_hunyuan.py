"""config.json parser for Hunyuan-A13B (``hunyuan_v1_moe``).

Read from transformers 5.24 (``models/hunyuan_v1_moe``): Llama's attention (q/k/v/o biases when
``attention_bias``) with a per-head RMSNorm on q and k applied *after* RoPE (``query_layernorm``,
``key_layernorm``; new: ``qk_norm="head_after_rope"``); RoPE with a fixed NTK ``alpha`` (the published
``{"type": "dynamic", "alpha": ...}``) only stretches the base to ``theta * alpha ** (d / (d - 2))``,
so it is the default rope over that base; every layer is MoE: a softmax router (``mlp.gate.wg``) whose
top ``moe_topk`` are renormalised, experts ``intermediate_size`` wide, and an unweighted shared MLP
(``mlp.shared_mlp``) as wide.  ``num_experts`` and ``moe_topk`` may be per-layer lists in a config.json;
the engine takes them when every layer has the same value.
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, RopeConfig, _common, register_family
from .convert import RULES, Rule

# HunYuanMoEV1Config's field defaults (transformers 5.24) that the engine reads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 290943, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "attention_bias": False,
    "num_experts": 1, "moe_topk": 1,
}


def _one_per_model(value: Any, name: str, n: int) -> int:
    """An int, or a per-layer list whose entries all agree (the engine has one expert count per model)."""
    if isinstance(value, list):
        if len(value) < n or len(set(value[:n])) != 1:
            raise ValueError(f"{name} must give every one of {n} layers the same value, got {value}")
        return int(value[0])
    return int(value)


def _rope(t: dict[str, Any], head_dim: int) -> RopeConfig:
    params = {**(t.get("rope_scaling") or {}), **(t.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", t.get("rope_theta", 10_000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    alpha = params.get("alpha")
    if kind == "dynamic" and alpha:
        theta = theta * float(alpha) ** (head_dim / (head_dim - 2))
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported (default, or dynamic with a fixed alpha)")
    return RopeConfig(theta=theta, dim=head_dim)


def _hunyuan_v1_moe(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **raw}
    for alias, name in (("num_experts_per_tok", "moe_topk"), ("num_local_experts", "num_experts")):
        if alias in raw and name not in raw:  # transformers' attribute_map
            t[name] = raw[alias]
    c = _common(t, "hunyuan_v1_moe", model_id)
    c["raw"] = raw
    n, head_dim = c["num_layers"], c["head_dim"]
    bias = bool(t["attention_bias"])
    inter = int(t["intermediate_size"])
    return ModelConfig(
        **c,
        rope=_rope(t, head_dim),
        moe_layers=(True,) * n,
        sliding_windows=(None,) * n,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head_after_rope",
        num_experts=_one_per_model(t["num_experts"], "num_experts", n),
        top_k=_one_per_model(t["moe_topk"], "moe_topk", n),
        moe_intermediate_size=inter,
        router="softmax_topk",
        norm_topk_prob=True,
        shared_intermediate_size=inter,
    )


PARSERS = {"hunyuan_v1_moe": _hunyuan_v1_moe}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})

_L = r"model\.layers\.(?P<L>\d+)\."
RULES.update(hunyuan_v1_moe=(
    Rule(_L + r"self_attn\.query_layernorm\.weight", "{L}.attn.q_norm"),
    Rule(_L + r"self_attn\.key_layernorm\.weight", "{L}.attn.k_norm"),
    Rule(_L + r"mlp\.gate\.wg\.weight", "{L}.router"),
    Rule(_L + r"mlp\.shared_mlp\.(?P<p>gate|up|down)_proj\.weight", "{L}.shared.{p}"),
) + RULES["qwen2_moe"])
