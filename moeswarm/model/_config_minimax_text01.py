"""MiniMax-Text-01 (``minimax``, MiniMax v1): config.json parser, its decoder layer and lightning attention.

Read from transformers 5.24 (``models/minimax``).  Mixtral's GQA, MoE block and router, but:

* per ``layer_types``, ``linear_attention`` layers use **lightning attention**: ``silu(qkv_proj(x))``
  split per head into q, k, v (``head_dim`` each); per head ``h`` a decay ``s_h = base ** (h + 1) *
  (1 - L / (layers - 1 + 1e-5) + 1e-5)`` (``base = 2 ** (-8 / heads)``), and the state
  ``KV <- exp(-s_h) KV + k_t^T v_t``, ``o_t = q_t KV`` (transformers' prefill computes the same
  sums in 256-token blocks); then an RMSNorm over all heads (eps 1e-6), times
  ``sigmoid(output_gate(x))``, and ``out_proj``;
* the residual stream is the *normed* one (``DecoderLayerForm``): ``h = norm(x)``,
  ``x = h * alpha + attention(h) * beta``, ``h = norm(x)``, ``x = h * alpha' + moe(h) * beta'``,
  with the ``{full,linear}_attn_{alpha,beta}_factor`` and ``mlp_{alpha,beta}_factor`` of the config.

The hub's names (``block_sparse_moe``, ``experts.E.w1/w2/w3``) and transformers' packed ones both load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import ConfigError
from .attention import LayerCache, gqa, linear, rms_norm
from .config import ModelConfig, _common, _rope, register_family
from .convert import RULES, Rule
from .experts import sigmoid
from .transformer import DECODER_LAYERS, Model
from .weights import FAMILY_SHAPES, expected_shapes

# MiniMaxConfig's field defaults (transformers 5.24) that the engine reads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
    "block_size": 256, "full_attn_alpha_factor": 1, "full_attn_beta_factor": 1, "linear_attn_alpha_factor": 1,
    "linear_attn_beta_factor": 1, "mlp_alpha_factor": 1, "mlp_beta_factor": 1, "rope_theta": 1_000_000.0,
}
LIGHTNING_NORM_EPS = 1e-6  # MiniMaxRMSNorm's default: the lightning output norm is built without the config's eps


@dataclass(frozen=True)
class MiniMaxSettings:
    """What MiniMax-Text-01's layers read beyond Mixtral's fields (``ModelConfig.family``)."""

    linear: tuple[bool, ...]  # per layer: True = lightning attention, False = softmax GQA
    full_attn: tuple[float, float]  # (alpha, beta): x = norm(x) * alpha + attention * beta, softmax layers
    linear_attn: tuple[float, float]  # the same on lightning layers
    mlp: tuple[float, float]  # the same around the MoE block


def _minimax(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **raw}
    if "num_experts" in raw and "num_local_experts" not in raw:  # MiniMaxConfig.attribute_map
        t["num_local_experts"] = raw["num_experts"]
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    n = int(t["num_hidden_layers"])
    types = list(t.get("layer_types") or ["full_attention" if (i + 1) % 2 else "linear_attention"
                                          for i in range(n)])[:n]
    c = _common(t, "minimax", model_id)
    c["raw"] = raw
    window = t["sliding_window"]

    def pair(kind: str) -> tuple[float, float]:
        return float(t[f"{kind}_alpha_factor"]), float(t[f"{kind}_beta_factor"])

    return ModelConfig(
        **c,
        rope=_rope(t, "minimax", c["head_dim"]),
        moe_layers=(True,) * n,
        sliding_windows=(int(window) if window else None,) * n,
        attention="minimax",
        num_experts=int(t["num_local_experts"]),
        top_k=int(t["num_experts_per_tok"]),
        moe_intermediate_size=int(t["intermediate_size"]),
        norm_topk_prob=True,
        family=MiniMaxSettings(linear=tuple(kind == "linear_attention" for kind in types),
                               full_attn=pair("full_attn"), linear_attn=pair("linear_attn"), mlp=pair("mlp")),
    )


@dataclass
class LightningState:
    """A lightning-attention layer's cache: the decayed sum ``KV (B, heads, d, d)``, whatever the length."""

    kv: np.ndarray | None = None
    length: int = 0

    def truncate(self, length: int) -> None:
        if length < self.length:
            raise ConfigError("a lightning-attention state cannot be rolled back: "
                              "speculative decoding is not supported for this model")


