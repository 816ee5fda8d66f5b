"""Shapes at real scale without real weights: what a MoE model's config.json implies.

``model_size(config)`` counts parameters from the fields of a Hugging Face ``config.json`` alone,
read generically (so it works for model types the engine does not run yet): total and active
parameters, one routed expert's parameters, and from those the bytes per expert in each stored
format, the working set per token and what a swarm or a memory budget implies.  It reads the
``text_config`` of a vision-language checkpoint (the vision tower is not counted: it is not served).

Counted exactly: embeddings, LM head, attention (GQA with per-head QK norm and Qwen3.5's output
gate, MLA, gated DeltaNet linear attention; DeepSeek's DSA indexer and MiniMax M3's lightning
indexer where the config has them; DeepSeek-V4's compressed attention, indexer and
hyper-connections; Llama 4's interleaved dense and MoE layers), dense MLPs, routers,
shared and routed experts, RMSNorms.  Not counted: multi-token-prediction layers (not used to generate).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ._stored import QuantFormat, quant_format

# GGML types (block of weights, bytes per block), as gguf.GGML_QUANT_SIZES has them (a test checks)
GGML_BLOCKS = {"Q8_0": (32, 34), "Q6_K": (256, 210), "Q5_K": (256, 176), "Q4_K": (256, 144),
               "IQ4_XS": (256, 136), "Q4_0": (32, 18), "Q3_K": (256, 110), "Q2_K": (256, 84)}
# stored formats plan prints: name -> QuantFormat (published formats) or None (16-bit) or a GGML type
PUBLISHED = {"FP8": QuantFormat("fp8_block", block=(128, 128), scale_bytes=4),
             "MXFP4": QuantFormat("mxfp4", group=32, scale_bytes=1),
             "INT4": QuantFormat("int4_group", group=32, scale_bytes=2)}
FORMATS = ("BF16", *PUBLISHED, *GGML_BLOCKS)
_DTYPE_FORMATS = {"bfloat16": "BF16", "float16": "FP16", "float32": "FP32"}  # a config's dtype, unquantised
_QK_NORM = ("minimax_m3_vl_text", "minimax_m3_vl", "qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe",
            "qwen3_next", "glm_moe_dsa", "dots1", "hunyuan_v1_moe")  # per-head q/k RMSNorm (unless the config says use_qk_norm; GLM-4.5's default is off)
_NO_O_BIAS = ("glm4_moe",)  # attention_bias puts biases on q/k/v only
_QK_NORM_FULL = ("minimax_m2", "olmoe", "flex_olmo")  # q/k RMSNorm over the whole projection


def _first(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is None:
        raise KeyError(names[0])
    return default


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of one model, from its config.json."""

    model_type: str
    hidden_size: int
    num_layers: int
    moe_layers: int
    num_experts: int  # routed experts per MoE layer
    top_k: int
    expert_matrices: tuple[tuple[int, int], ...]  # one routed expert's [out, in] matrices
    expert_extra: int  # one routed expert's other parameters (biases)
    total: int  # every parameter
    embeddings: int  # the input embedding and the LM head (counted once when tied)
    quant: QuantFormat | None  # how the checkpoint stores its experts (quantization_config), if it says
    dtype: str = "bfloat16"  # the config's dtype (torch_dtype): what unquantised tensors are stored as

    @property
    def expert_params(self) -> int:
        return sum(r * c for r, c in self.expert_matrices) + self.expert_extra

    @property
    def routed_experts(self) -> int:
        return self.moe_layers * self.num_experts

    @property
    def active_experts(self) -> int:
        return self.moe_layers * self.top_k

    @property
    def backbone(self) -> int:
        """Everything but the routed experts (attention, norms, routers, shared experts, embeddings)."""
        return self.total - self.routed_experts * self.expert_params

    @property
    def active(self) -> int:
        """Parameters one token touches: the backbone plus its top-k experts in every MoE layer."""
        return self.backbone + self.active_experts * self.expert_params

    def expert_bytes(self, fmt: str) -> int:
        """Bytes of one routed expert stored as ``fmt`` (one of ``FORMATS``); biases as 16-bit."""
        extra = 2 * self.expert_extra
        if fmt in ("BF16", "FP16"):
            return 2 * self.expert_params
        if fmt == "FP32":
            return 4 * self.expert_params
        if fmt in PUBLISHED:
            return sum(PUBLISHED[fmt].matrix_bytes(r, c) for r, c in self.expert_matrices) + extra
        block, size = GGML_BLOCKS[fmt]
        return sum(r * c // block * size for r, c in self.expert_matrices) + extra

    def stored_format(self) -> str:
        """The format the checkpoint's config says its experts are stored in: its quantization_config,
        else its dtype (BF16 if it names none)."""
        if self.quant is None:
            return _DTYPE_FORMATS.get(self.dtype, "BF16")
        return {"fp8_block": "FP8", "mxfp4": "MXFP4", "int4_group": "INT4"}[self.quant.method]

    def backbone_bytes(self, fmt: str) -> int:
        """The backbone at 16 bits, or in FP8 when the checkpoint stores its linear layers so."""
        if fmt == "FP8":  # DeepSeek/GLM/MiniMax FP8 checkpoints quantise attention and shared experts too
            return self.embeddings * 2 + (self.backbone - self.embeddings)
        return (4 if fmt == "FP32" else 2) * self.backbone


def _one(value: Any) -> int:
    """An int, or the first of a per-layer list (Hunyuan's ``num_experts`` / ``moe_topk``)."""
    return int(value[0] if isinstance(value, list) else value)


def _moe_layer_flags(t: dict[str, Any], n: int, experts: int) -> list[bool]:
    if t.get("moe_layer_interval"):  # ERNIE 4.5
        step, start, end = int(t["moe_layer_interval"]), int(t.get("moe_layer_start_index") or 0), int(
            t.get("moe_layer_end_index", -1))
        end = n - 1 if end == -1 else end
        return [(i + 1) % step == 0 and start <= i <= end for i in range(n)]
    if t.get("mlp_layer_types"):
        return [kind == "sparse" for kind in t["mlp_layer_types"][:n]]
    if experts == 0:
        return [False] * n
    if t.get("moe_layer_freq") and isinstance(t["moe_layer_freq"], list):
        return [bool(f) for f in t["moe_layer_freq"][:n]]
    first_dense = int(t.get("first_k_dense_replace") or 0)
    only = set(t.get("mlp_only_layers") or [])
    step = int(t.get("decoder_sparse_step") or 1)
    return [i >= first_dense and i not in only and (i + 1) % step == 0 for i in range(n)]


_GATED_ATTENTION = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")  # q_proj also yields the output gate


def _linear_attention(t: dict[str, Any], H: int) -> int:
    """A gated DeltaNet layer (Qwen3.5 / Qwen3-Next ``linear_attention``)."""
    nk, dk = int(t["linear_num_key_heads"]), int(t["linear_key_head_dim"])
    nv, dv = int(t["linear_num_value_heads"]), int(t["linear_value_head_dim"])
    qkv = 2 * nk * dk + nv * dv
    return H * qkv + H * nv * dv + 2 * H * nv + qkv * int(t["linear_conv_kernel_dim"]) + 2 * nv + dv + nv * dv * H


def _attention(t: dict[str, Any], H: int, layer_type: str) -> int:
    if t.get("model_type") == "deepseek_v4":
        return _deepseek_v4_attention(t, H, layer_type)
    if t.get("model_type") == "mimo_v2_flash":
        return _mimo_attention(t, H, layer_type)
    if t.get("model_type") == "kimi_linear" and layer_type == "linear_attention":
        return _kda_attention(t, H)
    if t.get("model_type") == "minimax" and layer_type == "linear_attention":  # lightning: qkv, gate, norm, out
        hd = int(t["num_attention_heads"]) * int(t.get("head_dim") or H // int(t["num_attention_heads"]))
        return 3 * H * hd + H * hd + hd + hd * H
    if layer_type == "linear_attention":
        return _linear_attention(t, H)
    nh = int(t["num_attention_heads"])
    norms = 0
    if t.get("kv_lora_rank"):  # MLA
        nope, rope, v, kvr = (int(t["qk_nope_head_dim"]), int(t["qk_rope_head_dim"]),
                              int(t.get("v_head_dim") or t["qk_nope_head_dim"]), int(t["kv_lora_rank"]))
        qr = int(t.get("q_lora_rank") or 0)
        q = H * qr + qr + qr * nh * (nope + rope) if qr else H * nh * (nope + rope)
        p = q + H * (kvr + rope) + kvr + kvr * nh * (nope + v) + nh * v * H
        if t.get("index_topk") and t.get("index_n_heads"):  # DSA indexer (DeepSeek-V3.2, GLM-5)
            inh, ihd = int(t["index_n_heads"]), int(t["index_head_dim"])
            p += (qr or H) * inh * ihd + H * ihd + 2 * ihd + H * inh
        return p
    hd = int(t.get("head_dim") or H // nh)
    nkv = int(t.get("num_key_value_heads") or nh)
    p = H * nh * hd * (2 if t.get("model_type") in _GATED_ATTENTION else 1) + 2 * H * nkv * hd + nh * hd * H
    if t.get("attention_bias"):
        p += nh * hd + 2 * nkv * hd + (0 if t.get("model_type") in _NO_O_BIAS else H)
    if t.get("qk_norm_type") == "per_layer" or t.get("model_type") in _QK_NORM_FULL:
        norms = nh * hd + nkv * hd
    elif t.get("use_qk_norm", t.get("model_type") in _QK_NORM):
        norms = 2 * hd
    if layer_type == "minimax_m3_sparse":  # the lightning indexer
        inh, ihd = int(t["index_n_heads"]), int(t["index_head_dim"])
        p += H * inh * ihd + H * ihd + 2 * ihd
    return p + norms


def _mimo_attention(t: dict[str, Any], H: int, layer_type: str) -> int:
    """MiMo-V2-Flash: values ``v_head_dim`` wide; sliding layers have twice the kv heads and a sink per head."""
    nh, hd, vd = int(t.get("num_attention_heads", 64)), int(t.get("head_dim", 192)), int(t.get("v_head_dim", 128))
    nkv = int(t.get("num_key_value_heads", 4)) * (2 if layer_type == "sliding_attention" else 1)
    return H * nh * hd + H * nkv * (hd + vd) + nh * vd * H + (nh if layer_type == "sliding_attention" else 0)


_KIMI_HUB_NAMES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
                   "num_shared_experts": "n_shared_experts", "num_expert_group": "n_group"}


def _kimi_linear_text(t: dict[str, Any], n: int) -> dict[str, Any]:
    """Kimi Linear's fields (the hub's spellings too) in the names ``model_size`` reads."""
    t = {**{_KIMI_HUB_NAMES.get(k, k): v for k, v in t.items()}}
    lin = t.get("linear_attn_config") or {}
    types = t.get("layer_types")
    if types is None and "full_attn_layers" in lin:
        full = {int(i) - 1 for i in lin["full_attn_layers"]}
        types = ["full_attention" if i in full else "linear_attention" for i in range(n)]
    dense = int(t.get("first_k_dense_replace", 1))
    return {**t, "layer_types": types or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)],
            "mlp_layer_types": t.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(n)],
            "n_shared_experts": t.get("n_shared_experts", 1), "linear_attn_config": lin}


