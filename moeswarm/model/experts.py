"""Routed-expert math and the expert backends (seed 004: eager, grouped, batched, auto).

A backend takes the tokens of one MoE layer, the router's choice and the layer's experts, and
returns the weighted sum of the chosen experts' outputs.  All backends compute the same thing;
they differ only in how they group the work:

* ``eager``   -- loop over the experts that were hit; the correctness reference.
* ``grouped`` -- sort (token, slot) pairs by expert once, one matmul per hit expert.
* ``batched`` -- per token, gather its k experts and run them as matrix-vector products;
  avoids OpenBLAS's small-M gemm cliff (M=2 costs ~9x M=1, spike finding 10) at tiny batches.
* ``auto``    -- ``batched`` for a handful of tokens, ``grouped`` above; always ``grouped`` when
  the experts run on quantized kernels (``_qkernels``: one call per expert whatever its rows), and a
  whole layer in one call (``_qmoe.QLayerMoE``) where its experts' formats allow and the cache holds
  every such layer.

Quantized experts (GGUF Q8_0, Q4_K, IQ4_XS...) are not converted to float32: ``F32Cache`` turns
them into ``KernelExpert``s (repacked once, kept in the same byte-bounded LRU) and ``expert_ffn``
runs them in one onnxruntime call.  F16/BF16 experts (GGUF or safetensors) are not converted either where
the F16 kernel is built (``_f16``): their entry computes from the stored bytes, builds nothing, and is held
outside the byte-bounded LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

import numpy as np

from ..errors import ConfigError
from ._f16 import StoredLinear, stored_linear
from ._ort_session import release_mapped
from ._pages import release_pages, release_stored
from ._qkernels import Activation, KernelExpert, packable
from ._qmoe import QLayerMoE, fits, kernel_nbytes
from .config import ModelConfig
from .weights import ExpertWeights

BACKENDS = ("auto", "eager", "grouped", "batched")
_AUTO_BATCHED_MAX_TOKENS = 4  # at or below this many tokens, auto picks "batched"


def f32(a: np.ndarray) -> np.ndarray:
    """fp32 view or converted copy (fp16/bf16 checkpoints are computed in fp32)."""
    return a if a.dtype == np.float32 else a.astype(np.float32)


_GEMV_MAX_ROWS = 8  # below this many rows, row-by-row gemv beats OpenBLAS's small-M gemm (measured 2-5x)


def mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x (M, in) @ w.T`` for ``w (out, in)``, float32, dodging OpenBLAS's small-M gemm cliff.
    A stored tensor with its own ``matmul`` (a quantized GGUF tensor) computes it itself."""
    kernel = getattr(w, "matmul", None)
    if kernel is not None:
        return kernel(x)
    w = f32(w)
    if 1 < x.shape[0] <= _GEMV_MAX_ROWS:
        return np.stack([w @ row for row in x])
    return x @ w.T


class DecodedOnce:
    """A fp16/bf16 backbone matrix: its products computed from the stored bytes by the F16 kernel (``_f16``) where
    it is built, else converted to float32 at its first product and kept (each token would otherwise convert it
    again).  Row lookups read the stored rows."""

    __slots__ = ("stored", "_value", "kernel")

    def __init__(self, stored: np.ndarray) -> None:
        self.stored = stored
        self._value: np.ndarray | None = None
        self.kernel = stored_linear(stored)  # None: the float32 copy computes

    shape = property(lambda self: self.stored.shape)
    ndim = property(lambda self: self.stored.ndim)
    size = property(lambda self: self.stored.size)
    dtype = property(lambda self: self.stored.dtype)
    nbytes = property(lambda self: self.stored.nbytes)
    kernel_nbytes = property(lambda self: 0 if self._value is None else self._value.nbytes)

    def value(self) -> np.ndarray:
        if self._value is None:
            self._value = self.stored.astype(np.float32)
            release_pages(self.stored)  # RSS counts the copy, not both (row lookups fault their rows back)
        return self._value

    def matmul(self, x: np.ndarray) -> np.ndarray:
        if self.kernel is not None:
            return self.kernel.matmul(x)
        return mm(x, self.value())

    def astype(self, dtype: object, copy: bool = True) -> np.ndarray:
        return self.value().astype(dtype, copy=False)  # type: ignore[call-overload]

    def __array__(self, dtype: object = None, copy: bool | None = None) -> np.ndarray:
        return self.value() if dtype is None else self.value().astype(dtype, copy=False)  # type: ignore[call-overload]

    def __getitem__(self, index: object) -> np.ndarray:
        return self.stored[index]  # type: ignore[index]


