"""Sampling: greedy, seeded reproducibility, temperature/top-p/top-k semantics, stop tokens."""

from __future__ import annotations

import numpy as np
import pytest

from moeswarm.errors import ConfigError
from moeswarm.model import SamplingParams, generate, load_model, sample

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], dtype=np.float32))


def draw(params: SamplingParams, n: int = 4000) -> np.ndarray:
    rng = np.random.default_rng(params.seed)
    return np.bincount([sample(LOGITS, params, rng) for _ in range(n)], minlength=LOGITS.size) / n


def test_greedy_is_argmax() -> None:
    assert sample(LOGITS, SamplingParams(temperature=0), np.random.default_rng(0)) == 0


def test_temperature_one_follows_the_distribution() -> None:
    freq = draw(SamplingParams(temperature=1.0, seed=1))
    assert np.abs(freq - np.exp(LOGITS)).max() < 0.03


def test_top_p_keeps_the_smallest_nucleus() -> None:
    freq = draw(SamplingParams(temperature=1.0, top_p=0.8, seed=2))  # 0.5 + 0.25 < 0.8 <= 0.9
    assert freq[3] == 0 and freq[4] == 0 and freq[2] > 0
    assert abs(freq[0] - 0.5 / 0.9) < 0.03


def test_top_k() -> None:
    freq = draw(SamplingParams(temperature=1.0, top_k=2, seed=3))
    assert freq[2:].sum() == 0 and abs(freq[0] - 2 / 3) < 0.03


def test_low_temperature_sharpens() -> None:
    assert draw(SamplingParams(temperature=0.2, seed=4))[0] > 0.95


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_new_tokens=-1)])
def test_bad_parameters(bad: dict) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def test_seeded_generation_is_reproducible_and_stops(oracle_checkpoints) -> None:
    folder, ref = oracle_checkpoints.get("qwen3_moe", "packed")
    model = load_model(folder)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=7)
    a = list(generate(model, ref.prompt_ids, params))
    b = list(generate(model, ref.prompt_ids, params))
    c = list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=8)))
    assert a == b and len(a) == 12
    assert a != c
    stop = a[3]
    first = a.index(stop)
    stopped = list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95,
                                                                  seed=7, stop_token_ids=(stop,))))
    assert stopped == a[: first + 1]


def test_empty_or_out_of_vocab_prompt(oracle_checkpoints) -> None:
    folder, _ = oracle_checkpoints.get("mixtral", "packed")
    model = load_model(folder)
    with pytest.raises(ConfigError):
        next(generate(model, []))
    with pytest.raises(ConfigError):
        next(generate(model, [model.config.vocab_size]))