def _kda_attention(t: dict[str, Any], H: int) -> int:
    """A Kimi delta attention layer: q/k/v, their convolutions, the low-rank forget gate (+ dt_bias,
    A_log), beta, the low-rank output gate, the output norm and projection."""
    lin = t.get("linear_attn_config") or {}
    h, d = int(lin.get("num_heads", t.get("linear_num_heads", 32))), int(lin.get("head_dim", t.get("linear_head_dim", 128)))
    K = int(lin.get("short_conv_kernel_size", t.get("linear_conv_kernel_dim", 4)))
    return 3 * H * h * d + 3 * h * d * K + 2 * (H * d + d * h * d) + h * d + h + H * h + d + h * d * H


def _mimo_text(t: dict[str, Any], n: int) -> dict[str, Any]:
    """MiMo-V2-Flash's layer patterns as ``MiMoV2FlashConfig`` derives them when the file leaves them out."""
    types = t.get("layer_types") or ["full_attention" if (i == 0 or not (i + 1) % 6) else "sliding_attention"
                                     for i in range(n)]
    return {**t, "layer_types": types, "mlp_layer_types": t.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)}


def _mistral_large4_attention(t: dict[str, Any], H: int, L: int) -> int:
    """Mistral Large 4's layer ``L``: MLA without a q LoRA plus a per-head softmax scaling (ssmax); a
    NoPE layer's keys are all "nope" (``no_rope_layers``); a layer reading an earlier layer's latent
    cache (``kv_source_layers``) has no ``kv_a``; a ``full`` indexer layer its own DSA indexer (queries
    from the LayerNormed hidden state, with their own ssmax)."""
    n = int(t["num_hidden_layers"])
    nh, kvr, v = int(t.get("num_attention_heads", 64)), int(t.get("kv_lora_rank", 512)), int(t.get("v_head_dim", 128))
    nope, rope = int(t.get("qk_nope_head_dim", 64)), int(t.get("qk_rope_head_dim", 64))
    rotary = bool((t.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(n)])[L])
    own_kv = (t.get("kv_source_layers") or list(range(n)))[L] == L
    p = H * nh * (nope + rope) + 2 * nh + kvr * nh * (nope + (0 if rotary else rope) + v) + nh * v * H
    if own_kv:
        p += H * (kvr + (rope if rotary else 0)) + kvr
    if (t.get("indexer_types") or ["full"] * n)[L] == "full":
        inh, ihd = int(t.get("index_n_heads", 32)), int(t.get("index_head_dim", 128))
        p += 2 * H + H * inh * ihd + 2 * inh + H * ihd + 2 * ihd + H * inh
    return p


