"""The two random models of ``benchmarks/llamacpp.py``, written as Hugging Face folders for llama.cpp's converter.

* ``mixtral_folder``: the 4-layer table's model (hidden 1024, 8 experts of 2816, top-2, Mixtral's 32000-token
  SentencePiece tokenizer from mistral-common).
* ``qwen3_moe_folder``: real depth and width, Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 key-value
  heads of 128, 128 experts of 768, top-8, QK-norm) and its 151936-token vocabulary, with as many layers as
  asked.  transformers names the tensors and shapes (``Qwen3MoeForCausalLM`` built on the meta device) and
  writes ``config.json``; the weights are random N(0, 1/fan_in) float16, written one layer at a time so
  a 12-layer (15 GB) model never has to be in memory at once.  The tokenizer is Qwen2's (Qwen3 uses it
  unchanged), rebuilt as a tokenizer.json from llama.cpp's own ``models/ggml-vocab-qwen2.gguf``: the
  converter recognises it by hashing a test string's ids, so a rebuild that tokenizes differently fails
  conversion instead of passing silently.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

# Qwen3-30B-A3B's layer
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, rms_norm_eps=1e-6, norm_topk_prob=True, max_position_embeddings=40960,
                     rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=False,
                     bos_token_id=151643, eos_token_id=151645)
SMALL_QWEN3 = dict(QWEN3_30B_A3B, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_experts=16,
                   num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def qwen3_params(shape: dict, layers: int) -> tuple[int, int]:  # type: ignore[type-arg]
    """(parameters per layer, parameters outside the layers: embedding + output)."""
    h, hd, e, f = shape["hidden_size"], shape["head_dim"], shape["num_experts"], shape["moe_intermediate_size"]
    attn = h * hd * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    per_layer = attn + e * 3 * h * f + e * h + 2 * h + 2 * hd
    return per_layer, 2 * shape["vocab_size"] * h + h


def layers_that_fit(budget_gib: float = 24.0, reserve_gib: float = 6.0) -> int:
    """Layers of Qwen3-30B-A3B's shape whose F16 file fits in ``budget_gib`` of RAM beside both engines.

    The file is memory-mapped by both engines (one copy in the page cache); beside it: moeswarm's float32
    copies of an F16 file's backbone (attention + output matrices, 4 bytes a weight) and its 512 MiB expert
    cache, llama.cpp's buffers, and ``reserve_gib`` for the system and the other programs of the machine."""
    per_layer, outside = qwen3_params(QWEN3_30B_A3B, 1)
    h, hd = QWEN3_30B_A3B["hidden_size"], QWEN3_30B_A3B["head_dim"]
    attn = h * hd * 2 * (QWEN3_30B_A3B["num_attention_heads"] + QWEN3_30B_A3B["num_key_value_heads"])
    fixed = 2 * outside + 4 * outside / 2 + (512 << 20) + (512 << 20) + reserve_gib * 2**30
    return int((budget_gib * 2**30 - fixed) // (2 * per_layer + 4 * attn))


def mixtral_folder(folder: Path, small: bool) -> Path:
    import mistral_common

    from moeswarm.model.synthetic import random_mixtral

    size = dict(hidden=256, inter=512, layers=2, heads=4, kv_heads=2) if small else \
        dict(hidden=1024, inter=2816, layers=4, heads=16, kv_heads=4)
    if (folder / "config.json").exists():
        return folder
    random_mixtral(folder, experts=8, vocab=32000, **size)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["MixtralForCausalLM"], rope_theta=1e6, bos_token_id=1, eos_token_id=2)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copyfile(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1", folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
         "tokenizer_class": "LlamaTokenizer", "model_max_length": 4096}))
    return folder


def qwen3_moe_folder(folder: Path, layers: int, small: bool, llama_src: Path, seed: int = 0) -> Path:
    """Write the real-depth model (see the module docstring); returns ``folder``."""
    if (folder / "model.safetensors.index.json").exists():
        return folder
    import torch
    from safetensors.numpy import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config = Qwen3MoeConfig(num_hidden_layers=layers, **(SMALL_QWEN3 if small else QWEN3_30B_A3B))
    config.architectures = ["Qwen3MoeForCausalLM"]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen3MoeForCausalLM(config).state_dict().items()}
    rng = np.random.default_rng(seed)
    groups: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        groups.setdefault(name.split(".")[2] if name.startswith("model.layers.") else "rest", {})[name] = shape
    weight_map: dict[str, str] = {}
    for i, (group, tensors) in enumerate(groups.items()):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: _random(k, s, rng) for k, s in tensors.items()}, str(folder / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
        print(f"  wrote {shard} ({group})", flush=True)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    qwen2_tokenizer(folder, llama_src / "models" / "ggml-vocab-qwen2.gguf")
    return folder


def _random(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """float16 weights ~ N(0, 1/fan_in) (norms: ones; the embedding: N(0, 1)), one expert at a time."""
    if len(shape) == 1:
        return np.ones(shape, np.float16)
    out = np.empty(shape, np.float16)
    scale = np.float32(1.0 if "embed_tokens" in name else shape[-1] ** -0.5)
    for i in range(shape[0] if len(shape) == 3 else 1):
        part = out[i] if len(shape) == 3 else out
        part[...] = rng.standard_normal(part.shape, dtype=np.float32) * scale
    return out


# Qwen2's tokenizer.json, as published (Qwen/Qwen2-7B, also Qwen3's), around the vocabulary and merges
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                r"\s+(?!\S)|\s+")


def qwen2_tokenizer(folder: Path, vocab_gguf: Path) -> None:
    """tokenizer.json + tokenizer_config.json of Qwen2 from llama.cpp's vocabulary-only GGUF of it."""
    import gguf

    reader = gguf.GGUFReader(vocab_gguf)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == gguf.TokenType.NORMAL}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, (t, kind) in enumerate(zip(tokens, types)) if kind == gguf.TokenType.CONTROL]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": dict(byte_level, trim_offsets=False), "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": normal, "merges": [m.split(" ") for m in merges]}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
         "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False, "model_max_length": 131072,
         "errors": "replace", "split_special_tokens": False}))
