"""DeepSeek-V4's attention (``ModelConfig.attention == "deepseek_v4"``), read from transformers 5.24's
``DeepseekV4Attention`` and its compressors (settings: ``_config_dsv4.Dsv4Settings``).

Every layer: q = unit-RMS(q_b(q_a_norm(q_a(x)))) per head; one K=V head kv = kv_norm(kv(x)); RoPE
turns the trailing ``rope_dim`` channels in interleaved pairs (sliding layers: ``main_rope``, CSA / HCA
layers: ``compress_rope``).  Keys are the last ``sliding_window`` tokens (a query's own included)
plus, on CSA / HCA layers, the compressed entries; per-head sinks join the softmax; the output's
rope channels are turned back by the query's own angle; then the grouped output LoRA
(``o_a`` per group of heads, ``o_b`` over all groups).

A compressor (``_compress``) pools every ``rate`` tokens into one entry: per channel, a softmax over
the window's gates (``c_gate(x) + c_bias``) weights ``c_kv(x)``; then ``c_norm`` and RoPE at the
entry's first position.  CSA's windows reach back into the previous window (its projections are two
series, 2 * head_dim wide: the first half feeds the next window); HCA's do not.  A query at position
p sees entry e when its window is complete (e < (p + 1) // rate); on CSA layers only the
``index_topk`` entries its lightning indexer scores best (a second, smaller compressor, scored by
``sum_h w_h(x) * relu(q_h . k)``).  The cache keeps the window's keys and, per compressor, the
tokens of the unfinished window, the previous window's first series and the entries so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from ._config_dsv4 import Dsv4Settings
from .attention import Rope, linear, rms_norm
from .config import ModelConfig, RopeConfig
from .experts import f32
from .transformer import ATTENTION_KINDS, LAYER_CACHES
from .weights import ATTENTION_SHAPES, Shapes

# how many of its last tokens a layer's cache can forget: a rejected draft (``--speculative`` is at most 32)
ROLLBACK = 32


@dataclass
class _Series:
    """One compressor's state across forward passes (transformers' ``DeepseekV4HCACache`` entries).
    The projections of the last ``2 * rate + ROLLBACK`` tokens (``recent_*``) are kept beside it: the
    state after any of those tokens is a slice of them and of the entries (``truncate``)."""

    buffer_kv: np.ndarray | None = None  # (B, < rate, width): projections of an unfinished window
    buffer_gate: np.ndarray | None = None
    overlap_kv: np.ndarray | None = None  # (B, rate, D): CSA's first series of the last full window
    overlap_gate: np.ndarray | None = None  # (gate + position bias)
    entries: np.ndarray | None = None  # (B, C, D): compressed, normed, rotated
    recent_kv: np.ndarray | None = None  # (B, R, width): projections of the last R tokens
    recent_gate: np.ndarray | None = None
    bias: np.ndarray | None = None  # (rate, width) the position bias (its rows: the rate)
    two_series: bool = False  # CSA's: width 2 * D, the first series reaching into the next window

    @property
    def count(self) -> int:
        return 0 if self.entries is None else self.entries.shape[1]

    def remember(self, kv: np.ndarray, gate: np.ndarray, bias: np.ndarray, two_series: bool) -> None:
        """Keep this pass's projections (B, T, width) among the recent ones."""
        keep = 2 * bias.shape[0] + ROLLBACK
        if self.recent_kv is not None:
            kv, gate = np.concatenate([self.recent_kv, kv], axis=1), np.concatenate([self.recent_gate, gate], axis=1)  # type: ignore[list-item]
        self.recent_kv, self.recent_gate, self.bias, self.two_series = kv[:, -keep:], gate[:, -keep:], bias, two_series

    def truncate(self, old: int, new: int) -> bool:
        """From ``old`` tokens back to ``new``: False when the recent projections do not reach."""
        if self.recent_kv is None or self.bias is None:
            return True  # never written (a sliding layer's)
        rate, csa = self.bias.shape[0], self.two_series
        start = old - self.recent_kv.shape[1]  # the position of recent[:, 0]
        c = new // rate
        first = (c - 1) * rate if csa and c else c * rate  # the earliest token the state at ``new`` holds
        if first < start:
            return False
        self.entries = None if self.entries is None else self.entries[:, :c]
        self.buffer_kv, self.buffer_gate = self.recent_kv[:, c * rate - start : new - start], self.recent_gate[:, c * rate - start : new - start]  # type: ignore[index]
        if csa:
            D = self.bias.shape[1] // 2
            window = slice((c - 1) * rate - start, c * rate - start)
            self.overlap_kv = self.recent_kv[:, window, :D].copy() if c else None
            self.overlap_gate = (self.recent_gate[:, window, :D] + f32(self.bias)[:, :D]) if c else None  # type: ignore[index]
        self.recent_kv, self.recent_gate = self.recent_kv[:, : new - start], self.recent_gate[:, : new - start]  # type: ignore[index]
        return True


