"""config.json parser for DBRX (``dbrx``).

Read from transformers 5.24 (``models/dbrx``): hyper-parameters nested in ``attn_config`` and
``ffn_config``; LayerNorms without bias (eps 1e-5, ``ModelConfig.norm = "layer"``) before each block
and at the end; attention from one fused ``Wqkv`` (q rows, then k, then v) clamped to
``+-clip_qkv``, RoPE in halves, no biases; every layer MoE: softmax over all experts, top
``moe_top_k``, renormalised (``moe_normalize_expert_weights`` is the p of a p-norm; every published
DBRX says 1, a plain sum, the only value the engine takes).  The experts of a layer are stored
flat, ``ffn.experts.mlp.w1`` / ``v1`` / ``w2`` each ``[E * I, H]``: per expert, w1 is the gate,
v1 the up projection and w2 the *transposed* down projection.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from .config import ModelConfig, RopeConfig, register_family
from .convert import RULES, Item, Op, Rule, transpose, unstack

# DbrxConfig / DbrxAttentionConfig / DbrxFFNConfig defaults (transformers 5.24) that the engine reads
_DEFAULTS: dict[str, Any] = {"d_model": 2048, "n_heads": 16, "n_layers": 24, "max_seq_len": 2048, "vocab_size": 32000,
                             "tie_word_embeddings": False}
_ATTN: dict[str, Any] = {"clip_qkv": None, "kv_n_heads": 1, "rope_theta": 10_000.0}
_FFN: dict[str, Any] = {"ffn_hidden_size": 3584, "moe_num_experts": 4, "moe_top_k": 1,
                        "moe_normalize_expert_weights": 1.0, "ffn_act_fn": None}


def _dbrx(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **raw}
    attn = {**_ATTN, **(t.get("attn_config") or {})}
    ffn = {**_FFN, **(t.get("ffn_config") or {})}
    act = (ffn["ffn_act_fn"] or {}).get("name", "silu")
    if act != "silu":
        raise ValueError(f"ffn_act_fn {act!r} is not supported (silu)")
    if ffn["moe_normalize_expert_weights"] not in (1, 1.0):
        raise ValueError(f"moe_normalize_expert_weights={ffn['moe_normalize_expert_weights']} is not supported (1)")
    H, nh, n = int(t["d_model"]), int(t["n_heads"]), int(t["n_layers"])
    head_dim = H // nh
    params = t.get("rope_parameters") or {}
    if (params.get("rope_type") or "default") != "default":
        raise ValueError(f"rope type {params.get('rope_type')!r} is not supported (default)")
    eos = t.get("eos_token_id")
    clip = attn["clip_qkv"]
    return ModelConfig(
        arch="dbrx", model_id=model_id, raw=raw, vocab_size=int(t["vocab_size"]), hidden_size=H, num_layers=n,
        num_heads=nh, num_kv_heads=int(attn["kv_n_heads"]), head_dim=head_dim, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=float(params.get("rope_theta", attn["rope_theta"])), dim=head_dim),
        tie_word_embeddings=bool(t["tie_word_embeddings"]), moe_layers=(True,) * n, sliding_windows=(None,) * n,
        clip_qkv=float(clip) if clip else None, num_experts=int(ffn["moe_num_experts"]), top_k=int(ffn["moe_top_k"]),
        moe_intermediate_size=int(ffn["ffn_hidden_size"]), router="softmax_topk", norm_topk_prob=True,
        norm="layer", bos_token_id=t.get("bos_token_id"), pad_token_id=t.get("pad_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        max_position_embeddings=int(t["max_seq_len"]),
    )


PARSERS = {"dbrx": _dbrx}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})


def _split_qkv() -> Op:
    """``Wqkv [H + 2 * kv, H]`` -> q ``[H, H]``, k and v ``[kv, H]`` (kv = kv_n_heads * head_dim: the
    rows left after q, halved)."""

    def op(items: Iterable[Item]) -> Iterator[Item]:
        for fields, a in items:
            kv = (a.shape[0] - a.shape[1]) // 2
            for name, part in zip("qkv", np.split(a, [a.shape[1], a.shape[1] + kv], axis=0)):
                yield {**fields, "p": name}, part

    return op


def _per_expert(part: str) -> Op:
    """``[E * I, H]`` -> E tensors ``[I, H]``, E from the configuration (``convert``'s field ``n``)."""

    def op(items: Iterable[Item]) -> Iterator[Item]:
        for fields, a in items:
            experts = int(fields["n"])
            yield from unstack("E")([({**fields, "p": part}, a.reshape(experts, a.shape[0] // experts, a.shape[1]))])

    return op


_B = r"transformer\.blocks\.(?P<L>\d+)\."
_RULES = (
    Rule(r"transformer\.wte\.weight", "embed"),
    Rule(r"transformer\.norm_f\.weight", "final_norm"),
    Rule(r"lm_head\.weight", "lm_head"),
    Rule(_B + r"norm_attn_norm\.norm_1\.weight", "{L}.attn_norm"),
    Rule(_B + r"norm_attn_norm\.norm_2\.weight", "{L}.mlp_norm"),
    Rule(_B + r"norm_attn_norm\.attn\.Wqkv\.weight", "{L}.attn.{p}", (_split_qkv(),)),
    Rule(_B + r"norm_attn_norm\.attn\.out_proj\.weight", "{L}.attn.o"),
    Rule(_B + r"ffn\.router\.layer\.weight", "{L}.router"),
    Rule(_B + r"ffn\.experts\.mlp\.w1", "{L}.experts.{E}.gate", (_per_expert("gate"),)),
    Rule(_B + r"ffn\.experts\.mlp\.v1", "{L}.experts.{E}.up", (_per_expert("up"),)),
    Rule(_B + r"ffn\.experts\.mlp\.w2", "{L}.experts.{E}.down", (_per_expert("down"), transpose())),
)
RULES.update(dbrx=_RULES)