def _llama4_text(t: dict[str, Any], n: int) -> dict[str, Any]:
    """Llama 4's fields in the names ``model_size`` reads: MoE layers from ``moe_layers`` (or every
    ``interleave_moe_layer_step``-th), dense layers ``intermediate_size_mlp`` wide, one shared expert
    as wide as a routed one, and a q/k norm without weights (nothing to count)."""
    step = int(t.get("interleave_moe_layer_step") or 1)
    moe = set(t["moe_layers"] if t.get("moe_layers") is not None else range(step - 1, n, step))
    return {**t, "mlp_layer_types": ["sparse" if i in moe else "dense" for i in range(n)], "use_qk_norm": False,
            "dense_intermediate_size": t.get("intermediate_size_mlp", 16384),
            "shared_intermediate_size": t.get("intermediate_size", 8192)}


_V4_LEGACY_LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _deepseek_v4_text(t: dict[str, Any], n: int) -> dict[str, Any]:
    """DeepSeek-V4's layers in the names ``model_size`` reads (as ``DeepseekV4Config`` derives them,
    also from the legacy ``compress_ratios`` / ``num_hash_layers``): every MLP is MoE (hash-routed
    or learned), attention per ``layer_types``."""
    types = t.get("layer_types")
    if types is None and t.get("compress_ratios") is not None:
        types = [_V4_LEGACY_LAYER_TYPES[int(r)] for r in t["compress_ratios"]]
    if types is None:
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    return {**t, "layer_types": list(types[:n]), "mlp_layer_types": ["sparse"] * n,
            "n_shared_experts": t.get("n_shared_experts", 1)}


