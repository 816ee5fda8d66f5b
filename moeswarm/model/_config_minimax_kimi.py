"""config.json parsers for MiniMax M2, MiniMax M3 (text model) and Kimi K2.5 (text model).

Read from transformers 5.24 (``models/minimax_m2``, ``models/minimax_m3_vl``, ``models/kimi_k25``):

* ``minimax_m2``: GQA with RMSNorm over the whole q and k projections (as OLMoE), partial rotary
  (``rope_parameters.partial_rotary_factor``, or the hub's ``rotary_dim``), sigmoid router whose
  choice adds ``e_score_correction_bias`` (one group: DeepSeek's router with ``n_group = 1``),
  weights renormalised over the k, no routed scaling; SwiGLU experts.
* ``minimax_m3_vl``: a vision-language checkpoint; only ``text_config`` is read.  Gemma-style
  RMSNorms (scale ``1 + w``), per-head q/k norms, partial rotary, per-layer ``layer_types``
  (``minimax_m3_sparse``: lightning-indexer block-sparse attention) and ``mlp_layer_types``
  (``dense`` / ``sparse``), a shared expert, SwiGLU-OAI (alpha, limit) everywhere, routed
  scaling.  transformers takes the rotary width from ``partial_rotary_factor`` only (its
  ``rotary_dim`` field is not read), and so do we.
* ``kimi_k25``: a vision-language checkpoint whose ``text_config`` is DeepSeek-V3
  (``model_type`` ``deepseek_v3`` or the hub's ``kimi_k2``).

The vision towers' hyper-parameters are not read: images are not supported yet.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .config import ModelConfig, _common, _deepseek_v3, _rope, register_family

THETAS = {"minimax_m2": 5_000_000.0, "minimax_m3_vl": 5_000_000.0}


def _rotary_dim(raw: dict[str, Any], head_dim: int, legacy_rotary_dim: bool) -> int:
    """Rotated channels per head, as transformers' default RoPE computes them."""
    params = raw.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor is None and legacy_rotary_dim and raw.get("rotary_dim") is not None:
        factor = int(raw["rotary_dim"]) / head_dim
    dim = int(head_dim * float(1.0 if factor is None else factor))
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(f"rotary width {dim} must be even and in (0, head_dim={head_dim}]")
    return dim


