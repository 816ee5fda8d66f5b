"""config.json parsers for Granite MoE (``granitemoe``: Granite 3.x MoE) and Granite MoE with a shared
expert (``granitemoeshared``).

Read from transformers 5.24 (``models/granitemoe``, ``models/granitemoeshared``): Mixtral's decoder
with four scalars (``embedding_multiplier`` on the embeddings, ``attention_multiplier`` as the
softmax scale instead of ``head_dim ** -0.5``, ``residual_multiplier`` on each attention and MLP
output before its residual add, and logits divided by ``logits_scaling``), q/k/v/o biases when
``attention_bias``, every layer MoE with a router that keeps the top-k logits and softmaxes over only
those (gpt-oss's ``topk_softmax``, without its bias), and in ``granitemoeshared`` an unweighted
shared MLP ``shared_intermediate_size`` wide.  The hub stores each layer's experts as
``block_sparse_moe.input_linear [E, 2I, H]`` (gate rows, then up) and ``output_linear [E, H, I]``,
the router as ``router.layer``, the shared MLP as ``shared_mlp.input_linear [2S, H]`` and
``output_linear``; transformers' runtime layout renames them to ``experts.gate_up_proj`` /
``down_proj`` and ``router.weight``.  Both load.

A field a config.json leaves out takes the value transformers' config classes give it (``_DEFAULTS``).
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, _common, _rope, register_family
from .convert import RULES, Rule, chunk, unstack

# GraniteMoeConfig's field defaults (transformers 5.24) that the engine reads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "attention_bias": False,
    "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
    "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 0,
}


def _granite(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **raw}
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    arch = str(raw.get("model_type"))
    c = _common(t, arch, model_id)
    c["raw"] = raw
    n = c["num_layers"]
    bias = bool(t["attention_bias"])
    shared = int(t["shared_intermediate_size"] or 0) if arch == "granitemoeshared" else 0
    if float(t["logits_scaling"]) == 0:
        raise ValueError("logits_scaling must not be 0 (the logits are divided by it)")
    return ModelConfig(
        **c,
        rope=_rope(t, arch, c["head_dim"]),
        moe_layers=(True,) * n,
        sliding_windows=(None,) * n,
        qkv_bias=bias,
        o_bias=bias,
        attention_scale=float(t["attention_multiplier"]),
        num_experts=int(t["num_local_experts"]),
        top_k=int(t["num_experts_per_tok"]),
        moe_intermediate_size=int(t["intermediate_size"]),
        router="topk_softmax",
        shared_intermediate_size=shared,
        embedding_multiplier=float(t["embedding_multiplier"]),
        residual_multiplier=float(t["residual_multiplier"]),
        logits_scaling=float(t["logits_scaling"]),
    )


PARSERS = {"granitemoe": _granite, "granitemoeshared": _granite}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})

_L = r"model\.layers\.(?P<L>\d+)\."
_M = _L + r"block_sparse_moe\."
_GRANITE = (
    Rule(_M + r"input_linear\.weight", "{L}.experts.{E}.{p}", (unstack("E"), chunk("p", ("gate", "up")))),
    Rule(_M + r"output_linear\.weight", "{L}.experts.{E}.down", (unstack("E"),)),
    Rule(_M + r"router\.(?:layer\.)?weight", "{L}.router"),
    Rule(_L + r"shared_mlp\.input_linear\.weight", "{L}.shared.{p}", (chunk("p", ("gate", "up")),)),
    Rule(_L + r"shared_mlp\.output_linear\.weight", "{L}.shared.down"),
) + RULES["mixtral"]  # attention, norms, embeddings; the runtime layout's experts.gate_up_proj / down_proj
RULES.update(granitemoe=_GRANITE, granitemoeshared=_GRANITE)
