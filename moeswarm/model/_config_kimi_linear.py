"""Kimi Linear (``kimi_linear``): config.json parser, its attention kind (Kimi delta attention beside
MLA without RoPE), caches and tensor names.

Read from transformers 5.24 (``models/kimi_linear``).  Per ``layer_types``:

* ``full_attention``: DeepSeek's MLA (``q_proj`` or a q LoRA, ``kv_a`` + norm, ``kv_b``) with **no
  RoPE at all**: the "rope" part of the key is the shared ``kv_a`` slice, unrotated; scale
  ``(nope + rope) ** -0.5``.
* ``linear_attention`` (KDA): q, k, v projections (``linear_num_heads`` heads of ``linear_head_dim``)
  through one depthwise causal convolution of width ``linear_conv_kernel_dim`` and SiLU; q and k
  L2-normalised (q also times ``head_dim ** -0.5``); a forget gate per head *and channel*,
  ``g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)``, and ``beta = sigmoid(b(x))``; per head the
  state ``S (dk, dv)`` follows the delta rule with that per-channel decay

      S <- exp(g_t)[:, None] * S;   S <- S + k_t (beta_t (v_t - k_t S));   o_t = q_t S

  (transformers runs prefill in 64-token chunks, decode token by token; the engine runs the
  recurrence, the same sums in another order); the output is RMS-normalised per head times
  ``sigmoid(g_b(g_a(x)))``, then ``o_proj``.  The cache holds the convolution's last inputs and ``S``.

MLPs: a dense first layer, then MoE with DeepSeek-V3's sigmoid group router (correction bias,
``routed_scaling_factor``) and shared experts.  The hub's spellings (``num_experts``,
``num_experts_per_token``, ``moe_renormalize``, ``num_expert_group``, ``num_shared_experts``,
``linear_attn_config`` with 1-based ``kda_layers`` / ``full_attn_layers``, ``block_sparse_moe.*``,
``q/k/v_conv1d``, the forget gate's tensors on ``self_attn``) and transformers' both load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ._attn_deltanet import DeltaNetState, _conv, _l2norm, _softplus
from .attention import LayerCache, Rope, linear, mla, rms_norm
from .config import ModelConfig, RopeConfig, _common, register_family
from .convert import RULES, Item, Op, Rule, chunk, squeeze
from .experts import f32, sigmoid
from .transformer import ATTENTION_KINDS, LAYER_CACHES
from .weights import FAMILY_SHAPES, expected_shapes

# KimiLinearConfig's field defaults (transformers 5.24) that the engine reads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "attention_bias": False, "num_local_experts": 256, "linear_head_dim": 128, "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
}
# the hub's config.json names -> transformers' (KimiLinearConfig.attribute_map)
_HUB_NAMES = {"model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
              "num_expert_group": "n_group", "num_experts": "num_local_experts",
              "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts"}


@dataclass(frozen=True)
class KimiLinearSettings:
    """What Kimi Linear's layers read beyond MLA's fields (``ModelConfig.family``)."""

    linear: tuple[bool, ...]  # per layer: True = Kimi delta attention, False = MLA without RoPE
    heads: int  # KDA heads
    head_dim: int  # KDA q/k/v width per head
    conv_kernel: int  # KDA causal convolution width


def _kimi_linear(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **{_HUB_NAMES.get(k, k): v for k, v in raw.items()}}
    lin = t.get("linear_attn_config") or {}
    heads, head_dim = int(lin.get("num_heads", t["linear_num_heads"])), int(lin.get("head_dim", t["linear_head_dim"]))
    kernel = int(lin.get("short_conv_kernel_size", t["linear_conv_kernel_dim"]))
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    if t["attention_bias"]:
        raise ValueError("attention_bias is not supported (Kimi Linear has none)")
    n = int(t["num_hidden_layers"])
    types = t.get("layer_types")
    if types is None and "kda_layers" in lin and "full_attn_layers" in lin:
        full = {int(i) - 1 for i in lin["full_attn_layers"]}  # 1-based in the hub's file
        types = ["full_attention" if i in full else "linear_attention" for i in range(n)]
    types = list(types or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)])[:n]
    dense = int(t.get("first_k_dense_replace", 1))
    mlp = list(t.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(n)])[:n]
    nope, rd = int(t["qk_nope_head_dim"]), int(t["qk_rope_head_dim"])
    c = _common(t, "kimi_linear", model_id)
    c.update(raw=raw, head_dim=nope + rd)
    return ModelConfig(
        **c,
        rope=RopeConfig(theta=10_000.0, dim=rd),  # never applied: Kimi Linear's MLA has no RoPE
        moe_layers=tuple(kind == "sparse" for kind in mlp),
        sliding_windows=(None,) * n,
        attention="kimi_linear",
        attention_scale=(nope + rd) ** -0.5,
        q_lora_rank=int(t["q_lora_rank"]) if t.get("q_lora_rank") else None,
        kv_lora_rank=int(t["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rd,
        v_head_dim=int(t["v_head_dim"]),
        num_experts=int(t["num_local_experts"]),
        top_k=int(t["num_experts_per_tok"]),
        moe_intermediate_size=int(t["moe_intermediate_size"]),
        dense_intermediate_size=int(t["intermediate_size"]),
        router="sigmoid_group",
        norm_topk_prob=bool(t["norm_topk_prob"]),
        routed_scaling_factor=float(t["routed_scaling_factor"]),
        n_group=int(t["n_group"]),
        topk_group=int(t["topk_group"]),
        shared_intermediate_size=int(t["moe_intermediate_size"]) * int(t["n_shared_experts"] or 0),
        family=KimiLinearSettings(linear=tuple(kind == "linear_attention" for kind in types), heads=heads,
                                  head_dim=head_dim, conv_kernel=kernel),
    )


class _Unrotated(Rope):
    """MLA's rotation left out (Kimi Linear's full-attention layers have no RoPE): empty tables, and
    ``apply`` hands its input back."""

    def __init__(self) -> None:
        self.interleaved = False

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        empty = np.zeros((len(positions), 0), np.float32)
        return empty, empty

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return x


_NOPE = _Unrotated()


def _kda(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig, cache: DeltaNetState) -> np.ndarray:
    """Kimi delta attention.  x (B, T, H) -> (B, T, H)."""
    s: KimiLinearSettings = cfg.family
    B, T, _ = x.shape
    h, d = s.heads, s.head_dim
    qkv = np.concatenate([linear(x, w[p]) for p in ("q", "k", "v")], axis=-1)  # type: ignore[arg-type]  # (B, T, 3hd)
    conv = np.concatenate([f32(w[f"{p}_conv"]) for p in ("q", "k", "v")])  # type: ignore[arg-type]  # (3hd, K)
    mixed = _conv(qkv, conv, cache).reshape(B, T, 3, h, d)
    q = _l2norm(mixed[:, :, 0]) * np.float32(d**-0.5)  # (B, T, h, d)
    k, v = _l2norm(mixed[:, :, 1]), mixed[:, :, 2]
    g = linear(linear(x, w["f_a"]), w["f_b"]) + f32(w["dt_bias"])  # type: ignore[arg-type]  # (B, T, h*d)
    g = (f32(w["A"])[:, None] * _softplus(g.reshape(B, T, h, d))).astype(np.float32)  # type: ignore[arg-type]
    beta = sigmoid(linear(x, w["b"]))  # type: ignore[arg-type]  # (B, T, h)
    state = cache.state if cache.state is not None else np.zeros((B, h, d, d), np.float32)
    out = np.zeros((B, T, h, d), np.float32)
    for i in range(T):
        state = state * np.exp(g[:, i])[..., None]
        delta = (v[:, i] - np.einsum("bhkv,bhk->bhv", state, k[:, i])) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        out[:, i] = np.einsum("bhkv,bhk->bhv", state, q[:, i])
    cache.state, cache.length = state, cache.length + T
    gate = linear(linear(x, w["g_a"]), w["g_b"]).reshape(B, T, h, d)  # type: ignore[arg-type]
    out = rms_norm(out, w["o_norm"], cfg.rms_norm_eps) * sigmoid(gate)  # type: ignore[arg-type]
    return linear(out.reshape(B, T, h * d), w["o"])  # type: ignore[arg-type]


def kimi_linear_attention(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig, rope: Rope,
                          cache: object, positions: np.ndarray, layer: int,
                          step: dict[str, Any] | None = None) -> np.ndarray:
    """Layer ``layer``'s token mixing: KDA or MLA without RoPE.  x (B, T, H) -> (B, T, H)."""
    if cfg.family.linear[layer]:
        assert isinstance(cache, DeltaNetState)
        return _kda(w, x, cfg, cache)
    assert isinstance(cache, LayerCache)
    return mla(w, x, cfg, _NOPE, cache, positions)