def _minimax_m2(raw: dict[str, Any], model_id: str, path: str | None) -> Any:
    c = _common(raw, "minimax_m2", model_id)
    n = c["num_layers"]
    return ModelConfig(
        **c,
        rope=_rope(raw, "minimax_m2", _rotary_dim(raw, c["head_dim"], legacy_rotary_dim=True)),
        moe_layers=(True,) * n,
        sliding_windows=(None,) * n,
        qk_norm="full",
        num_experts=int(raw["num_local_experts"] if "num_local_experts" in raw else raw["num_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["intermediate_size"]),
        router="sigmoid_group",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
    )


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise KeyError("text_config")
    return text


def _layer_kinds(t: dict[str, Any], n: int) -> tuple[list[str], list[str]]:
    """(attention kind, MLP kind) per layer, with transformers' fallbacks to the hub's legacy fields."""
    sparse_cfg = t.get("sparse_attention_config") or {}
    layer_types = t.get("layer_types")
    if layer_types is None and "sparse_attention_freq" in sparse_cfg:
        layer_types = ["minimax_m3_sparse" if f else "full_attention" for f in sparse_cfg["sparse_attention_freq"]]
    layer_types = layer_types or ["full_attention"] * n
    mlp_types = t.get("mlp_layer_types")
    if mlp_types is None and t.get("moe_layer_freq") is not None:
        mlp_types = ["sparse" if f else "dense" for f in t["moe_layer_freq"]]
    mlp_types = mlp_types or ["sparse"] * n
    if len(layer_types) < n or len(mlp_types) < n:
        raise ValueError(f"layer_types / mlp_layer_types list fewer than num_hidden_layers={n} layers")
    for kind in layer_types[:n]:
        if kind not in ("full_attention", "minimax_m3_sparse"):
            raise ValueError(f"layer type {kind!r} is not supported (full_attention, minimax_m3_sparse)")
    for kind in mlp_types[:n]:
        if kind not in ("dense", "sparse"):
            raise ValueError(f"MLP layer type {kind!r} is not supported (dense, sparse)")
    return list(layer_types[:n]), list(mlp_types[:n])


_INDEX_LEGACY = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}
_INDEX_DEFAULTS = {"index_n_heads": 4, "index_head_dim": 128, "index_block_size": 128, "index_topk_blocks": 16,
                   "index_local_blocks": 1}


def _index(t: dict[str, Any], key: str) -> int:
    legacy = (t.get("sparse_attention_config") or {}).get(_INDEX_LEGACY[key])
    return int(legacy if legacy is not None else t.get(key, _INDEX_DEFAULTS[key]))


def _minimax_m3_vl(raw: dict[str, Any], model_id: str, path: str | None) -> Any:
    t = _text_config(raw)
    c = _common(t, "minimax_m3_vl", model_id)
    c.update(raw=raw, tie_word_embeddings=bool(raw.get("tie_word_embeddings")) or bool(t.get("tie_word_embeddings")))
    n = c["num_layers"]
    attn, mlp = _layer_kinds(t, n)
    cfg = ModelConfig(
        **c,
        rope=_rope(t, "minimax_m3_vl", _rotary_dim(t, c["head_dim"], legacy_rotary_dim=False)),
        moe_layers=tuple(k == "sparse" for k in mlp),
        sliding_windows=(None,) * n,
        qk_norm="head",
        num_experts=int(t["num_local_experts"] if "num_local_experts" in t else t["num_experts"]),
        top_k=int(t["num_experts_per_tok"]),
        moe_intermediate_size=int(t["intermediate_size"]),
        dense_intermediate_size=int(t.get("dense_intermediate_size", 12288)),
        router="sigmoid_group",
        norm_topk_prob=True,
        routed_scaling_factor=float(t.get("routed_scaling_factor", 2.0)),
        shared_intermediate_size=int(t.get("shared_intermediate_size", 3072)),
        expert_activation="clamped_swiglu",
        swiglu_alpha=float(t.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(t.get("swiglu_limit", 7.0)),
        dense_activation="clamped_swiglu",
        norm_offset=1.0,
        sparse_layers=tuple(k == "minimax_m3_sparse" for k in attn),
        index_heads=_index(t, "index_n_heads"),
        index_head_dim=_index(t, "index_head_dim"),
        index_block_size=_index(t, "index_block_size"),
        index_topk_blocks=_index(t, "index_topk_blocks"),
        index_local_blocks=_index(t, "index_local_blocks"),
    )
    if any(cfg.sparse_layers):
        if cfg.index_heads <= 0 or cfg.num_heads % cfg.index_heads:
            raise ValueError(f"index_n_heads={cfg.index_heads} must divide num_attention_heads={cfg.num_heads}")
        if min(cfg.index_head_dim, cfg.index_block_size, cfg.index_topk_blocks) <= 0 or cfg.index_local_blocks < 0:
            raise ValueError("index_head_dim, index_block_size and index_topk_blocks must be positive")
    return cfg


def _kimi_k25(raw: dict[str, Any], model_id: str, path: str | None) -> Any:
    t = dict(_text_config(raw))
    if t.get("model_type", "deepseek_v3") not in ("deepseek_v3", "kimi_k2"):
        raise ValueError(f"text_config.model_type {t.get('model_type')!r} is not deepseek_v3 / kimi_k2")
    cfg = _deepseek_v3(t, model_id, path)
    # transformers ties lm_head to the embeddings by the top-level flag, whose default is True
    return replace(cfg, arch="kimi_k25", raw=raw, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


PARSERS = {"minimax_m2": _minimax_m2, "minimax_m3_vl": _minimax_m3_vl, "kimi_k25": _kimi_k25}


def extra_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of the tensors only these families have (the lightning indexer)."""
    s: dict[str, tuple[int, ...]] = {}
    for L, sparse in enumerate(cfg.sparse_layers):
        if sparse:
            p = f"{L}.attn."
            s[p + "index_q"] = (cfg.index_heads * cfg.index_head_dim, cfg.hidden_size)
            s[p + "index_k"] = (cfg.index_head_dim, cfg.hidden_size)
            s[p + "index_q_norm"] = s[p + "index_k_norm"] = (cfg.index_head_dim,)
    return s
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, THETAS)
