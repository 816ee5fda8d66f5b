"""Decode speed of the moeswarm numpy engine vs Hugging Face transformers, same model, same run.

Builds two random Mixtral-style checkpoints with transformers (a tiny one and a ~1.2 GB one),
then for batch 1 and 8: a 16-token prefill followed by N timed decode steps, in each engine.
Both use one thread (OPENBLAS_NUM_THREADS=1, torch.set_num_threads(1)) so the ratio is fair and
stable on a shared 2-core box.  Prints a table; the ratio column is what to quote.

    python benchmarks/engine.py [--steps 24] [--keep DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, MixtralConfig

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
def bench_hf(folder: Path, batch: int, steps: int, prompt: np.ndarray) -> float:
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.from_numpy(prompt[:batch])
    out = model(ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    out = model(token, cache=cache, use_cache=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(token, cache=out.past_key_values, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return batch * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per case")
    ap.add_argument("--keep", type=Path, default=None, help="build/reuse checkpoints here instead of a temp dir")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = args.keep or Path(tempfile.mkdtemp(prefix="moeswarm-bench-"))
    rng = np.random.default_rng(0)
    rows = []
    for size in SIZES:
        folder = root / size
        build(folder, size)
        gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
        prompt = rng.integers(3, SIZES[size]["vocab_size"], size=(8, 16))
        for batch in (1, 8):
            ours = bench_ours(folder, batch, args.steps, prompt)
            hf = bench_hf(folder, batch, args.steps, prompt)
            rows.append((size, f"{gb:.2f}", batch, ours, hf, ours / hf))
    print(f"\ndecode tokens/s, 1 thread each, {args.steps} steps after a 16-token prefill")
    print("| model | GB | batch | moeswarm | transformers eager | ratio |")
    print("|---|---|---|---|---|---|")
    for size, gb, batch, ours, hf, ratio in rows:
        print(f"| {size} | {gb} | {batch} | {ours:.1f} | {hf:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