def _deepseek_v4_attention(t: dict[str, Any], H: int, layer_type: str) -> int:
    """One DeepSeek-V4 attention: low-rank q (+ norm), one shared KV head (+ norm), grouped low-rank
    output, sinks; a compressor on CSA / HCA layers (CSA's with its lightning indexer)."""
    nh, hd, qr = int(t["num_attention_heads"]), int(t.get("head_dim") or 512), int(t.get("q_lora_rank") or 1024)
    groups, olr = int(t.get("o_groups") or 8), int(t.get("o_lora_rank") or 1024)
    p = H * qr + qr + qr * nh * hd + H * hd + hd + olr * nh * hd + groups * olr * H + nh
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(t.get("compress_rates") or {})}
    if layer_type == "heavily_compressed_attention":
        p += 2 * H * hd + rates[layer_type] * hd + hd
    elif layer_type == "compressed_sparse_attention":
        inh, ihd = int(t.get("index_n_heads") or 64), int(t.get("index_head_dim") or 128)
        rate = rates[layer_type]
        p += 4 * H * hd + rate * 2 * hd + hd  # two overlapping series, 2 * head_dim wide
        p += 4 * H * ihd + rate * 2 * ihd + ihd + qr * inh * ihd + H * inh  # the indexer's own compressor, q, weights
    return p


