"""MiniMax M3's lightning-indexer block-sparse attention, and the cache that keeps its index keys.

Read from transformers 5.24 ``models/minimax_m3_vl`` (``MiniMaxM3VLIndexer``, eager path):

1. the attention's q/k/v are those of GQA (per-head q/k RMSNorm, partial RoPE);
2. the indexer projects ``index_heads`` query heads and one key head of width ``index_head_dim``
   (each RMSNormed, then RoPE'd with the model's cos/sin cut to ``index_head_dim``), and scores
   every query against every earlier key: ``q . k`` in float32 (no scale), future keys ``-inf``;
3. the key axis is cut into blocks of ``index_block_size`` slots (the last padded with ``-inf``)
   and a block scores the max of its keys;
4. the ``index_local_blocks`` blocks ending at the query's own block score ``+inf``;
5. each indexer head keeps its best ``index_topk_blocks`` blocks (never one scoring ``-inf``);
6. query head ``h`` attends, causally, to the keys of the blocks its indexer head
   ``h // (num_heads / index_heads)`` kept.

The index keys (post-RoPE) are cached beside the keys and values, on whoever runs attention (the
backbone), and roll back with them.

Shapes: B batch, T new tokens, S = cached + T keys, nI indexer heads, dI indexer width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .attention import LayerCache, Rope, linear, rms_norm
from .config import ModelConfig


@dataclass
class SparseLayerCache(LayerCache):
    """Keys and values, plus the indexer's keys ``(B, 1, S, dI)`` (held as a zero-width-value cache)."""

    index: LayerCache = field(default_factory=LayerCache)

    def append_index(self, k: np.ndarray) -> np.ndarray:
        keys, _ = self.index.append(k, np.zeros((*k.shape[:-1], 0), np.float32))
        return keys

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.index.truncate(length)


def _rope_cut(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """transformers' ``apply_rotary_pos_emb`` with ``cat(freqs, freqs)`` tables cut to ``x``'s width:
    x (B, h, T, d); cos, sin (T, r/2) -> the first ``min(r, d)`` channels turn, the rest pass."""
    full_cos = np.concatenate([cos, cos], axis=-1)[:, : x.shape[-1]]
    full_sin = np.concatenate([sin, sin], axis=-1)[:, : x.shape[-1]]
    r = full_cos.shape[-1]
    turn, rest = x[..., :r], x[..., r:]
    a, b = turn[..., : r // 2], turn[..., r // 2 :]
    rotated = turn * full_cos + np.concatenate([-b, a], axis=-1) * full_sin
    return np.concatenate([rotated, rest], axis=-1)


def select_blocks(scores: np.ndarray, positions: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """scores (B, nI, T, S) with future keys at -inf -> kept blocks (B, nI, T, nb) bool."""
    B, nI, T, S = scores.shape
    bs = cfg.index_block_size
    nb = -(-S // bs)
    padded = np.full((B, nI, T, nb * bs), -np.inf, np.float32)
    padded[..., :S] = scores
    block = padded.reshape(B, nI, T, nb, bs).max(axis=-1)  # (B, nI, T, nb)
    own = positions // bs  # (T,)
    for back in range(cfg.index_local_blocks):
        block[:, :, np.arange(T), np.maximum(own - back, 0)] = np.inf
    k = min(cfg.index_topk_blocks, nb)
    order = np.argsort(-block, axis=-1, kind="stable")[..., :k]  # best first; ties keep the lower block
    keep = np.zeros_like(block, dtype=bool)
    np.put_along_axis(keep, order, np.take_along_axis(block, order, axis=-1) > -np.inf, axis=-1)
    return keep


def _indexer(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig, cos: np.ndarray, sin: np.ndarray,
             cache: SparseLayerCache, positions: np.ndarray) -> np.ndarray:
    """x (B, T, H) -> the keys each indexer head lets each query see, (B, nI, T, S) bool."""
    B, T, _ = x.shape
    nI, dI = cfg.index_heads, cfg.index_head_dim
    q = rms_norm(linear(x, w["index_q"]).reshape(B, T, nI, dI), w["index_q_norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]
    k = rms_norm(linear(x, w["index_k"]).reshape(B, T, 1, dI), w["index_k_norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]
    q = _rope_cut(q.transpose(0, 2, 1, 3), cos, sin)  # (B, nI, T, dI)
    k = _rope_cut(k.transpose(0, 2, 1, 3), cos, sin)  # (B, 1, T, dI)
    keys = cache.append_index(k)  # (B, 1, S, dI)
    S = keys.shape[2]
    scores = np.matmul(q, keys.swapaxes(-1, -2))  # (B, nI, T, S)
    causal = np.arange(S)[None, :] <= positions[:, None]  # (T, S)
    scores = np.where(causal, scores, np.float32(-np.inf))
    keep = select_blocks(scores, positions, cfg)  # (B, nI, T, nb)
    keep = np.repeat(keep, cfg.index_block_size, axis=-1)[..., :S]
    return keep & causal


def lightning(
    w: dict[str, np.ndarray | None],
    x: np.ndarray,
    cfg: ModelConfig,
    rope: Rope,
    cache: LayerCache,
    positions: np.ndarray,
) -> np.ndarray:
    """Block-sparse attention of a ``minimax_m3_sparse`` layer.  x (B, T, H) -> (B, T, H)."""
    if not isinstance(cache, SparseLayerCache):
        raise TypeError("a lightning-indexer layer needs a SparseLayerCache (Model.new_cache makes one)")
    B, T, _ = x.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = rms_norm(linear(x, w["q"]).reshape(B, T, nh, hd), w["q_norm"], cfg.rms_norm_eps).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    k = rms_norm(linear(x, w["k"]).reshape(B, T, nkv, hd), w["k_norm"], cfg.rms_norm_eps).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    v = linear(x, w["v"]).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    cos, sin = rope.tables(positions)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    keys, values = cache.append(k, v)  # (B, nkv, S, hd)
    allowed = _indexer(w, x, cfg, cos, sin, cache, positions)  # (B, nI, T, S)
    allowed = np.repeat(allowed, nh // cfg.index_heads, axis=1)  # (B, nh, T, S): head h -> indexer head h // g
    S, g = keys.shape[2], nh // nkv
    scores = np.matmul(q.reshape(B, nkv, g, T, hd), keys[:, :, None].swapaxes(-1, -2)) * np.float32(cfg.scale)
    scores = np.where(allowed.reshape(B, nkv, g, T, S), scores, np.float32(-np.inf))  # (B, nkv, g, T, S)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.matmul(probs, values[:, :, None])  # (B, nkv, g, T, hd)
    out = out.reshape(B, nh, T, hd).transpose(0, 2, 1, 3).reshape(B, T, nh * hd)
    return linear(out, w["o"])  # type: ignore[arg-type]


def new_layer_cache(cfg: ModelConfig, layer: int) -> LayerCache:
    """The cache a layer needs: index keys too on a lightning-indexer layer."""
    sparse = layer < len(cfg.sparse_layers) and cfg.sparse_layers[layer]
    return SparseLayerCache() if sparse else LayerCache()


__all__ = ["SparseLayerCache", "lightning", "new_layer_cache", "select_blocks"]
