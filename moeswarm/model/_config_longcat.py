"""LongCat-Flash (``longcat_flash``): config.json parser, tensor names and its decoder layer.

Read from transformers 5.24 (``models/longcat_flash``).  Each of the ``num_layers`` layers holds two
sublayers, each an MLA attention (DeepSeek's, with a q LoRA always, interleaved RoPE, and the q and
the normed kv latent scaled by ``sqrt(hidden / q_lora_rank)`` and ``sqrt(hidden / kv_lora_rank)``:
``ModelConfig.mla_lora_scale``) and a dense SwiGLU MLP ``ffn_hidden_size`` wide.  The layer's one MoE
block reads the first sublayer's MLP input and its output joins the residual only at the end of the
second sublayer (the "shortcut").  Its router softmaxes over ``n_routed_experts + zero_expert_num``
experts, chooses the top ``moe_topk`` of the probabilities plus ``e_score_correction_bias``, and
weights each by its probability times ``routed_scaling_factor`` (``softmax_topk`` with
``choice_bias``).  Experts numbered from ``n_routed_experts`` on are zero-computation ones: they
return their input (times the weight).  The backbone computes those where it routes
(``Model._submit_with_zero_experts``): no node holds one and none is sent over the network.

Canonical names: ``{L}.attn.{i}.*`` (MLA, ``i`` the sublayer), ``{L}.attn_norm{i}``,
``{L}.mlp_norm{i}``, ``{L}.mlp{i}.{gate,up,down}``, ``{L}.router`` ``[E + Z, H]`` and
``{L}.router_score_bias``.  The hub's per-expert names and transformers' packed ones both load (the
packed ``gate_up_proj`` has rows for the zero experts too, never read).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .attention import LayerCache, mla, rms_norm
from .config import ModelConfig, RopeConfig, _common, register_family
from .convert import RULES, Rule, chunk, unstack
from .experts import dense_ffn
from .transformer import DECODER_LAYERS, Model
from .weights import FAMILY_SHAPES, expected_shapes

# LongcatFlashConfig's field defaults (transformers 5.24; its docstring's meituan-longcat/LongCat-Flash-Chat)
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 6144, "num_layers": 28, "num_attention_heads": 64, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "attention_bias": False, "ffn_hidden_size": 12288, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "head_dim": 64, "v_head_dim": 128,
    "moe_topk": 12, "n_routed_experts": 512, "zero_expert_num": 256, "expert_ffn_hidden_size": 2048,
    "routed_scaling_factor": 6.0, "rope_theta": 10_000_000.0,
}


def _longcat(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **raw}
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    if t["attention_bias"]:
        raise ValueError("attention_bias is not supported (LongCat-Flash has none)")
    nope, rd, H = int(t["qk_nope_head_dim"]), int(t["qk_rope_head_dim"]), int(t["hidden_size"])
    if int(t["head_dim"]) != rd:
        raise ValueError(f"head_dim {t['head_dim']} must equal qk_rope_head_dim {rd} (the rotary width)")
    params = t.get("rope_parameters") or {}
    if (params.get("rope_type") or "default") != "default":
        raise ValueError(f"rope type {params.get('rope_type')!r} is not supported (default)")
    n, q_rank, kv_rank = int(t["num_layers"]), int(t["q_lora_rank"]), int(t["kv_lora_rank"])
    c = _common({**t, "num_hidden_layers": n}, "longcat_flash", model_id)
    c.update(raw=raw, head_dim=nope + rd)
    return ModelConfig(
        **c,
        rope=RopeConfig(theta=float(params.get("rope_theta", t["rope_theta"])), dim=rd, interleaved=True),
        moe_layers=(True,) * n,
        sliding_windows=(None,) * n,
        attention="longcat_flash",  # two MLA sublayers per layer (``DECODER_LAYERS``), not paged
        attention_scale=(nope + rd) ** -0.5,
        q_lora_rank=q_rank,
        kv_lora_rank=kv_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rd,
        v_head_dim=int(t["v_head_dim"]),
        mla_lora_scale=((H / q_rank) ** 0.5, (H / kv_rank) ** 0.5),
        num_experts=int(t["n_routed_experts"]),
        zero_experts=int(t["zero_expert_num"] or 0),
        top_k=int(t["moe_topk"]),
        moe_intermediate_size=int(t["expert_ffn_hidden_size"]),
        dense_intermediate_size=int(t["ffn_hidden_size"]),
        router="softmax_topk",
        choice_bias=True,
        routed_scaling_factor=float(t["routed_scaling_factor"]),
    )


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor: each layer's two sublayers named as DeepSeek-V3's one (MLA, dense MLP)."""
    one = expected_shapes(replace(cfg, arch="deepseek_v3", attention="mla", moe_layers=(False,) * cfg.num_layers))
    E, H = cfg.num_experts + cfg.zero_experts, cfg.hidden_size
    s = {name: one[name] for name in ("embed", "final_norm", "lm_head") if name in one}
    for L in range(cfg.num_layers):
        for i in (0, 1):
            s.update({f"{L}.attn.{i}.{name.split('.', 2)[2]}": shape for name, shape in one.items()
                      if name.startswith(f"{L}.attn.")})
            s.update({f"{L}.mlp{i}.{p}": one[f"{L}.mlp.{p}"] for p in ("gate", "up", "down")})
            s[f"{L}.attn_norm{i}"] = s[f"{L}.mlp_norm{i}"] = (H,)
        s[f"{L}.router"], s[f"{L}.router_score_bias"] = (E, H), (E,)
    return s


