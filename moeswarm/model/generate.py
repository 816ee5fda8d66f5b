"""Token generation: prefill, then one decode step per token over the KV cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .transformer import Model


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64  # upper bound on generated tokens (a stop token ends earlier)
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus sampling: smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep only the k most likely tokens (0 = all)
    seed: int | None = None  # seeds the sampler; the same seed gives the same tokens
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ConfigError("max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ConfigError("temperature must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError("top_k must be >= 0")


def probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution ``sample`` draws from at temperature > 0: logits (V,) -> p (V,) float64
    after temperature, top-k and top-p."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        cut = int(np.searchsorted(cumulative, params.top_p)) + 1  # keep the token that crosses top_p
        keep = order[:cut]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick the next token from logits (V,)."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    p = probs(logits, params)
    return int(rng.choice(p.size, p=p))


def generate(model: Model, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams()) -> Iterator[int]:
    """Yield generated token ids one by one (a stop token is yielded, then generation ends)."""
    if not prompt_ids:
        raise ConfigError("the prompt is empty: give at least one token")
    vocab = model.config.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ConfigError(f"prompt token ids must be in [0, {vocab})")
    rng = np.random.default_rng(params.seed)
    cache = model.new_cache()
    logits = model.forward(np.asarray([prompt_ids], dtype=np.int64), cache, last_only=True)[0, -1]
    stop = set(params.stop_token_ids)
    for _ in range(params.max_new_tokens):
        token = sample(logits, params, rng)
        yield token
        if token in stop:
            return
        logits = model.forward(np.asarray([[token]], dtype=np.int64), cache, last_only=True)[0, -1]