def _new_cache(cfg: ModelConfig, layer: int) -> object:
    return DeltaNetState() if cfg.family.linear[layer] else LayerCache()


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """MLA's and the MLPs' shapes, with each KDA layer's own attention tensors instead of MLA's."""
    s: KimiLinearSettings = cfg.family
    shapes = expected_shapes(replace(cfg, arch="deepseek_v3", attention="mla"))
    H, hd, K = cfg.hidden_size, s.heads * s.head_dim, s.conv_kernel
    for L in range(cfg.num_layers):
        if not s.linear[L]:
            continue
        p = f"{L}.attn."
        for name in [n for n in shapes if n.startswith(p)]:
            del shapes[name]
        shapes.update({p + "q": (hd, H), p + "k": (hd, H), p + "v": (hd, H), p + "q_conv": (hd, K),
                       p + "k_conv": (hd, K), p + "v_conv": (hd, K), p + "f_a": (s.head_dim, H),
                       p + "f_b": (hd, s.head_dim), p + "dt_bias": (hd,), p + "A": (s.heads,), p + "b": (s.heads, H),
                       p + "g_a": (s.head_dim, H), p + "g_b": (hd, s.head_dim), p + "o_norm": (s.head_dim,),
                       p + "o": (H, hd)})
    return shapes


