"""One frozen description of a MoE model, read from a Hugging Face ``config.json``.

Each supported architecture spells its hyper-parameters differently (``num_local_experts`` vs
``n_routed_experts``, ``rope_theta`` at top level in older files vs ``rope_parameters`` in
transformers 5).  ``ModelConfig.from_hf`` normalises them once, here, so the rest of the engine
reads a single set of names.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ._stored import QuantFormat, quant_format

ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")

_DEFAULT_THETA = {"mixtral": 1_000_000.0, "gpt_oss": 150_000.0}


@dataclass(frozen=True)
class RopeConfig:
    theta: float  # base wavelength
    dim: int  # rotary dimensions per head
    kind: str = "default"  # "default" or "yarn"
    factor: float = 1.0  # context extension factor (yarn)
    original_max_position: int = 0  # pre-extension context length (yarn)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # explicit cos/sin scale, else derived
    mscale: float | None = None
    mscale_all_dim: float | None = None
    interleaved: bool = False  # DeepSeek pairs (x0, x1), (x2, x3) instead of halves
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_position / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_position / this are kept
    factors: tuple[float, ...] = ()  # longrope: each frequency's wavelength multiplier (PhiMoE: the short ones)
    long_mscale: float = 0.0  # longrope: the cos/sin scale of a pass reaching past original_max_position

    def inv_freq(self) -> tuple[np.ndarray, float]:
        """Inverse frequencies ``(dim/2,)`` float32 and the cos/sin scale, as transformers computes them."""
        exponents = np.arange(0, self.dim, 2, dtype=np.float32) / np.float32(self.dim)
        pos_freqs = np.power(np.float32(self.theta), exponents, dtype=np.float32)
        if self.kind == "default":
            return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
        if self.kind == "llama3":
            return self._llama3(np.float32(1.0) / pos_freqs), 1.0
        if self.kind == "longrope":
            factors = np.asarray(self.factors, np.float32)
            return (np.float32(1.0) / (factors * pos_freqs)).astype(np.float32), float(self.attention_factor or 1.0)
        if self.kind != "yarn":
            raise CheckpointError(f"unsupported rope type {self.kind!r}")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = self.attention_factor
        if attention is None:
            if self.mscale and self.mscale_all_dim:
                attention = get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
            else:
                attention = get_mscale(self.factor)

        def correction_dim(rotations: float) -> float:
            return (self.dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(self.dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extrapolation = 1 - ramp
        inv_extra = np.float32(1.0) / pos_freqs
        inv_inter = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)
        inv = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
        return inv.astype(np.float32), float(attention)

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        """Llama 3.1 / Llama 4 ``llama3`` scaling (transformers' ``_compute_llama3_parameters``)."""
        old, factor = np.float32(self.original_max_position), np.float32(self.factor)
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > old / np.float32(self.low_freq_factor), inv / factor, inv)
        smooth = (old / wavelen - np.float32(self.low_freq_factor)) / np.float32(
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / np.float32(self.high_freq_factor)) & ~(wavelen > old / np.float32(self.low_freq_factor))
        return np.where(medium, smoothed, scaled).astype(np.float32)


