"""GGUF metadata: the model's hyper-parameters under llama.cpp's keys, plus moeswarm's own.

Writing: ``write_metadata`` puts the llama.cpp keys (``{arch}.block_count``,
``{arch}.expert_count``, ...) and, for exactness, the original ``config.json`` as the string
``moeswarm.hf_config``; the tokenizer files travel as strings too (``moeswarm.tokenizer_json``...).

Reading: ``hf_config_from_metadata`` rebuilds a ``config.json``-like dict from the llama.cpp keys
alone, for GGUF files written by other converters (llama.cpp's own).  It is best effort: llama.cpp
has no key for a few things the engine honours (gpt-oss's ``swiglu_limit`` -- llama.cpp hard-codes
7.0 -- and YaRN ``truncate``; DeepSeek's ``mscale`` is assumed equal to ``mscale_all_dim``), and
which layers are dense is read from which tensors exist.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFWriter, Keys

from .config import ModelConfig, RopeConfig

FORMAT_VERSION = 1
HF_CONFIG = "moeswarm.hf_config"  # config.json, verbatim
ARCH = "moeswarm.architecture"  # moeswarm's architecture name (mixtral, qwen2_moe, ...)
VERSION = "moeswarm.format_version"
# file name beside a model -> metadata key holding its text
EMBEDDED_FILES = {
    "tokenizer.json": "moeswarm.tokenizer_json",
    "tokenizer_config.json": "moeswarm.tokenizer_config_json",
    "generation_config.json": "moeswarm.generation_config_json",
    "special_tokens_map.json": "moeswarm.special_tokens_map_json",
}


def write_metadata(w: GGUFWriter, cfg: ModelConfig, raw_config: str, files: dict[str, str], file_type: int,
                   spm_model: Path | None = None) -> None:
    """Everything but the tensors.  ``files``: name -> text of the tokenizer files to embed;
    ``spm_model``: a SentencePiece ``tokenizer.model`` beside the source, if any.  The tokenizer is also
    written as llama.cpp's ``tokenizer.ggml.*`` keys (``_gguf_vocab``), so llama.cpp can load the file."""
    from ._gguf_vocab import write_vocab

    w.add_name(cfg.model_id or cfg.arch)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_uint32(VERSION, FORMAT_VERSION)
    w.add_string(ARCH, cfg.arch)
    w.add_string(HF_CONFIG, raw_config)
    for name, key in EMBEDDED_FILES.items():
        if name in files:
            w.add_string(key, files[name])
    write_vocab(w, {"config.json": raw_config, **files}, cfg.vocab_size, spm_model)
    have = set(w.kv_data[0])  # what the tokenizer's files gave; the config fills in the rest
    template = _chat_template(files.get("tokenizer_config.json"))
    if template and Keys.Tokenizer.CHAT_TEMPLATE not in have:
        w.add_chat_template(template)
    _hparams(w, cfg)
    for add, key, value in ((w.add_bos_token_id, Keys.Tokenizer.BOS_ID, cfg.bos_token_id),
                            (w.add_pad_token_id, Keys.Tokenizer.PAD_ID, cfg.pad_token_id),
                            (w.add_eos_token_id, Keys.Tokenizer.EOS_ID,
                             cfg.eos_token_ids[0] if cfg.eos_token_ids else None)):
        if value is not None and key not in have:
            add(int(value))


