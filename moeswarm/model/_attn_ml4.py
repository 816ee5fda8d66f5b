"""Mistral Large 4's attention (``mistral_large4``): DSA over MLA without a q LoRA, with ssmax, NoPE
layers and KV sharing (see ``_config_mistral_large4.py`` for where each is read from).

Per layer L (``q_proj`` straight from the normed hidden state x; rd = qk_rope_head_dim, or 0 on a NoPE
layer, where the whole qk head is "nope"):

    latent, k_rot = rms_norm(kv_a(x)[:kv_lora]), rope(kv_a(x)[kv_lora:])   (or layer kv_source[L]'s)
    k_nope | v    = kv_b(latent)             (this layer's own kv_b, also over a shared latent)
    query         = [q_nope, rope(q_rot)] * (s[h] * log(p + 1) + b[h])      (ssmax, per head h)

and attention over the keys the indexer keeps.  The indexer's queries are ``wq_b(LayerNorm(x))``,
ssmax-scaled with its own ``s``, ``b``; keys ``LayerNorm(wk(x))``; both rotated (interleaved pairs) on
their first qk_rope_head_dim dims unless the layer is NoPE; scored and cut to ``index_topk`` as
DeepSeek-V3.2's (``_attn_dsa.top_keys``).  A ``"shared"`` indexer layer reuses the previous layer's
choice.  A layer hands its new latent and rotated key (and its choice) to the next ones through the
pass's ``step``: a sharing layer expands them with its own ``kv_b`` and caches the result, so decode
expands only the new tokens.  Every layer keeps a ``DsaLayerCache``.

Shapes: B batch, T new tokens, S = cached + new tokens, nh heads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from ._attn_dsa import DsaLayerCache, _layer_norm, _rotate, top_keys
from ._config_mistral_large4 import Ml4Settings
from .attention import Rope, _attend, linear, rms_norm
from .config import ModelConfig
from .experts import f32
from .transformer import ATTENTION_KINDS, LAYER_CACHES
from .weights import ATTENTION_SHAPES, EXTRA_SHAPES, Shapes

INDEXER_NORM_EPS = 1e-6  # the indexer's two LayerNorms (q_input_norm, k_norm), whatever rms_norm_eps says


def ssmax(s: np.ndarray, b: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The per-head query scale ``s * log(p + 1) + b``: (nh, T) for positions (T,)."""
    log_pos = np.log(positions.astype(np.float32) + np.float32(1))
    return (f32(s)[:, None] * log_pos[None, :] + f32(b)[:, None]).astype(np.float32)


def _indexer_keep(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig, cos: np.ndarray | None,
                  sin: np.ndarray | None, cache: DsaLayerCache, positions: np.ndarray) -> np.ndarray:
    """x (B, T, H) -> keep (B, T, S): the indexer's top-k causal keys per query (no rotation when cos is None)."""
    dsa = cfg.dsa
    assert dsa is not None
    B, T, _ = x.shape
    nh, rd = dsa.n_heads, cfg.qk_rope_head_dim
    xq = _layer_norm(x, w["idx_q_norm"], w["idx_q_norm_bias"], INDEXER_NORM_EPS)  # type: ignore[arg-type]
    q = linear(xq, w["idx_q_b"]).reshape(B, T, nh, dsa.head_dim)  # type: ignore[arg-type]
    q = q * ssmax(w["idx_ssmax_s"], w["idx_ssmax_b"], positions).T[None, :, :, None]  # type: ignore[arg-type]
    k = _layer_norm(linear(x, w["idx_k"]), w["idx_k_norm"], w["idx_k_norm_bias"], INDEXER_NORM_EPS)  # type: ignore[arg-type]
    if cos is not None and sin is not None:
        q = np.concatenate([_rotate(q[..., :rd], cos[:, None], sin[:, None], True), q[..., rd:]], axis=-1)
        k = np.concatenate([_rotate(k[..., :rd], cos, sin, True), k[..., rd:]], axis=-1)
    return top_keys(q, k, linear(x, w["idx_w"]), dsa.topk, cache)  # type: ignore[arg-type]