@dataclass
class Dsv4LayerCache:
    """One layer's state: the last ``sliding_window - 1 + ROLLBACK`` keys and the compressors' series."""

    length: int = 0
    window: np.ndarray | None = None  # (B, <= sliding_window - 1 + ROLLBACK, head_dim) rotated K=V
    kv: _Series = field(default_factory=_Series)
    index: _Series = field(default_factory=_Series)
    sliding_window: int = 0  # set by the first pass

    def truncate(self, length: int) -> None:
        """Forget everything after ``length`` tokens: exact for up to ``ROLLBACK`` of the last tokens."""
        if length >= self.length:
            return
        start = self.length - (0 if self.window is None else self.window.shape[1])
        reach = start == 0 or length - (self.sliding_window - 1) >= start
        if not (reach and self.kv.truncate(self.length, length) and self.index.truncate(self.length, length)):
            raise ConfigError(f"DeepSeek-V4's cache can forget its last {ROLLBACK} tokens, not "
                              f"{self.length - length}")
        if self.window is not None:
            self.window = self.window[:, : length - start]
        self.length = length


def _tables(rope: RopeConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (T, rope_dim / 2), as ``DeepseekV4RotaryEmbedding`` computes them."""
    inv, scale = rope.inv_freq()
    freqs = positions.astype(np.float32)[:, None] * inv[None, :]
    return (np.cos(freqs) * np.float32(scale)).astype(np.float32), (np.sin(freqs) * np.float32(scale)).astype(np.float32)


def rope_tail(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Turn the trailing 2 * cos.shape[-1] channels of x (..., T, D) in interleaved pairs, in place
    (the layout stays interleaved, unlike ``Rope.apply``)."""
    rd = 2 * cos.shape[-1]
    a, b = x[..., -rd:][..., 0::2], x[..., -rd:][..., 1::2]
    out = x.copy()
    out[..., x.shape[-1] - rd :: 2] = a * cos - b * sin
    out[..., x.shape[-1] - rd + 1 :: 2] = b * cos + a * sin
    return out


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _compress(state: _Series, x: np.ndarray, w: dict[str, np.ndarray | None], prefix: str, rate: int, dim: int,
              overlap: bool | None, cfg: ModelConfig, rope: RopeConfig) -> np.ndarray:
    """x (B, T, H) -> every entry so far (B, C, dim).  ``overlap``: None for HCA (one series), else
    whether CSA's first series reaches into the next window (False only as a negative control)."""
    kv, gate = linear(x, w[prefix + "kv"]), linear(x, w[prefix + "gate"])  # type: ignore[arg-type]  # (B, T, width)
    state.remember(kv, gate, w[prefix + "bias"], overlap is not None)  # type: ignore[arg-type]
    if state.buffer_kv is not None:
        kv, gate = np.concatenate([state.buffer_kv, kv], axis=1), np.concatenate([state.buffer_gate, gate], axis=1)  # type: ignore[list-item]
    usable = kv.shape[1] // rate * rate
    state.buffer_kv, state.buffer_gate = kv[:, usable:], gate[:, usable:]
    if not usable:
        return state.entries if state.entries is not None else np.zeros((x.shape[0], 0, dim), np.float32)
    B, n = kv.shape[0], usable // rate
    ck = kv[:, :usable].reshape(B, n, rate, -1)
    cg = gate[:, :usable].reshape(B, n, rate, -1) + f32(w[prefix + "bias"])  # type: ignore[arg-type]
    if overlap is not None:  # CSA: window w pools the first series of w - 1 and the second of w
        slots_kv = np.zeros((B, n, 2 * rate, dim), np.float32)
        slots_gate = np.full((B, n, 2 * rate, dim), -np.inf, np.float32)
        slots_kv[:, :, rate:], slots_gate[:, :, rate:] = ck[..., dim:], cg[..., dim:]
        if overlap:
            slots_kv[:, 1:, :rate], slots_gate[:, 1:, :rate] = ck[:, :-1, :, :dim], cg[:, :-1, :, :dim]
            if state.overlap_kv is not None:
                slots_kv[:, 0, :rate], slots_gate[:, 0, :rate] = state.overlap_kv, state.overlap_gate
        state.overlap_kv, state.overlap_gate = ck[:, -1, :, :dim].copy(), cg[:, -1, :, :dim].copy()
        ck, cg = slots_kv, slots_gate
    pooled = (ck * _softmax(cg, axis=2)).sum(axis=2)  # (B, n, dim)
    pooled = rms_norm(pooled, w[prefix + "norm"], cfg.rms_norm_eps)  # type: ignore[arg-type]
    cos, sin = _tables(rope, np.arange(state.count, state.count + n) * rate)
    pooled = rope_tail(pooled, cos, sin).astype(np.float32)
    state.entries = pooled if state.entries is None else np.concatenate([state.entries, pooled], axis=1)
    return state.entries


def _indexed(w: dict[str, np.ndarray | None], x: np.ndarray, q_res: np.ndarray, keys: np.ndarray,
             positions: np.ndarray, visible: np.ndarray, s: Dsv4Settings) -> np.ndarray:
    """The lightning indexer: which of the visible entries (T, C) each query keeps -> (B, T, C) bool."""
    B, T, _ = x.shape
    nh, D = s.index_heads, s.index_head_dim
    q = linear(q_res, w["i_q_b"]).reshape(B, T, nh, D).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    q = rope_tail(q, *_tables(s.compress_rope, positions))  # (B, nh, T, D)
    scores = np.maximum(np.einsum("bhtd,bcd->bthc", q, keys), 0) * np.float32(D**-0.5)  # (B, T, nh, C)
    weights = linear(x, w["i_w"]) * np.float32(nh**-0.5)  # type: ignore[arg-type]  # (B, T, nh)
    score = np.where(visible[None], (scores * weights[..., None]).sum(axis=2), -np.inf)  # (B, T, C)
    k = min(s.index_topk, keys.shape[1])
    best = np.argsort(-score, axis=-1, kind="stable")[..., :k]
    keep = np.zeros(score.shape, bool)
    np.put_along_axis(keep, best, True, axis=-1)
    return keep & visible[None]


def dsv4_attention(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig, rope: Rope,
                   cache: Dsv4LayerCache, positions: np.ndarray, layer: int,
                   step: dict[str, Any] | None = None) -> np.ndarray:
    """x (B, T, H) -> (B, T, H)."""
    s: Dsv4Settings = cfg.family
    kind = s.layer_kinds[layer]
    B, T, _ = x.shape
    nh, hd, eps, window = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps, s.sliding_window
    cos, sin = _tables(s.main_rope if kind == "sliding" else s.compress_rope, positions)
    q_res = rms_norm(linear(x, w["q_a"]), w["q_a_norm"], eps)  # type: ignore[arg-type]  # (B, T, q_lora)
    q = linear(q_res, w["q_b"]).reshape(B, T, nh, hd).transpose(0, 2, 1, 3)  # type: ignore[arg-type]
    q = rope_tail(q / np.sqrt(np.mean(np.square(q), axis=-1, keepdims=True) + np.float32(eps)), cos, sin)
    kv = rope_tail(rms_norm(linear(x, w["kv"]), w["kv_norm"], eps), cos, sin)  # type: ignore[arg-type]  # (B, T, hd)
    past = cache.length
    keys = kv if cache.window is None else np.concatenate([cache.window, kv], axis=1)
    # the keys' positions: an MTP layer's cache holds slot j at index j, position j + 1 (model/_mtp_run.py)
    kpos = np.arange(past + T - keys.shape[1], past + T) + (int(positions[0]) - past)
    allowed = (kpos[None, :] <= positions[:, None]) & (kpos[None, :] > positions[:, None] - window)  # (T, S)
    allowed = np.broadcast_to(allowed, (B, T, keys.shape[1]))
    keep = min(window - 1 + ROLLBACK, keys.shape[1])  # the window, and the keys a rollback needs back
    cache.window, cache.length, cache.sliding_window = keys[:, keys.shape[1] - keep :], past + T, window
    if kind != "sliding" and s.compressed:
        rate = s.csa_rate if kind == "csa" else s.hca_rate
        entries = _compress(cache.kv, x, w, "c_", rate, hd, s.overlap if kind == "csa" else None, cfg, s.compress_rope)
        visible = np.arange(entries.shape[1])[None, :] < ((positions + 1) // rate)[:, None]  # (T, C)
        sees = np.broadcast_to(visible, (B, *visible.shape))
        if kind == "csa":
            index_keys = _compress(cache.index, x, w, "i_", rate, s.index_head_dim, s.overlap, cfg, s.compress_rope)
            if s.indexer:
                sees = _indexed(w, x, q_res, index_keys, positions, visible, s)
        keys = np.concatenate([keys, entries], axis=1)
        allowed = np.concatenate([allowed, sees], axis=-1)
    scores = np.einsum("bhtd,bsd->bhts", q, keys) * np.float32(hd**-0.5)  # (B, nh, T, S)
    scores = np.where(allowed[:, None], scores, np.float32(-np.inf))
    if s.sinks:
        sink = np.broadcast_to(f32(w["sinks"]).reshape(1, nh, 1, 1), (B, nh, T, 1))  # type: ignore[arg-type]
        scores = np.concatenate([scores, sink], axis=-1)
    probs = _softmax(scores, axis=-1)[..., : keys.shape[1]]
    out = rope_tail(np.einsum("bhts,bsd->bhtd", probs, keys), cos, -sin)  # the values' rope turned back
    out = out.transpose(0, 2, 1, 3)  # (B, T, nh, hd)
    g = s.o_groups
    if s.grouped_output:
        grouped = out.reshape(B, T, g, -1)
    else:
        grouped = out.reshape(B, T, nh // g, g, hd).transpose(0, 1, 3, 2, 4).reshape(B, T, g, -1)
    o_a = f32(w["o_a"]).reshape(g, s.o_lora_rank, -1)  # type: ignore[arg-type]  # (g, r, nh * hd / g)
    low = np.einsum("btgi,gri->btgr", grouped, o_a).reshape(B, T, -1)
    return linear(low, w["o_b"])  # type: ignore[arg-type]


def attention_shapes(cfg: ModelConfig, L: int) -> Shapes:
    s: Dsv4Settings = cfg.family
    H, nh, hd, qr, p = cfg.hidden_size, cfg.num_heads, cfg.head_dim, int(cfg.q_lora_rank or 0), f"{L}.attn."
    g, r = s.o_groups, s.o_lora_rank
    shapes = {p + "q_a": (qr, H), p + "q_a_norm": (qr,), p + "q_b": (nh * hd, qr), p + "kv": (hd, H),
              p + "kv_norm": (hd,), p + "o_a": (g * r, nh * hd // g), p + "o_b": (H, g * r), p + "sinks": (nh,)}
    kind = s.layer_kinds[L] if L < len(s.layer_kinds) else "sliding"
    if kind == "sliding":
        return shapes
    rate, width = (s.csa_rate, 2 * hd) if kind == "csa" else (s.hca_rate, hd)
    shapes.update({p + "c_kv": (width, H), p + "c_gate": (width, H), p + "c_bias": (rate, width), p + "c_norm": (hd,)})
    if kind == "csa":
        D, nhi = s.index_head_dim, s.index_heads
        shapes.update({p + "i_kv": (2 * D, H), p + "i_gate": (2 * D, H), p + "i_bias": (rate, 2 * D),
                       p + "i_norm": (D,), p + "i_q_b": (nhi * D, qr), p + "i_w": (nhi, H)})
    return shapes


ATTENTION_KINDS["deepseek_v4"] = dsv4_attention  # type: ignore[assignment]
LAYER_CACHES["deepseek_v4"] = lambda cfg, L: Dsv4LayerCache()
ATTENTION_SHAPES["deepseek_v4"] = attention_shapes
