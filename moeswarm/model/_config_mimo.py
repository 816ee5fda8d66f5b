"""MiMo-V2-Flash (``mimo_v2_flash``): config.json parser, its attention kind and tensor shapes.

Read from transformers 5.24 (``models/mimo_v2_flash``).  GLM-4.5's decoder (a dense first layer,
then MoE layers with DeepSeek-V3's sigmoid group router and correction bias, no shared expert) with
a hybrid attention per ``layer_types``:

* ``full_attention`` layers: GQA with ``num_key_value_heads`` kv heads, RoPE theta and partial
  rotary factor from ``rope_parameters["full_attention"]``;
* ``sliding_attention`` layers: twice the kv heads, a ``sliding_window``-token window (the query
  included), a learned attention sink per head (gpt-oss's), and their own RoPE theta;
* both: q/k heads ``head_dim`` wide but values ``v_head_dim`` wide, the values scaled by
  ``attention_value_scale`` before the cache, rotary on the first ``int(head_dim * partial_rotary_factor)``
  channels (halves layout), softmax scale ``head_dim ** -0.5``.

The hub's per-expert names (sinks as ``attention_sink_bias``) and transformers' packed ones both load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from .attention import LayerCache, Rope, _attend, linear
from .config import ModelConfig, RopeConfig, _common, register_family
from .convert import RULES, Rule
from .transformer import ATTENTION_KINDS
from .weights import FAMILY_SHAPES, expected_shapes

# MiMoV2FlashConfig's field defaults (transformers 5.24; its docstring's XiaomiMiMo/MiMo-V2-Flash)
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152576, "hidden_size": 4096, "intermediate_size": 16384, "moe_intermediate_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 4, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "bos_token_id": 1,
    "tie_word_embeddings": False, "attention_bias": False, "head_dim": 192, "v_head_dim": 128,
    "sliding_window": 129, "attention_value_scale": 0.707,
}
_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}


@dataclass(frozen=True)
class MimoSettings:
    """What MiMo-V2-Flash's attention reads beyond GQA's fields (``ModelConfig.family``)."""

    sliding: tuple[bool, ...]  # per layer: a sliding-window layer (more kv heads, sinks, its own RoPE)
    sliding_rope: RopeConfig  # the sliding layers' RoPE (``ModelConfig.rope`` is the full layers')
    sliding_kv_heads: int  # kv heads of a sliding layer (twice num_key_value_heads)
    v_head_dim: int  # value (and output) width per head
    value_scale: float  # attention_value_scale: values are multiplied by it


def _layer_rope(params: dict[str, Any], head_dim: int) -> RopeConfig:
    if (params.get("rope_type") or "default") != "default":
        raise ValueError(f"rope type {params.get('rope_type')!r} is not supported (default)")
    dim = int(head_dim * float(params.get("partial_rotary_factor", 0.334)))
    return RopeConfig(theta=float(params["rope_theta"]), dim=dim)


def _mimo(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    if t["attention_bias"]:
        raise ValueError("attention_bias is not supported (MiMo-V2-Flash has none)")
    n = int(t["num_hidden_layers"])
    types = list(t.get("layer_types") or ["full_attention" if (i == 0 or not (i + 1) % 6) else "sliding_attention"
                                          for i in range(n)])[:n]
    mlp = list(t.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1))[:n]
    window = int(t["sliding_window_size"]) + 1 if t.get("sliding_window_size") is not None else int(t["sliding_window"])
    params = {**_ROPE, **(t.get("rope_parameters") or {})}
    c = _common(t, "mimo_v2_flash", model_id)
    c["raw"] = raw
    hd = c["head_dim"]
    sliding = tuple(kind == "sliding_attention" for kind in types)
    return ModelConfig(
        **c,
        rope=_layer_rope(params["full_attention"], hd),
        moe_layers=tuple(kind == "sparse" for kind in mlp),
        sliding_windows=tuple(window if s else None for s in sliding),
        attention="mimo_v2_flash",
        num_experts=int(t["n_routed_experts"]),
        top_k=int(t["num_experts_per_tok"]),
        moe_intermediate_size=int(t["moe_intermediate_size"]),
        dense_intermediate_size=int(t["intermediate_size"]),
        router="sigmoid_group",
        norm_topk_prob=bool(t["norm_topk_prob"]),
        routed_scaling_factor=float(t["routed_scaling_factor"]),
        n_group=int(t["n_group"]),
        topk_group=int(t["topk_group"]),
        family=MimoSettings(sliding=sliding, sliding_rope=_layer_rope(params["sliding_attention"], hd),
                            sliding_kv_heads=2 * c["num_kv_heads"], v_head_dim=int(t["v_head_dim"]),
                            value_scale=float(t["attention_value_scale"])),
    )


@lru_cache(maxsize=8)
def _rope(rope: RopeConfig) -> Rope:
    """The sliding layers' cos/sin tables (``Rope`` reads only ``.rope`` of what it is given)."""
    return Rope(replace(_BLANK, rope=rope))


