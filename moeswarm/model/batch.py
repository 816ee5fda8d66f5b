"""Many sequences in one forward pass, each with its own cache in fixed-size blocks of one pool.

``forward_batch`` flattens every sequence's new tokens into one ``(N, H)`` array: norms,
routers, the routed experts (one ``ExpertExecutor.submit`` per MoE layer carrying every
sequence's rows, so one request per holder per layer) and the LM head see the whole batch;
attention runs per sequence over its own cache.  A sequence's logits are those it gets alone
(up to float rounding of the batched matmuls), whatever else is in the batch.

``CachePool`` is the cache memory of every sequence, sized in bytes.  A KV-attention layer keeps
``block_tokens`` tokens of keys and values per block; a sequence's block table is shared by its
layers, so a block id covers one span of tokens in every layer.  A sequence holds blocks as it
grows (``grow``) and gives them all back when it ends (``release``); nothing is copied when
others join or leave.  Resident memory never exceeds the pool: its arrays are mapped once,
untouched pages lazily.

Other attention kinds plug in through ``LayerSpec``: a layer with a fixed-size per-sequence state
(a recurrent DeltaNet state, a sparse-attention index) declares ``state_bytes`` and a ``make``
that builds its per-sequence cache object; the pool charges that state in whole blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from ._attn_deltanet import DeltaNetState
from ._attn_dsa import DsaLayerCache
from ._attn_lightning import new_layer_cache
from .attention import LayerCache, gqa_attend, gqa_qkv, linear, mla
from .config import ModelConfig
from .experts import f32, mm
from .transformer import DECODER_LAYERS, LAYER_CACHES, Model, block_norm, residual, scaled_logits


@dataclass(frozen=True)
class LayerSpec:
    """What one layer keeps per sequence.  ``kv``: (heads, key dim, value dim) of a paged KV
    cache, or None; ``state_bytes`` and ``make`` for other kinds (see the module docstring)."""

    kv: tuple[int, int, int] | None
    state_bytes: int = 0
    make: Callable[["SequenceCache", int], Any] | None = None  # (sequence, layer) -> the layer's cache


def paged(cfg: ModelConfig) -> bool:
    """Whether this model's attention runs batched over paged KV blocks (GQA, MLA); the other kinds
    (DSA, Qwen3.5's DeltaNet, MiniMax M3's lightning-indexer layers) keep their own per-layer
    caches and step one sequence at a time inside the batch (``forward_batch``)."""
    return cfg.attention in ("gqa", "mla") and not any(cfg.sparse_layers)


def native_layer_cache(cfg: ModelConfig, layer: int) -> Any:
    """The cache ``Model.new_cache`` gives layer ``layer`` of a model that is not ``paged``."""
    if cfg.attention in LAYER_CACHES:
        return LAYER_CACHES[cfg.attention](cfg, layer)
    if cfg.dsa is not None:
        return DsaLayerCache()
    if cfg.deltanet is not None:
        return DeltaNetState() if cfg.deltanet.layers[layer] else LayerCache()
    if cfg.arch in DECODER_LAYERS:
        return DECODER_LAYERS[cfg.arch].new_cache(cfg, layer)
    return new_layer_cache(cfg, layer)


NATIVE_SEQUENCE_BYTES = 1 << 20  # what the pool books per sequence of a model that is not paged (see layer_specs)


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """Per-layer cache shapes.  GQA and MLA layers page their keys and values in the pool's blocks;
    a model that is not ``paged`` books a fixed share of the pool per sequence
    (``NATIVE_SEQUENCE_BYTES``, so the pool bounds how many run at once, not their bytes) and
    keeps its layers' own caches."""
    if not paged(cfg):
        share = max(1, NATIVE_SEQUENCE_BYTES // max(cfg.num_layers, 1))
        return [LayerSpec(None, share, lambda seq, L: native_layer_cache(cfg, L)) for _ in range(cfg.num_layers)]
    if cfg.attention == "mla":
        kv = (cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
    else:
        kv = (cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    return [LayerSpec(kv) for _ in range(cfg.num_layers)]


class CachePool:
    """Every sequence's cache, in ``block_tokens``-token blocks from one budget of ``budget_bytes``."""

    def __init__(self, specs: Sequence[LayerSpec], budget_bytes: int, block_tokens: int = 16) -> None:
        if block_tokens < 1:
            raise ConfigError("block_tokens must be >= 1")
        self.specs, self.block_tokens = list(specs), block_tokens
        self.block_bytes = sum(block_tokens * h * (dk + dv) * 4 for h, dk, dv in (s.kv for s in specs if s.kv))
        state = sum(s.state_bytes for s in specs)
        self.state_blocks = math.ceil(state / self.block_bytes) if state and self.block_bytes else (1 if state else 0)
        unit = self.block_bytes or state or 1
        self.num_blocks = budget_bytes // unit
        if self.num_blocks < 1:
            raise ConfigError(f"--kv-cache {budget_bytes} bytes holds no block (one block is {unit} bytes)")
        # np.zeros maps untouched pages lazily: resident memory grows with the blocks used, up to the pool
        self.k = [np.zeros((self.num_blocks, s.kv[0], block_tokens, s.kv[1]), np.float32) if s.kv else None
                  for s in specs]
        self.v = [np.zeros((self.num_blocks, s.kv[0], block_tokens, s.kv[2]), np.float32) if s.kv else None
                  for s in specs]
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return self.num_blocks * (self.block_bytes or 1)

    @property
    def free(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` tokens holds (its fixed-size state included)."""
        return (math.ceil(tokens / self.block_tokens) if self.block_bytes else 0) + self.state_blocks

    def admit(self, tokens: int, headroom: int = 0) -> "SequenceCache | None":
        """A cache holding room for ``tokens`` tokens, or None unless ``headroom`` blocks stay free after."""
        need = self.blocks_for(tokens)
        if need > self.num_blocks:
            raise ConfigError(f"a sequence of {tokens} tokens needs {need} cache blocks; the pool has "
                              f"{self.num_blocks} ({self.nbytes} bytes): raise --kv-cache")
        if need + headroom > self.free:
            return None
        seq = SequenceCache(self)
        seq.grow(tokens)
        return seq


class SequenceCache:
    """One sequence's cache: a block table shared by its layers (``KVCache``'s interface)."""

    def __init__(self, pool: CachePool) -> None:
        self.pool = pool
        self.blocks: list[int] = [pool._free.pop() for _ in range(pool.state_blocks)]
        self._state = len(self.blocks)
        self.layers = [PagedLayerCache(self, L) if s.kv else s.make(self, L)  # type: ignore[misc]
                       for L, s in enumerate(pool.specs)]
        self.released = False

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def capacity(self) -> int:
        """Tokens the blocks held now can take."""
        return (len(self.blocks) - self._state) * self.pool.block_tokens if self.pool.block_bytes else 1 << 62

    def grow(self, tokens: int) -> bool:
        """Hold blocks for ``tokens`` tokens; False (holding what it had) when the pool has too few free."""
        bs = self.pool.block_tokens
        more = math.ceil(tokens / bs) - (len(self.blocks) - self._state) if self.pool.block_bytes else 0
        if more > self.pool.free:
            return False
        self.blocks.extend(self.pool._free.pop() for _ in range(max(0, more)))
        return True

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

    def table(self, tokens: int) -> np.ndarray:
        """Block ids holding the first ``tokens`` tokens (``grow`` first)."""
        if tokens > self.capacity:
            raise ConfigError(f"the sequence holds cache for {self.capacity} tokens, not {tokens}")
        bs = self.pool.block_tokens
        return np.asarray(self.blocks[self._state : self._state + math.ceil(tokens / bs)], np.int64)

    def release(self) -> None:
        """Give every block back to the pool (once)."""
        if not self.released:
            self.released = True
            self.pool._free.extend(reversed(self.blocks))
            self.blocks = []


@dataclass
class PagedLayerCache:
    """One layer's keys and values of one sequence, in the pool's blocks (``LayerCache``'s interface)."""

    seq: SequenceCache
    layer: int
    length: int = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """k (1, h, T, Dk), v (1, h, T, Dv) -> every key and value so far, (1, h, S, D)."""
        if k.shape[0] != 1:
            raise ConfigError("a paged cache holds one sequence: batch size 1")
        need = self.length + k.shape[2]
        pool, bs = self.seq.pool, self.seq.pool.block_tokens
        table = self.seq.table(need)
        pos = np.arange(self.length, need)
        pk, pv = pool.k[self.layer], pool.v[self.layer]
        assert pk is not None and pv is not None
        pk[table[pos // bs], :, pos % bs] = k[0].transpose(1, 0, 2)  # (T, h, Dk)
        pv[table[pos // bs], :, pos % bs] = v[0].transpose(1, 0, 2)
        self.length = need
        keys = pk[table].transpose(1, 0, 2, 3).reshape(pk.shape[1], -1, pk.shape[3])[:, :need]
        values = pv[table].transpose(1, 0, 2, 3).reshape(pv.shape[1], -1, pv.shape[3])[:, :need]
        return keys[None], values[None]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


@dataclass
class Step:
    """One sequence's share of a batched forward pass."""

    cache: Any  # SequenceCache (or a KVCache with batch 1)
    ids: Sequence[int]  # new tokens, fed after what the cache holds
    all_logits: bool = False  # logits at every new position (speculative verification), else the last only
    want_hidden: bool = False  # also the final-normed hidden states of every new position (MTP drafts)
    logits: np.ndarray | None = field(default=None, repr=False)  # (T or 1, V), set by forward_batch
    hidden: np.ndarray | None = field(default=None, repr=False)  # (T, H) (V4: (T, n, H)), set if want_hidden


def forward_batch(model: Model, steps: Sequence[Step]) -> None:
    """Advance every step's sequence by its ``ids`` in one pass; sets each ``step.logits``."""
    cfg, w = model.config, model.weights
    lens = [len(s.ids) for s in steps]
    if not steps or min(lens) < 1:
        raise ConfigError("every sequence in a batch needs at least one new token")
    if not paged(cfg):  # its own caches: one sequence at a time, exactly as alone
        for s in steps:
            hidden: list[np.ndarray] = []
            out = model.forward(np.asarray([list(s.ids)], np.int64), s.cache, last_only=not s.all_logits,
                                hidden_out=hidden if s.want_hidden else None)
            s.logits = out[0]
            s.hidden = hidden[0][0] if s.want_hidden else None
        return
    ends = np.cumsum(lens)
    starts = ends - lens
    x = f32(w["embed"][np.concatenate([np.asarray(s.ids, np.int64) for s in steps])])  # (N, H)
    if cfg.embedding_multiplier != 1.0:  # Granite
        x = x * np.float32(cfg.embedding_multiplier)
    positions = [np.arange(s.cache.length, s.cache.length + n) for s, n in zip(steps, lens)]
    for L in range(cfg.num_layers):
        h = block_norm(cfg, x, w[f"{L}.attn_norm"], w.get(f"{L}.attn_norm_bias"))
        x = x + residual(cfg, _attention(model, L, h, steps, starts, ends, positions))
        for observe_state in model.state_observers:
            observe_state(L, x)
        x = x + residual(cfg, model._mlp(L, block_norm(cfg, x, w[f"{L}.mlp_norm"], w.get(f"{L}.mlp_norm_bias"))))
    model.experts.end_step()
    rows = np.concatenate([np.arange(a, b) if s.all_logits else np.asarray([b - 1])
                           for s, a, b in zip(steps, starts, ends)])
    final = block_norm(cfg, x[rows], w["final_norm"], w.get("final_norm_bias"))
    logits = scaled_logits(cfg, mm(final, w["lm_head"]), w.get("lm_head_bias"))
    at = 0
    for s, n, a, b in zip(steps, lens, starts, ends):
        k = n if s.all_logits else 1
        s.logits = logits[at : at + k]
        at += k
        if s.want_hidden:
            s.hidden = block_norm(cfg, x[a:b], w["final_norm"], w.get("final_norm_bias"))


def _attention(model: Model, L: int, h: np.ndarray, steps: Sequence[Step], starts: np.ndarray, ends: np.ndarray,
               positions: list[np.ndarray]) -> np.ndarray:
    """Layer ``L``'s attention over the flattened batch h (N, H) -> (N, H): projections over all
    rows at once (GQA), heads, rope, cache and attention per sequence."""
    cfg, w = model.config, model._attn[L]
    if cfg.attention == "mla":  # its projections interleave with rope: per sequence
        out = np.empty_like(h)
        for s, a, b, pos in zip(steps, starts, ends, positions):
            out[a:b] = mla(w, h[None, a:b], cfg, model.rope, s.cache.layers[L], pos)[0]
        return out
    q, k, v = gqa_qkv(w, h[None], cfg)  # (1, N, .)
    heads = np.empty((h.shape[0], cfg.num_heads * cfg.head_dim), np.float32)
    for s, a, b, pos in zip(steps, starts, ends, positions):
        heads[a:b] = gqa_attend(w, q[:, a:b], k[:, a:b], v[:, a:b], cfg, model.rope, s.cache.layers[L], pos,
                                cfg.sliding_windows[L])[0]
    return linear(heads, w["o"], w.get("o_bias"))  # type: ignore[arg-type]
