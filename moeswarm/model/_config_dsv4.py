"""config.json parser for DeepSeek-V4 (``deepseek_v4``: V4-Flash, V4-Pro).

Read from transformers 5.24 (``models/deepseek_v4``).  What the engine composes for it:

* attention kind ``"deepseek_v4"`` (``_attn_dsv4``): per ``layer_types``, sliding-window attention
  alone, or beside compressed entries: compressed sparse attention (CSA: overlapping windows of
  ``compress_rates["compressed_sparse_attention"]`` tokens, a lightning indexer keeps the best
  ``index_topk`` entries per query) or heavily compressed attention (HCA: every entry, non-overlapping
  windows); one K=V head, per-head sinks, grouped low-rank output (``o_groups``, ``o_lora_rank``);
* router ``"sqrtsoftplus"`` (``routing.py``), and on the ``hash_moe`` layers of ``mlp_layer_types``
  experts taken from the token id (``{L}.router_table``, ``routing.hash_route``); experts and the
  shared expert clamp gate and up at ``swiglu_limit`` (``expert_activation="limited_swiglu"``);
* residual form ``"hyper"`` (``_residual_hc``): ``hc_mult`` streams mixed by manifold-constrained
  hyper-connections, collapsed by the ``hc_head`` before the final norm.

Fields a config.json leaves out take ``DeepseekV4Config``'s defaults (V4-Flash's); the legacy
spellings (``compress_ratios``, ``compress_rate_csa`` / ``_hca``, ``num_hash_layers``,
``qk_rope_head_dim``) are folded in as ``DeepseekV4Config.__post_init__`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .config import ModelConfig, RopeConfig, _common, register_family
from .convert import RULES, Rule, chunk, unstack

_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0,
    "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hidden_act": "silu", "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False,
}
_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
_LEGACY_RATIOS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


@dataclass(frozen=True)
class Dsv4Settings:
    """What DeepSeek-V4's attention, router and residual form read beyond the common fields
    (``ModelConfig.family``).  The switches at the end exist for the tests' negative controls."""

    layer_kinds: tuple[str, ...]  # per layer: "sliding", "csa" or "hca"
    hash_layers: tuple[bool, ...]  # per layer: experts chosen by token id (mlp_layer_types "hash_moe")
    csa_rate: int  # tokens per compressed entry, CSA layers (windows overlap: 2 * rate wide)
    hca_rate: int  # tokens per compressed entry, HCA layers
    sliding_window: int  # keys a query sees among the uncompressed tokens (its own included)
    rope_dim: int  # trailing channels of each head that RoPE turns (interleaved pairs)
    main_rope: RopeConfig  # sliding layers
    compress_rope: RopeConfig  # CSA / HCA layers, their compressed entries and the indexer
    o_groups: int  # head groups of the grouped output projection
    o_lora_rank: int  # each group's low-rank width
    index_heads: int
    index_head_dim: int
    index_topk: int  # compressed entries each query keeps (CSA)
    hc_mult: int  # residual streams
    hc_sinkhorn_iters: int
    hc_eps: float
    sinks: bool = True  # the per-head attention sinks
    compressed: bool = True  # CSA / HCA layers attend to their compressed entries
    indexer: bool = True  # CSA keeps only the indexer's top-k entries (False: all of them)
    overlap: bool = True  # CSA's windows reach into the previous window
    grouped_output: bool = True  # False: the heads of each output group taken interleaved (a wrong grouping)


def _layer_types(t: dict[str, Any], n: int) -> list[str]:
    types = t.get("layer_types")
    if types is None and t.get("compress_ratios") is not None:
        types = [_LEGACY_RATIOS[int(r)] for r in t["compress_ratios"]]
    if types is None:
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    bad = sorted({k for k in types if k not in _KINDS})
    if len(types) < n or bad:
        raise ValueError(f"layer_types must name one of {sorted(_KINDS)} for each of {n} layers (got {bad or len(types)})")
    return list(types[:n])


