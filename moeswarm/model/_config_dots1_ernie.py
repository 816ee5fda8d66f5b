"""config.json parsers for dots.llm1 (``dots1``) and ERNIE 4.5 MoE (``ernie4_5_moe``).

Read from transformers 5.24 (``models/dots1``, ``models/ernie4_5_moe``):

* ``dots1``: Qwen3's attention (per-head q/k RMSNorm before RoPE, q/k/v *and* o biases when
  ``attention_bias``, full rotary, halves layout), sliding-window layers where ``layer_types`` says
  (by default the layers from ``max_window_layers`` on, when ``sliding_window`` is set); the first
  ``first_k_dense_replace`` layers dense, the others DeepSeek-V3's MoE block: sigmoid router,
  ``e_score_correction_bias`` on the choice only, ``n_group`` / ``topk_group`` group limit,
  ``norm_topk_prob`` (off by default), ``routed_scaling_factor``, ``n_shared_experts`` shared
  experts.  Every piece exists in the engine: this module only names them.
* ``ernie4_5_moe``: Llama's attention (biases on q/k/v/o when ``use_bias``), RoPE in the
  interleaved-pairs layout (the engine's DeepSeek layout: the same scores); MoE layers where
  ``(i + 1) % moe_layer_interval == 0`` and ``moe_layer_start_index <= i <= moe_layer_end_index``,
  dense elsewhere; the router is a softmax whose top-k is *chosen* on the probabilities plus
  ``moe_statics.e_score_correction_bias`` (new: ``choice_bias``), weighted by the unbiased
  probabilities renormalised over the k (transformers clamps the sum at ``moe_norm_min``, 1e-12:
  the same numbers for any sum a softmax can give the top k of a real router);
  ``moe_num_shared_experts`` unweighted shared experts.  ``use_bias`` also puts biases on every
  MLP and on the LM head: no published ERNIE 4.5 MoE checkpoint sets it, and the engine refuses it.

A field a config.json leaves out takes the value transformers' config class gives it (``_DEFAULTS``).
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, _common, _rope, _windows, register_family
from .convert import RULES, Rule, squeeze

# Dots1Config's field defaults (transformers 5.24) that the engine reads; n_routed_experts,
# n_shared_experts and num_experts_per_tok default to None there (a model cannot be built without them)
_DOTS1_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 4608, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 32, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 0, "norm_topk_prob": False, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "routed_scaling_factor": 1.0, "sliding_window": 4096,
    "max_window_layers": 62,
}
# Ernie4_5_MoeConfig's
_ERNIE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 103424, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 2560,
    "intermediate_size": 12288, "num_hidden_layers": 28, "num_attention_heads": 20, "num_key_value_heads": 4,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "use_bias": False,
    "moe_intermediate_size": 1536, "moe_k": 6, "moe_num_experts": 64, "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1,
}


def _required(t: dict[str, Any], name: str) -> int:
    if t.get(name) is None:
        raise ValueError(f"{name} is required (transformers cannot build the model without it)")
    return int(t[name])


def _dots1(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DOTS1_DEFAULTS, **raw}
    c = _common(t, "dots1", model_id)
    c["raw"] = raw
    n = c["num_layers"]
    experts, n_group = _required(t, "n_routed_experts"), int(t["n_group"] or 1)
    if experts % n_group:
        raise ValueError(f"n_group={n_group} must divide n_routed_experts={experts}")
    window, start = t["sliding_window"], int(t["max_window_layers"] or 0)
    default_types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(n)]
    types = t.get("layer_types") or default_types
    if len(types) < n or any(k not in ("sliding_attention", "full_attention") for k in types):
        raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' for each of {n} layers")
    first_dense = int(t["first_k_dense_replace"] or 0)
    bias = bool(t["attention_bias"])
    return ModelConfig(
        **c,
        rope=_rope(t, "dots1", c["head_dim"]),
        moe_layers=tuple(i >= first_dense for i in range(n)),
        sliding_windows=_windows({**t, "layer_types": types}, n),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        num_experts=experts,
        top_k=_required(t, "num_experts_per_tok"),
        moe_intermediate_size=int(t["moe_intermediate_size"]),
        dense_intermediate_size=int(t["intermediate_size"]),
        router="sigmoid_group",
        norm_topk_prob=bool(t["norm_topk_prob"]),
        routed_scaling_factor=float(t["routed_scaling_factor"]),
        n_group=n_group,
        topk_group=int(t["topk_group"] or 1),
        shared_intermediate_size=int(t["moe_intermediate_size"]) * _required(t, "n_shared_experts"),
    )


def _ernie_moe_layers(t: dict[str, Any], n: int) -> tuple[bool, ...]:
    interval, start = int(t["moe_layer_interval"]), int(t["moe_layer_start_index"])
    end = int(t["moe_layer_end_index"])
    end = n - 1 if end == -1 else end
    if interval < 1:
        raise ValueError(f"moe_layer_interval={interval} must be at least 1")
    return tuple((i + 1) % interval == 0 and start <= i <= end for i in range(n))


def _ernie4_5_moe(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_ERNIE_DEFAULTS, **raw}
    for alias, name in (("num_experts", "moe_num_experts"), ("num_experts_per_tok", "moe_k")):  # attribute_map
        if alias in raw and name not in raw:
            t[name] = raw[alias]
    if t["use_bias"]:
        raise ValueError("use_bias=true (biases on every MLP and the LM head) is not supported")
    c = _common(t, "ernie4_5_moe", model_id)
    c["raw"] = raw
    n = c["num_layers"]
    return ModelConfig(
        **c,
        rope=_rope(t, "ernie4_5_moe", c["head_dim"], interleaved=True),
        moe_layers=_ernie_moe_layers(t, n),
        sliding_windows=(None,) * n,
        num_experts=int(t["moe_num_experts"]),
        top_k=int(t["moe_k"]),
        moe_intermediate_size=int(t["moe_intermediate_size"]),
        dense_intermediate_size=int(t["intermediate_size"]),
        router="softmax_topk",
        norm_topk_prob=True,
        choice_bias=True,
        shared_intermediate_size=int(t["moe_intermediate_size"]) * int(t["moe_num_shared_experts"] or 0),
    )


PARSERS = {"dots1": _dots1, "ernie4_5_moe": _ernie4_5_moe}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {"ernie4_5_moe": 500_000.0})

_L = r"model\.layers\.(?P<L>\d+)\."
# dots1's checkpoint keys are DeepSeek-V3's (q/k/v/o_proj + biases, q/k_norm, mlp.gate +
# e_score_correction_bias, mlp.shared_experts.*, per-expert or packed experts); ERNIE's too, but its
# score bias is ``mlp.moe_statics.e_score_correction_bias`` [1, E] on the hub and
# ``mlp.gate.moe_statics.e_score_correction_bias`` in transformers' runtime layout
RULES.update(
    dots1=RULES["deepseek_v3"],
    ernie4_5_moe=(Rule(_L + r"mlp\.(?:gate\.)?moe_statics\.e_score_correction_bias", "{L}.router_score_bias",
                       (squeeze(0),)),) + RULES["deepseek_v3"],
)
