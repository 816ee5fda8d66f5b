"""Expert cache policies on a routed trace from a real generation, side by side.

Records which experts the demo model's routers pick while it generates (sampled, several
prompts), then replays that access trace through plain LRU and the recency-frequency policy
(LRFU with admission control) at several cache sizes, and measures how often the next layer's
experts were predicted by applying its router to the current hidden state.

    python benchmarks/expert_cache.py [--model DIR] [--tokens 200]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse

import numpy as np

from moeswarm.demo import CHECKPOINT
from moeswarm.model import SamplingParams, Tokenizer, generate, load_model
from moeswarm.model.expert_cache import LRU, RecencyFrequency, predict_next_experts, simulate

PROMPTS = ["And it came to pass", "The LORD is my shepherd", "In the beginning", "Blessed are the poor in spirit"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(CHECKPOINT))
    ap.add_argument("--tokens", type=int, default=200, help="tokens generated per prompt")
    args = ap.parse_args()
    model = load_model(args.model)
    cfg = model.config
    tok = Tokenizer.from_folder(args.model, cfg.bos_token_id)
    trace: list[tuple[int, int]] = []
    guesses: dict[int, set[int]] = {}
    hit = total = 0

    def routed(layer: int, ids: np.ndarray) -> None:
        nonlocal hit, total
        if ids.shape[0] != 1:
            return  # prefill: not part of the decode trace
        chosen = [int(e) for e in ids[0]]
        trace.extend((layer, e) for e in chosen)
        if layer in guesses:
            hit += len(set(chosen) & guesses.pop(layer))
            total += len(chosen)

    def predict(layer: int, x: np.ndarray) -> None:
        if x.shape[0] == 1 and cfg.moe_layers[layer]:
            ids = predict_next_experts(cfg, model.weights, layer, x)
            if ids is not None:
                nxt = next(L for L in range(layer + 1, cfg.num_layers) if cfg.moe_layers[L])
                guesses[nxt] = set(int(e) for e in ids[0])

    model.observers.append(routed)
    model.state_observers.append(predict)
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_new_tokens=args.tokens, temperature=0.8, top_p=0.95, seed=i)
        list(generate(model, tok.encode(prompt), params))
    experts = sum(cfg.moe_layers) * cfg.num_experts
    per_token = sum(cfg.moe_layers) * cfg.top_k
    print(f"\nrouted trace: {len(trace)} expert accesses, {len(PROMPTS)} x {args.tokens} sampled tokens; "
          f"{experts} experts in the model, {per_token} touched per token")
    print("| cache size (experts) | vs one token's set | LRU hit rate | recency-frequency hit rate |")
    print("|---|---|---|---|")
    for size in sorted({per_token // 2, per_token * 3 // 4, per_token, per_token * 3 // 2, experts // 2, experts * 3 // 4}):
        lru, lrfu = simulate(LRU(size), trace), simulate(RecencyFrequency(size), trace)
        print(f"| {size} | {size / per_token:.2f}x | {lru:.1%} | {lrfu:.1%} |")
    print(f"\nnext-layer experts predicted from the current hidden state: {hit / max(1, total):.1%} "
          f"of {total} picks (uniform guessing: {cfg.top_k / cfg.num_experts:.1%})")


if __name__ == "__main__":
    main()