def mtp_settings(s: Dsv4Settings, raw: dict[str, Any], n: int, count: int) -> Dsv4Settings:
    """``s`` with ``count`` MTP layers after the ``n`` decoder layers.  DeepSeek's reference
    (``inference/model.py``: ``MTPBlock(Block)`` built as layer ``n_layers + k``) reads its attention
    from ``compress_ratios[n_layers + k]`` -- the hub's list is one longer than the layers, its last
    entry 0, sliding attention alone -- and routes by score (``layer_id < n_hash_layers`` is false).
    A config that names the MTP layers (``layer_types`` / ``mlp_layer_types`` / ``compress_ratios``
    longer than ``n``) is followed; else sliding attention and a learned router.  Compressed
    attention in an MTP layer is refused when config.json is read (``_check_mtp_kinds``): no
    published checkpoint has it, and no reference says at which positions its windows would start."""
    mlp = raw.get("mlp_layer_types") or []
    hashed = [L < len(mlp) and mlp[L] == "hash_moe" for L in range(n, n + count)]
    return replace(s, layer_kinds=s.layer_kinds + ("sliding",) * count,
                   hash_layers=s.hash_layers + tuple(hashed))


def _check_mtp_kinds(t: dict[str, Any], n: int) -> None:
    """Entries of ``layer_types`` / ``compress_ratios`` past the ``n`` layers describe MTP layers:
    only sliding attention is read (``mtp_settings``)."""
    types, ratios = t.get("layer_types") or [], t.get("compress_ratios") or []
    extra = [*types[n:], *(_LEGACY_RATIOS.get(int(r), str(r)) for r in ([] if t.get("layer_types") else ratios[n:]))]
    if any(k != "sliding_attention" for k in extra):  # as in every published V4 checkpoint
        raise ValueError(f"the MTP layers' attention must be sliding_attention (got {extra})")


def _mlp_types(t: dict[str, Any], n: int) -> list[str]:
    types = t.get("mlp_layer_types")
    if types is None:
        hashed = int(t.get("num_hash_layers", 3) if t.get("num_hash_layers") is not None else 3)
        types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    if len(types) < n or any(k not in ("hash_moe", "moe") for k in types):
        raise ValueError(f"mlp_layer_types must name 'hash_moe' or 'moe' for each of {n} layers")
    return list(types[:n])