def _hyper_connections(t: dict[str, Any], H: int, n: int) -> int:
    """DeepSeek-V4's hyper-connections: two per layer (attention, MLP) and the head's."""
    m = int(t.get("hc_mult") or 4)
    per = (2 + m) * m * (m * H + 1) + 3
    return n * 2 * per + m * m * H + m + 1


def _dbrx_text(t: dict[str, Any]) -> dict[str, Any]:
    """DBRX's nested ``attn_config`` / ``ffn_config`` in the names ``model_size`` reads (its LayerNorms
    without bias have as many parameters as RMSNorms)."""
    attn, ffn = t.get("attn_config") or {}, t.get("ffn_config") or {}
    return {**t, "hidden_size": t["d_model"], "num_hidden_layers": t["n_layers"], "num_attention_heads": t["n_heads"],
            "num_key_value_heads": attn.get("kv_n_heads", 1), "num_local_experts": ffn.get("moe_num_experts", 4),
            "num_experts_per_tok": ffn.get("moe_top_k", 1), "intermediate_size": ffn.get("ffn_hidden_size", 3584)}


def _longcat_text(t: dict[str, Any]) -> dict[str, Any]:
    """LongCat-Flash's fields in the names ``model_size`` reads: ``num_layers`` layers, each counted as
    one MLA attention and a MoE block whose "shared expert" is the two dense MLPs (always active);
    ``model_size`` adds the second attention and the zero-computation experts' router rows (they have
    no other parameters)."""
    return {**t, "num_hidden_layers": t["num_layers"], "n_routed_experts": t["n_routed_experts"],
            "num_experts_per_tok": t["moe_topk"], "moe_intermediate_size": t["expert_ffn_hidden_size"],
            "shared_intermediate_size": 2 * int(t["ffn_hidden_size"])}