def _decay_rate() -> Op:
    """``A_log [1, 1, h, 1]`` -> ``A = -exp(A_log)`` ``(h,)`` in float32."""

    def op(items: Iterable[Item]) -> Iterator[Item]:
        for fields, a in items:
            yield fields, -np.exp(a.astype(np.float32).reshape(-1))

    return op


PARSERS = {"kimi_linear": _kimi_linear}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})
ATTENTION_KINDS["kimi_linear"] = kimi_linear_attention
LAYER_CACHES["kimi_linear"] = _new_cache
FAMILY_SHAPES["kimi_linear"] = _shapes

_L = r"model\.layers\.(?P<L>\d+)\."
_A = _L + r"self_attn\.(?:forget_gate\.)?"
_M = _L + r"(?:mlp|block_sparse_moe)\."
RULES.update(kimi_linear=(
    Rule(_A + r"(?P<p>f_a|f_b|g_a|g_b|b)_proj\.weight", "{L}.attn.{p}"),
    Rule(_A + r"dt_bias", "{L}.attn.dt_bias"),
    Rule(_A + r"A_log", "{L}.attn.A", (_decay_rate(),)),
    Rule(_A + r"o_norm\.weight", "{L}.attn.o_norm"),
    Rule(_A + r"(?P<p>[qkv])_conv1d\.weight", "{L}.attn.{p}_conv", (squeeze(1),)),
    Rule(_A + r"conv1d\.weight", "{L}.attn.{p}_conv", (squeeze(1), chunk("p", ("q", "k", "v")))),
    Rule(_M + r"(?P<p>gate|up|down)_proj\.weight", "{L}.mlp.{p}"),
    Rule(_M + r"shared_experts\.(?P<p>gate|up|down)_proj\.weight", "{L}.shared.{p}"),
    Rule(_M + r"gate\.e_score_correction_bias", "{L}.router_score_bias"),
) + RULES["deepseek_v3"])  # MLA, norms, router, experts in either layout
