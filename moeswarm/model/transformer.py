"""The decoder: embeddings -> (attention, MLP or MoE) x layers -> norm -> LM head.

The routed experts are behind an ``ExpertExecutor`` so that the same forward pass runs with the
experts in this process (``LocalExperts``) or spread over a swarm (the backbone in
the swarm's backbone supplies a remote executor).  ``submit`` starts the work and returns a handle;
the shared expert is computed while the routed experts are in flight; ``result`` joins them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from ._attn_deltanet import DeltaNetState, deltanet, gated_attention
from ._attn_dsa import DsaLayerCache, dsa_attention
from ._attn_lightning import lightning, new_layer_cache
from ._fused import fuse_backbone, fused_names
from ._qkernels import Activation
from .attention import KVCache, LayerCache, Rope, gqa, mla, rms_norm
from .config import ModelConfig
from .experts import (DecodedOnce, F32Cache, activation, dense_ffn, f32, get_backend, kernels_nbytes, mm, oai_dense_ffn,
                      sigmoid)
from .memory import available_bytes
from .routing import hash_route, route
from .weights import ExpertWeights, Weights


class ExpertHandle(Protocol):
    def result(self) -> np.ndarray:
        """The combined routed-expert output ``(T, H)``."""
        ...


class ExpertExecutor(Protocol):
    def submit(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> ExpertHandle:
        """x (T, H), ids (T, k), weights (T, k): start computing the layer's routed experts."""
        ...

    def end_step(self) -> None:
        """Called once after every forward pass (a remote executor settles receipts here)."""
        ...


class AttentionKind(Protocol):
    def __call__(self, w: dict[str, np.ndarray | None], h: np.ndarray, cfg: ModelConfig, rope: Rope, cache: object,
                 positions: np.ndarray, layer: int, step: dict[str, Any]) -> np.ndarray:
        """Layer ``layer``'s token mixing: h (B, T, H) -> (B, T, H), over its ``cache``.  ``step`` is what
        one layer hands the next within this pass (Mistral Large 4: a layer's latent keys and values, the
        indexer's top-k)."""
        ...


# attention kinds a family's module adds (``ModelConfig.attention`` -> function), e.g. Llama 4's
ATTENTION_KINDS: dict[str, AttentionKind] = {}
# the per-layer cache of a registered attention kind that keeps more than keys and values
# (``ModelConfig.attention`` -> (cfg, layer) -> cache with ``length`` and ``truncate``), e.g. DeepSeek-V4's,
# Kimi Linear's delta-attention layers
LAYER_CACHES: dict[str, Callable[[ModelConfig, int], object]] = {}


class ResidualForm(Protocol):
    """How the blocks of a layer read and join the residual stream.  The stream is what ``expand``
    makes of the embeddings ((B, T, H) for a plain sum; DeepSeek-V4 keeps (B, T, hc_mult, H))."""

    def expand(self, x: np.ndarray) -> np.ndarray:
        """Embeddings (B, T, H) -> the stream."""
        ...

    def enter(self, layer: int, site: str, x: np.ndarray) -> tuple[np.ndarray, object]:
        """The stream -> the input (B, T, H) of block ``site`` ("attn" or "mlp"), and what ``leave`` needs."""
        ...

    def leave(self, layer: int, site: str, x: np.ndarray, out: np.ndarray, held: object) -> np.ndarray:
        """The stream and the block's output (B, T, H) -> the next stream."""
        ...

    def collapse(self, x: np.ndarray) -> np.ndarray:
        """The last stream -> (B, T, H), before the final norm."""
        ...


class AddResidual:
    """The usual residual stream: each block's output is added (Granite scales it first)."""

    def __init__(self, cfg: ModelConfig, weights: Weights) -> None:
        self.cfg = cfg

    def expand(self, x: np.ndarray) -> np.ndarray:
        return x

    def enter(self, layer: int, site: str, x: np.ndarray) -> tuple[np.ndarray, object]:
        return x, None

    def leave(self, layer: int, site: str, x: np.ndarray, out: np.ndarray, held: object) -> np.ndarray:
        return x + residual(self.cfg, out)

    def collapse(self, x: np.ndarray) -> np.ndarray:
        return x


