"""Random Mixtral-style checkpoints written with numpy + safetensors (no torch): for
benchmarks, tests, and for trying a machine's limits with a model of a chosen size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def random_mixtral(folder: Path, *, hidden: int = 1024, inter: int = 2816, layers: int = 4, experts: int = 8,
                   vocab: int = 8192, heads: int = 16, kv_heads: int = 4, seed: int = 0) -> Path:
    """Weights ~ N(0, 1/fan_in) so routing is not uniform; one shard per layer plus an index."""
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = hidden // heads

    def w(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp), dtype=np.float32) / np.float32(inp**0.5)).astype(np.float32)

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
