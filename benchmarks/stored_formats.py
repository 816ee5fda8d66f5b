"""What an expert costs in each stored format: bytes, the time to dequantise it, and one decode
token's work on it (batch 1) when its float32 copy is cached vs when it must be decoded first.

One DeepSeek-V3-sized expert by default (hidden 7168, expert FFN 2048): random weights are
quantised to FP8 e4m3 (128x128 block scales), MXFP4 (e8m0 per 32) and INT4 (bf16 scale per 32)
in numpy, then the engine's decoders (``moeswarm.model._stored``) and ``expert_ffn`` are timed,
the cases alternated round by round, medians of ``--repeats``, one BLAS thread.

    python benchmarks/stored_formats.py [--hidden 7168] [--inter 2048] [--repeats 7]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

from moeswarm.model._stored import QuantFormat, StoredTensor
from moeswarm.model.config import ModelConfig
from moeswarm.model.experts import expert_ffn
from moeswarm.model.weights import ExpertWeights


def quantise(fmt: QuantFormat, w: np.ndarray) -> StoredTensor:
    R, C = w.shape
    if fmt.method == "fp8_block":
        b = w.reshape(R // 128, 128, C // 128, 128)
        scale = np.abs(b).max(axis=(1, 3)) / 448.0
        q = (b / scale[:, None, :, None]).reshape(R, C).astype(ml_dtypes.float8_e4m3fn)
        return StoredTensor(fmt, (R, C), q.view(np.uint8), scale.astype(np.float32))
    g = w.reshape(R, C // 32, 32)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(R, C // 2), dtype=np.uint8)  # any nibbles: decode cost does not depend on them
    if fmt.method == "mxfp4":
        exp = np.clip(np.ceil(np.log2(np.abs(g).max(axis=-1) / 6.0)), -120, 120).astype(np.int32) + 127
        return StoredTensor(fmt, (R, C), codes, exp.astype(np.uint8))
    scale = (np.abs(g).max(axis=-1) / 7.0).astype(ml_dtypes.bfloat16)
    return StoredTensor(fmt, (R, C), codes, scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    H, I = args.hidden, args.inter
    cfg = ModelConfig.from_hf({"model_type": "mixtral", "vocab_size": 8, "hidden_size": H, "num_hidden_layers": 1,
                               "num_attention_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                               "intermediate_size": I})
    rng = np.random.default_rng(1)
    mats = {"gate": rng.standard_normal((I, H), dtype=np.float32) / H**0.5,
            "up": rng.standard_normal((I, H), dtype=np.float32) / H**0.5,
            "down": rng.standard_normal((H, I), dtype=np.float32) / I**0.5}
    formats = {"BF16": None, "FP8": QuantFormat("fp8_block", block=(128, 128), scale_bytes=4),
               "MXFP4": QuantFormat("mxfp4", group=32, scale_bytes=1),
               "INT4": QuantFormat("int4_group", group=32, scale_bytes=2)}
    experts = {}
    for name, fmt in formats.items():
        if fmt is None:
            experts[name] = ExpertWeights(**{k: v.astype(ml_dtypes.bfloat16) for k, v in mats.items()})
        else:
            experts[name] = ExpertWeights(**{k: quantise(fmt, v) for k, v in mats.items()})
    x = rng.standard_normal((1, H), dtype=np.float32)
    cached = {name: ExpertWeights(*(a.astype(np.float32) for a in (w.gate, w.up, w.down)))
              for name, w in experts.items()}
    times: dict[str, dict[str, list[float]]] = {n: {"decode": [], "hit": [], "miss": []} for n in experts}
    for _ in range(args.repeats):  # cases alternate within each round
        for name, w in experts.items():
            t0 = time.perf_counter()
            f = ExpertWeights(*(a.astype(np.float32) for a in (w.gate, w.up, w.down)))
            t1 = time.perf_counter()
            expert_ffn(f, x, cfg)
            t2 = time.perf_counter()
            expert_ffn(cached[name], x, cfg)
            t3 = time.perf_counter()
            times[name]["decode"].append(t1 - t0)
            times[name]["miss"].append(t2 - t0)
            times[name]["hit"].append(t3 - t2)
    print(f"one expert, hidden {H}, FFN {I} ({3 * H * I / 1e6:.1f}M weights); medians of {args.repeats}, "
          f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}")
    print(f"{'format':8s} {'stored MiB':>11s} {'decode ms':>10s} {'token, cached f32 ms':>21s} "
          f"{'token, decode first ms':>23s}")
    for name, w in experts.items():
        t = {k: statistics.median(v) * 1e3 for k, v in times[name].items()}
        print(f"{name:8s} {w.nbytes / 2**20:11.1f} {t['decode']:10.1f} {t['hit']:21.2f} {t['miss']:23.1f}")


if __name__ == "__main__":
    main()