def _ropes(t: dict[str, Any], rope_dim: int) -> tuple[RopeConfig, RopeConfig]:
    params = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
    else:
        main = {"rope_type": "default", "rope_theta": t["rope_theta"]}
        compress = {**{k: v for k, v in params.items() if k not in ("main", "compress")},
                    "rope_theta": t["compress_rope_theta"]}
        compress.setdefault("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
    out = []
    for p in (main, compress):
        kind = p.get("rope_type") or p.get("type") or "default"
        if kind not in ("default", "yarn"):
            raise ValueError(f"rope type {kind!r} is not supported (default, yarn)")
        if kind == "default":
            out.append(RopeConfig(theta=float(p["rope_theta"]), dim=rope_dim, interleaved=True))
            continue
        out.append(RopeConfig(
            theta=float(p["rope_theta"]), dim=rope_dim, kind="yarn", factor=float(p["factor"]),
            original_max_position=int(p.get("original_max_position_embeddings") or t["max_position_embeddings"]),
            beta_fast=float(p.get("beta_fast") or 32.0), beta_slow=float(p.get("beta_slow") or 1.0),
            truncate=bool(p.get("truncate", True)), attention_factor=p.get("attention_factor"),
            mscale=p.get("mscale"), mscale_all_dim=p.get("mscale_all_dim"), interleaved=True))
    return out[0], out[1]


def _deepseek_v4(raw: dict[str, Any], model_id: str, path: str | None) -> ModelConfig:
    t = {**_DEFAULTS, **raw}
    if t["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (silu)")
    if t["scoring_func"] != "sqrtsoftplus":
        raise ValueError(f"scoring_func {t['scoring_func']!r} is not supported (sqrtsoftplus)")
    if int(t["num_key_value_heads"]) != 1:
        raise ValueError(f"num_key_value_heads must be 1 (one shared K=V head), not {t['num_key_value_heads']}")
    c = _common(t, "deepseek_v4", model_id)
    c["raw"] = raw
    n, hd, nh = c["num_layers"], c["head_dim"], c["num_heads"]
    factor = t.get("partial_rotary_factor")
    if factor is None:
        factor = t["qk_rope_head_dim"] / hd if t.get("qk_rope_head_dim") is not None else 64 / 512
    rope_dim = int(hd * float(factor))
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(t.get("compress_rates") or {})}
    if t.get("compress_rate_csa") is not None:
        rates["compressed_sparse_attention"] = t["compress_rate_csa"]
    if t.get("compress_rate_hca") is not None:
        rates["heavily_compressed_attention"] = t["compress_rate_hca"]
    groups = int(t["o_groups"])
    if groups <= 0 or nh % groups:
        raise ValueError(f"o_groups={groups} must divide num_attention_heads={nh}")
    main, compress = _ropes(t, rope_dim)
    _check_mtp_kinds(t, n)
    settings = Dsv4Settings(
        layer_kinds=tuple(_KINDS[k] for k in _layer_types(t, n)),
        hash_layers=tuple(k == "hash_moe" for k in _mlp_types(t, n)),
        csa_rate=int(rates["compressed_sparse_attention"]), hca_rate=int(rates["heavily_compressed_attention"]),
        sliding_window=int(t["sliding_window"]), rope_dim=rope_dim, main_rope=main, compress_rope=compress,
        o_groups=groups, o_lora_rank=int(t["o_lora_rank"]), index_heads=int(t["index_n_heads"]),
        index_head_dim=int(t["index_head_dim"]), index_topk=int(t["index_topk"]), hc_mult=int(t["hc_mult"]),
        hc_sinkhorn_iters=int(t["hc_sinkhorn_iters"]), hc_eps=float(t["hc_eps"]))
    inter = int(t["moe_intermediate_size"])
    return ModelConfig(
        **c,
        rope=main,
        moe_layers=(True,) * n,
        sliding_windows=(None,) * n,
        attention="deepseek_v4",
        q_lora_rank=int(t["q_lora_rank"]),
        num_experts=int(t["n_routed_experts"]),
        top_k=int(t["num_experts_per_tok"]),
        moe_intermediate_size=inter,
        router="sqrtsoftplus",
        norm_topk_prob=True,  # transformers' V4 routers always renormalise
        routed_scaling_factor=float(t["routed_scaling_factor"]),
        shared_intermediate_size=int(t["n_shared_experts"] or 0) * inter,
        expert_activation="limited_swiglu",
        dense_activation="limited_swiglu",
        swiglu_limit=float(t["swiglu_limit"]),
        residual_form="hyper",
        family=settings,
    )


PARSERS = {"deepseek_v4": _deepseek_v4}
ARCHITECTURES = tuple(PARSERS)

register_family(PARSERS, {})