@dataclass
class SublayerCaches:
    """A layer's two MLA caches (``LayerCache``'s ``length`` and ``truncate``)."""

    parts: tuple[LayerCache, LayerCache]

    @property
    def length(self) -> int:
        return self.parts[0].length

    def truncate(self, length: int) -> None:
        for part in self.parts:
            part.truncate(length)


class LongcatLayer:
    """``DecoderLayerForm`` of LongCat-Flash: two (MLA, dense MLP) sublayers; the MoE shortcut reads
    the first one's MLP input and joins the residual at the end.  (Its remote experts could stay in
    flight across the second attention; they are waited for at once, as every other family's.)"""

    def new_cache(self, cfg: ModelConfig, layer: int) -> SublayerCaches:
        return SublayerCaches((LayerCache(), LayerCache()))

    def __call__(self, model: Model, L: int, x: np.ndarray, cache: object, positions: np.ndarray,
                 observe: bool) -> np.ndarray:
        cfg, w = model.config, model.weights
        assert isinstance(cache, SublayerCaches)
        B, T, H = x.shape
        shortcut = np.zeros((B * T, H), np.float32)
        for i in (0, 1):
            attn = {k[2:]: a for k, a in model._attn[L].items() if k.startswith(f"{i}.")}
            h = rms_norm(x, w[f"{L}.attn_norm{i}"], cfg.rms_norm_eps)
            x = x + mla(attn, h, cfg, model.rope, cache.parts[i], positions)  # type: ignore[arg-type]
            h = rms_norm(x, w[f"{L}.mlp_norm{i}"], cfg.rms_norm_eps).reshape(B * T, H)
            if i == 0:
                shortcut = model._mlp(L, h, observe=observe)
            x = x + dense_ffn(w[f"{L}.mlp{i}.gate"], w[f"{L}.mlp{i}.up"], w[f"{L}.mlp{i}.down"], h).reshape(B, T, H)
        return x + shortcut.reshape(B, T, H)


PARSERS = {"longcat_flash": _longcat}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})
FAMILY_SHAPES["longcat_flash"] = _shapes
DECODER_LAYERS["longcat_flash"] = LongcatLayer()

_L = r"model\.layers\.(?P<L>\d+)\."
_A = _L + r"self_attn\.(?P<i>[01])\."
_E = _L + r"mlp\.experts\."
RULES.update(longcat_flash=(
    Rule(r"model\.embed_tokens\.weight", "embed"),
    Rule(r"model\.norm\.weight", "final_norm"),
    Rule(r"lm_head\.weight", "lm_head"),
    Rule(_L + r"input_layernorm\.(?P<i>[01])\.weight", "{L}.attn_norm{i}"),
    Rule(_L + r"post_attention_layernorm\.(?P<i>[01])\.weight", "{L}.mlp_norm{i}"),
    Rule(_A + r"(?P<p>q_a|q_b|kv_a|kv_b)_proj(?:_with_mqa)?\.weight", "{L}.attn.{i}.{p}"),
    Rule(_A + r"(?P<p>q_a|kv_a)_layernorm\.weight", "{L}.attn.{i}.{p}_norm"),
    Rule(_A + r"o_proj\.weight", "{L}.attn.{i}.o"),
    Rule(_L + r"mlps\.(?P<i>[01])\.(?P<p>gate|up|down)_proj\.weight", "{L}.mlp{i}.{p}"),
    Rule(_L + r"mlp\.router\.classifier\.weight", "{L}.router"),
    Rule(_L + r"mlp\.router\.e_score_correction_bias", "{L}.router_score_bias"),
    Rule(_E + r"(?P<E>\d+)\.(?P<p>gate|up|down)_proj\.weight", "{L}.experts.{E}.{p}"),
    Rule(_E + r"gate_up_proj", "{L}.experts.{E}.{p}", (unstack("E"), chunk("p", ("gate", "up")))),
    Rule(_E + r"down_proj", "{L}.experts.{E}.down", (unstack("E"),)),
))
