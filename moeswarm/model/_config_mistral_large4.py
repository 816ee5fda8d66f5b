"""config.json parser and checkpoint names for Mistral Large 4 (``mistral_large4``; its text model
``mistral_large4_text``).

Read from transformers 5.24 (``models/mistral_large4``): GLM-5's DSA decoder (MLA whose queries see
the keys a lightning indexer keeps, GLM-5's ``"shared"`` indexer layers) changed as follows, each run
by ``_attn_ml4.py``:

* MLA without a q LoRA (``q_proj`` straight from the hidden state); the indexer's queries come from
  the hidden state through a LayerNorm with bias (``q_input_norm``) and ``wq_b``;
* ssmax: the attention's and the indexer's queries at position p are scaled per head by
  ``s * log(p + 1) + b`` (``softmax_scaling``, learned ``s`` and ``b``);
* LeRoPE: YaRN's inverse frequencies times ``exp(alpha)``, a learned tensor (``attention.Rope``);
* NoPE layers (``no_rope_layers``: 0 = no rotary; the whole query/key head is "nope", ``kv_a`` has no
  rotary part, the indexer does not rotate either);
* KV sharing (``kv_source_layers``): a layer naming an earlier one has no ``kv_a`` of its own and
  attends over that layer's (normed) latent and rotated key, through its own ``kv_b``;
* ``final_logit_softcapping``; the router is Mistral 4's ``softmax_group``, always renormalised;
  the latent norm's eps is ``rms_norm_eps`` (not MLA's 1e-6).

A field a config.json leaves out takes the value ``MistralLarge4TextConfig`` gives it (``_DEFAULTS``).
The multimodal config (``mistral_large4``) is read through its ``text_config``; the Pixtral vision
tower and projector are not run and their tensors are never read (text in, text out).

Checkpoint layouts: transformers' (``model.language_model.layers.L.self_attn.q_proj.weight``,
``mlp.experts.gate_up_proj``) and the hub's Mistral-native one (``tok_embeddings``,
``layers.L.attention.wq``, ``wkv_a_with_mqa``, ``feed_forward.w1``, ``experts.E.w1``,
``ssmax_scaling.s``, ``lerope.alpha``, ``output``), named as transformers' ``conversion_mapping.py``
renames them (``mistral_large4`` + ``mistral_large4_text``); ``vision_encoder.*`` and the projector's
keys match no rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .config import (
    DsaConfig,
    ModelConfig,
    _deepseek_v3,
    _indexer_shared,
    _mlp_layer_types,
    register_family,
)
from .convert import _BACKBONE, _INDEXER, _L, _PACKED, RULES, Rule, _language_model

# MistralLarge4TextConfig's field defaults (transformers 5.24) that the engine reads
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 204800, "hidden_size": 6144, "intermediate_size": 24576, "moe_intermediate_size": 6144,
    "num_hidden_layers": 72, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 128, "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 4,
    "hidden_act": "silu", "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": None, "tie_word_embeddings": False, "attention_bias": False,
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "first_k_dense_replace": 1,
    "final_logit_softcapping": 30.0,
}
_DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0, "original_max_position_embeddings": 512,
    "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0,
}


@dataclass(frozen=True)
class Ml4Settings:
    """What Mistral Large 4's attention reads beyond DSA's (``ModelConfig.family``)."""

    rope_layers: tuple[bool, ...]  # per layer: False = NoPE
    kv_source: tuple[int, ...]  # per layer: the layer whose latent keys and values it attends over


def _kv_sources(t: dict[str, Any], rope: tuple[bool, ...]) -> tuple[int, ...]:
    n = len(rope)
    sources = [int(s) for s in (t.get("kv_source_layers") or range(n))]
    if len(sources) != n:
        raise ValueError(f"kv_source_layers must have one entry per layer ({n}), got {len(sources)}")
    stored: dict[bool, int] = {}  # transformers hands the latest sharing layer of each kind (RoPE, NoPE) on
    for layer, source in enumerate(sources):
        if source > layer or sources[source] != source:
            raise ValueError(f"kv_source_layers: layer {layer} must share KV with an earlier layer that owns "
                             f"its cache, got {source}")
        if source == layer:
            if layer in sources[layer + 1:]:
                stored[rope[layer]] = layer
        elif rope[source] != rope[layer] or stored.get(rope[layer]) != source:
            raise ValueError(f"kv_source_layers: layer {layer} reads layer {source}'s KV, but transformers "
                             f"hands it the latest {'RoPE' if rope[layer] else 'NoPE'} sharing layer's "
                             f"({stored.get(rope[layer])})")
    return tuple(sources)


def _mistral_large4(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    if raw.get("model_type") == "mistral_large4":  # the multimodal config: its text model only
        raw = {"model_type": "mistral_large4_text", **(raw.get("text_config") or {})}
    t = {**_DEFAULTS, **raw}
    if not t.get("rope_parameters") and not t.get("rope_scaling"):
        t["rope_parameters"] = dict(_DEFAULT_ROPE)
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    if t["attention_bias"]:
        raise ValueError("attention_bias is not supported (Mistral Large 4 has none)")
    n = int(t["num_hidden_layers"])
    experts, n_group = int(t["n_routed_experts"]), int(t["n_group"] or 1)
    if experts % n_group:
        raise ValueError(f"n_group={n_group} must divide n_routed_experts={experts}")
    flags = t.get("no_rope_layers")
    if flags is None:
        interval = int(t.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) < n:
        raise ValueError(f"no_rope_layers must have an entry per layer ({n}), got {len(flags)}")
    rope_layers = tuple(bool(f) for f in flags[:n])
    index_head_dim, rope_dim = int(t["index_head_dim"]), int(t["qk_rope_head_dim"])
    if index_head_dim < rope_dim:
        raise ValueError(f"index_head_dim {index_head_dim} is smaller than qk_rope_head_dim {rope_dim}")
    base = _deepseek_v3({**t, "q_lora_rank": None, "rope_interleave": True, "n_group": n_group}, model_id, path)
    dsa = DsaConfig(topk=int(t["index_topk"]), n_heads=int(t["index_n_heads"]), head_dim=index_head_dim,
                    rope_interleaved=True, shared=_indexer_shared(t, n))
    return replace(base, arch="mistral_large4", raw=raw, attention="mistral_large4", dsa=dsa,
                   moe_layers=_mlp_layer_types(t, n, int(t["first_k_dense_replace"])), router="softmax_group",
                   norm_topk_prob=True, rms_norm_eps=float(t["rms_norm_eps"]),
                   final_logit_softcapping=float(t["final_logit_softcapping"] or 0.0),
                   family=Ml4Settings(rope_layers, _kv_sources(t, rope_layers)))


PARSERS = {"mistral_large4": _mistral_large4, "mistral_large4_text": _mistral_large4}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})

_ML = _L + r"self_attn\."
_RUNTIME = (  # transformers' names (save_pretrained), beside DSA's
    Rule(r"model\.rotary_emb\.alpha", "rope_alpha"),
    Rule(_ML + r"softmax_scaling\.scale", "{L}.attn.ssmax_s"),
    Rule(_ML + r"softmax_scaling\.bias", "{L}.attn.ssmax_b"),
    Rule(_ML + r"indexer\.softmax_scaling\.scale", "{L}.attn.idx_ssmax_s"),
    Rule(_ML + r"indexer\.softmax_scaling\.bias", "{L}.attn.idx_ssmax_b"),
    Rule(_ML + r"indexer\.q_input_norm\.weight", "{L}.attn.idx_q_norm"),
    Rule(_ML + r"indexer\.q_input_norm\.bias", "{L}.attn.idx_q_norm_bias"),
)
_N = r"layers\.(?P<L>\d+)\."
_NATIVE = (  # the hub's Mistral-native names
    Rule(r"tok_embeddings\.weight", "embed"),
    Rule(r"norm\.weight", "final_norm"),
    Rule(r"output\.weight", "lm_head"),
    Rule(r"lerope\.alpha", "rope_alpha"),
    Rule(_N + r"attention_norm\.weight", "{L}.attn_norm"),
    Rule(_N + r"ffn_norm\.weight", "{L}.mlp_norm"),
    Rule(_N + r"attention\.wq\.weight", "{L}.attn.q"),
    Rule(_N + r"attention\.wkv_a_with_mqa\.weight", "{L}.attn.kv_a"),
    Rule(_N + r"attention\.kv_a_norm\.weight", "{L}.attn.kv_a_norm"),
    Rule(_N + r"attention\.wkv_b\.weight", "{L}.attn.kv_b"),
    Rule(_N + r"attention\.wo\.weight", "{L}.attn.o"),
    Rule(_N + r"attention\.ssmax_scaling\.s", "{L}.attn.ssmax_s"),
    Rule(_N + r"attention\.ssmax_scaling\.b", "{L}.attn.ssmax_b"),
    Rule(_N + r"attention\.indexer\.wq_b\.weight", "{L}.attn.idx_q_b"),
    Rule(_N + r"attention\.indexer\.wk\.weight", "{L}.attn.idx_k"),
    Rule(_N + r"attention\.indexer\.k_norm\.weight", "{L}.attn.idx_k_norm"),
    Rule(_N + r"attention\.indexer\.k_norm\.bias", "{L}.attn.idx_k_norm_bias"),
    Rule(_N + r"attention\.indexer\.weights_proj\.weight", "{L}.attn.idx_w"),
    Rule(_N + r"attention\.indexer\.q_input_norm\.weight", "{L}.attn.idx_q_norm"),
    Rule(_N + r"attention\.indexer\.q_input_norm\.bias", "{L}.attn.idx_q_norm_bias"),
    Rule(_N + r"attention\.indexer\.ssmax_scaling\.s", "{L}.attn.idx_ssmax_s"),
    Rule(_N + r"attention\.indexer\.ssmax_scaling\.b", "{L}.attn.idx_ssmax_b"),
    Rule(_N + r"feed_forward\.w1\.weight", "{L}.mlp.gate"),
    Rule(_N + r"feed_forward\.w3\.weight", "{L}.mlp.up"),
    Rule(_N + r"feed_forward\.w2\.weight", "{L}.mlp.down"),
    Rule(_N + r"gate\.weight", "{L}.router"),
    Rule(_N + r"shared_experts\.w1\.weight", "{L}.shared.gate"),
    Rule(_N + r"shared_experts\.w3\.weight", "{L}.shared.up"),
    Rule(_N + r"shared_experts\.w2\.weight", "{L}.shared.down"),
    Rule(_N + r"experts\.(?P<E>\d+)\.w1\.weight", "{L}.experts.{E}.gate"),
    Rule(_N + r"experts\.(?P<E>\d+)\.w3\.weight", "{L}.experts.{E}.up"),
    Rule(_N + r"experts\.(?P<E>\d+)\.w2\.weight", "{L}.experts.{E}.down"),
)
_RULES = _language_model(_RUNTIME + _INDEXER + _BACKBONE + _PACKED) + _NATIVE
RULES.update(mistral_large4=_RULES)
