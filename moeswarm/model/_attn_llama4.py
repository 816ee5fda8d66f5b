"""Llama 4's attention (``ModelConfig.attention == "llama4"``), read from transformers 5.24's
``Llama4TextAttention``: grouped-query attention in which

* RoPE layers (``Llama4Settings.rope_layers``) rotate q and k in the interleaved-pairs layout,
  then (``use_qk_norm``) scale each head of q and k to unit RMS (an L2 norm without weight, eps
  ``rms_norm_eps``), and see only the keys of their own ``attention_chunk_size``-token chunk;
* the other layers (no RoPE, "NoPE") see every earlier key and, with ``attn_temperature_tuning``,
  multiply q at position p by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .attention import LayerCache, Rope, _attend, linear
from .config import ModelConfig
from .transformer import ATTENTION_KINDS


@dataclass(frozen=True)
class Llama4Settings:
    """What Llama 4's attention reads beyond GQA's fields (``ModelConfig.family``)."""

    rope_layers: tuple[bool, ...]  # per layer: True = RoPE (+ qk norm, chunked), False = NoPE
    chunked: tuple[bool, ...]  # per layer: attention within ``chunk_size``-token chunks only
    chunk_size: int  # attention_chunk_size (tokens)
    qk_norm: bool  # use_qk_norm: unit-RMS q and k heads on RoPE layers
    temperature_tuning: bool  # attn_temperature_tuning: position-dependent q scale on NoPE layers
    floor_scale: float
    attn_scale: float


def _unit_rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps))


def llama4_attention(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig, rope: Rope,
                     cache: LayerCache, positions: np.ndarray, layer: int,
                     step: dict[str, Any] | None = None) -> np.ndarray:
    """x (B, T, H) -> (B, T, H)."""
    s: Llama4Settings = cfg.family
    B, T, _ = x.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(x, w["q"], w.get("q_bias")).reshape(B, T, nh, hd).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    k = linear(x, w["k"], w.get("k_bias")).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    v = linear(x, w["v"], w.get("v_bias")).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    keep = None
    past = cache.length
    if s.rope_layers[layer]:
        cos, sin = rope.tables(positions)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        if s.qk_norm:
            q, k = _unit_rms(q, cfg.rms_norm_eps), _unit_rms(k, cfg.rms_norm_eps)
    elif s.temperature_tuning:
        p = positions.astype(np.float32)
        scale = np.log1p(np.floor((p + 1) / np.float32(s.floor_scale))) * np.float32(s.attn_scale) + 1
        q = q * scale.astype(np.float32)[None, None, :, None]
    keys, values = cache.append(k, v)
    if s.chunked[layer]:
        chunk = np.arange(keys.shape[2]) // s.chunk_size  # (S,)
        keep = np.broadcast_to(chunk[None, :] == (positions // s.chunk_size)[:, None], (B, T, keys.shape[2]))
    out = _attend(q, keys, values, past, cfg.scale, None, None, keep)
    return linear(out, w["o"], w.get("o_bias"))  # type: ignore[arg-type]


ATTENTION_KINDS["llama4"] = llama4_attention
