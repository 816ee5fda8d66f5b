"""Qwen3.5-MoE's and Qwen3-Next's token mixers: gated DeltaNet linear attention and gated full attention.

Read from transformers 5.24 (``models/qwen3_5_moe/modeling_qwen3_5_moe.py``, ``models/qwen3_next``;
the two differ here only in how the DeltaNet input projections are stored, see ``_projections``).

Gated DeltaNet (``layer_types[L] == "linear_attention"``): ``in_proj_qkv(x)`` goes through a
depthwise causal convolution of width ``K`` and SiLU, then splits into q, k (``num_k_heads``) and
v (``num_v_heads``); q and k are L2-normalised (q also scaled by ``k_head_dim**-0.5``) and repeated
to the value heads.  Per value head, with ``g = A * softplus(a + dt_bias)`` (``A = -exp(A_log)``) and
``beta = sigmoid(b)``, the recurrent state ``S (dk, dv)`` follows the gated delta rule

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - k_t S));   o_t = q_t S

Prefill runs its chunked form (chunks of 64 tokens, as transformers does); decode runs the
recurrence.  The output is RMS-normalised per head, times ``silu(z)`` with ``z = in_proj_z(x)``,
then ``out_proj``.  The cache holds the last ``K - 1`` convolution inputs and ``S``.

Gated full attention (``"full_attention"``): ``q_proj`` yields a query and a gate per head; q/k
are RMS-normalised per head, the first ``head_dim * partial_rotary_factor`` dims are rotated, and
the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``.  (Qwen3.5's RMSNorms
scale by ``1 + weight``; the converter adds the 1 when it reads the checkpoint.)

Shapes: B batch, T new tokens, C conv channels (2 key dims + value dim), h value heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .attention import LayerCache, Rope, _attend, linear, rms_norm
from .config import ModelConfig
from .experts import f32, sigmoid


@dataclass
class DeltaNetState:
    """A linear-attention layer's cache: a fixed-size state, whatever the sequence length."""

    conv: np.ndarray | None = None  # (B, C, K-1) the convolution's last inputs
    state: np.ndarray | None = None  # (B, h, dk, dv) the delta rule's recurrent state
    length: int = 0  # tokens folded in so far

    def truncate(self, length: int) -> None:
        if length < self.length:
            raise ConfigError("a linear-attention (DeltaNet) state cannot be rolled back: "
                              "speculative decoding is not supported for this model")


def _silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def _l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(1e-6))


def _conv(x: np.ndarray, w: np.ndarray, cache: DeltaNetState) -> np.ndarray:
    """Depthwise causal convolution + SiLU.  x (B, T, C), w (C, K) -> (B, T, C)."""
    B, T, C = x.shape
    K = w.shape[1]
    prev = cache.conv if cache.conv is not None else np.zeros((B, C, K - 1), np.float32)
    seq = np.concatenate([prev, x.transpose(0, 2, 1)], axis=-1)  # (B, C, K-1+T)
    out = np.zeros((B, C, T), np.float32)
    for j in range(K):
        out += seq[:, :, j : j + T] * w[:, j : j + 1]
    cache.conv = np.ascontiguousarray(seq[:, :, T:])
    return _silu(out).transpose(0, 2, 1)


def _recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
               state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token by token.  q, k (B, h, T, dk), v (B, h, T, dv), g, beta (B, h, T) -> out (B, h, T, dv), state."""
    out = np.zeros_like(v)
    for t in range(q.shape[2]):
        state = state * np.exp(g[:, :, t])[..., None, None]
        mem = np.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        delta = (v[:, :, t] - mem) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = np.einsum("bhkv,bhk->bhv", state, q[:, :, t])
    return out, state


def _unit_lower_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Solve (I + strict_lower(a)) x = b by forward substitution.  a (..., n, n), b (..., n, d)."""
    x = np.empty_like(b)
    for i in range(a.shape[-1]):
        x[..., i, :] = b[..., i, :] - np.einsum("...j,...jd->...d", a[..., i, :i], x[..., :i, :])
    return x


