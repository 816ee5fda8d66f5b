"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2 and GLM-5): MLA whose queries see only the keys
that a lightning indexer picks.

Read from transformers 5.24 (``models/deepseek_v32``, ``models/glm_moe_dsa``).  Per layer, the
indexer projects its own small queries from the MLA query latent (``wq_b``) and one key per token
from the hidden state (``wk`` then a LayerNorm with bias); it rotates their first
``qk_rope_head_dim`` dims (halves in DeepSeek-V3.2, interleaved pairs in GLM-5) and scores

    index[t, s] = sum_h  w[t, h] * n_heads**-0.5 * relu(q[t, h] . k[s] * head_dim**-0.5)

with ``w = weights_proj(x)``.  Each query keeps the ``index_topk`` best causal keys; attention
is ordinary MLA restricted to them.  GLM-5's ``"shared"`` layers have no indexer and reuse the
previous layer's choice.  The indexer keys are cached next to the layer's keys and values.

Shapes: B batch, T new tokens, S = cached + new tokens, nh indexer heads, D indexer head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .attention import LayerCache, Rope, _attend, linear, mla_qkv
from .config import ModelConfig


@dataclass
class DsaLayerCache(LayerCache):
    """An MLA layer's keys and values plus the indexer's key per token."""

    index_k: np.ndarray | None = None  # (B, capacity, D)
    index_length: int = 0

    def append_index(self, k: np.ndarray) -> np.ndarray:
        """k (B, T, D) -> every cached indexer key (B, S, D)."""
        B, T, D = k.shape
        need = self.index_length + T
        if self.index_k is None or need > self.index_k.shape[1]:
            cap = max(need, 2 * (self.index_k.shape[1] if self.index_k is not None else 0), 16)
            grown = np.zeros((B, cap, D), np.float32)
            if self.index_k is not None:
                grown[:, : self.index_length] = self.index_k[:, : self.index_length]
            self.index_k = grown
        self.index_k[:, self.index_length : need] = k
        self.index_length = need
        return self.index_k[:, :need]

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.index_length = min(self.index_length, length)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = np.square(x - mean).mean(axis=-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + np.float32(eps)) * w + b).astype(np.float32)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotary embedding of ``x (..., T, heads?, rd)`` laid out (T, rd/2) -> halves layout, as transformers."""
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else np.split(x, 2, axis=-1)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def indexer_keep(
    w: dict[str, np.ndarray | None],
    x: np.ndarray,
    q_resid: np.ndarray,
    cfg: ModelConfig,
    rope: Rope,
    cache: DsaLayerCache,
    positions: np.ndarray,
) -> np.ndarray:
    """x (B, T, H), q_resid (B, T, q_lora) -> keep (B, T, S) bool: the top-k causal keys of each query."""
    dsa = cfg.dsa
    assert dsa is not None
    B, T, _ = x.shape
    nh, D, rd = dsa.n_heads, dsa.head_dim, cfg.qk_rope_head_dim
    q = linear(q_resid, w["idx_q_b"]).reshape(B, T, nh, D)  # type: ignore[arg-type]
    k = _layer_norm(linear(x, w["idx_k"]), w["idx_k_norm"], w["idx_k_norm_bias"])  # type: ignore[arg-type]
    cos, sin = rope.tables(positions)  # (T, rd/2)
    q = np.concatenate([_rotate(q[..., :rd], cos[:, None], sin[:, None], dsa.rope_interleaved), q[..., rd:]], axis=-1)
    k = np.concatenate([_rotate(k[..., :rd], cos, sin, dsa.rope_interleaved), k[..., rd:]], axis=-1)
    return top_keys(q, k, linear(x, w["idx_w"]), dsa.topk, cache)  # type: ignore[arg-type]


def top_keys(q: np.ndarray, k: np.ndarray, head_weights: np.ndarray, topk: int, cache: DsaLayerCache) -> np.ndarray:
    """The indexer's choice from its rotated queries q (B, T, nh, D), keys k (B, T, D) (cached here) and
    per-head weights (B, T, nh): keep (B, T, S) bool, the ``topk`` best causal keys of each query."""
    B, T, nh, D = q.shape
    keys = cache.append_index(k)  # (B, S, D)
    S = keys.shape[1]
    scores = np.matmul(q, keys[:, None].swapaxes(-1, -2)) * np.float32(D**-0.5)  # (B, T, nh, S)
    np.maximum(scores, 0, out=scores)
    weights = head_weights * np.float32(nh**-0.5)  # (B, T, nh)
    index = np.matmul(weights[:, :, None, :], scores)[:, :, 0]  # (B, T, S)
    past = S - T
    causal = np.arange(S)[None, :] <= past + np.arange(T)[:, None]  # (T, S)
    if topk >= S:
        return np.broadcast_to(causal, (B, T, S))
    index = np.where(causal, index, np.float32(-np.inf))
    chosen = np.argpartition(-index, topk - 1, axis=-1)[..., :topk]  # (B, T, topk)
    keep = np.zeros((B, T, S), dtype=bool)
    np.put_along_axis(keep, chosen, True, axis=-1)
    return keep & causal


def dsa_attention(
    w: dict[str, np.ndarray | None],
    x: np.ndarray,
    cfg: ModelConfig,
    rope: Rope,
    cache: LayerCache,
    positions: np.ndarray,
    layer: int,
    step: dict[str, np.ndarray],
) -> np.ndarray:
    """MLA over the indexer's keys.  ``step`` carries the last top-k to GLM-5's shared layers."""
    if not isinstance(cache, DsaLayerCache):
        raise ConfigError("a DSA model needs the cache of Model.new_cache()")
    assert cfg.dsa is not None
    query, keys, values, past, q_resid = mla_qkv(w, x, cfg, rope, cache, positions)
    if cfg.dsa.shared[layer]:
        keep = step["dsa_keep"]
    else:
        assert q_resid is not None
        keep = indexer_keep(w, x, q_resid, cfg, rope, cache, positions)
        step["dsa_keep"] = keep
    out = _attend(query, keys, values, past, cfg.scale, None, None, keep)
    return linear(out, w["o"])  # type: ignore[arg-type]