@dataclass(frozen=True)
class ModelConfig:
    """Every hyper-parameter the engine reads; one instance per checkpoint."""

    arch: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # per-head q/k/v size (MLA: see mla_* fields)
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    # per layer
    moe_layers: tuple[bool, ...]  # True where the MLP is a MoE block
    sliding_windows: tuple[int | None, ...]  # attention window (tokens) per layer, None = full
    # attention
    attention: str = "gqa"  # "gqa" or "mla"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # None, "head" (per head, Qwen3), "full" (whole projection, OLMoE),
    # or "head_after_rope" (per head, on the rotated q/k: Hunyuan)
    sinks: bool = False  # gpt-oss learned per-head attention sinks
    clip_qkv: float | None = None  # OLMoE option: clamp q/k/v to +-clip
    attention_scale: float = 0.0  # softmax scale; 0 means head_dim**-0.5
    q_lora_rank: int | None = None  # MLA
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0  # per-expert FFN width
    dense_intermediate_size: int = 0  # width of non-MoE MLP layers
    router: str = "softmax_topk"  # "softmax_topk", "sigmoid_group" (DeepSeek-V3), "topk_softmax" (gpt-oss)
    norm_topk_prob: bool = False
    choice_bias: bool = False  # softmax_topk: choose on probabilities + router_score_bias (ERNIE 4.5)
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert
    expert_activation: str = "swiglu"  # "swiglu", "clamped_swiglu" (gpt-oss) or "limited_swiglu" (DeepSeek-V4)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False  # gpt-oss experts carry biases
    dsa: DsaConfig | None = None  # DeepSeek Sparse Attention indexer over MLA (deepseek_v32, glm_moe_dsa)
    deltanet: DeltaNetConfig | None = None  # gated DeltaNet linear attention on some layers (qwen3_5_moe)
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_position_embeddings: int = 0
    model_id: str = ""  # a human name for the model (folder name unless given)
    # MiniMax M3 (issue 13; see _config_minimax_kimi.py)
    dense_activation: str = "swiglu"  # dense MLP layers and shared experts: "swiglu" or "clamped_swiglu"
    norm_offset: float = 0.0  # RMSNorms scale by (norm_offset + w) (Gemma style: 1.0); folded into w at load
    sparse_layers: tuple[bool, ...] = ()  # True where a lightning indexer picks the key blocks a query sees
    index_heads: int = 0  # indexer query heads (one block choice per head, shared by its query-head group)
    index_head_dim: int = 0  # indexer q/k width
    index_block_size: int = 0  # keys per scored block
    index_topk_blocks: int = 0  # blocks each query keeps (best max-pooled indexer score)
    index_local_blocks: int = 0  # blocks ending at the query's own block, always kept
    quant: QuantFormat | None = None  # how quantised weights are stored (quantization_config), None: plain floats
    # Llama 4 (issue 34; see _config_llama4.py)
    expert_input_scaled: bool = False  # experts take x * weight and their outputs add unweighted
    family: Any = None  # a family's own frozen settings, read by the attention kind it registers
    # Mistral 4: (beta, length): after RoPE, q at position p *= 1 + beta * log(1 + floor(p / length))
    q_position_scale: tuple[float, int] | None = None
    # Granite MoE: embeddings *= embedding_multiplier; each block's output *= residual_multiplier
    # before the residual add; logits /= logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    norm: str = "rms"  # block and final norms: "rms", or "layer" (LayerNorm without bias, eps 1e-5: DBRX)
    norm_bias: bool = False  # the "layer" norms have biases (PhiMoE)
    lm_head_bias: bool = False  # the LM head has a bias (PhiMoE)
    # LongCat-Flash: the router also picks among this many zero-computation experts, numbered after the
    # routed ones, each returning its input times its weight (computed where the router runs: no holder)
    zero_experts: int = 0
    mla_lora_scale: tuple[float, float] | None = None  # LongCat-Flash MLA: q *= [0], the normed kv latent *= [1]
    # multi-token prediction (model/mtp.py): MTP layers loaded, numbered num_layers ... num_layers + mtp_layers - 1;
    # the per-layer tuples above then describe them too (MoE, full attention)
    mtp_layers: int = 0
    # how each block's output joins the residual stream (``transformer.RESIDUAL_FORMS``): "add", or
    # DeepSeek-V4's "hyper" (hc_mult streams mixed by manifold-constrained hyper-connections)
    residual_form: str = "add"
    # logits = c * tanh(logits / c) when c > 0 (Mistral Large 4's ``final_logit_softcapping``)
    final_logit_softcapping: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def all_layers(self) -> int:
        """Decoder layers including the multi-token-prediction ones (what nodes may serve)."""
        return self.num_layers + self.mtp_layers

    @property
    def scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> "ModelConfig":
        """From ``folder/config.json`` (``moeswarm.model.load_config`` also reads GGUF files)."""
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError("config.json not found", path=str(path)) from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"config.json is not valid JSON: {e}", path=str(path)) from None
        return cls.from_hf(raw, model_id=Path(folder).resolve().name, path=str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, model_id: str = "", path: str | None = None) -> "ModelConfig":
        arch = raw.get("model_type")
        if arch not in _PARSERS:
            raise CheckpointError(
                f"unsupported architecture {arch!r}; supported: {', '.join(_PARSERS)}", path=path
            )
        try:
            quant = quant_format(raw)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"config.json quantization_config: {e}", path=path) from None
        try:
            cfg = _PARSERS[arch](raw, model_id, path)
            return cfg if quant is None else replace(cfg, quant=quant)
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required field {e.args[0]!r}", path=path) from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has a malformed field: {e}", path=path) from None