# Two layouts: transformers' runtime names (``model.layers.L.self_attn.q_a_proj``, packed experts) and
# DeepSeek's own, as the hub stores V4 and ``save_pretrained`` writes by default (``layers.L.attn.wq_a``,
# ``ffn.experts.E.w1``; with or without a ``model.`` prefix).
_M = r"(?:model\.)?"
_L = _M + r"layers\.(?P<L>\d+)\."
_RUNTIME = (
    Rule(_L + r"self_attn\.(?P<p>q_a|q_b|kv|o_a|o_b)_proj\.weight", "{L}.attn.{p}"),
    Rule(_L + r"self_attn\.(?P<p>q_a|kv)_norm\.weight", "{L}.attn.{p}_norm"),
    Rule(_L + r"self_attn\.sinks", "{L}.attn.sinks"),
    Rule(_L + r"self_attn\.compressor\.(?P<p>kv|gate)_proj\.weight", "{L}.attn.c_{p}"),
    Rule(_L + r"self_attn\.compressor\.position_bias", "{L}.attn.c_bias"),
    Rule(_L + r"self_attn\.compressor\.kv_norm\.weight", "{L}.attn.c_norm"),
    Rule(_L + r"self_attn\.compressor\.indexer\.(?P<p>kv|gate)_proj\.weight", "{L}.attn.i_{p}"),
    Rule(_L + r"self_attn\.compressor\.indexer\.position_bias", "{L}.attn.i_bias"),
    Rule(_L + r"self_attn\.compressor\.indexer\.kv_norm\.weight", "{L}.attn.i_norm"),
    Rule(_L + r"self_attn\.compressor\.indexer\.q_b_proj\.weight", "{L}.attn.i_q_b"),
    Rule(_L + r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight", "{L}.attn.i_w"),
    Rule(_L + r"input_layernorm\.weight", "{L}.attn_norm"),
    Rule(_L + r"post_attention_layernorm\.weight", "{L}.mlp_norm"),
    Rule(_L + r"attn_hc\.(?P<p>fn|base|scale)", "{L}.hc_attn_{p}"),
    Rule(_L + r"ffn_hc\.(?P<p>fn|base|scale)", "{L}.hc_mlp_{p}"),
    Rule(_L + r"mlp\.gate\.weight", "{L}.router"),
    Rule(_L + r"mlp\.gate\.e_score_correction_bias", "{L}.router_score_bias"),
    Rule(_L + r"mlp\.gate\.tid2eid", "{L}.router_table"),
    Rule(_L + r"mlp\.shared_experts\.(?P<p>gate|up|down)_proj\.weight", "{L}.shared.{p}"),
    Rule(_L + r"mlp\.experts\.gate_up_proj", "{L}.experts.{E}.{p}", (unstack("E"), chunk("p", ("gate", "up")))),
    Rule(_L + r"mlp\.experts\.down_proj", "{L}.experts.{E}.down", (unstack("E"),)),
    Rule(_M + r"hc_head\.hc_(?P<p>fn|base|scale)", "hc_head_{p}"),
    Rule(_M + r"embed_tokens\.weight", "embed"),
    Rule(_M + r"norm\.weight", "final_norm"),
    Rule(r"lm_head\.weight", "lm_head"),
)
_W = {"w1": "gate", "w3": "up", "w2": "down"}
_ORIGINAL = (
    Rule(_L + r"attn\.w(?P<p>q_a|q_b|kv|o_a|o_b)\.weight", "{L}.attn.{p}"),
    Rule(_L + r"attn\.q_norm\.weight", "{L}.attn.q_a_norm"),
    Rule(_L + r"attn\.norm\.weight", "{L}.attn.kv_norm"),
    Rule(_L + r"attn\.attn_sink", "{L}.attn.sinks"),
    Rule(_L + r"attn\.compressor\.w(?P<p>kv|gate)\.weight", "{L}.attn.c_{p}"),
    Rule(_L + r"attn\.compressor\.ape", "{L}.attn.c_bias"),
    Rule(_L + r"attn\.compressor\.norm\.weight", "{L}.attn.c_norm"),
    Rule(_L + r"attn\.indexer\.compressor\.w(?P<p>kv|gate)\.weight", "{L}.attn.i_{p}"),
    Rule(_L + r"attn\.indexer\.compressor\.ape", "{L}.attn.i_bias"),
    Rule(_L + r"attn\.indexer\.compressor\.norm\.weight", "{L}.attn.i_norm"),
    Rule(_L + r"attn\.indexer\.wq_b\.weight", "{L}.attn.i_q_b"),
    Rule(_L + r"attn\.indexer\.weights_proj\.weight", "{L}.attn.i_w"),
    Rule(_L + r"attn_norm\.weight", "{L}.attn_norm"),
    Rule(_L + r"ffn_norm\.weight", "{L}.mlp_norm"),
    Rule(_L + r"hc_attn_(?P<p>fn|base|scale)", "{L}.hc_attn_{p}"),
    Rule(_L + r"hc_ffn_(?P<p>fn|base|scale)", "{L}.hc_mlp_{p}"),
    Rule(_L + r"ffn\.gate\.weight", "{L}.router"),
    Rule(_L + r"ffn\.gate\.bias", "{L}.router_score_bias"),
    Rule(_L + r"ffn\.gate\.tid2eid", "{L}.router_table"),
    *(Rule(_L + rf"ffn\.shared_experts\.{k}\.weight", "{L}.shared." + v) for k, v in _W.items()),
    *(Rule(_L + rf"ffn\.experts\.(?P<E>\d+)\.{k}\.weight", "{L}.experts.{E}." + v) for k, v in _W.items()),
    Rule(_M + r"hc_head_(?P<p>fn|base|scale)", "hc_head_{p}"),
    Rule(_M + r"embed\.weight", "embed"),
    Rule(r"head\.weight", "lm_head"),
)
RULES.update(deepseek_v4=_RUNTIME + _ORIGINAL)