_BLANK = ModelConfig(arch="", vocab_size=0, hidden_size=0, num_layers=0, num_heads=0, num_kv_heads=0, head_dim=0,
                     rms_norm_eps=0.0, rope=RopeConfig(theta=1.0, dim=2), tie_word_embeddings=False, moe_layers=(),
                     sliding_windows=())


def mimo_attention(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig, rope: Rope,
                   cache: LayerCache, positions: np.ndarray, layer: int,
                   step: dict[str, Any] | None = None) -> np.ndarray:
    """x (B, T, H) -> (B, T, H)."""
    s: MimoSettings = cfg.family
    B, T, _ = x.shape
    sliding = s.sliding[layer]
    nh, hd, vd = cfg.num_heads, cfg.head_dim, s.v_head_dim
    nkv = s.sliding_kv_heads if sliding else cfg.num_kv_heads
    q = linear(x, w["q"]).reshape(B, T, nh, hd).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    k = linear(x, w["k"]).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    v = linear(x, w["v"]).reshape(B, T, nkv, vd).transpose(0, 2, 1, 3) * np.float32(s.value_scale)  # type: ignore[arg-type]
    turn = _rope(s.sliding_rope) if sliding else rope
    cos, sin = turn.tables(positions)
    q, k = turn.apply(q, cos, sin), turn.apply(k, cos, sin)
    past = cache.length
    keys, values = cache.append(k, v)
    out = _attend(q, keys, values, past, cfg.scale, cfg.sliding_windows[layer], w.get("sinks") if sliding else None)
    return linear(out, w["o"])  # type: ignore[arg-type]


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GQA's shapes with each layer's own kv heads, the narrower values and the sliding layers' sinks."""
    s: MimoSettings = cfg.family
    shapes = expected_shapes(replace(cfg, arch="deepseek_v3", attention="gqa"))
    H, nh, hd, vd = cfg.hidden_size, cfg.num_heads, cfg.head_dim, s.v_head_dim
    for L in range(cfg.num_layers):
        nkv = s.sliding_kv_heads if s.sliding[L] else cfg.num_kv_heads
        p = f"{L}.attn."
        shapes.update({p + "k": (nkv * hd, H), p + "v": (nkv * vd, H), p + "o": (H, nh * vd)})
        if s.sliding[L]:
            shapes[p + "sinks"] = (nh,)
    return shapes


PARSERS = {"mimo_v2_flash": _mimo}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})
ATTENTION_KINDS["mimo_v2_flash"] = mimo_attention
FAMILY_SHAPES["mimo_v2_flash"] = _shapes
# the hub's sinks are ``attention_sink_bias`` (transformers' runtime name ``sinks`` is in DeepSeek-V3's rules,
# with the attention, norms, dense MLP, router and experts)
RULES.update(mimo_v2_flash=(Rule(r"model\.layers\.(?P<L>\d+)\.self_attn\.attention_sink_bias", "{L}.attn.sinks"),)
             + RULES["deepseek_v3"])