def _rope(raw: dict[str, Any], arch: str, dim: int, interleaved: bool = False) -> RopeConfig:
    """Read ``rope_parameters`` (transformers 5) or the older ``rope_theta`` + ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    if "rope_theta" not in params:
        params["rope_theta"] = raw.get("rope_theta", _DEFAULT_THETA.get(arch, 10_000.0))
    scaling = raw.get("rope_scaling") or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "yarn"):
        raise ValueError(f"rope type {kind!r} is not supported (default, yarn)")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 0)
    if kind == "yarn" and factor is None:
        factor = raw["max_position_embeddings"] / original
    return RopeConfig(
        theta=float(params["rope_theta"]),
        dim=dim,
        kind=kind,
        factor=float(factor or 1.0),
        original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        interleaved=interleaved,
    )


def _tokens(raw: dict[str, Any]) -> dict[str, Any]:
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return dict(
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=raw.get("pad_token_id"),
        max_position_embeddings=int(raw.get("max_position_embeddings", 0)),
    )


def _common(raw: dict[str, Any], arch: str, model_id: str) -> dict[str, Any]:
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
    return dict(
        arch=arch,
        model_id=model_id,
        raw=raw,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        **_tokens(raw),
    )


def _windows(raw: dict[str, Any], n: int, default_types: list[str] | None = None) -> tuple[int | None, ...]:
    types = raw.get("layer_types") or default_types or ["full_attention"] * n
    window = raw.get("sliding_window")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types[:n])


def _mixtral(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    c = _common(raw, "mixtral", model_id)
    n = c["num_layers"]
    window = raw.get("sliding_window")
    return ModelConfig(
        **c,
        rope=_rope(raw, "mixtral", c["head_dim"]),
        moe_layers=(True,) * n,
        sliding_windows=(int(window) if window else None,) * n,
        num_experts=int(raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=True,
    )


def _n_experts(raw: dict[str, Any]) -> int:
    """Hub configs say ``num_experts``; transformers 5 writes ``num_local_experts`` for some."""
    return int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])


def _qwen_moe_layers(raw: dict[str, Any], n: int) -> tuple[bool, ...]:
    only = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    experts = _n_experts(raw)
    return tuple(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(n))


def _qwen_windows(raw: dict[str, Any], n: int) -> tuple[int | None, ...]:
    max_window = int(raw.get("max_window_layers", n))
    default = [
        "sliding_attention" if (i + 1) % 2 and i < max_window and raw.get("use_sliding_window") else "full_attention"
        for i in range(n)
    ]
    return _windows(raw, n, default)


def _qwen2_moe(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    c = _common(raw, "qwen2_moe", model_id)
    n = c["num_layers"]
    shared = int(raw.get("shared_expert_intermediate_size", 0) or 0)
    return ModelConfig(
        **c,
        rope=_rope(raw, "qwen2_moe", c["head_dim"]),
        moe_layers=_qwen_moe_layers(raw, n),
        sliding_windows=_qwen_windows(raw, n),
        qkv_bias=bool(raw.get("qkv_bias", True)),
        num_experts=_n_experts(raw),
        top_k=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        dense_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
    )


def _qwen3_moe(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    c = _common(raw, "qwen3_moe", model_id)
    n = c["num_layers"]
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        **c,
        rope=_rope(raw, "qwen3_moe", c["head_dim"]),
        moe_layers=_qwen_moe_layers(raw, n),
        sliding_windows=_qwen_windows(raw, n),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        num_experts=_n_experts(raw),
        top_k=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        dense_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )


def _olmoe(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    c = _common(raw, "olmoe", model_id)
    n = c["num_layers"]
    bias = bool(raw.get("attention_bias", False))
    clip = raw.get("clip_qkv")
    return ModelConfig(
        **c,
        rope=_rope(raw, "olmoe", c["head_dim"]),
        moe_layers=(True,) * n,
        sliding_windows=(None,) * n,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=float(clip) if clip else None,
        num_experts=_n_experts(raw),
        top_k=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )


def _deepseek_v3(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    c = _common(raw, "deepseek_v3", model_id)
    n = c["num_layers"]
    nope, rope_dim = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    rope = _rope(raw, "deepseek_v3", rope_dim, interleaved=bool(raw.get("rope_interleave", True)))
    scale = (nope + rope_dim) ** -0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
        scale *= m * m
    first_dense = int(raw.get("first_k_dense_replace", 0) or 0)
    c["head_dim"] = nope + rope_dim
    return ModelConfig(
        **c,
        rope=rope,
        moe_layers=tuple(i >= first_dense for i in range(n)),
        sliding_windows=(None,) * n,
        attention="mla",
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        attention_scale=scale,
        q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(raw.get("v_head_dim") or nope),
        num_experts=int(raw["n_routed_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        dense_intermediate_size=int(raw["intermediate_size"]),
        router="sigmoid_group",
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        shared_intermediate_size=int(raw["moe_intermediate_size"]) * int(raw.get("n_shared_experts") or 0),
    )


def _gpt_oss(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    c = _common(raw, "gpt_oss", model_id)
    n = c["num_layers"]
    default_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    bias = bool(raw.get("attention_bias", True))
    return ModelConfig(
        **c,
        rope=_rope(raw, "gpt_oss", c["head_dim"]),
        moe_layers=(True,) * n,
        sliding_windows=_windows(raw, n, default_types),
        qkv_bias=bias,
        o_bias=bias,
        sinks=True,
        num_experts=int(raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["intermediate_size"]),
        router="topk_softmax",
        expert_activation="clamped_swiglu",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        expert_bias=True,
    )


_PARSERS = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}

def register_family(parsers: dict[str, Any], default_thetas: dict[str, float]) -> None:
    """Add the config.json parsers of more architectures (each family's own ``_config_*`` module calls
    this when ``moeswarm.model`` is imported; this module never imports them, so none imports it back)."""
    _PARSERS.update(parsers)
    _DEFAULT_THETA.update(default_thetas)

# ---------------------------------------------------------------- DSA (DeepSeek-V3.2, GLM-5) and
# Qwen3.5-MoE (gated DeltaNet + gated full attention).  Registered below, after the six above.


@dataclass(frozen=True)
class DsaConfig:
    """DeepSeek Sparse Attention: a lightning indexer keeps the ``topk`` best keys per query."""

    topk: int  # keys each query may attend to (index_topk)
    n_heads: int  # indexer heads (index_n_heads)
    head_dim: int  # indexer q/k size (index_head_dim); its first qk_rope_head_dim dims are rotated
    rope_interleaved: bool  # GLM-5 rotates pairs (x0, x1)...; DeepSeek-V3.2 rotates halves
    shared: tuple[bool, ...]  # per layer: True = reuse the previous layer's top-k (GLM-5 "shared")


@dataclass(frozen=True)
class DeltaNetConfig:
    """Qwen3.5's gated DeltaNet: causal short convolution, then the gated delta rule's recurrent state."""

    layers: tuple[bool, ...]  # per layer: True = linear attention, False = gated full attention
    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads (each q/k head serves num_v_heads // num_k_heads)
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # width of the depthwise causal convolution over q, k, v
    chunk_size: int = 64  # prefill runs the chunked form of the delta rule, this many tokens a chunk

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def _mlp_layer_types(raw: dict[str, Any], n: int, first_dense_default: int) -> tuple[bool, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        first = int(raw.get("first_k_dense_replace", first_dense_default))
        return tuple(i >= first for i in range(n))
    if len(types) < n or any(t not in ("dense", "sparse") for t in types):
        raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of {n} layers")
    return tuple(t == "sparse" for t in types[:n])


def _indexer_shared(raw: dict[str, Any], n: int) -> tuple[bool, ...]:
    """GLM-5 ``indexer_types`` (or the ``index_topk_pattern`` / ``index_topk_freq`` it derives from)."""
    types = raw.get("indexer_types")
    if types is None:
        pattern = raw.get("index_topk_pattern")
        if isinstance(pattern, str):
            types = [{"F": "full", "S": "shared"}[c] for c in pattern]
        elif pattern is not None:
            types = list(pattern)
        else:
            freq = max(int(raw.get("index_topk_freq", 1)), 1)
            offset = int(raw.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) < n or any(t not in ("full", "shared") for t in types) or types[0] != "full":
        raise ValueError("indexer_types must be 'full' or 'shared' per layer, starting with 'full'")
    return tuple(t == "shared" for t in types[:n])


def _dsa(raw: dict[str, Any], arch: str, model_id: str, first_dense_default: int) -> ModelConfig:
    """DeepSeek-V3 MLA + MoE, plus the indexer; ``mlp_layer_types`` says which layers are MoE."""
    if not raw.get("q_lora_rank"):
        raise ValueError("q_lora_rank is required: the DSA indexer reads the query's low-rank latent")
    base = _deepseek_v3({**raw, "rope_interleave": True}, model_id, None)
    n = base.num_layers
    rope_dim = base.qk_rope_head_dim
    head_dim = int(raw.get("index_head_dim", 128))
    if head_dim < rope_dim:
        raise ValueError(f"index_head_dim {head_dim} is smaller than qk_rope_head_dim {rope_dim}")
    dsa = DsaConfig(
        topk=int(raw.get("index_topk", 2048)),
        n_heads=int(raw.get("index_n_heads", 64 if arch == "deepseek_v32" else 32)),
        head_dim=head_dim,
        rope_interleaved=arch == "glm_moe_dsa",
        shared=_indexer_shared(raw, n) if arch == "glm_moe_dsa" else (False,) * n,
    )
    return replace(base, arch=arch, attention="dsa", moe_layers=_mlp_layer_types(raw, n, first_dense_default),
                   rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6 if arch == "deepseek_v32" else 1e-5)), dsa=dsa)


def _deepseek_v32(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    return _dsa(raw, "deepseek_v32", model_id, 3)


def _glm_moe_dsa(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    return _dsa({"n_group": 1, "topk_group": 1, **raw}, "glm_moe_dsa", model_id, 3)


def _qwen3_5_moe(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    """The language model of a Qwen3.5-MoE checkpoint (``text_config``); the vision tower is not read."""
    text = {**raw.get("text_config", raw)}
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    c = _common(text, "qwen3_5_moe", model_id)
    c["raw"] = raw
    n = c["num_layers"]
    types = text.get("layer_types") or [
        "linear_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) else "full_attention"
        for i in range(n)
    ]
    if len(types) < n or any(t not in ("linear_attention", "full_attention") for t in types):
        raise ValueError(f"layer_types must name 'linear_attention' or 'full_attention' for each of {n} layers")
    params = dict(text.get("rope_parameters") or {})
    partial = float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    deltanet = DeltaNetConfig(
        layers=tuple(t == "linear_attention" for t in types[:n]),
        num_k_heads=int(text.get("linear_num_key_heads", 16)),
        num_v_heads=int(text.get("linear_num_value_heads", 32)),
        k_head_dim=int(text.get("linear_key_head_dim", 128)),
        v_head_dim=int(text.get("linear_value_head_dim", 128)),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
    )
    if deltanet.num_v_heads % deltanet.num_k_heads:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    shared = int(text.get("shared_expert_intermediate_size", 0) or 0)
    return ModelConfig(
        **c,
        rope=_rope(text, "qwen3_5_moe", int(c["head_dim"] * partial)),
        moe_layers=(True,) * n,
        sliding_windows=(None,) * n,
        attention="qwen3_5",
        qkv_bias=bool(text.get("attention_bias", False)),
        o_bias=bool(text.get("attention_bias", False)),
        qk_norm="head",
        num_experts=_n_experts(text),
        top_k=int(text["num_experts_per_tok"]),
        moe_intermediate_size=int(text["moe_intermediate_size"]),
        norm_topk_prob=True,
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
        deltanet=deltanet,
    )


ARCHITECTURES = ARCHITECTURES + ("deepseek_v32", "glm_moe_dsa", "qwen3_5_moe")
_PARSERS.update(deepseek_v32=_deepseek_v32, glm_moe_dsa=_glm_moe_dsa, qwen3_5_moe=_qwen3_5_moe)
