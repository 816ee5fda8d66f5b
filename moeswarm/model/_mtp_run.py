"""Running multi-token-prediction layers (``mtp.py`` loads them): one MTP step over slots, and its cache."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._attn_dsa import DsaLayerCache
from .attention import KVCache, LayerCache, linear, rms_norm
from .config import ModelConfig
from .experts import f32, mm
from .transformer import LAYER_CACHES


def new_mtp_cache(cfg: ModelConfig) -> KVCache:
    """A ``KVCache`` with one cache per MTP layer; slot j sits at index j (its position is j + 1)."""
    if cfg.attention in LAYER_CACHES:  # DeepSeek-V4
        return KVCache([LAYER_CACHES[cfg.attention](cfg, L) for L in range(cfg.num_layers, cfg.all_layers)])  # type: ignore[misc]
    return KVCache([DsaLayerCache() if cfg.dsa is not None else LayerCache() for _ in range(cfg.mtp_layers)])


def mtp_forward(model: Any, k: int, hidden: np.ndarray, ids: np.ndarray, cache: KVCache,
                first_position: int) -> tuple[np.ndarray, np.ndarray]:
    """MTP layer ``k`` over consecutive slots: hidden (T, H) (the model's final-normed states, or the
    previous MTP step's output; DeepSeek-V4: (T, n, H) streams, ``_streams_forward``), ids (T,) the
    next token of each slot, the first at position ``first_position`` -> (g (T, H), logits (T, V)).  Every routed expert of the T slots is one
    ``submit`` call for the layer."""
    cfg, w = model.config, model.weights
    if not 0 <= k < cfg.mtp_layers:
        raise ValueError(f"the model has {cfg.mtp_layers} MTP layers loaded, not layer {k}")
    L, eps = cfg.num_layers + k, cfg.rms_norm_eps
    e = f32(w["embed"][np.asarray(ids, np.int64)])  # (T, H)
    if f"{L}.mtp.e_proj" in w.tensors:
        return _streams_forward(model, k, hidden, e, ids, cache, first_position)
    both = np.concatenate([rms_norm(e, w[f"{L}.mtp.enorm"], eps), rms_norm(f32(hidden), w[f"{L}.mtp.hnorm"], eps)],
                          axis=-1)  # (T, 2H)
    x = mm(both, w[f"{L}.mtp.eh_proj"])[None]  # (1, T, H)
    positions = np.arange(first_position, first_position + len(ids))
    x = model.layer(L, x, cache.layers[k], positions, {}, observe=False)[0]
    model.experts.end_step()
    g = rms_norm(x, w[f"{L}.mtp.norm"], eps)
    return g, mm(g, w["lm_head"]).astype(np.float32, copy=False)


def _streams_forward(model: Any, k: int, hidden: np.ndarray, e: np.ndarray, ids: np.ndarray, cache: KVCache,
                     first_position: int) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V4's MTP layer (``MTPBlock.forward`` in DeepSeek's ``inference/model.py``): hidden
    (T, n, H) the model's streams before its ``hc_head`` (or this layer's output streams) ->
    (the layer's output streams (T, n, H), logits (T, V))."""
    cfg, w = model.config, model.weights
    L, eps = cfg.num_layers + k, cfg.rms_norm_eps
    h = rms_norm(f32(hidden), w[f"{L}.mtp.hnorm"], eps)  # (T, n, H)
    x = linear(h, w[f"{L}.mtp.h_proj"]) + mm(rms_norm(e, w[f"{L}.mtp.enorm"], eps), w[f"{L}.mtp.e_proj"])[:, None, :]
    positions = np.arange(first_position, first_position + len(ids))
    step = {"tokens": np.asarray(ids, np.int64)}
    x = model.layer(L, x[None], cache.layers[k], positions, step, observe=False)  # (1, T, n, H)
    model.experts.end_step()
    g = rms_norm(model.residual_form.collapse(x, f"{L}.mtp.")[0], w[f"{L}.mtp.norm"], eps)  # (T, H)
    return x[0], mm(g, w["lm_head"]).astype(np.float32, copy=False)
