"""config.json parser for Llama 4 (``llama4``: Scout, Maverick; and the text-only ``llama4_text``).

Read from transformers 5.24 (``models/llama4``).  The engine runs the text model (a ``llama4``
checkpoint's ``text_config`` and ``language_model.*`` tensors; the vision tower is not read):

* attention (``_attn_llama4``): GQA with RoPE on the layers ``no_rope_layers`` marks 1 (default:
  all but every ``no_rope_layer_interval``-th), interleaved pairs, ``llama3`` frequency scaling
  when ``rope_parameters`` says so; on those layers an L2 norm of each q and k head after RoPE
  (``use_qk_norm``) and chunked attention (``attention_chunk_size``, ``layer_types``); on the NoPE
  layers attention temperature tuning (``attn_temperature_tuning``, ``floor_scale``,
  ``attn_scale``);
* MLP: MoE on the layers ``moe_layers`` lists (default every ``interleave_moe_layer_step``-th),
  a dense SwiGLU ``intermediate_size_mlp`` wide elsewhere; the router takes the top
  ``num_experts_per_tok`` logits, weights each by its sigmoid and scales the expert's *input* by
  it (``expert_input_scaled``); one unweighted shared expert ``intermediate_size`` wide, as wide as
  each routed expert.  Experts are stored packed and input-major: ``gate_up_proj [E, H, 2I]``
  (gate columns, then up), ``down_proj [E, I, H]``.

A field a config.json leaves out takes the value transformers' ``Llama4TextConfig`` gives it
(``_DEFAULTS``: Llama 4 Scout's).
"""

from __future__ import annotations

from typing import Any

from ._attn_llama4 import Llama4Settings
from .config import ModelConfig, RopeConfig, _common, register_family
from .convert import RULES, Rule, chunk, transpose, unstack

# Llama4TextConfig's field defaults (transformers 5.24), the ones the engine reads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "num_experts_per_tok": 1, "num_local_experts": 16,
    "moe_layers": None, "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layers": None,
    "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "layer_types": None,
    "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "attention_bias": False,
    "rope_theta": 500_000.0,
}


def _rope(t: dict[str, Any], head_dim: int) -> RopeConfig:
    params = {**(t.get("rope_scaling") or {}), **(t.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", t["rope_theta"]))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta, dim=head_dim, interleaved=True)
    if kind != "llama3":
        raise ValueError(f"rope type {kind!r} is not supported (default, llama3)")
    return RopeConfig(theta=theta, dim=head_dim, kind="llama3", factor=float(params["factor"]),
                      original_max_position=int(params["original_max_position_embeddings"]),
                      low_freq_factor=float(params["low_freq_factor"]),
                      high_freq_factor=float(params["high_freq_factor"]), interleaved=True)


def _per_layer(t: dict[str, Any], n: int) -> tuple[tuple[bool, ...], tuple[bool, ...], tuple[bool, ...]]:
    """(RoPE layers, chunked layers, MoE layers), derived as ``Llama4TextConfig.__post_init__`` does."""
    no_rope = t["no_rope_layers"] or [int((i + 1) % int(t["no_rope_layer_interval"]) != 0) for i in range(n)]
    if len(no_rope) < n:
        raise ValueError(f"no_rope_layers must give each of {n} layers 1 (RoPE) or 0 (NoPE)")
    chunk = t["attention_chunk_size"]
    types = t["layer_types"] or ["chunked_attention" if r and chunk is not None else "full_attention" for r in no_rope]
    if len(types) < n or any(k not in ("chunked_attention", "full_attention") for k in types):
        raise ValueError(f"layer_types must name 'chunked_attention' or 'full_attention' for each of {n} layers")
    step = int(t["interleave_moe_layer_step"])
    moe = t["moe_layers"] if t["moe_layers"] is not None else list(range(step - 1, n, step))
    if any(not 0 <= int(i) < n for i in moe):
        raise ValueError(f"moe_layers {moe} names a layer outside 0..{n - 1}")
    return (tuple(bool(r) for r in no_rope[:n]), tuple(k == "chunked_attention" for k in types[:n]),
            tuple(i in set(int(m) for m in moe) for i in range(n)))


def _llama4(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    text = raw.get("text_config", raw) if raw.get("model_type") == "llama4" else raw
    t = {**_DEFAULTS, **text}
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    c = _common(t, str(raw.get("model_type")), model_id)
    c["raw"] = raw
    n, head_dim = c["num_layers"], c["head_dim"]
    rope_layers, chunked, moe = _per_layer(t, n)
    if any(chunked) and not t["attention_chunk_size"]:
        raise ValueError("layer_types names chunked_attention layers but attention_chunk_size is not set")
    bias = bool(t["attention_bias"])
    settings = Llama4Settings(
        rope_layers=rope_layers, chunked=chunked, chunk_size=int(t["attention_chunk_size"] or 0),
        qk_norm=bool(t["use_qk_norm"]), temperature_tuning=bool(t["attn_temperature_tuning"]),
        floor_scale=float(t["floor_scale"]), attn_scale=float(t["attn_scale"]),
    )
    inter = int(t["intermediate_size"])
    return ModelConfig(
        **c,
        rope=_rope(t, head_dim),
        moe_layers=moe,
        sliding_windows=(None,) * n,
        attention="llama4",
        qkv_bias=bias,
        o_bias=bias,
        num_experts=int(t["num_local_experts"]),
        top_k=int(t["num_experts_per_tok"]),
        moe_intermediate_size=inter,
        dense_intermediate_size=int(t["intermediate_size_mlp"]),
        router="topk_sigmoid",
        shared_intermediate_size=inter,
        expert_input_scaled=True,
        family=settings,
    )


PARSERS = {"llama4": _llama4, "llama4_text": _llama4}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})

_P = r"(?:language_model\.)?"  # a llama4 (vision-language) checkpoint keeps the text model here
_L = _P + r"model\.layers\.(?P<L>\d+)\."
_E = _L + r"feed_forward\.experts\."
_RULES = (
    Rule(_P + r"model\.embed_tokens\.weight", "embed"),
    Rule(_P + r"model\.norm\.weight", "final_norm"),
    Rule(_P + r"lm_head\.weight", "lm_head"),
    Rule(_L + r"input_layernorm\.weight", "{L}.attn_norm"),
    Rule(_L + r"post_attention_layernorm\.weight", "{L}.mlp_norm"),
    Rule(_L + r"self_attn\.(?P<p>[qkvo])_proj\.weight", "{L}.attn.{p}"),
    Rule(_L + r"self_attn\.(?P<p>[qkvo])_proj\.bias", "{L}.attn.{p}_bias"),
    Rule(_L + r"feed_forward\.(?P<p>gate|up|down)_proj\.weight", "{L}.mlp.{p}"),
    Rule(_L + r"feed_forward\.shared_expert\.(?P<p>gate|up|down)_proj\.weight", "{L}.shared.{p}"),
    Rule(_L + r"feed_forward\.router\.weight", "{L}.router"),
    # [E, H, 2I] input-major: per expert [H, 2I] -> [2I, H] -> gate rows, up rows
    Rule(_E + r"gate_up_proj", "{L}.experts.{E}.{p}", (unstack("E"), transpose(), chunk("p", ("gate", "up")))),
    Rule(_E + r"down_proj", "{L}.experts.{E}.down", (unstack("E"), transpose())),
)
RULES.update(llama4=_RULES, llama4_text=_RULES)