def model_size(raw: dict[str, Any]) -> ModelSize:
    """Count a config.json's parameters (``KeyError`` names a field it lacks)."""
    t = raw.get("text_config") or raw
    t = {**t, "model_type": t.get("model_type") or raw.get("model_type")}
    if t["model_type"] in ("llama4", "llama4_text"):
        t = _llama4_text(t, int(t["num_hidden_layers"]))
    if t["model_type"] == "deepseek_v4":
        t = _deepseek_v4_text(t, int(t["num_hidden_layers"]))
    if t["model_type"] == "dbrx":
        t = _dbrx_text(t)
    if t["model_type"] == "longcat_flash":
        t = _longcat_text(t)
    if t["model_type"] == "mimo_v2_flash":
        t = _mimo_text(t, int(t["num_hidden_layers"]))
    if t["model_type"] == "kimi_linear":
        t = _kimi_linear_text(t, int(t["num_hidden_layers"]))
    if t["model_type"] == "minimax" and not t.get("layer_types"):  # MiniMaxConfig's default: every other layer
        t = {**t, "layer_types": ["full_attention" if (i + 1) % 2 else "linear_attention"
                                  for i in range(int(t["num_hidden_layers"]))]}
    if t["model_type"] == "mistral_large4_text":  # what its config class derives from what the file leaves out
        n_all, dense = int(t["num_hidden_layers"]), int(t.get("first_k_dense_replace", 1))
        t = {**t, "n_shared_experts": t.get("n_shared_experts", 1), "mlp_layer_types": t.get("mlp_layer_types") or (
            ["dense"] * min(dense, n_all) + ["sparse"] * max(n_all - dense, 0))}
    if t["model_type"] == "hunyuan_v1_moe":  # experts and shared MLP are intermediate_size wide: transformers and
        # the engine do not read moe_intermediate_size (a per-layer list in Hunyuan-A13B's config.json)
        t = {key: v for key, v in t.items() if key != "moe_intermediate_size"}
    H, n, V = int(t["hidden_size"]), int(t["num_hidden_layers"]), int(t["vocab_size"])
    E = _one(_first(t, "n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts", default=0))
    k = _one(_first(t, "num_experts_per_tok", "moe_topk", "moe_k", "top_k", default=0))
    I_e = int(_first(t, "moe_intermediate_size", "intermediate_size"))
    I_d = int(_first(t, "dense_intermediate_size", "intermediate_size", default=0))  # needed only by dense layers
    shared = int(t.get("n_shared_experts") or t.get("moe_num_shared_experts") or 0) * I_e or int(
        _first(t, "shared_intermediate_size", "shared_expert_intermediate_size", default=0))
    if t["model_type"] == "hunyuan_v1_moe":  # one shared MLP as wide as the experts
        shared = I_e
    gpt_oss = t["model_type"] == "gpt_oss"
    moe = _moe_layer_flags(t, n, E)
    interval = t.get("full_attention_interval")
    default_types = [("full_attention" if (i + 1) % int(interval) == 0 else "linear_attention") if interval
                     else "full_attention" for i in range(n)]
    layer_types = list(t.get("layer_types") or default_types)
    total = 0
    for L in range(n):
        attention = _mistral_large4_attention(t, H, L) if t["model_type"] == "mistral_large4_text" else _attention(
            t, H, layer_types[L])
        total += attention + 2 * H  # + input and post-attention RMSNorm
        if moe[L]:
            total += E * H + (E if gpt_oss or t["model_type"] == "ernie4_5_moe" else 0)  # router (+ its bias, a
            # parameter in gpt-oss and ERNIE's moe_statics; DeepSeek-V3's e_score_correction_bias is a buffer)
            total += 3 * H * shared + (H if t.get("shared_expert_intermediate_size") else 0)  # (+ Qwen's gate)
        elif I_d:
            total += 3 * H * I_d
        else:
            raise KeyError("intermediate_size")
    matrices = ((I_e, H), (I_e, H), (H, I_e))
    extra = 2 * I_e + H if gpt_oss else 0
    total += sum(moe) * E * (3 * H * I_e + extra)
    tied = bool(t.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)))
    embeddings = V * H * (1 if tied else 2)
    total += embeddings + H  # + the final norm
    if t["model_type"] == "deepseek_v4":
        total += _hyper_connections(t, H, n)
    if t["model_type"] == "longcat_flash":  # each layer's second attention (+ its norms), the zero experts' router rows
        total += n * (_attention(t, H, "full_attention") + 2 * H + int(t.get("zero_expert_num") or 0) * H)
    if t["model_type"] == "mistral_large4_text":  # LeRoPE's learned per-frequency alpha
        total += int(t.get("qk_rope_head_dim", 64)) // 2
    if t["model_type"] == "phimoe":  # LayerNorms with biases, the LM head's bias
        total += (2 * n + 1) * H + (V if t.get("lm_head_bias") else 0)
    name = str(raw.get("model_type") or t["model_type"])
    if raw.get("text_config"):
        name += f" (text model: {t['model_type']})"
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or t.get("torch_dtype") or t.get("dtype") or "bfloat16")
    return ModelSize(name, H, n, sum(moe), E, k, matrices, extra, total, embeddings,
                     quant_format(raw), dtype)