class F32Experts(Mapping[int, ExpertWeights]):
    """A layer's experts as float32, converting fp16/bf16 ones on first use and keeping the most
    recently used conversions up to a byte budget (shared by all layers through ``F32Cache``).
    float32 checkpoints pass through untouched: their views are already what the math needs."""

    def __init__(self, layer: int, experts: Mapping[int, ExpertWeights], cache: "F32Cache",
                 on_access: Callable[[int, int], None] | None = None) -> None:
        self.layer, self.experts, self.cache, self.on_access = layer, experts, cache, on_access

    def __getitem__(self, expert: int) -> ExpertWeights:
        w = self.experts[expert]
        if self.on_access is not None:  # e.g. a memory budget making room for this expert's pages
            self.on_access(self.layer, expert)
        if w.gate.dtype == np.float32:
            return w
        return self.cache.get((self.layer, expert), w)  # type: ignore[return-value]

    def __iter__(self) -> Iterator[int]:
        return iter(self.experts)

    def __len__(self) -> int:
        return len(self.experts)


Computable = ExpertWeights | KernelExpert | QLayerMoE  # what the cache holds: float32 weights or kernels


class ExpertLRU:
    """Experts by key, bounded in bytes; the least recently used leave first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[tuple[int, int], Computable] = OrderedDict()

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    @property
    def experts(self) -> int:
        """Experts held: one per entry, or each expert of a layer kernel (``QLayerMoE``)."""
        return sum(len(w.expert_ids) if isinstance(w, QLayerMoE) else 1 for w in self._items.values())

    def keys(self) -> list[tuple[int, int]]:
        return list(self._items)

    def get(self, key: tuple[int, int]) -> Computable | None:
        w = self._items.get(key)
        if w is not None:
            self._items.move_to_end(key)
        return w

    def put(self, key: tuple[int, int], w: Computable) -> bool:
        """Keep ``w`` unless it alone exceeds the budget; returns whether it was kept."""
        size = w.nbytes
        if size > self.max_bytes:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        while self.bytes + size > self.max_bytes and self._items:
            _, gone = self._items.popitem(last=False)
            self.bytes -= gone.nbytes
        self._items[key] = w
        self.bytes += size
        return True


def kernels_nbytes(experts: Mapping[int, Mapping[int, ExpertWeights]], cfg: ModelConfig) -> int:
    """What ``F32Cache`` holds once every quantized expert of ``experts`` (layer -> expert -> weights) has run: a
    layer's ``QLayerMoE`` where its formats fit one, else a ``KernelExpert`` per expert (``kernel_nbytes``)."""
    total = 0
    for layer in experts.values():
        ws = [w for w in layer.values() if all(packable(a) for a in (w.gate, w.up, w.down))]
        if ws:
            total += kernel_nbytes(ws) if fits(ws, activation(cfg)) else sum(KernelExpert(w).nbytes for w in ws)
    return total