def _chat_template(text: str | None) -> str | None:
    try:
        value = json.loads(text).get("chat_template") if text else None
    except (json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _hparams(w: GGUFWriter, cfg: ModelConfig) -> None:
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.dense_intermediate_size or cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(_kv_heads(cfg))
    if cfg.norm == "layer" and cfg.arch != "phimoe":  # DBRX's LayerNorm (llama.cpp's phimoe reads the RMS key)
        w.add_layer_norm_eps(cfg.rms_norm_eps)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_rope_dimension_count(cfg.rope.dim)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.top_k)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    if cfg.attention == "kimi_linear":  # written absorbed (attn_k_b / attn_v_b): one key-value head of the latent
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        if cfg.q_lora_rank:
            w.add_q_lora_rank(cfg.q_lora_rank)
    elif cfg.attention in ("mla", "dsa"):
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
        if cfg.q_lora_rank:
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.family.v_head_dim if cfg.arch == "mimo_v2_flash" else cfg.head_dim)
    if cfg.clip_qkv is not None:
        w.add_clamp_kqv(cfg.clip_qkv)
    if cfg.shared_intermediate_size:
        w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    if cfg.arch in ("deepseek_v3", "kimi_k25", "glm_moe_dsa", "glm4_moe", "glm4_moe_lite", "mistral4", "dots1"):
        w.add_leading_dense_block_count(cfg.moe_layers.index(True) if True in cfg.moe_layers else cfg.num_layers)
        w.add_expert_shared_count(cfg.shared_intermediate_size // max(cfg.moe_intermediate_size, 1))
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX if cfg.router == "softmax_group"
                                 else gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if cfg.arch == "ernie4_5_moe":  # llama.cpp's ERNIE: MoE from the leading dense layers on, every step-th
        w.add_leading_dense_block_count(cfg.moe_layers.index(True) if True in cfg.moe_layers else cfg.num_layers)
        w.add_interleave_moe_layer_step(int(cfg.raw.get("moe_layer_interval", 1)))
        w.add_expert_shared_count(cfg.shared_intermediate_size // max(cfg.moe_intermediate_size, 1))
    if cfg.arch == "glm4_moe":  # its multi-token-prediction layers are not written (llama.cpp counts them here)
        w.add_nextn_predict_layers(0)
    if cfg.arch == "minimax_m2":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.q_position_scale is not None:  # Mistral 4's llama_4_scaling_beta over its length
        w.add_attn_temperature_scale(cfg.q_position_scale[0])
        w.add_attn_temperature_length(cfg.q_position_scale[1])
    if cfg.arch in ("granitemoe", "granitemoeshared"):  # Granite's four scalars
        w.add_attention_scale(cfg.scale)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if cfg.arch in ("llama4", "llama4_text"):  # llama.cpp fixes the chunk size, NoPE step and temperature
        w.add_interleave_moe_layer_step(cfg.moe_layers.index(True) + 1 if True in cfg.moe_layers else cfg.num_layers)
        if not any(cfg.family.chunked):
            w.add_sliding_window(0)
    if cfg.arch == "hunyuan_v1_moe":  # one shared MLP, as wide as an expert
        w.add_expert_shared_count(1)
    if cfg.arch == "phimoe":
        _phimoe_hparams(w, cfg)
    if cfg.arch == "mimo_v2_flash":
        _mimo_hparams(w, cfg)
    if cfg.arch == "kimi_linear":
        _kimi_linear_hparams(w, cfg)
    _dsa_deltanet_hparams(w, cfg)
    windows = {x for x in cfg.sliding_windows if x is not None}
    if windows and cfg.arch != "phimoe":
        w.add_sliding_window(max(windows))
    if cfg.rope.kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope.factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position)
        w.add_rope_scaling_yarn_beta_fast(cfg.rope.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(cfg.rope.beta_slow)
        if cfg.rope.mscale_all_dim:
            w.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope.mscale_all_dim)


def hf_config_from_metadata(meta: Mapping[str, Any], tensors: set[str], garch: str,
                            rope_freqs: np.ndarray | None = None,
                            rope_factors: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """A config.json-like dict from llama.cpp keys (``meta``: key -> value) and tensor names; ``rope_freqs``:
    the values of llama.cpp's ``rope_freqs`` tensor when the file has one (Llama 4's llama3 RoPE scaling);
    ``rope_factors``: those of ``rope_factors_short`` / ``rope_factors_long`` (PhiMoE's longrope), by name."""
    from ._gguf_names import model_type_of

    arch = model_type_of(garch)
    if arch is None:
        raise KeyError("general.architecture")

    def get(key: str, default: Any = KeyError) -> Any:
        k = key.format(arch=garch)
        if k in meta:
            return meta[k]
        if default is KeyError:
            raise KeyError(k)
        return default

    L = Keys.LLM
    A = Keys.Attention
    R = Keys.Rope
    n = int(get(L.BLOCK_COUNT))
    heads = int(get(A.HEAD_COUNT))
    raw: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": int(get(L.VOCAB_SIZE, 0)) or None,
        "hidden_size": int(get(L.EMBEDDING_LENGTH)),
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": _attention_kv_heads(get(A.HEAD_COUNT_KV, heads)),
        "rms_norm_eps": _f32(get(A.LAYERNORM_RMS_EPS, 1e-6)),
        "max_position_embeddings": int(get(L.CONTEXT_LENGTH, 0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get(Keys.Tokenizer.BOS_ID),
        "eos_token_id": meta.get(Keys.Tokenizer.EOS_ID),
        "pad_token_id": meta.get(Keys.Tokenizer.PAD_ID),
        "num_experts_per_tok": int(get(L.EXPERT_USED_COUNT)),
        # without the key, what llama.cpp's graph hard-codes (build_moe_ffn's norm_w): Mixtral and Qwen3-MoE
        # renormalise (src/models/qwen3moe.cpp; its converter never writes the key), Qwen2-MoE and OLMoE do not
        "norm_topk_prob": bool(get(L.EXPERT_WEIGHTS_NORM, arch in ("mixtral", "qwen3_moe"))),
        "rope_parameters": _rope(get, R),
        "head_dim": int(get(A.KEY_LENGTH, 0)) or None,
    }
    experts = int(get(L.EXPERT_COUNT))
    expert_ff = int(get(L.EXPERT_FEED_FORWARD_LENGTH, 0)) or int(get(L.FEED_FORWARD_LENGTH))
    dense = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]

    def has(suffix: str) -> bool:
        return any(t.endswith("." + suffix) for t in tensors)

    if arch in ("mixtral", "gpt_oss", "granitemoe"):
        raw.update(num_local_experts=experts, intermediate_size=expert_ff)
    else:
        raw.update(num_experts=experts, moe_intermediate_size=expert_ff,
                   intermediate_size=int(get(L.FEED_FORWARD_LENGTH, expert_ff)))
    if arch == "qwen2_moe":
        raw.update(qkv_bias=has("attn_q.bias"), mlp_only_layers=dense, decoder_sparse_step=1,
                   shared_expert_intermediate_size=int(get(L.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)))
    elif arch == "qwen3_moe":
        raw.update(attention_bias=has("attn_q.bias"), mlp_only_layers=dense, decoder_sparse_step=1)
    elif arch == "olmoe":
        clip = get(A.CLAMP_KQV, None)
        raw.update(attention_bias=has("attn_q.bias"), clip_qkv=_f32(clip) if clip else None)
    elif arch in ("deepseek_v3", "mistral4"):
        first_dense = int(get(L.LEADING_DENSE_BLOCK_COUNT, 0))
        if arch == "deepseek_v3" and dense != list(range(first_dense)):  # GLM-4.7-Flash: dense layers anywhere
            raw.update(model_type="glm4_moe_lite",
                       mlp_layer_types=["dense" if i in dense else "sparse" for i in range(n)])
        rope_dim = int(get(R.DIMENSION_COUNT))
        q_lora = get(A.Q_LORA_RANK, None)
        key, value = _mla_head_lengths(get, A)
        raw.update(n_routed_experts=experts, qk_rope_head_dim=rope_dim, num_key_value_heads=heads,
                   qk_nope_head_dim=key - rope_dim, v_head_dim=value,
                   q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(get(A.KV_LORA_RANK)),
                   first_k_dense_replace=int(get(L.LEADING_DENSE_BLOCK_COUNT, 0)),
                   n_shared_experts=int(get(L.EXPERT_SHARED_COUNT, 0)),
                   routed_scaling_factor=_f32(get(L.EXPERT_WEIGHTS_SCALE, 1.0)),
                   n_group=int(get(L.EXPERT_GROUP_COUNT, 1)), topk_group=int(get(L.EXPERT_GROUP_USED_COUNT, 1)),
                   rope_interleave=True, head_dim=None)
        beta = get(A.TEMPERATURE_SCALE, None)
        if arch == "mistral4" and beta is not None:
            raw["rope_parameters"]["llama_4_scaling_beta"] = _f32(beta)
            if raw["rope_parameters"]["rope_type"] == "default":  # the length is YaRN's original context
                raw["rope_parameters"]["original_max_position_embeddings"] = int(get(A.TEMPERATURE_LENGTH))
    elif arch == "minimax_m2":
        head_dim = int(raw["head_dim"] or raw["hidden_size"] // heads)
        raw.update(num_local_experts=experts, intermediate_size=expert_ff, head_dim=head_dim)
        raw["rope_parameters"]["partial_rotary_factor"] = int(get(R.DIMENSION_COUNT, head_dim)) / head_dim
    elif arch in ("glm_moe_dsa", "qwen3_5_moe", "qwen3_next"):
        _dsa_deltanet_config(raw, get, tensors, n, experts, dense)
    elif arch == "hunyuan_v1_moe":
        raw.update(intermediate_size=expert_ff, moe_topk=raw["num_experts_per_tok"], attention_bias=has("attn_q.bias"),
                   head_dim=int(raw["head_dim"] or raw["hidden_size"] // heads))
    elif arch == "phimoe":
        _phimoe_config(raw, get, tensors, experts, expert_ff, rope_factors or {})
    elif arch == "mimo_v2_flash":
        _mimo_config(raw, get, n, experts, dense)
    elif arch == "kimi_linear":
        _kimi_linear_config(raw, get, n, experts, expert_ff, dense)
    elif arch == "dots1":  # llama.cpp's dots1 has no sliding-window layers
        raw.update(n_routed_experts=experts, head_dim=int(raw["head_dim"] or raw["hidden_size"] // heads),
                   attention_bias=has("attn_q.bias"), first_k_dense_replace=int(get(L.LEADING_DENSE_BLOCK_COUNT, 0)),
                   n_shared_experts=int(get(L.EXPERT_SHARED_COUNT, 0)),
                   routed_scaling_factor=_f32(get(L.EXPERT_WEIGHTS_SCALE, 1.0)), sliding_window=None,
                   n_group=int(get(L.EXPERT_GROUP_COUNT, 1)), topk_group=int(get(L.EXPERT_GROUP_USED_COUNT, 1)))
    elif arch == "ernie4_5_moe":
        moe = [i for i in range(n) if i not in dense]
        raw.update(moe_layer_start_index=int(get(L.LEADING_DENSE_BLOCK_COUNT, 0)),
                   moe_layer_interval=int(get(L.INTERLEAVE_MOE_LAYER_STEP, 1)),
                   moe_layer_end_index=moe[-1] if moe else -1, moe_num_shared_experts=int(get(L.EXPERT_SHARED_COUNT, 0)))
    elif arch == "glm4_moe":
        head_dim = int(raw["head_dim"] or raw["hidden_size"] // heads)
        raw.update(n_routed_experts=experts, head_dim=head_dim, attention_bias=has("attn_q.bias"),
                   use_qk_norm=has("attn_q_norm.weight"), first_k_dense_replace=int(get(L.LEADING_DENSE_BLOCK_COUNT, 0)),
                   n_shared_experts=int(get(L.EXPERT_SHARED_COUNT, 0)),
                   routed_scaling_factor=_f32(get(L.EXPERT_WEIGHTS_SCALE, 1.0)),
                   n_group=int(get(L.EXPERT_GROUP_COUNT, 1)), topk_group=int(get(L.EXPERT_GROUP_USED_COUNT, 1)))
        raw["rope_parameters"]["partial_rotary_factor"] = int(get(R.DIMENSION_COUNT, head_dim // 2)) / head_dim
    elif arch == "granitemoe":
        shared = int(get(L.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0))
        raw.update(model_type="granitemoeshared" if shared else "granitemoe", shared_intermediate_size=shared,
                   attention_bias=has("attn_q.bias"), attention_multiplier=_f32(get(A.SCALE)),
                   embedding_multiplier=_f32(get(L.EMBEDDING_SCALE)), residual_multiplier=_f32(get(L.RESIDUAL_SCALE)),
                   logits_scaling=_f32(get(L.LOGIT_SCALE)))
    elif arch == "llama4_text":
        _llama4_config(raw, get, tensors, experts, expert_ff, rope_freqs)
    elif arch == "dbrx":
        clip = get(A.CLAMP_KQV, None)
        raw = {"model_type": "dbrx", "vocab_size": raw["vocab_size"], "d_model": raw["hidden_size"], "n_heads": heads,
               "n_layers": n, "max_seq_len": raw["max_position_embeddings"],
               "tie_word_embeddings": raw["tie_word_embeddings"], "bos_token_id": raw["bos_token_id"],
               "eos_token_id": raw["eos_token_id"], "pad_token_id": raw["pad_token_id"],
               "attn_config": {"kv_n_heads": raw["num_key_value_heads"], "clip_qkv": _f32(clip) if clip else None,
                               "rope_theta": raw["rope_parameters"]["rope_theta"]},
               "ffn_config": {"ffn_hidden_size": expert_ff, "moe_num_experts": experts,
                              "moe_top_k": raw["num_experts_per_tok"], "moe_normalize_expert_weights": 1.0}}
    elif arch == "gpt_oss":
        window = get(A.SLIDING_WINDOW, None)
        raw.update(sliding_window=int(window) if window else None, attention_bias=has("attn_q.bias"))
        if raw["rope_parameters"]["rope_type"] == "yarn":
            raw["rope_parameters"]["truncate"] = False  # as in the hub's config; llama.cpp has no key for it
    return raw


def _mla_head_lengths(get: Any, A: Any) -> tuple[int, int]:
    """An MLA head's key (nope + rope) and value widths.  Recent llama.cpp writes MLA absorbed (attn_k_b /
    attn_v_b, one key-value head, key_length = kv_lora_rank + rope): the heads' own widths are then under
    ``key_length_mla`` / ``value_length_mla``."""
    key, value = get(A.KEY_LENGTH_MLA, None), get(A.VALUE_LENGTH_MLA, None)
    return (int(key) if key else int(get(A.KEY_LENGTH))), (int(value) if value else int(get(A.VALUE_LENGTH)))


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _rope(get: Any, R: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": _f32(get(R.FREQ_BASE, 10000.0)), "rope_type": "default"}
    if str(get(R.SCALING_TYPE, "none")) == "yarn":
        params.update(rope_type="yarn", factor=_f32(get(R.SCALING_FACTOR)),
                      original_max_position_embeddings=int(get(R.SCALING_ORIG_CTX_LEN)),
                      beta_fast=_f32(get(R.SCALING_YARN_BETA_FAST, 32.0)),
                      beta_slow=_f32(get(R.SCALING_YARN_BETA_SLOW, 1.0)))
        log_mul = get(R.SCALING_YARN_LOG_MUL, None)
        if log_mul:  # llama.cpp stores 0.1 * mscale_all_dim; mscale is assumed equal (as in DeepSeek-V3)
            mscale = round(_f32(log_mul) / 0.1, 6)
            params.update(mscale=mscale, mscale_all_dim=mscale)
    return params


# ---------------------------------------------------------------- GLM-5 (glm-dsa) and Qwen3.5-MoE (qwen35moe)
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"  # llama.cpp's key (newer than this gguf package's Keys)


def _dsa_deltanet_hparams(w: GGUFWriter, cfg: ModelConfig) -> None:
    """llama.cpp's keys for the DSA indexer and for Qwen3.5's DeltaNet (as its convert_hf_to_gguf.py writes them)."""
    if cfg.dsa is not None:
        w.add_indexer_head_count(cfg.dsa.n_heads)
        w.add_indexer_key_length(cfg.dsa.head_dim)
        w.add_indexer_top_k(cfg.dsa.topk)
    dn = cfg.deltanet
    if dn is not None:
        w.add_ssm_conv_kernel(dn.conv_kernel)
        w.add_ssm_state_size(dn.k_head_dim)
        w.add_ssm_group_count(dn.num_k_heads)
        w.add_ssm_time_step_rank(dn.num_v_heads)
        w.add_ssm_inner_size(dn.value_dim)
        full = [i for i, linear in enumerate(dn.layers) if not linear]
        if cfg.arch == "qwen3_next":  # as llama.cpp's Qwen3NextModel writes them: the config's interval (its
            # default 4) and which layers are DeltaNet
            w.add_full_attention_interval(int(cfg.raw.get("full_attention_interval", 4)))
            w.add_array(RECURRENT_LAYERS.format(arch=w.arch), [bool(x) for x in dn.layers])
            return
        w.add_full_attention_interval(full[0] + 1 if full else len(dn.layers))
        text = cfg.raw.get("text_config", cfg.raw)
        section = list((text.get("rope_parameters") or {}).get("mrope_section") or [11, 11, 10])
        w.add_rope_dimension_sections((section + [0] * 4)[:4])


def _dsa_deltanet_config(raw: dict[str, Any], get: Any, tensors: set[str], n: int, experts: int,
                         dense: list[int]) -> None:
    """The config.json fields of GLM-5 / Qwen3.5-MoE that llama.cpp's keys and tensor names imply."""
    L, A, S = Keys.LLM, Keys.Attention, Keys.SSM
    if raw["model_type"] == "glm_moe_dsa":
        rope_dim = int(get(Keys.Rope.DIMENSION_COUNT))
        raw.update(n_routed_experts=experts, qk_rope_head_dim=rope_dim,
                   qk_nope_head_dim=int(get(A.KEY_LENGTH)) - rope_dim, v_head_dim=int(get(A.VALUE_LENGTH)),
                   q_lora_rank=int(get(A.Q_LORA_RANK)), kv_lora_rank=int(get(A.KV_LORA_RANK)),
                   n_shared_experts=int(get(L.EXPERT_SHARED_COUNT, 0)),
                   routed_scaling_factor=_f32(get(L.EXPERT_WEIGHTS_SCALE, 1.0)),
                   n_group=int(get(L.EXPERT_GROUP_COUNT, 1)), topk_group=int(get(L.EXPERT_GROUP_USED_COUNT, 1)),
                   head_dim=None, index_n_heads=int(get(A.Indexer.HEAD_COUNT)),
                   index_head_dim=int(get(A.Indexer.KEY_LENGTH)), index_topk=int(get(A.Indexer.TOP_K)),
                   mlp_layer_types=["dense" if i in dense else "sparse" for i in range(n)],
                   indexer_types=["full" if f"blk.{i}.indexer.proj.weight" in tensors else "shared"
                                  for i in range(n)])
        return
    value_heads = int(get(S.TIME_STEP_RANK))
    raw.update(layer_types=["linear_attention" if f"blk.{i}.ssm_a" in tensors else "full_attention"
                            for i in range(n)],
               attention_bias=any(t.endswith(".attn_q.bias") for t in tensors),
               linear_conv_kernel_dim=int(get(S.CONV_KERNEL)), linear_key_head_dim=int(get(S.STATE_SIZE)),
               linear_num_key_heads=int(get(S.GROUP_COUNT)), linear_num_value_heads=value_heads,
               linear_value_head_dim=int(get(S.INNER_SIZE)) // value_heads,
               shared_expert_intermediate_size=int(get(L.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)))
    raw["rope_parameters"]["partial_rotary_factor"] = int(get(Keys.Rope.DIMENSION_COUNT)) / int(raw["head_dim"])
    if raw["model_type"] == "qwen3_next":  # llama.cpp's qwen3next always renormalises the top-k weights
        raw.update(mlp_only_layers=dense, decoder_sparse_step=1, norm_topk_prob=bool(get(L.EXPERT_WEIGHTS_NORM, True)),
                   intermediate_size=int(get(L.FEED_FORWARD_LENGTH, raw["moe_intermediate_size"])))


# ---------------------------------------------------------------- Llama 4 (llama4)


def _llama4_config(raw: dict[str, Any], get: Any, tensors: set[str], experts: int, expert_ff: int,
                   rope_freqs: np.ndarray | None) -> None:
    """Llama 4's config.json fields from llama.cpp's keys.  llama.cpp stores no chunk size, NoPE
    interval, temperature or q/k-norm switch: it fixes them (8192, every 4th layer NoPE, floor 8192
    and scale 0.1; q/k norm unless 128 experts, i.e. Maverick), and so does this reading.  Its
    ``rope_freqs`` tensor (per-frequency divisors) is read back as ``llama3`` scaling (``llama3_from_factors``)."""
    chunked = get(Keys.Attention.SLIDING_WINDOW, None) != 0
    raw.update(num_local_experts=experts, intermediate_size=expert_ff,
               intermediate_size_mlp=int(get(Keys.LLM.FEED_FORWARD_LENGTH)),
               interleave_moe_layer_step=int(get(Keys.LLM.INTERLEAVE_MOE_LAYER_STEP, 1)),
               attention_bias=any(t.endswith(".attn_q.bias") for t in tensors), use_qk_norm=experts != 128,
               attention_chunk_size=8192 if chunked else None, floor_scale=8192, attn_scale=0.1,
               attn_temperature_tuning=True, no_rope_layer_interval=4 if chunked else raw["num_hidden_layers"])
    if rope_freqs is not None:
        head_dim = int(raw["head_dim"] or raw["hidden_size"] // raw["num_attention_heads"])
        raw["rope_parameters"].update(llama3_from_factors(rope_freqs, raw["rope_parameters"]["rope_theta"], head_dim))


LLAMA3_CONTEXT = 8192  # the original context llama.cpp's converter assumes, and Llama 4 Scout's


def llama3_factors(rope: RopeConfig) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` of a ``llama3`` RoPE: each frequency's divisor, float32 ``(dim / 2,)``."""
    with np.errstate(divide="ignore", invalid="ignore"):  # no band between (Scout: low = high factor)
        scaled = rope.inv_freq()[0]
    return (replace(rope, kind="default").inv_freq()[0] / scaled).astype(np.float32)


def llama3_from_factors(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any]:
    """``rope_parameters`` of the ``llama3`` scaling whose divisors are ``factors``.  They fix the factor
    (the largest) and the bands relative to the original context, which is taken as ``LLAMA3_CONTEXT``
    (every such triple gives these frequencies): through the frequencies between the bands (two at least),
    or, with none there (Llama 4 Scout's low = high factor), through where the divisors step."""
    rf = np.asarray(factors, np.float64).reshape(-1)
    if rf.shape != (dim // 2,) or not np.all(np.isfinite(rf)) or rf.min() < 1 - 1e-6:
        raise ValueError(f"rope_freqs holds {rf.shape[0]} divisors, not {dim // 2} of at least 1")
    factor = float(rf.max())
    if factor <= 1 + 1e-6:
        return {}
    wavelength = 2 * math.pi * theta ** (np.arange(0, dim, 2) / dim)
    smooth = (1 / rf - 1 / factor) / (1 - 1 / factor)  # 1 in the kept band, 0 in the divided one
    mid = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if mid.sum() >= 2:
        a, minus_b = np.polyfit(1 / wavelength[mid], smooth[mid], 1)  # smooth = a / wavelength - b
        low = round(-minus_b * LLAMA3_CONTEXT / a, 4)
        high = round(low + LLAMA3_CONTEXT / a, 4)
    elif mid.any():
        raise ValueError("rope_freqs has one frequency between llama3's bands: its parameters are not determined")
    else:  # a step: kept below some wavelength, divided above; the step's place is all that is fixed
        kept, divided = wavelength[smooth >= 0.5].max(initial=0.0), wavelength[smooth < 0.5].min()
        step = LLAMA3_CONTEXT if kept < LLAMA3_CONTEXT < divided else math.sqrt(max(kept, 1.0) * divided)
        low = high = round(LLAMA3_CONTEXT / step, 4)
    params = {"rope_type": "llama3", "factor": round(factor, 4), "low_freq_factor": low, "high_freq_factor": high,
              "original_max_position_embeddings": LLAMA3_CONTEXT}
    rope = RopeConfig(theta=theta, dim=dim, kind="llama3", factor=params["factor"],
                      original_max_position=LLAMA3_CONTEXT, low_freq_factor=low, high_freq_factor=high)
    if not np.allclose(llama3_factors(rope), rf, rtol=1e-4, atol=0):
        raise ValueError("rope_freqs is not a llama3 RoPE scaling")
    return params


# ---------------------------------------------------------------- PhiMoE (phimoe)
PHIMOE_JITTER = "moeswarm.phimoe.router_jitter_noise"  # sparsemixer's jitter: llama.cpp has no key for it
PHIMOE_LONG_MSCALE = "moeswarm.phimoe.long_mscale"  # longrope's cos/sin scale past the original context


def _phimoe_hparams(w: GGUFWriter, cfg: ModelConfig) -> None:
    """As llama.cpp's Phi3MiniModel / PhiMoeModel write them (the LayerNorms' epsilon under the RMS key, above): the
    window (0: none), the original context, and for longrope the cos/sin scale as ``rope.scaling.attn_factor``
    (the short one: transformers 5.24's PhiMoE rotates with the short factors; past the original context it
    switches to ``long_mscale``, which has no llama.cpp key)."""
    windows = {x for x in cfg.sliding_windows if x is not None}
    w.add_sliding_window(max(windows) if windows else 0)
    w.add_float32(PHIMOE_JITTER, cfg.family.router_jitter)
    if cfg.rope.kind == "longrope":
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position)
        w.add_rope_scaling_attn_factors(float(cfg.rope.attention_factor or 1.0))
        w.add_float32(PHIMOE_LONG_MSCALE, cfg.rope.long_mscale)
    else:
        w.add_rope_scaling_orig_ctx_len(cfg.max_position_embeddings)


def phimoe_rope_factors(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """llama.cpp's ``rope_factors_short`` / ``rope_factors_long`` tensors of a longrope PhiMoE (none otherwise)."""
    if cfg.rope.kind != "longrope":
        return {}
    params = {**(cfg.raw.get("rope_scaling") or {}), **(cfg.raw.get("rope_parameters") or {})}
    short = np.asarray(cfg.rope.factors, np.float32)
    long = np.asarray(params.get("long_factor") or cfg.rope.factors, np.float32)
    return {"rope_factors_short.weight": short, "rope_factors_long.weight": long}


def _phimoe_config(raw: dict[str, Any], get: Any, tensors: set[str], experts: int, expert_ff: int,
                   rope_factors: Mapping[str, np.ndarray]) -> None:
    """PhiMoE's config.json fields from llama.cpp's keys and its rope_factors tensors.  A file without our
    jitter key takes PhimoeConfig's default (0.01, Phi-3.5-MoE's); without our long scale, the short one."""
    A, R = Keys.Attention, Keys.Rope
    window = int(get(A.SLIDING_WINDOW, 0))
    raw.update(num_local_experts=experts, intermediate_size=expert_ff, sliding_window=window or None,
               attention_bias=any(t.endswith(".attn_q.bias") for t in tensors), lm_head_bias="output.bias" in tensors,
               rms_norm_eps=_f32(get(A.LAYERNORM_RMS_EPS, 1e-5)),
               router_jitter_noise=_f32(get(PHIMOE_JITTER, 0.01)), num_experts_per_tok=2)
    short = rope_factors.get("rope_factors_short.weight")
    if short is not None:
        mscale = _f32(get(R.SCALING_ATTN_FACTOR, 1.0))
        long = rope_factors.get("rope_factors_long.weight", short)
        raw["rope_parameters"].update(
            rope_type="longrope", short_factor=[_f32(x) for x in np.asarray(short).reshape(-1)],
            long_factor=[_f32(x) for x in np.asarray(long).reshape(-1)], short_mscale=mscale,
            long_mscale=_f32(get(PHIMOE_LONG_MSCALE, mscale)),
            original_max_position_embeddings=int(get(R.SCALING_ORIG_CTX_LEN)))


# ---------------------------------------------------------------- MiMo-V2-Flash (mimo2)
MIMO_VALUE_SCALE = "{arch}.attention.value_scale"  # llama.cpp's key (newer than this gguf package's Keys)


def _kv_heads(cfg: ModelConfig) -> int | list[int]:
    """``head_count_kv``: one number, or per layer where layers differ (MiMo's sliding layers have more; Kimi
    Linear's KDA layers none, by which llama.cpp tells its recurrent layers, and its absorbed MLA one)."""
    if cfg.arch == "mimo_v2_flash":
        return [cfg.family.sliding_kv_heads if s else cfg.num_kv_heads for s in cfg.family.sliding]
    if cfg.arch == "kimi_linear":
        return [0 if linear else 1 for linear in cfg.family.linear]  # MLA absorbed: one latent head
    return cfg.num_kv_heads


def _attention_kv_heads(value: Any) -> int:
    """The key-value heads of the full-attention layers from ``head_count_kv`` (one number, or per layer: the
    fewest of the layers that have any)."""
    counts = [int(x) for x in np.asarray(value).reshape(-1)]
    return min((x for x in counts if x), default=0)


def _mimo_hparams(w: GGUFWriter, cfg: ModelConfig) -> None:
    """As llama.cpp's MimoV2Model writes them: which layers slide, their RoPE base, the values' scale; and the
    router's group counts and scale (llama.cpp's mimo2 reads no scale and always renormalises: the published
    checkpoint's routed_scaling_factor is 1)."""
    s = cfg.family
    w.add_sliding_window_pattern([int(x) for x in s.sliding])  # type: ignore[list-item]
    w.add_rope_freq_base_swa(s.sliding_rope.theta)
    w.add_float32(MIMO_VALUE_SCALE.format(arch=w.arch), s.value_scale)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)


def _mimo_config(raw: dict[str, Any], get: Any, n: int, experts: int, dense: list[int]) -> None:
    """MiMo-V2-Flash's config.json fields from llama.cpp's keys (its sliding layers have twice the full layers'
    key-value heads; the partial rotary factor is the one whose ``int(head_dim * factor)`` is the rotary width)."""
    A, R, L = Keys.Attention, Keys.Rope, Keys.LLM
    head_dim = int(get(A.KEY_LENGTH))
    factor = (int(get(R.DIMENSION_COUNT)) + 0.5) / head_dim
    pattern = [bool(x) for x in np.asarray(get(A.SLIDING_WINDOW_PATTERN)).reshape(-1)][:n]
    base = raw["rope_parameters"]["rope_theta"]
    raw.update(n_routed_experts=experts, head_dim=head_dim, v_head_dim=int(get(A.VALUE_LENGTH)),
               sliding_window=int(get(A.SLIDING_WINDOW)),
               attention_value_scale=_f32(get(MIMO_VALUE_SCALE, 1.0)),
               layer_types=["sliding_attention" if s else "full_attention" for s in pattern],
               mlp_layer_types=["dense" if i in dense else "sparse" for i in range(n)],
               n_group=int(get(L.EXPERT_GROUP_COUNT, 1)), topk_group=int(get(L.EXPERT_GROUP_USED_COUNT, 1)),
               routed_scaling_factor=_f32(get(L.EXPERT_WEIGHTS_SCALE, 1.0)),
               norm_topk_prob=bool(get(L.EXPERT_WEIGHTS_NORM, True)),
               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": base,
                                                   "partial_rotary_factor": factor},
                                "sliding_attention": {"rope_type": "default", "partial_rotary_factor": factor,
                                                      "rope_theta": _f32(get(R.FREQ_BASE_SWA, base))}})


# ---------------------------------------------------------------- Kimi Linear (kimi-linear)
KDA_HEAD_DIM = "{arch}.kda.head_dim"  # llama.cpp's key (newer than this gguf package's Keys)


def _kimi_linear_hparams(w: GGUFWriter, cfg: ModelConfig) -> None:
    """As llama.cpp's KimiLinearModel writes them (its runtime requires the MLA widths, the convolution width,
    the KDA head width and the gating function): KDA uses the model's head count."""
    k = cfg.family
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_ssm_conv_kernel(k.conv_kernel)
    w.add_uint32(KDA_HEAD_DIM.format(arch=w.arch), k.head_dim)
    w.add_leading_dense_block_count(cfg.moe_layers.index(True) if True in cfg.moe_layers else cfg.num_layers)
    w.add_expert_shared_count(cfg.shared_intermediate_size // max(cfg.moe_intermediate_size, 1))
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)


def _kimi_linear_config(raw: dict[str, Any], get: Any, n: int, experts: int, expert_ff: int,
                        dense: list[int]) -> None:
    """Kimi Linear's config.json fields from llama.cpp's keys: KDA layers are those without key-value heads."""
    A, L, R = Keys.Attention, Keys.LLM, Keys.Rope
    kv = [int(x) for x in np.asarray(get(A.HEAD_COUNT_KV)).reshape(-1)]
    kv = kv * n if len(kv) == 1 else kv
    rope = int(get(R.DIMENSION_COUNT))
    q_lora = get(A.Q_LORA_RANK, None)
    raw.update(layer_types=["linear_attention" if x == 0 else "full_attention" for x in kv[:n]],
               mlp_layer_types=["dense" if i in dense else "sparse" for i in range(n)],
               linear_num_heads=raw["num_attention_heads"], linear_head_dim=int(get(KDA_HEAD_DIM)),
               linear_conv_kernel_dim=int(get(Keys.SSM.CONV_KERNEL)), num_local_experts=experts,
               moe_intermediate_size=expert_ff, qk_rope_head_dim=rope,
               qk_nope_head_dim=int(get(A.KEY_LENGTH_MLA)) - rope, v_head_dim=int(get(A.VALUE_LENGTH_MLA)),
               kv_lora_rank=int(get(A.KV_LORA_RANK)), q_lora_rank=int(q_lora) if q_lora else None,
               n_shared_experts=int(get(L.EXPERT_SHARED_COUNT, 0)),
               routed_scaling_factor=_f32(get(L.EXPERT_WEIGHTS_SCALE, 1.0)),
               n_group=int(get(L.EXPERT_GROUP_COUNT, 1)), topk_group=int(get(L.EXPERT_GROUP_USED_COUNT, 1)),
               norm_topk_prob=bool(get(L.EXPERT_WEIGHTS_NORM, True)), head_dim=None,
               num_key_value_heads=raw["num_attention_heads"])