def _decay(cfg: ModelConfig, layer: int) -> np.ndarray:
    """exp(-s_h) per head ``(heads,)``, computed in float32 as transformers' buffers are."""
    nh = cfg.num_heads
    base = np.float32(1 / (2 ** (8 / nh)))
    factor = np.float32(1 - layer / (cfg.num_layers - 1 + 1e-5) + 1e-5)
    rate = (base ** np.arange(1, nh + 1, dtype=np.float32)) * factor
    return np.exp(-rate.astype(np.float32)).astype(np.float32)


def lightning(w: dict[str, np.ndarray | None], x: np.ndarray, cfg: ModelConfig, cache: LightningState,
              layer: int) -> np.ndarray:
    """x (B, T, H) -> (B, T, H).  The decay comes from the layer and head count (transformers also
    saves it as the buffer ``slope_rate``, which the engine does not read)."""
    B, T, _ = x.shape
    nh, d = cfg.num_heads, cfg.head_dim
    qkv = linear(x, w["qkv"])  # type: ignore[arg-type]
    qkv = (qkv * sigmoid(qkv)).reshape(B, T, nh, 3 * d)
    q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]  # (B, T, nh, d)
    ratio = _decay(cfg, layer)[None, :, None, None]
    kv = cache.kv if cache.kv is not None else np.zeros((B, nh, d, d), np.float32)
    out = np.zeros((B, T, nh, d), np.float32)
    for i in range(T):
        kv = ratio * kv + k[:, i, :, :, None] * v[:, i, :, None, :]
        out[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i], kv)
    cache.kv, cache.length = kv, cache.length + T
    out = rms_norm(out.reshape(B, T, nh * d), w["norm"], LIGHTNING_NORM_EPS) * sigmoid(  # type: ignore[arg-type]
        linear(x, w["gate"]))  # type: ignore[arg-type]
    return linear(out, w["out"])  # type: ignore[arg-type]


class MiniMaxLayer:
    """``DecoderLayerForm`` of MiniMax-Text-01: the residual stream is the normed input."""

    def new_cache(self, cfg: ModelConfig, layer: int) -> object:
        return LightningState() if cfg.family.linear[layer] else LayerCache()

    def __call__(self, model: Model, L: int, x: np.ndarray, cache: object, positions: np.ndarray,
                 observe: bool) -> np.ndarray:
        cfg, w = model.config, model.weights
        s: MiniMaxSettings = cfg.family
        B, T, H = x.shape
        h = rms_norm(x, w[f"{L}.attn_norm"], cfg.rms_norm_eps)
        if s.linear[L]:
            assert isinstance(cache, LightningState)
            a, (alpha, beta) = lightning(model._attn[L], h, cfg, cache, L), s.linear_attn
        else:
            assert isinstance(cache, LayerCache)
            a, (alpha, beta) = gqa(model._attn[L], h, cfg, model.rope, cache, positions, cfg.sliding_windows[L]), s.full_attn
        x = h * np.float32(alpha) + a * np.float32(beta)
        h = rms_norm(x, w[f"{L}.mlp_norm"], cfg.rms_norm_eps)
        m = model._mlp(L, h.reshape(B * T, H), observe=observe).reshape(B, T, H)
        alpha, beta = s.mlp
        return h * np.float32(alpha) + m * np.float32(beta)


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Mixtral's shapes, with each lightning layer's own attention tensors instead of GQA's."""
    shapes = expected_shapes(replace(cfg, arch="mixtral", attention="gqa"))
    H, hd = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    for L in range(cfg.num_layers):
        if cfg.family.linear[L]:
            p = f"{L}.attn."
            for name in [n for n in shapes if n.startswith(p)]:
                del shapes[name]
            shapes.update({p + "qkv": (3 * hd, H), p + "gate": (hd, H), p + "norm": (hd,), p + "out": (H, hd)})
    return shapes


PARSERS = {"minimax": _minimax}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {"minimax": 1_000_000.0})
DECODER_LAYERS["minimax"] = MiniMaxLayer()
FAMILY_SHAPES["minimax"] = _shapes

_A = r"model\.layers\.(?P<L>\d+)\.self_attn\."
RULES.update(minimax=(
    Rule(_A + r"qkv_proj\.weight", "{L}.attn.qkv"),
    Rule(_A + r"output_gate\.weight", "{L}.attn.gate"),
    Rule(_A + r"norm\.weight", "{L}.attn.norm"),
    Rule(_A + r"out_proj\.weight", "{L}.attn.out"),
) + RULES["mixtral"])  # softmax attention, norms, router and experts in either layout