class F32Cache:
    """LRU of float32 copies of experts (or, for quantized ones, their repacked kernels), bounded in
    bytes (0 disables it).  F16/BF16 experts are computed from their stored bytes where the F16 kernel is built:
    nothing is copied, so nothing enters the LRU."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self._copies = ExpertLRU(max_bytes)
        # F16/BF16 experts computed as stored (``_f16``), by key: views of the mapped weights, holding no bytes of
        # their own (the stored pages are the weights' and the memory budget's to count), so outside the LRU
        self._as_stored: dict[tuple[int, int], ExpertWeights] = {}
        self._layer_kernels: set[tuple[int, int]] = set()  # keys of the layer kernels built so far
        self.layer_kernels_fit = True  # False once one was evicted: per-expert kernels from then on (no thrash)

    def layer_kernel(self, layer: int, experts: Mapping[int, ExpertWeights], cfg: ModelConfig) -> QLayerMoE | None:
        """The layer's held experts as one ``QLayerMoE``, built at first use, or None where their formats do not
        fit one or the cache cannot keep it beside the other layers' (``layer_kernels_fit``)."""
        key = (layer, -1)
        hit = self._copies.get(key)
        if isinstance(hit, QLayerMoE):
            return hit
        if not self.layer_kernels_fit or not experts:
            return None
        held = sorted(experts)
        ws = [experts[e] for e in held]
        nbytes = kernel_nbytes(ws) if fits(ws, activation(cfg)) else None
        if nbytes is None or nbytes > self._copies.max_bytes:
            return None
        biases = [tuple(None if b is None else np.asarray(b, np.float32) for b in (w.gate_bias, w.up_bias, w.down_bias))
                  for w in ws]
        matrices = [(w.gate.packed(), w.up.packed(), w.down.packed()) for w in ws]  # type: ignore[attr-defined]
        kernel = QLayerMoE(held, matrices, biases, cfg.top_k)  # type: ignore[arg-type]
        kernel.nbytes = nbytes
        for p in (p for m in matrices for p in m):  # kernel-file views, read once: their pages leave this process
            for a in (p.data, p.scales, p.bias):
                if a is not None:
                    release_mapped(a)
        del matrices
        release_stored(a for w in ws for a in (w.gate, w.up, w.down))  # not read again: leave them to the file
        self._copies.put(key, kernel)
        self._layer_kernels.add(key)
        if any(k not in self._copies for k in self._layer_kernels):
            self.layer_kernels_fit = False
        return kernel

    def get(self, key: tuple[int, int], w: ExpertWeights) -> Computable:
        hit = self._copies.get(key)
        if hit is not None:
            return hit
        if all(packable(a) for a in (w.gate, w.up, w.down)):
            kernel = KernelExpert(w)
            self._copies.put(key, kernel)
            return kernel
        as_stored = self._as_stored.get(key)
        if as_stored is not None:
            return as_stored
        stored = [_stored(a) for a in (w.gate, w.up, w.down)]
        if all(k is not None for k in stored):  # F16/BF16 computed from the mapped bytes: nothing built to count
            as_stored = replace(w, gate=stored[0], up=stored[1], down=stored[2],
                                **{k: f32(getattr(w, k)) for k in ("gate_bias", "up_bias", "down_bias")
                                   if getattr(w, k) is not None})
            self._as_stored[key] = as_stored
            return as_stored
        converted = replace(w, **{k: f32(getattr(w, k)) for k in ("gate", "up", "down", "gate_bias", "up_bias",
                                                                     "down_bias") if getattr(w, k) is not None})
        if self._copies.put(key, converted):  # kept: RSS counts the copy, not the stored pages too
            for a in w.arrays():
                release_pages(a)
        return converted

    def layer(self, layer: int, experts: Mapping[int, ExpertWeights],
              on_access: Callable[[int, int], None] | None = None) -> F32Experts:
        return F32Experts(layer, experts, self, on_access)


def _stored(a: object) -> StoredLinear | None:
    """``a`` (a stored fp16/bf16 matrix, or a GGUF F16/BF16 tensor) computed as stored, or None."""
    own = getattr(a, "stored_linear", None)
    return own() if own is not None else stored_linear(a)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def activation(cfg: ModelConfig) -> Activation:
    if cfg.expert_activation in ("clamped_swiglu", "limited_swiglu"):
        return Activation(cfg.expert_activation, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))
    return Activation("silu")


