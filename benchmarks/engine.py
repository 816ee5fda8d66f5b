"""Decode speed of the moeswarm numpy engine vs Hugging Face transformers, same model, same run.

Builds two random Mixtral-style checkpoints with transformers (a tiny one and a ~1.2 GB one),
then for batch 1 and 8: a 16-token prefill followed by N timed decode steps, in each engine.
Then one row per newer family at batch 1 (DeepSeek-V3.2 and GLM-5 with an indexer top-k of 16,
below the sequence length so the attention is really sparse; Qwen3.5-MoE with 3 DeltaNet layers
per full-attention layer), each a ~0.2 GB random checkpoint.
Both use one thread (OPENBLAS_NUM_THREADS=1, torch.set_num_threads(1)) so the ratio is fair and
stable on a shared 2-core box.  Prints a table; the ratio column is what to quote.

    python benchmarks/engine.py [--steps 24] [--keep DIR] [--rounds 3] [--only all|mixtral|families|new]

``--only families`` measures one row per family of issue 13 (MiniMax M2, MiniMax M3 text model
with its lightning indexer, Kimi K2.5 text model) at batch 1; ``--only new`` the other three
(DeepSeek-V3.2, GLM-5, Qwen3.5-MoE); ``--only mixtral`` the Mixtral size/batch table.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DeepseekV32Config,
    GlmMoeDsaConfig,
    MixtralConfig,
    Qwen3_5MoeConfig,
)

from moeswarm.model import load_model

SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    "1.2GB": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2),
}


def build(folder: Path, size: str) -> None:
    if (folder / "config.json").exists():
        return
    torch.manual_seed(0)
    cfg = MixtralConfig(**SIZES[size], max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # wider init than HF's 0.02 so routing is not uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(folder)


_BASE = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, max_position_embeddings=1024,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_DSA = dict(_BASE, num_key_value_heads=8, intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=32,
            n_shared_experts=1, num_experts_per_tok=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, index_topk=16, index_head_dim=32, index_n_heads=8,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
#: arch -> transformers config, for the newer families' rows (batch 1)
FAMILIES = {
    "deepseek_v32": lambda: DeepseekV32Config(**_DSA, n_group=4, topk_group=2,
                                              rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "glm_moe_dsa": lambda: GlmMoeDsaConfig(**_DSA, n_group=1, topk_group=1,
                                           rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    "qwen3_5_moe": lambda: Qwen3_5MoeConfig(
        text_config=dict(_BASE, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                         linear_key_head_dim=64, linear_value_head_dim=64, moe_intermediate_size=256,
                         shared_expert_intermediate_size=256, num_experts=32, num_experts_per_tok=4),
        vision_config=dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=64, out_hidden_size=512),
        tie_word_embeddings=False),
}


def _hf_class(arch: str):  # type: ignore[no-untyped-def]
    return AutoModelForImageTextToText if arch == "qwen3_5_moe" else AutoModelForCausalLM


def build_family(folder: Path, arch: str) -> None:
    if (folder / "config.json").exists():
        return
    torch.manual_seed(0)
    model = _hf_class(arch).from_config(FAMILIES[arch](), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "visual" not in name:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(folder)


def bench_ours(folder: Path, batch: int, steps: int, prompt: np.ndarray) -> float:
    model = load_model(folder, backend="auto")
    cache = model.new_cache()
    logits = model.forward(prompt[:batch], cache, last_only=True)
    token = logits[:, -1].argmax(-1)[:, None]
    model.forward(token, cache, last_only=True)  # warm-up step
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.forward(token, cache, last_only=True)
        token = logits[:, -1].argmax(-1)[:, None]
    return batch * steps / (time.perf_counter() - t0)


@torch.no_grad()
def bench_hf(folder: Path, batch: int, steps: int, prompt: np.ndarray, arch: str = "mixtral") -> float:
    model = _hf_class(arch).from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.from_numpy(prompt[:batch])
    out = model(ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    out = model(token, cache=cache, use_cache=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(token, cache=out.past_key_values, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return batch * steps / (time.perf_counter() - t0)


# Issue 13's families at a common small size (hidden 512, 4 layers, 16 experts, vocab 8192), built
# by transformers from their configs, decoded at batch 1 after a 64-token prefill.
_TEXT = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def _family_config(family: str):  # type: ignore[no-untyped-def]
    import transformers as T

    rope = dict(rope_type="default", rope_theta=5_000_000.0, partial_rotary_factor=0.5)
    if family == "minimax_m2":
        return T.MiniMaxM2Config(**_TEXT, intermediate_size=512, num_local_experts=16, num_experts_per_tok=2,
                                 rope_parameters=rope, tie_word_embeddings=False)
    if family == "minimax_m3_vl":
        text = dict(**_TEXT, intermediate_size=512, dense_intermediate_size=1024, shared_intermediate_size=512,
                    num_local_experts=16, num_experts_per_tok=2, index_n_heads=2, index_head_dim=64,
                    index_block_size=16, index_topk_blocks=2, index_local_blocks=1, rope_parameters=rope,
                    layer_types=["full_attention", "minimax_m3_sparse"] * 2, mlp_layer_types=["dense"] + ["sparse"] * 3)
        return T.MiniMaxM3VLConfig(text_config=text, vision_config=_VISION)
    text = dict({k: v for k, v in _TEXT.items() if k != "head_dim"}, num_key_value_heads=8, intermediate_size=1024, moe_intermediate_size=512,
                n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64,
                qk_rope_head_dim=32, v_head_dim=64, routed_scaling_factor=2.5, num_mtp_layers=0)
    return T.Kimi_K25Config(text_config=T.DeepseekV3Config(**text).to_dict(),
                            vision_config=dict(_VISION, pos_emb_height=4, pos_emb_width=4))


def _auto(family: str):  # type: ignore[no-untyped-def]
    import transformers as T

    return T.AutoModelForCausalLM if family == "minimax_m2" else T.AutoModelForImageTextToText


def build_minimax_kimi(folder: Path, family: str) -> None:
    if (folder / "config.json").exists():
        return
    torch.manual_seed(0)
    model = _auto(family).from_config(_family_config(family), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(folder)


@torch.no_grad()
def bench_hf_family(folder: Path, family: str, steps: int, prompt: np.ndarray) -> float:
    from transformers import DynamicCache

    model = _auto(family).from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.from_numpy(prompt[:1]), cache=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    model(input_ids=token, cache=cache, use_cache=True)  # warm-up step
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return steps / (time.perf_counter() - t0)


def alternate(rounds: int, ours: Callable[[], float], theirs: Callable[[], float]) -> tuple[float, float]:
    """Medians of ``rounds`` runs of each engine, in alternating order (ours first in even rounds,
    transformers first in odd ones), so neither always runs on a warm cache or after the other."""
    a, b = [], []
    for i in range(rounds):
        if i % 2 == 0:
            a.append(ours())
            b.append(theirs())
        else:
            b.append(theirs())
            a.append(ours())
    return float(np.median(a)), float(np.median(b))


def family_rows(root: Path, steps: int, rounds: int) -> list[tuple[str, str, float, float]]:
    """(family, GB, moeswarm tok/s, transformers tok/s): medians of ``rounds`` alternating runs."""
    rows = []
    for family in ("minimax_m2", "minimax_m3_vl", "kimi_k25"):
        folder = root / family
        build_minimax_kimi(folder, family)
        gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
        prompt = np.random.default_rng(1).integers(3, _TEXT["vocab_size"], size=(1, 64))
        ours, hf = alternate(rounds, lambda: bench_ours(folder, 1, steps, prompt),
                             lambda: bench_hf_family(folder, family, steps, prompt))
        rows.append((family, f"{gb:.2f}", ours, hf))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per case")
    ap.add_argument("--keep", type=Path, default=None, help="build/reuse checkpoints here instead of a temp dir")
    ap.add_argument("--only", choices=("all", "mixtral", "families", "new"), default="all",
                    help="the Mixtral size/batch table, the MiniMax/Kimi families, the DSA/DeltaNet families, or all")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs per case (median reported)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = args.keep or Path(tempfile.mkdtemp(prefix="moeswarm-bench-"))
    if args.only in ("all", "families"):
        fam = family_rows(root, args.steps, args.rounds)
        print(f"\ndecode tokens/s at batch 1, 1 thread each, {args.steps} steps after a 64-token prefill, "
              f"median of {args.rounds} runs in alternating order (ours first, then transformers first, ...)")
        print("| family | GB | moeswarm | transformers eager | ratio |")
        print("|---|---|---|---|---|")
        for family, gb, ours, hf in fam:
            print(f"| {family} | {gb} | {ours:.1f} | {hf:.1f} | {ours / hf:.2f}x |")
    if args.only == "families":
        return
    rng = np.random.default_rng(0)
    rows = []
    for size in SIZES if args.only in ("all", "mixtral") else ():
        folder = root / size
        build(folder, size)
        gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
        prompt = rng.integers(3, SIZES[size]["vocab_size"], size=(8, 16))
        for batch in (1, 8):
            ours, hf = alternate(args.rounds, lambda: bench_ours(folder, batch, args.steps, prompt),
                                 lambda: bench_hf(folder, batch, args.steps, prompt))
            rows.append((size, f"{gb:.2f}", batch, ours, hf, ours / hf))
    for arch in FAMILIES if args.only in ("all", "new") else ():
        folder = root / arch
        build_family(folder, arch)
        gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
        prompt = rng.integers(3, _BASE["vocab_size"], size=(1, 16))
        o, h = alternate(args.rounds, lambda: bench_ours(folder, 1, args.steps, prompt),
                         lambda: bench_hf(folder, 1, args.steps, prompt, arch))
        rows.append((arch, f"{gb:.2f}", 1, o, h, o / h))
    print(f"\ndecode tokens/s, 1 thread each, {args.steps} steps after a 16-token prefill; "
          f"median of {args.rounds} runs in alternating order (ours first, then transformers first, ...)")
    print("| model | GB | batch | moeswarm | transformers eager | ratio |")
    print("|---|---|---|---|---|---|")
    for size, gb, batch, ours, hf, ratio in rows:
        print(f"| {size} | {gb} | {batch} | {ours:.1f} | {hf:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