def ml4_attention(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig, rope: Rope,
                  cache: DsaLayerCache, positions: np.ndarray, layer: int, step: dict[str, Any]) -> np.ndarray:
    """x (B, T, H) -> (B, T, H)."""
    if not isinstance(cache, DsaLayerCache):
        raise ConfigError("a Mistral Large 4 model needs the cache of Model.new_cache()")
    s: Ml4Settings = cfg.family
    assert cfg.dsa is not None
    B, T, _ = x.shape
    nh, qk, vd, kvr = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    rd = cfg.qk_rope_head_dim if s.rope_layers[layer] else 0
    nope = qk - rd
    cos, sin = rope.tables(positions) if rd else (None, None)  # (T, rd/2)
    q = linear(x, w["q"]).reshape(B, T, nh, qk).transpose(0, 2, 1, 3)  # type: ignore[arg-type]  # (B, nh, T, qk)
    source = s.kv_source[layer]
    if source == layer:
        kv = linear(x, w["kv_a"])  # type: ignore[arg-type]  # (B, T, kv_lora + rd)
        latent = rms_norm(kv[..., :kvr], w["kv_a_norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]
        k_rot = kv[..., kvr:].reshape(B, 1, T, rd)
        if rd:
            k_rot = rope.apply(k_rot, cos, sin)
        step[f"latent_kv.{layer}"] = (latent, k_rot)
    else:
        latent, k_rot = step[f"latent_kv.{source}"]  # type: ignore[misc]
    if rd:
        q = np.concatenate([q[..., :nope], rope.apply(q[..., nope:], cos, sin)], axis=-1)
    query = q * ssmax(w["ssmax_s"], w["ssmax_b"], positions)[None, :, :, None]  # type: ignore[arg-type]
    kv_full = linear(latent, w["kv_b"]).reshape(B, T, nh, nope + vd).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    key = np.concatenate([kv_full[..., :nope], np.broadcast_to(k_rot, (B, nh, T, rd))], axis=-1)
    past = cache.length
    keys, values = cache.append(key, kv_full[..., nope:])
    if cfg.dsa.shared[layer]:
        keep = step["dsa_keep"]
    else:
        keep = _indexer_keep(w, x, cfg, cos, sin, cache, positions)
        step["dsa_keep"] = keep
    out = _attend(query, keys, values, past, cfg.scale, None, None, keep)  # type: ignore[arg-type]
    return linear(out, w["o"])  # type: ignore[arg-type]


def attention_shapes(cfg: ModelConfig, L: int) -> Shapes:
    """Layer L's attention tensors."""
    s: Ml4Settings = cfg.family
    assert cfg.dsa is not None
    H, nh, p = cfg.hidden_size, cfg.num_heads, f"{L}.attn."
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    rd = cfg.qk_rope_head_dim if s.rope_layers[L] else 0
    shapes: Shapes = {p + "q": (nh * qk, H), p + "kv_b": (nh * (qk - rd + cfg.v_head_dim), cfg.kv_lora_rank),
                      p + "o": (H, nh * cfg.v_head_dim), p + "ssmax_s": (nh,), p + "ssmax_b": (nh,)}
    if s.kv_source[L] == L:
        shapes.update({p + "kv_a": (cfg.kv_lora_rank + rd, H), p + "kv_a_norm": (cfg.kv_lora_rank,)})
    if not cfg.dsa.shared[L]:
        ih, D = cfg.dsa.n_heads, cfg.dsa.head_dim
        shapes.update({p + "idx_q_norm": (H,), p + "idx_q_norm_bias": (H,), p + "idx_q_b": (ih * D, H),
                       p + "idx_k": (D, H), p + "idx_k_norm": (D,), p + "idx_k_norm_bias": (D,), p + "idx_w": (ih, H),
                       p + "idx_ssmax_s": (ih,), p + "idx_ssmax_b": (ih,)})
    return shapes


ATTENTION_KINDS["mistral_large4"] = ml4_attention  # type: ignore[assignment]
LAYER_CACHES["mistral_large4"] = lambda cfg, L: DsaLayerCache()
ATTENTION_SHAPES["mistral_large4"] = attention_shapes
EXTRA_SHAPES["mistral_large4"] = lambda cfg: {"rope_alpha": (cfg.qk_rope_head_dim // 2,)}  # LeRoPE