def expert_ffn(w: Computable, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One expert on ``x (T, H)`` -> ``(T, H)``, float32."""
    if isinstance(w, KernelExpert):
        return w(x, activation(cfg))
    gate = mm(x, w.gate)  # (T, I)
    up = mm(x, w.up)  # (T, I)
    if w.gate_bias is not None:
        gate += f32(w.gate_bias)
    if w.up_bias is not None:
        up += f32(w.up_bias)
    if cfg.expert_activation == "clamped_swiglu":  # gpt-oss
        gate = np.minimum(gate, np.float32(cfg.swiglu_limit))
        up = np.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        hidden = (up + 1) * (gate * sigmoid(gate * np.float32(cfg.swiglu_alpha)))
    elif cfg.expert_activation == "limited_swiglu":  # DeepSeek-V4: SiLU(min(gate, limit)) * clip(up, +-limit)
        gate = np.minimum(gate, np.float32(cfg.swiglu_limit))
        hidden = gate * sigmoid(gate) * np.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    else:
        hidden = gate * sigmoid(gate) * up  # SiLU(gate) * up
    out = mm(hidden.astype(np.float32, copy=False), w.down)  # (T, H)
    if w.down_bias is not None:
        out += f32(w.down_bias)
    return out


def dense_ffn(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray) -> np.ndarray:
    """A plain SwiGLU MLP (dense layers and shared experts)."""
    g = mm(x, gate)
    return mm(g * sigmoid(g) * mm(x, up), down)


def oai_dense_ffn(cfg: ModelConfig) -> Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """``dense_ffn`` with SwiGLU-OAI (clamped, alpha, ``up + 1``), as MiniMax M3's dense layers and shared
    expert compute it."""

    def ffn(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray) -> np.ndarray:
        return expert_ffn(ExpertWeights(gate, up, down), x, cfg)

    return ffn


Backend = Callable[[Mapping[int, ExpertWeights], np.ndarray, np.ndarray, np.ndarray, ModelConfig], np.ndarray]


def _missing(store: Mapping[int, ExpertWeights], ids: np.ndarray) -> None:
    absent = sorted(set(np.unique(ids).tolist()) - set(store))
    if absent:
        raise ConfigError(f"experts {absent} are not held by this process")


def eager(store: Mapping[int, ExpertWeights], x: np.ndarray, ids: np.ndarray, weights: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """x (T, H), ids (T, k), weights (T, k) -> (T, H)."""
    _missing(store, ids)
    out = np.zeros_like(x)
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)  # a token picks an expert at most once
        y = expert_ffn(store[int(e)], x[rows], cfg)
        out[rows] += weights[rows, slots, None] * y
    return out


def grouped(store: Mapping[int, ExpertWeights], x: np.ndarray, ids: np.ndarray, weights: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    _missing(store, ids)
    k = ids.shape[1]
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    starts = np.flatnonzero(np.r_[True, flat[order][1:] != flat[order][:-1]])
    ends = np.r_[starts[1:], flat.size]
    out = np.zeros_like(x)
    flat_w = weights.ravel()
    for s, t in zip(starts, ends):
        pairs = order[s:t]
        rows = pairs // k
        y = expert_ffn(store[int(flat[pairs[0]])], x[rows], cfg)
        out[rows] += flat_w[pairs, None] * y
    return out


def batched(store: Mapping[int, ExpertWeights], x: np.ndarray, ids: np.ndarray, weights: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    _missing(store, ids)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        row = x[t : t + 1]
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * expert_ffn(store[int(ids[t, j])], row, cfg)[0]
    return out


def auto(store: Mapping[int, ExpertWeights], x: np.ndarray, ids: np.ndarray, weights: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    kernel = _layer_kernel(store, cfg)
    if kernel is not None and kernel.holds(ids):
        return kernel(x, ids, weights)
    if x.shape[0] <= _AUTO_BATCHED_MAX_TOKENS and not (ids.size and _on_kernels(store, int(ids.flat[0]))):
        return batched(store, x, ids, weights, cfg)
    return grouped(store, x, ids, weights, cfg)


def _layer_kernel(store: Mapping[int, ExpertWeights], cfg: ModelConfig) -> QLayerMoE | None:
    """The store's layer as one kernel call, when it is an ``F32Experts`` of quantized experts without a memory
    budget watching each expert's access (``on_access``: it pages experts in and out one by one)."""
    if not isinstance(store, F32Experts) or store.on_access is not None or not store.experts:
        return None
    first = next(iter(store.experts.values()))
    if not packable(first.gate):
        return None
    return store.cache.layer_kernel(store.layer, store.experts, cfg)


def _on_kernels(store: Mapping[int, ExpertWeights], expert: int) -> bool:
    """Whether the store's experts are quantized ones computed by kernels (looked up without counting
    as an access: an ``F32Experts`` shows its stored weights)."""
    w = getattr(store, "experts", store).get(expert)
    return w is not None and packable(w.gate)


_BY_NAME: dict[str, Backend] = {"auto": auto, "eager": eager, "grouped": grouped, "batched": batched}


def get_backend(name: str) -> Backend:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown expert backend {name!r}; choose one of {', '.join(BACKENDS)}") from None