def _chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
             state: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The chunked gated delta rule (transformers' ``torch_chunk_gated_delta_rule``); same shapes as
    ``_recurrent``.  Within a chunk, a triangular solve condenses the per-token updates into matmuls."""
    B, h, T, dk = k.shape
    pad = (size - T % size) % size
    q, k, v = (np.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (q, k, v))
    g, beta = (np.pad(a, ((0, 0), (0, 0), (0, pad))) for a in (g, beta))
    n = (T + pad) // size
    v_beta = (v * beta[..., None]).reshape(B, h, n, size, -1)
    k_beta = (k * beta[..., None]).reshape(B, h, n, size, dk)
    q, k = q.reshape(B, h, n, size, dk), k.reshape(B, h, n, size, dk)
    decay = np.cumsum(g.reshape(B, h, n, size), axis=-1)  # (B, h, n, size)
    upper = np.triu(np.ones((size, size), dtype=bool), 1)
    pair = np.exp(np.where(upper, -np.inf, decay[..., :, None] - decay[..., None, :])).astype(np.float32)
    system = np.matmul(k_beta, k.swapaxes(-1, -2)) * pair  # (B, h, n, size, size)
    intra = np.matmul(q, k.swapaxes(-1, -2)) * pair
    values = _unit_lower_solve(system, v_beta)
    k_cumdecay = _unit_lower_solve(system, k_beta * np.exp(decay)[..., None])
    q = q * np.exp(decay)[..., None]
    k = k * np.exp(decay[..., -1:] - decay)[..., None]
    chunk_decay = np.exp(decay[..., -1])[..., None, None]  # (B, h, n, 1, 1)
    out = np.zeros_like(values)
    for i in range(n):
        v_new = values[:, :, i] - np.matmul(k_cumdecay[:, :, i], state)
        out[:, :, i] = np.matmul(q[:, :, i], state) + np.matmul(intra[:, :, i], v_new)
        state = state * chunk_decay[:, :, i] + np.matmul(k[:, :, i].swapaxes(-1, -2), v_new)
    return out.reshape(B, h, n * size, -1)[:, :, :T], state


def _projections(w: dict[str, np.ndarray | None], x: np.ndarray,
                 cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x (B, T, H) -> q | k | v (B, T, C), z (B, T, h*dv), b and a (B, T, h).

    Qwen3.5 stores the four projections apart.  Qwen3-Next stores two matrices grouped per key
    head (``in_proj_qkvz``: per key head its q, k, then v and z of its value heads; ``in_proj_ba``:
    per key head b then a of its value heads); the projected activations are re-ordered here, so
    that the weights stay memory-mapped as stored."""
    dn = cfg.deltanet
    assert dn is not None
    if w.get("qkvz") is None:
        return tuple(linear(x, w[n]) for n in ("qkv", "z", "b", "a"))  # type: ignore[return-value,arg-type]
    B, T, _ = x.shape
    nk, dk, rep, dv = dn.num_k_heads, dn.k_head_dim, dn.num_v_heads // dn.num_k_heads, dn.v_head_dim
    qkvz = linear(x, w["qkvz"]).reshape(B, T, nk, 2 * dk + 2 * rep * dv)  # type: ignore[arg-type]
    ba = linear(x, w["ba"]).reshape(B, T, nk, 2 * rep)  # type: ignore[arg-type]
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
    v, z = qkvz[..., 2 * dk : 2 * dk + rep * dv], qkvz[..., 2 * dk + rep * dv :]
    qkv = np.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
    return qkv, z.reshape(B, T, -1), ba[..., :rep].reshape(B, T, -1), ba[..., rep:].reshape(B, T, -1)


def deltanet(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig, cache: DeltaNetState) -> np.ndarray:
    """Gated DeltaNet.  x (B, T, H) -> (B, T, H)."""
    dn = cfg.deltanet
    assert dn is not None
    if not isinstance(cache, DeltaNetState):
        raise ConfigError("a Qwen3.5 model needs the cache of Model.new_cache()")
    B, T, _ = x.shape
    h, dk, dv = dn.num_v_heads, dn.k_head_dim, dn.v_head_dim
    qkv, z, b, a = _projections(w, x, cfg)
    mixed = _conv(qkv, f32(w["conv"]), cache)  # type: ignore[arg-type]  # (B, T, C)
    beta = sigmoid(b)  # (B, T, h)
    g = f32(w["A"]) * _softplus(a + f32(w["dt_bias"]))  # type: ignore[arg-type]  # A = -exp(A_log)
    rep = h // dn.num_k_heads
    q = mixed[..., : dn.key_dim].reshape(B, T, dn.num_k_heads, dk)
    k = mixed[..., dn.key_dim : 2 * dn.key_dim].reshape(B, T, dn.num_k_heads, dk)
    v = mixed[..., 2 * dn.key_dim :].reshape(B, T, h, dv)
    q = np.repeat(_l2norm(q), rep, axis=2).transpose(0, 2, 1, 3) * np.float32(dk**-0.5)  # (B, h, T, dk)
    k = np.repeat(_l2norm(k), rep, axis=2).transpose(0, 2, 1, 3)
    v = v.transpose(0, 2, 1, 3)
    g, beta = g.transpose(0, 2, 1).astype(np.float32), beta.transpose(0, 2, 1)
    state = cache.state if cache.state is not None else np.zeros((B, h, dk, dv), np.float32)
    if T == 1 and cache.state is not None:
        out, state = _recurrent(q, k, v, g, beta, state)
    else:
        out, state = _chunked(q, k, v, g, beta, state, dn.chunk_size)
    cache.state, cache.length = state, cache.length + T
    out = rms_norm(out.transpose(0, 2, 1, 3), w["norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]  # (B, T, h, dv)
    out = (out * _silu(z.reshape(B, T, h, dv))).reshape(B, T, h * dv)
    return linear(out, w["out"])  # type: ignore[arg-type]


def gated_attention(
    w: dict[str, np.ndarray | None],
    x: np.ndarray,
    cfg: ModelConfig,
    rope: Rope,
    cache: LayerCache,
    positions: np.ndarray,
) -> np.ndarray:
    """Qwen3.5 full attention: per-head q/k norms, partial rotary, a sigmoid output gate."""
    B, T, _ = x.shape
    nh, nkv, hd, rd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope.dim
    qg = linear(x, w["q"], w.get("q_bias")).reshape(B, T, nh, 2 * hd)  # [query | gate] per head
    q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, nh * hd)
    q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps).transpose(0, 2, 1, 3)  # type: ignore[arg-type]  # (B, nh, T, hd)
    k = linear(x, w["k"], w.get("k_bias")).reshape(B, T, nkv, hd)
    k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    v = linear(x, w["v"], w.get("v_bias")).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
    cos, sin = rope.tables(positions)
    q = np.concatenate([rope.apply(q[..., :rd], cos, sin), q[..., rd:]], axis=-1)
    k = np.concatenate([rope.apply(k[..., :rd], cos, sin), k[..., rd:]], axis=-1)
    past = cache.length
    keys, values = cache.append(k, v)
    out = _attend(q, keys, values, past, cfg.scale, None, None) * sigmoid(gate)
    return linear(out, w["o"], w.get("o_bias"))  # type: ignore[arg-type]