@dataclass(frozen=True)
class ModelCard:
    """What a published model's card says of its size, to print beside the count from config.json."""

    total: str  # total parameters as the card writes them ("355B")
    active: str  # active parameters per token ("32B")
    source: str  # where the card is (hub repository)


# shipped config name -> its model card's figures (cards round, and may count the
# multi-token-prediction layer, which plan leaves out)
MODEL_CARDS = {"glm-4.5": ModelCard("355B", "32B", "zai-org/GLM-4.5"),
               "qwen3-next-80b-a3b": ModelCard("80B", "3B", "Qwen/Qwen3-Next-80B-A3B-Instruct"),
               "llama-4-scout": ModelCard("109B", "17B", "meta-llama/Llama-4-Scout-17B-16E-Instruct"),
               "llama-4-maverick": ModelCard("400B", "17B", "meta-llama/Llama-4-Maverick-17B-128E-Instruct"),
               "mistral-small-4": ModelCard("119B", "6B", "mistralai/Mistral-Small-4-119B-2603"),
               "deepseek-v4-flash": ModelCard("284B", "13B", "deepseek-ai/DeepSeek-V4-Flash"),
               "deepseek-v4-pro": ModelCard("1.6T", "49B", "deepseek-ai/DeepSeek-V4-Pro"),
               "granite-3.0-3b-a800m": ModelCard("3.3B", "800M", "ibm-granite/granite-3.0-3b-a800m-instruct"),
               "dbrx": ModelCard("132B", "36B", "databricks/dbrx-instruct"),
               "phi-3.5-moe": ModelCard("41.9B", "6.6B", "microsoft/Phi-3.5-MoE-instruct"),
               "longcat-flash-chat": ModelCard("560B", "18.6B-31.3B", "meituan-longcat/LongCat-Flash-Chat"),
               "mimo-v2-flash": ModelCard("309B", "15B", "XiaomiMiMo/MiMo-V2-Flash"),
               "mistral-large-4": ModelCard("1T", "52B", "mistralai/Mistral-Large-4-1T-A52B"),
               "kimi-linear-48b-a3b": ModelCard("48B", "3B", "moonshotai/Kimi-Linear-48B-A3B-Instruct"),
               "minimax-text-01": ModelCard("456B", "45.9B", "MiniMaxAI/MiniMax-Text-01"),
               "dots-llm1": ModelCard("142B", "14B", "rednote-hilab/dots.llm1.inst"),
               "ernie-4.5-21b-a3b": ModelCard("21B", "3B", "baidu/ERNIE-4.5-21B-A3B-PT"),
               "hunyuan-a13b": ModelCard("80B", "13B", "tencent/Hunyuan-A13B-Instruct"),
               "glm-4.7-flash": ModelCard("30B", "3B", "zai-org/GLM-4.7-Flash")}


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """config.json from a file or a model folder."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError("config.json not found", path=str(p)) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"not valid JSON: {e}", path=str(p)) from None
    if not isinstance(raw, dict):
        raise CheckpointError("config.json is not a JSON object", path=str(p))
    return raw


def swarm_figures(size: ModelSize, fmt: str, *, nodes: int = 0, budget: int = 0) -> dict[str, float]:
    """What ``nodes`` expert nodes, or ``budget`` bytes of memory per machine, imply in ``fmt``."""
    one = size.expert_bytes(fmt)
    experts_total = size.routed_experts * one
    out: dict[str, float] = {"expert_bytes": one, "experts_total_bytes": experts_total,
                             "backbone_bytes": size.backbone_bytes(fmt),
                             "working_set_bytes": size.backbone_bytes(fmt) + size.active_experts * one}
    if nodes:
        per = math.ceil(size.routed_experts / nodes)
        out.update(nodes=nodes, experts_per_node=per, bytes_per_node=per * one)
    if budget:
        room = budget - out["backbone_bytes"]
        out.update(budget=budget, resident_experts_one_machine=max(0, min(size.routed_experts, room // one)),
                   machines_for_all_experts=math.ceil(experts_total / budget))
    return out