# residual forms (``ModelConfig.residual_form`` -> constructor); a family's module adds its own
RESIDUAL_FORMS: dict[str, Callable[[ModelConfig, Weights], ResidualForm]] = {"add": AddResidual}


class DecoderLayerForm(Protocol):
    """A family's whole decoder layer, where it is not one attention + one MLP (LongCat-Flash's two
    attention and dense-MLP sublayers with a MoE shortcut)."""

    def new_cache(self, cfg: ModelConfig, layer: int) -> object:
        """Layer ``layer``'s empty cache (it needs ``length`` and ``truncate``, as ``LayerCache``)."""
        ...

    def __call__(self, model: "Model", L: int, x: np.ndarray, cache: object, positions: np.ndarray,
                 observe: bool) -> np.ndarray:
        """Decoder layer ``L``: x (B, T, H) -> (B, T, H)."""
        ...


# decoder layer forms a family's module adds (``ModelConfig.arch`` -> form)
DECODER_LAYERS: dict[str, DecoderLayerForm] = {}


class _Done:
    def __init__(self, value: np.ndarray) -> None:
        self._value = value

    def result(self) -> np.ndarray:
        return self._value


DECODE_AT_LOAD_MAX = 4 << 30  # float32 copies made at load (fp16/bf16 backbone, expert cache floor), bytes
KERNELS_RESERVE = 2 << 30  # memory left to everything else when the default expert cache sizes itself for kernels


def _prepare_backbone(weights: Weights, fused: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Once, at load: repack quantized backbone matrices into kernels (except ``fused``: computed by the fused
    kernels of ``_fused``); wrap fp16/bf16 ones (up to ``DECODE_AT_LOAD_MAX`` in float32) so that they are
    converted at their first use and kept, not converted again by every token.  The embedding alone is only
    read by rows and stays as stored.  Memory-mapped vectors (norms, biases, routers) become plain ndarray
    views of the same bytes: an ``np.memmap`` costs a Python-level ``__array_finalize__`` per operation."""
    cfg = weights.config
    views: dict[int, np.ndarray] = {}  # one view per array: a tied LM head stays the embedding itself
    for n, a in weights.tensors.items():
        if isinstance(a, np.memmap):
            weights.tensors[n] = views.setdefault(id(a), a.view(np.ndarray))
    names = [n for n, a in weights.tensors.items() if a.ndim == 2 and (n != "embed" or cfg.tie_word_embeddings)
             and getattr(a.dtype, "kind", "f") not in "iu"  # not an index table (DeepSeek-V4's hash routing)
             and n not in fused]
    half = [n for n in names if weights.tensors[n].dtype != np.float32 and not hasattr(weights.tensors[n], "matmul")]
    if sum(weights.tensors[n].size * 4 for n in half) <= DECODE_AT_LOAD_MAX:
        wrapped = {n: DecodedOnce(weights.tensors[n]) for n in half}
        if cfg.tie_word_embeddings and "lm_head" in wrapped:
            wrapped["embed"] = wrapped["lm_head"]
        weights.tensors.update(wrapped)  # type: ignore[arg-type]
    for n in names:
        prepare = getattr(weights.tensors[n], "prepare", None)
        if prepare is not None:
            prepare()


def _dense_activation(cfg: ModelConfig) -> Activation:
    """The dense MLPs' and shared experts' activation, as ``dense_ffn`` / ``oai_dense_ffn`` compute it."""
    return Activation("silu") if cfg.dense_activation == "swiglu" else activation(cfg)


def _cache_size(experts: Mapping[int, Mapping[int, ExpertWeights]], cfg: ModelConfig) -> int:
    """Default expert cache (no ``--memory-budget``): room for every float32 copy of an fp16/bf16 expert (up to
    ``DECODE_AT_LOAD_MAX``) and every quantized expert's kernel (up to the memory available at load, less
    ``KERNELS_RESERVE``), as llama.cpp keeps the whole file resident; 512 MiB at least.  A 512 MiB cap alone left
    a real-depth model (8 layers of 128 Q8_0 experts) rebuilding 54 onnxruntime sessions a token: 1.8 tok/s."""
    copies = sum(sum(a.size * 4 for a in w.arrays()) for layer in experts.values() for w in layer.values()
                 if w.gate.dtype != np.float32 and not hasattr(w.gate, "kernel_format"))
    kernels = kernels_nbytes(experts, cfg)
    return max(512 << 20, (copies if copies <= DECODE_AT_LOAD_MAX else 0)
               + (kernels if kernels <= available_bytes() - KERNELS_RESERVE else 0))


class LocalExperts:
    """Routed experts computed in this process from the memory-mapped checkpoint."""

    def __init__(self, experts: Mapping[int, Mapping[int, ExpertWeights]], cfg: ModelConfig, backend: str = "auto",
                 cache: F32Cache | None = None) -> None:
        self.experts = experts
        self.cfg = cfg
        self.backend = get_backend(backend)
        self.backend_name = backend
        self.cache = cache or F32Cache(_cache_size(experts, cfg))
        self.on_access: Callable[[int, int], None] | None = None  # called before each expert is computed

    def submit(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> ExpertHandle:
        store = self.cache.layer(layer, self.experts[layer], self.on_access)
        return _Done(self.backend(store, x, ids, weights, self.cfg))

    def end_step(self) -> None:
        pass


def block_norm(cfg: ModelConfig, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """The norm before each block and the final one: RMSNorm, or LayerNorm (DBRX's without bias,
    PhiMoE's with the bias ``b``)."""
    if cfg.norm != "layer":
        return rms_norm(x, w, cfg.rms_norm_eps)
    x = x - x.mean(axis=-1, keepdims=True)
    y = x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(cfg.rms_norm_eps)) * f32(w)
    return y if b is None else y + f32(b)


