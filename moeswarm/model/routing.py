"""Routers: hidden states -> (expert ids, combine weights) per token, for each architecture.

Read from transformers 5.24's modeling files (see ``shared/spikes/moe/tensors/*_router.md``):

* ``softmax_topk`` (Mixtral, Qwen2/3-MoE, OLMoE, Hunyuan): softmax over all experts in fp32, top-k of the
  probabilities, renormalised over the k when ``norm_topk_prob`` (Mixtral always).  ERNIE 4.5 adds
  an ``e_score_correction_bias`` to the probabilities for the choice only (``choice_bias``); the
  weights stay the unbiased probabilities.
* ``sigmoid_group`` (DeepSeek-V3 noaux_tc, GLM-4.5, dots1): sigmoid scores; choice uses scores +
  ``e_score_correction_bias``; each of ``n_group`` groups is scored by the sum of its top two;
  only the best ``topk_group`` groups compete; the weights are the *unbiased* scores at the
  chosen experts, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
* ``topk_softmax`` (gpt-oss): logits with a bias, top-k on the logits, softmax over only those k.
* ``softmax_group`` (Mistral 4): ``sigmoid_group`` over softmax scores, without a correction bias.
* ``sqrtsoftplus`` (DeepSeek-V4): ``sigmoid_group`` with one group over ``sqrt(softplus(logits))``
  scores, always renormalised; its hash-routed layers (``hash_route``) take the experts from a
  token-id table instead and weight them the same way.
* ``topk_sigmoid`` (Llama 4): top-k on the logits, each chosen expert weighted by the sigmoid of its
  logit (Llama 4 scales the expert's *input* by it: ``ModelConfig.expert_input_scaled``).
* ``sparsemixer`` (PhiMoE, at inference): the top logit's expert, weighted by its softmax over the
  experts whose logit is within ``2 * jitter`` of the top (relative: ``(top - s) / max(|s|, top)``);
  then the same over the others for the second expert.  ``jitter`` is ``cfg.family.router_jitter``.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .experts import f32, sigmoid


def _topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, largest first.  scores (T, E) -> (T, k)."""
    part = np.argpartition(-scores, k - 1, axis=-1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, part, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(part, order, axis=-1)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def router_logits(cfg: ModelConfig, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    logits = x.astype(np.float32, copy=False) @ f32(w).T  # (T, E)
    if bias is not None:
        logits += f32(bias)
    return logits


def sqrt_softplus(x: np.ndarray) -> np.ndarray:
    """``sqrt(softplus(x))`` as torch computes softplus (``x`` itself above 20)."""
    with np.errstate(over="ignore"):
        return np.sqrt(np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))).astype(np.float32)


_SCORES = {"sigmoid_group": sigmoid, "softmax_group": _softmax, "sqrtsoftplus": sqrt_softplus}


def hash_route(cfg: ModelConfig, x: np.ndarray, w: np.ndarray, table: np.ndarray,
               tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V4's hash-routed layers: x (T, H), tokens (T,) -> the experts ``table[token]`` (T, k),
    weighted by their scores (the router's, ``sqrtsoftplus``), renormalised, times ``routed_scaling_factor``."""
    ids = np.asarray(table[np.asarray(tokens, np.int64)], np.int64)
    if ids.shape != (x.shape[0], cfg.top_k):
        raise ValueError(f"hash routing: {ids.shape[0]} token ids for {x.shape[0]} rows")
    scores = _SCORES[cfg.router](router_logits(cfg, w, x))
    weights = np.take_along_axis(scores, ids, axis=-1)
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * np.float32(cfg.routed_scaling_factor)
    return ids, weights.astype(np.float32)


def route(
    cfg: ModelConfig,
    x: np.ndarray,
    w: np.ndarray,
    bias: np.ndarray | None = None,
    score_bias: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """x (T, H) -> ids (T, k) int64, weights (T, k) float32."""
    k = cfg.top_k
    logits = router_logits(cfg, w, x, bias if cfg.router == "topk_softmax" else None)
    if cfg.router == "softmax_topk":
        probs = _softmax(logits)
        ids = _topk(probs + f32(score_bias) if cfg.choice_bias and score_bias is not None else probs, k)
        weights = np.take_along_axis(probs, ids, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        if cfg.routed_scaling_factor != 1.0:  # LongCat-Flash
            weights = weights * np.float32(cfg.routed_scaling_factor)
    elif cfg.router == "topk_softmax":
        ids = _topk(logits, k)
        weights = _softmax(np.take_along_axis(logits, ids, axis=-1))
    elif cfg.router == "topk_sigmoid":
        ids = _topk(logits, k)
        weights = sigmoid(np.take_along_axis(logits, ids, axis=-1))
    elif cfg.router in ("sigmoid_group", "softmax_group", "sqrtsoftplus"):
        scores = _SCORES[cfg.router](logits)
        choice = scores + (f32(score_bias) if score_bias is not None else 0)
        T, E = choice.shape
        groups = choice.reshape(T, cfg.n_group, E // cfg.n_group)
        group_scores = np.sort(groups, axis=-1)[..., -2:].sum(axis=-1)  # (T, n_group)
        keep = _topk(group_scores, cfg.topk_group)
        mask = np.zeros((T, cfg.n_group), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        masked = np.where(np.repeat(mask, E // cfg.n_group, axis=-1), choice, -np.inf)
        ids = _topk(masked, k)
        weights = np.take_along_axis(scores, ids, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        weights = weights * np.float32(cfg.routed_scaling_factor)
    elif cfg.router == "sparsemixer":
        ids, weights = _sparsemixer(logits, float(cfg.family.router_jitter), k)
    else:  # pragma: no cover - config parsing only produces the routers above
        raise ValueError(cfg.router)
    return ids.astype(np.int64), weights.astype(np.float32)


def _sparsemixer(logits: np.ndarray, jitter: float, k: int) -> tuple[np.ndarray, np.ndarray]:
    """PhiMoE's ``sparsemixer`` without training noise: logits (T, E) -> ids, weights (T, k), one expert
    at a time, each weighted by a softmax over the experts near it (transformers 5.24, eval mode)."""
    T = logits.shape[0]
    ids, weights = np.zeros((T, k), np.int64), np.zeros((T, k), np.float32)
    rows, scores = np.arange(T), logits
    for j in range(k):
        best = np.argmax(scores, axis=-1)  # (T,): torch's max, the first of equals
        top = scores[rows, best][:, None]
        far = (top - logits) / np.maximum(np.abs(logits), top) > np.float32(2 * jitter)
        ids[:, j], weights[:, j] = best, _softmax(np.where(far, -np.inf, scores))[rows, best]
        scores = scores.copy()
        scores[rows, best] = -np.inf  # the next choice is among the others
    return ids, weights
