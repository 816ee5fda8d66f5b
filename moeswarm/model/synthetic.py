"""Random Mixtral- and Qwen2-MoE-style checkpoints written with numpy + safetensors (no torch): for
benchmarks, tests, and for trying a machine's limits with a model of a chosen size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def _scaled_normal(rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """``w(out, in)``: float32 weights ~ N(0, 1/in), so activations keep their scale and routing is not uniform."""

    def w(out: int, inp: int) -> np.ndarray:
        return rng.standard_normal((out, inp), dtype=np.float32) / np.float32(inp**0.5)

    return w


def random_mixtral(folder: Path, *, hidden: int = 1024, inter: int = 2816, layers: int = 4, experts: int = 8,
                   vocab: int = 8192, heads: int = 16, kv_heads: int = 4, seed: int = 0) -> Path:
    """Weights ~ N(0, 1/fan_in) so routing is not uniform; one shard per layer plus an index."""
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = hidden // heads

    w = _scaled_normal(rng)

    weight_map: dict[str, str] = {}
    shards = [{"model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
               "model.norm.weight": np.ones(hidden, np.float32), "lm_head.weight": w(vocab, hidden)}]
    for L in range(layers):
        p = f"model.layers.{L}."
        t = {p + "input_layernorm.weight": np.ones(hidden, np.float32),
             p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
             p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
             p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * hd),
             p + "block_sparse_moe.gate.weight": w(experts, hidden)}
        for e in range(experts):
            q = p + f"block_sparse_moe.experts.{e}."
            t[q + "w1.weight"], t[q + "w3.weight"], t[q + "w2.weight"] = w(inter, hidden), w(inter, hidden), w(hidden, inter)
        shards.append(t)
    for i, tensors in enumerate(shards):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / name))
        weight_map.update({k: name for k in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"model_type": "mixtral", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_local_experts": experts, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 4096, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
              "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def random_qwen2_moe(folder: Path, *, hidden: int = 1024, moe_inter: int = 512, shared_inter: int = 2048,
                     layers: int = 4, experts: int = 16, top_k: int = 4, vocab: int = 8192, heads: int = 16,
                     kv_heads: int = 4, seed: int = 0) -> Path:
    """A random fp32 Qwen2-MoE checkpoint (hub tensor names, one file); weights ~ N(0, 1/fan_in)."""
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = hidden // heads

    w = _scaled_normal(rng)

    def ffn(prefix: str, inter: int) -> dict[str, np.ndarray]:
        return {f"{prefix}.gate_proj.weight": w(inter, hidden), f"{prefix}.up_proj.weight": w(inter, hidden),
                f"{prefix}.down_proj.weight": w(hidden, inter)}

    t = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
         "model.norm.weight": np.ones(hidden, np.float32), "lm_head.weight": w(vocab, hidden)}
    for L in range(layers):
        p = f"model.layers.{L}."
        t[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        for name, rows in (("q", heads * hd), ("k", kv_heads * hd), ("v", kv_heads * hd)):
            t[p + f"self_attn.{name}_proj.weight"] = w(rows, hidden)
            t[p + f"self_attn.{name}_proj.bias"] = np.zeros(rows, np.float32)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * hd)
        t[p + "mlp.gate.weight"] = w(experts, hidden)
        for e in range(experts):
            t.update(ffn(p + f"mlp.experts.{e}", moe_inter))
        t.update(ffn(p + "mlp.shared_expert", shared_inter))
        t[p + "mlp.shared_expert_gate.weight"] = w(1, hidden)
    save_file(t, str(folder / "model.safetensors"))
    config = {"model_type": "qwen2_moe", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": shared_inter,
              "moe_intermediate_size": moe_inter, "shared_expert_intermediate_size": shared_inter,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": False,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
              "max_position_embeddings": 4096, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
              "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