def residual(cfg: ModelConfig, h: np.ndarray) -> np.ndarray:
    """A block's output as it joins the residual stream (Granite scales it by ``residual_multiplier``)."""
    return h if cfg.residual_multiplier == 1.0 else h * np.float32(cfg.residual_multiplier)


def scaled_logits(cfg: ModelConfig, logits: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """float32 logits, plus PhiMoE's LM-head ``bias``, divided by Granite's ``logits_scaling``, soft-capped
    by Mistral Large 4's ``final_logit_softcapping``."""
    if bias is not None:
        logits = logits + f32(bias)
    if cfg.logits_scaling != 1.0:
        logits = logits / np.float32(cfg.logits_scaling)
    if cfg.final_logit_softcapping:
        cap = np.float32(cfg.final_logit_softcapping)
        logits = np.tanh(logits / cap) * cap
    return logits.astype(np.float32, copy=False)


class _Summed:
    """The (T*k, H) outputs of ``Model._submit_scaled`` summed back to (T, H)."""

    def __init__(self, handle: ExpertHandle, tokens: int, k: int) -> None:
        self._handle, self._tokens, self._k = handle, tokens, k

    def result(self) -> np.ndarray:
        return self._handle.result().reshape(self._tokens, self._k, -1).sum(axis=1, dtype=np.float32)


class RouteObserver(Protocol):
    def __call__(self, layer: int, ids: np.ndarray) -> None: ...


class Model:
    """A loaded MoE model.  ``forward`` is pure numpy; all state lives in the ``KVCache``."""

    def __init__(self, weights: Weights, experts: ExpertExecutor | None = None, backend: str = "auto",
                 overlap_shared: bool = True) -> None:
        self.weights = weights
        self.config = cfg = weights.config
        self.experts: ExpertExecutor = experts or LocalExperts(weights.experts, cfg, backend)
        # compute the shared expert while the routed experts are in flight; False waits for them
        # first (the same numbers, only slower: for measuring what the overlap saves)
        self.overlap_shared = overlap_shared
        self.rope = Rope(cfg, weights.get("rope_alpha"))  # LeRoPE's learned alpha, if the family has one
        self.observers: list[RouteObserver] = []  # (layer, expert ids (T, k)) once a MoE layer has routed
        self.state_observers: list[Callable[[int, np.ndarray], None]] = []  # (layer, residual (N, H)) before its MLP
        self.residual_form = RESIDUAL_FORMS[cfg.residual_form](cfg, weights)
        # q/k/v, dense MLPs and shared experts of block-quantized matrices: one kernel call each (``_fused``)
        self.fused = fuse_backbone(cfg, weights.tensors, self._attention_tensors(), _dense_activation(cfg),
                                   [L for L in range(cfg.all_layers) if self._runs_gqa(L)])
        _prepare_backbone(weights, fused_names(self.fused))
        self._attn = self._attention_tensors()
        for L, attn in enumerate(self._attn):
            if f"{L}.attn.qkv" in self.fused:
                attn["qkv"] = self.fused[f"{L}.attn.qkv"]  # gqa_qkv computes q, k, v with it

    def _attention_tensors(self) -> list[dict[str, Any]]:
        """Each layer's ``{L}.attn.*`` tensors by their short name, the MTP layers' too."""
        tensors = self.weights.tensors
        return [{name.split(".", 2)[2]: a for name, a in tensors.items() if name.startswith(f"{L}.attn.")}
                for L in range(self.config.all_layers)]

    def _runs_gqa(self, L: int) -> bool:
        """Whether layer ``L``'s token mixing is ``attention.gqa`` as ``layer`` calls it."""
        cfg = self.config
        sparse = bool(cfg.sparse_layers) and L < len(cfg.sparse_layers) and bool(cfg.sparse_layers[L])
        return cfg.attention == "gqa" and cfg.arch not in DECODER_LAYERS and not sparse

    def new_cache(self) -> KVCache:
        cfg = self.config
        if cfg.attention in LAYER_CACHES:
            return KVCache([LAYER_CACHES[cfg.attention](cfg, L) for L in range(cfg.num_layers)])  # type: ignore[misc]
        if cfg.dsa is not None:
            return KVCache([DsaLayerCache() for _ in range(cfg.num_layers)])
        if cfg.deltanet is not None:
            return KVCache([DeltaNetState() if linear else LayerCache() for linear in cfg.deltanet.layers[:cfg.num_layers]])
        if cfg.arch in DECODER_LAYERS:
            return KVCache([DECODER_LAYERS[cfg.arch].new_cache(cfg, L) for L in range(cfg.num_layers)])  # type: ignore[misc]
        return KVCache([new_layer_cache(cfg, L) for L in range(cfg.num_layers)])  # MiniMax M3: index keys too

    def forward(self, ids: np.ndarray, cache: KVCache, *, last_only: bool = False,
                hidden_out: list[np.ndarray] | None = None) -> np.ndarray:
        """ids (B, T) int -> logits (B, T, V) float32 (or (B, 1, V) with ``last_only``).  ``hidden_out``
        gets the final-normed hidden states (B, T, H) of every position (what an MTP layer drafts from;
        DeepSeek-V4's drafts from the streams before the ``hc_head``, (B, T, hc_mult, H))."""
        cfg, w = self.config, self.weights
        ids = np.asarray(ids)
        if ids.ndim == 1:
            ids = ids[None]
        T = ids.shape[1]
        past = cache.length
        positions = np.arange(past, past + T)
        x = f32(w["embed"][ids])  # (B, T, H)
        if cfg.embedding_multiplier != 1.0:  # Granite
            x = x * np.float32(cfg.embedding_multiplier)
        # what one layer hands the next within this pass (DSA top-k), and the token ids (hash routing)
        step: dict[str, Any] = {"tokens": ids.reshape(-1)}
        self._announce_hashed(step["tokens"])
        x = self.residual_form.expand(x)
        for L in range(cfg.num_layers):
            x = self.layer(L, x, cache.layers[L], positions, step)
        streams, x = x, self.residual_form.collapse(x)
        self.experts.end_step()
        if hidden_out is not None:
            hidden_out.append(streams if cfg.residual_form == "hyper" else
                              block_norm(cfg, x, w["final_norm"], w.get("final_norm_bias")))
        if last_only:
            x = x[:, -1:]
        x = block_norm(cfg, x, w["final_norm"], w.get("final_norm_bias"))
        logits = mm(x.reshape(-1, x.shape[-1]), w["lm_head"]).reshape(*x.shape[:-1], -1)
        return scaled_logits(cfg, logits, w.get("lm_head_bias"))

    def _announce_hashed(self, tokens: np.ndarray) -> None:
        """Hash-routed layers (DeepSeek-V4's) take their experts from the token ids alone: an executor
        with ``hint`` learns them before any layer runs (the swarm's warms their holders early)."""
        hint = getattr(self.experts, "hint", None)
        if hint is None or not any(self.config.moe_layers):
            return
        tables = {L: self.weights.get(f"{L}.router_table") for L in range(self.config.num_layers)}
        routes = {L: np.asarray(t[tokens.astype(np.int64)], np.int64) for L, t in tables.items() if t is not None}
        if routes:
            hint(routes)

    def layer(self, L: int, x: np.ndarray, layer_cache: object, positions: np.ndarray, step: dict[str, Any],
              *, observe: bool = True) -> np.ndarray:
        """Decoder layer ``L`` (an MTP layer too: ``model/mtp.py``): x (B, T, H) -> (B, T, H).
        ``observe`` False keeps the observers (demand counts, state prefetch) out of it."""
        cfg, w, form = self.config, self.weights, self.residual_form
        if cfg.arch in DECODER_LAYERS:
            return DECODER_LAYERS[cfg.arch](self, L, x, layer_cache, positions, observe)
        B, T = x.shape[:2]
        h, held = form.enter(L, "attn", x)
        h = block_norm(cfg, h, w[f"{L}.attn_norm"], w.get(f"{L}.attn_norm_bias"))
        if cfg.attention == "mla":
            h = mla(self._attn[L], h, cfg, self.rope, layer_cache, positions)  # type: ignore[arg-type]
        elif cfg.sparse_layers and cfg.sparse_layers[L]:  # MiniMax M3 lightning indexer
            h = lightning(self._attn[L], h, cfg, self.rope, layer_cache, positions)  # type: ignore[arg-type]
        elif cfg.attention == "gqa":
            h = gqa(self._attn[L], h, cfg, self.rope, layer_cache, positions, cfg.sliding_windows[L])  # type: ignore[arg-type]
        else:
            h = self._mix_tokens(L, h, layer_cache, positions, step)
        x = form.leave(L, "attn", x, h, held)
        h, held = form.enter(L, "mlp", x)
        if observe:
            for observe_state in self.state_observers:
                observe_state(L, h.reshape(B * T, -1))
        h = block_norm(cfg, h, w[f"{L}.mlp_norm"], w.get(f"{L}.mlp_norm_bias")).reshape(B * T, -1)
        out = self._mlp(L, h, observe=observe, tokens=step.get("tokens"))
        return form.leave(L, "mlp", x, out.reshape(B, T, -1), held)

    def _mix_tokens(self, L: int, h: np.ndarray, layer_cache: object, positions: np.ndarray,
                    step: dict[str, Any]) -> np.ndarray:
        """The attention kinds beyond GQA and MLA: DSA (DeepSeek-V3.2, GLM-5), Qwen3.5's DeltaNet +
        gated attention.  h (B, T, H) -> (B, T, H)."""
        cfg = self.config
        if cfg.attention in ATTENTION_KINDS:
            return ATTENTION_KINDS[cfg.attention](self._attn[L], h, cfg, self.rope, layer_cache, positions, L, step)
        if cfg.attention == "dsa":
            return dsa_attention(self._attn[L], h, cfg, self.rope, layer_cache, positions, L, step)  # type: ignore[arg-type]
        if cfg.attention == "qwen3_5":
            assert cfg.deltanet is not None
            if cfg.deltanet.layers[L]:
                return deltanet(self._attn[L], h, cfg, layer_cache)  # type: ignore[arg-type]
            return gated_attention(self._attn[L], h, cfg, self.rope, layer_cache, positions)  # type: ignore[arg-type]
        raise ValueError(f"unknown attention kind {cfg.attention!r}")

    def _mlp(self, L: int, h: np.ndarray, *, observe: bool = True, tokens: np.ndarray | None = None) -> np.ndarray:
        """h (N, H) -> (N, H): a dense MLP, or router + routed experts + shared expert.  ``tokens`` (N,):
        the token ids, which a hash-routed layer (DeepSeek-V4's ``{L}.router_table``) routes by."""
        cfg, w = self.config, self.weights
        ffn = dense_ffn if cfg.dense_activation == "swiglu" else oai_dense_ffn(cfg)
        if not cfg.moe_layers[L]:
            fused = self.fused.get(f"{L}.mlp")
            return fused(h) if fused is not None else ffn(w[f"{L}.mlp.gate"], w[f"{L}.mlp.up"], w[f"{L}.mlp.down"], h)
        table = w.get(f"{L}.router_table")
        if table is not None:
            if tokens is None:
                raise ValueError(f"layer {L} routes by token id (hash routing): the token ids are needed")
            ids, weights = hash_route(cfg, h, w[f"{L}.router"], table, tokens)
        else:
            ids, weights = route(cfg, h, w[f"{L}.router"], w.get(f"{L}.router_bias"), w.get(f"{L}.router_score_bias"))
        if cfg.zero_experts:  # LongCat-Flash: the zero-computation choices are done here, the rest sent
            return self._submit_with_zero_experts(L, h, ids, weights, observe)
        for route_observer in self.observers if observe else ():
            route_observer(L, ids)
        handle = self._submit_scaled(L, h, ids, weights) if cfg.expert_input_scaled else self.experts.submit(
            L, h, ids, weights)
        if not self.overlap_shared:
            handle.result()
        shared = None
        if cfg.shared_intermediate_size:  # overlaps with remote experts in flight
            fused = self.fused.get(f"{L}.shared")
            shared = fused(h) if fused is not None else ffn(w[f"{L}.shared.gate"], w[f"{L}.shared.up"],
                                                            w[f"{L}.shared.down"], h)
            if cfg.shared_expert_gate:
                shared = sigmoid(h @ f32(w[f"{L}.shared_gate"]).T) * shared
        out = handle.result()
        return out if shared is None else out + shared

    def _submit_scaled(self, L: int, h: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> ExpertHandle:
        """Llama 4: each chosen expert computes on ``weight * x``; outputs add unweighted.  Sent as
        one row per (token, choice) with weight 1, so any executor (a swarm's too) computes it."""
        T, k = ids.shape
        rows = (h[:, None, :] * weights[:, :, None]).reshape(T * k, -1)  # (T*k, H)
        handle = self.experts.submit(L, rows, ids.reshape(T * k, 1), np.ones((T * k, 1), np.float32))
        return _Summed(handle, T, k)

    def _submit_with_zero_experts(self, L: int, h: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                                  observe: bool) -> np.ndarray:
        """h (T, H) -> (T, H): each choice of a zero-computation expert (id >= num_experts) adds its
        weight times the input, here; the routed choices go to the executor as one row per (token,
        choice), so no node holds, and no message carries, a zero-computation expert."""
        real = ids < self.config.num_experts  # (T, k)
        out = np.where(real, np.float32(0), weights).sum(axis=-1, dtype=np.float32)[:, None] * h  # (T, H)
        tokens, choices = np.nonzero(real)
        if not len(tokens):
            return out
        routed = ids[tokens, choices][:, None]  # (R, 1)
        for route_observer in self.observers if observe else ():
            route_observer(L, routed)
        rows = self.experts.submit(L, h[tokens], routed, weights[tokens, choices][:, None]).result()  # (R, H)
        np.add.at(out, tokens, rows)
        return out
