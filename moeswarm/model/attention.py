"""Attention with a KV cache: grouped-query attention (with optional q/k norms, biases, sinks and
sliding windows) and DeepSeek's multi-head latent attention.  float32 throughout.

Shapes: B batch, T new tokens, P cached tokens, S = P + T, nh query heads, nkv key/value heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig
from .experts import f32, mm


# transformers builds MLA's latent norms (q_a_layernorm, kv_a_layernorm) with RMSNorm's default eps
# in every family that uses them (DeepSeek-V3/V3.2, GLM-5, GLM-4.7-Flash), whatever rms_norm_eps says
MLA_LATENT_EPS = 1e-6


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    var = np.square(x).sum(axis=-1, keepdims=True) / x.shape[-1]  # np.mean's arithmetic, without its Python layer
    return (x / np.sqrt(var + np.float32(eps))) * f32(w)


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    y = mm(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], -1)
    if b is not None:
        y += f32(b)
    return y


class Rope:
    """cos/sin tables for positions, grown on demand."""

    def __init__(self, cfg: ModelConfig, alpha: np.ndarray | None = None) -> None:
        self.inv_freq, self.scale = cfg.rope.inv_freq()  # (dim/2,)
        if alpha is not None:  # LeRoPE (Mistral Large 4): each inverse frequency times exp(a learned alpha)
            self.inv_freq = (self.inv_freq * np.exp(f32(alpha))).astype(np.float32)
        self.interleaved = cfg.rope.interleaved
        # PhiMoE's longrope: a pass whose last position reaches past ``original`` scales by long_mscale
        self.long_scale, self.original = cfg.rope.long_mscale, cfg.rope.original_max_position
        self._last: tuple[bytes, tuple[np.ndarray, np.ndarray]] | None = None  # every layer of a pass asks for the same

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions (T,) -> cos, sin (T, dim/2), already multiplied by the attention factor (read-only: the
        last positions' tables are kept for the next layer of the same pass)."""
        key = positions.dtype.str.encode() + positions.tobytes()
        last = self._last  # read once: another thread's pass may replace it meanwhile
        if last is None or last[0] != key:
            last = self._last = key, self._compute(positions)
        return last[1]

    def _compute(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        scale = self.scale
        if self.long_scale and len(positions) and int(positions.max()) + 1 > self.original:
            scale = self.long_scale
        cos, sin = (np.cos(freqs) * np.float32(scale)).astype(np.float32), (
            np.sin(freqs) * np.float32(scale)
        ).astype(np.float32)
        cos.setflags(write=False)
        sin.setflags(write=False)
        return cos, sin

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x (B, heads, T, dim).  Halves layout rotates (x[:d/2], x[d/2:]); DeepSeek's interleaved
        layout rotates (x[0::2], x[1::2]) and returns the halves layout, like transformers does."""
        rotated = 2 * cos.shape[-1]
        if rotated < x.shape[-1]:  # partial rotary (MiniMax): the first channels turn, the rest pass
            return np.concatenate([self.apply(x[..., :rotated], cos, sin), x[..., rotated:]], axis=-1)
        if self.interleaved:
            a, b = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


@dataclass
class LayerCache:
    """Keys and values of the tokens seen so far, with amortised growth along the sequence axis."""

    k: np.ndarray | None = None  # (B, nkv, capacity, Dk)
    v: np.ndarray | None = None  # (B, nkv, capacity, Dv)
    length: int = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        B, h, T, _ = k.shape
        need = self.length + T
        if self.k is None or need > self.k.shape[2]:
            cap = max(need, 2 * (self.k.shape[2] if self.k is not None else 0), 16)
            nk = np.zeros((B, h, cap, k.shape[-1]), np.float32)
            nv = np.zeros((B, h, cap, v.shape[-1]), np.float32)
            if self.k is not None:
                nk[:, :, : self.length] = self.k[:, :, : self.length]
                nv[:, :, : self.length] = self.v[:, :, : self.length]  # type: ignore[index]
            self.k, self.v = nk, nv
        self.k[:, :, self.length : need] = k
        self.v[:, :, self.length : need] = v  # type: ignore[index]
        self.length = need
        return self.k[:, :, :need], self.v[:, :, :need]  # type: ignore[index]

    def truncate(self, length: int) -> None:
        """Forget everything after ``length`` tokens (speculative decoding rolls back this way)."""
        self.length = min(self.length, length)


@dataclass
class KVCache:
    layers: list[LayerCache] = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int) -> "KVCache":
        return cls([LayerCache() for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)


def _attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    past: int,
    scale: float,
    window: int | None,
    sinks: np.ndarray | None,
    keep: np.ndarray | None = None,
) -> np.ndarray:
    """q (B, nh, T, D), k (B, nkv, S, D), v (B, nkv, S, Dv) -> (B, T, nh * Dv).
    ``keep`` (B, T, S) bool, if given, further restricts which keys each query sees (sparse attention)."""
    B, nh, T, D = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nh // nkv
    qg = q.reshape(B, nkv, g, T, D)
    scores = np.matmul(qg, k[:, :, None].swapaxes(-1, -2)) * np.float32(scale)  # (B, nkv, g, T, S)
    if T > 1 or past + 1 != S or (window is not None and window < S) or keep is not None:  # else: sees every key
        qpos = past + np.arange(T)[:, None]
        kpos = np.arange(S)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        if keep is not None:
            allowed = allowed & keep[:, None, None]  # (B, 1, 1, T, S)
        scores = np.where(allowed, scores, np.float32(-np.inf))
    if sinks is not None:
        sink = np.broadcast_to(f32(sinks).reshape(1, nkv, g, 1, 1), (B, nkv, g, T, 1))
        scores = np.concatenate([scores, sink], axis=-1)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    if sinks is not None:
        probs = probs[..., :-1]
    out = np.matmul(probs, v[:, :, None])  # (B, nkv, g, T, Dv)
    return out.reshape(B, nh, T, -1).transpose(0, 2, 1, 3).reshape(B, T, -1)


def gqa(
    w: dict[str, np.ndarray | None],
    x: np.ndarray,
    cfg: ModelConfig,
    rope: Rope,
    cache: LayerCache,
    positions: np.ndarray,
    window: int | None,
) -> np.ndarray:
    """Grouped-query attention.  x (B, T, H) -> (B, T, H).  ``w`` holds this layer's attn.* tensors."""
    out = gqa_attend(w, *gqa_qkv(w, x, cfg), cfg, rope, cache, positions, window)
    return linear(out, w["o"], w.get("o_bias"))  # type: ignore[arg-type]


def gqa_qkv(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The row-wise half of ``gqa``: x (B, T, H) -> q (B, T, nh*hd), k, v (B, T, nkv*hd)
    (a batch of sequences projects all its rows at once: ``moeswarm.model.batch``).  ``w["qkv"]``, where the
    model fused them (``_fused``), computes the three (biases included) in one kernel call."""
    fused = w.get("qkv")
    if fused is not None:
        y = fused.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)  # type: ignore[union-attr]
        nq, nk, _ = fused.widths  # type: ignore[union-attr]
        q, k, v = y[..., :nq], y[..., nq : nq + nk], y[..., nq + nk :]
    else:
        q = linear(x, w["q"], w.get("q_bias"))  # type: ignore[arg-type]
        k = linear(x, w["k"], w.get("k_bias"))  # type: ignore[arg-type]
        v = linear(x, w["v"], w.get("v_bias"))  # type: ignore[arg-type]
    if cfg.clip_qkv is not None:
        q, k, v = (np.clip(t, -cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    if cfg.qk_norm == "full":  # OLMoE: over the whole projection
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]
    return q, k, v


def gqa_attend(
    w: dict[str, np.ndarray | None],
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cfg: ModelConfig,
    rope: Rope,
    cache: LayerCache,
    positions: np.ndarray,
    window: int | None,
) -> np.ndarray:
    """The per-sequence half of ``gqa``: heads, rope, cache, attention -> (B, T, nh*hd), before ``o``."""
    B, T, _ = q.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = q.reshape(B, T, nh, hd).transpose(0, 2, 1, 3)  # (B, nh, T, hd)
    k = k.reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
    v = v.reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
    if cfg.qk_norm == "head":  # Qwen3: per head
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]
    cos, sin = rope.tables(positions)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    if cfg.qk_norm == "head_after_rope":  # Hunyuan: per head, on the rotated q and k
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]
    past = cache.length
    keys, values = cache.append(k, v)
    return _attend(q, keys, values, past, cfg.scale, window, w.get("sinks"))


def mla_qkv(
    w: dict[str, np.ndarray | None],
    x: np.ndarray,
    cfg: ModelConfig,
    rope: Rope,
    cache: LayerCache,
    positions: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray | None]:
    """MLA projections with the cache appended: query (B, nh, T, nope+rd), keys (B, nh, S, nope+rd),
    values (B, nh, S, vd), the cached length before this step, and the query latent
    ``q_a_norm(q_a(x))`` (B, T, q_lora_rank) (None without q_lora_rank; the DSA indexer reads it)."""
    B, T, _ = x.shape
    nh, nope, rd, vd = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q_resid = None
    if cfg.q_lora_rank:
        q_resid = rms_norm(linear(x, w["q_a"]), w["q_a_norm"], MLA_LATENT_EPS)  # type: ignore[arg-type]
        q = linear(q_resid, w["q_b"])  # type: ignore[arg-type]
    else:
        q = linear(x, w["q"])  # type: ignore[arg-type]
    q = q.reshape(B, T, nh, nope + rd).transpose(0, 2, 1, 3)  # (B, nh, T, nope+rd)
    kv = linear(x, w["kv_a"])  # type: ignore[arg-type]  # (B, T, kv_lora + rd)
    latent, k_rot = kv[..., : cfg.kv_lora_rank], kv[..., cfg.kv_lora_rank :]
    latent = rms_norm(latent, w["kv_a_norm"], MLA_LATENT_EPS)  # type: ignore[arg-type]
    if cfg.mla_lora_scale is not None:  # LongCat-Flash
        q, latent = q * np.float32(cfg.mla_lora_scale[0]), latent * np.float32(cfg.mla_lora_scale[1])
    q_pass, q_rot = q[..., :nope], q[..., nope:]
    k_rot = k_rot.reshape(B, 1, T, rd)
    cos, sin = rope.tables(positions)
    q_rot, k_rot = rope.apply(q_rot, cos, sin), rope.apply(k_rot, cos, sin)
    kv_full = linear(latent, w["kv_b"]).reshape(B, T, nh, nope + vd).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    k_nope, value = kv_full[..., :nope], kv_full[..., nope:]
    key = np.concatenate([k_nope, np.broadcast_to(k_rot, (B, nh, T, rd))], axis=-1)
    query = np.concatenate([q_pass, q_rot], axis=-1)
    if cfg.q_position_scale is not None:  # Mistral 4
        beta, length = cfg.q_position_scale
        scale = 1 + np.float32(beta) * np.log(1 + np.floor(positions.astype(np.float32) / np.float32(length)))
        query = query * scale.astype(np.float32)[None, None, :, None]
    past = cache.length
    keys, values = cache.append(key, value)
    return query, keys, values, past, q_resid


def mla(
    w: dict[str, np.ndarray | None],
    x: np.ndarray,
    cfg: ModelConfig,
    rope: Rope,
    cache: LayerCache,
    positions: np.ndarray,
) -> np.ndarray:
    """DeepSeek multi-head latent attention.  The cache keeps expanded per-head keys and values."""
    query, keys, values, past, _ = mla_qkv(w, x, cfg, rope, cache, positions)
    out = _attend(query, keys, values, past, cfg.scale, None, None)
    return linear(out, w["o"])  # type: ignore[arg-type]
