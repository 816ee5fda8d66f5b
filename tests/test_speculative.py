"""Prompt-lookup speculative decoding gives exactly the greedy tokens, in fewer forward passes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeswarm.demo import CHECKPOINT
from moeswarm.errors import ConfigError
from moeswarm.model import SamplingParams, Tokenizer, generate, load_model
from moeswarm.model.speculative import SpeculativeStats, generate_speculative, prompt_lookup_draft


def test_draft_follows_the_latest_match() -> None:
    assert prompt_lookup_draft([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert prompt_lookup_draft([5, 6, 7], 3) == []
    assert prompt_lookup_draft([4, 4, 4], 5) == [4]


@given(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(0, 6))
def test_drafts_are_continuations_found_in_the_context(tokens: list[int], k: int) -> None:
    draft = prompt_lookup_draft(tokens, k)
    assert len(draft) <= k
    if draft:  # it is what followed an earlier occurrence of the last token
        assert any(tokens[s - 1] == tokens[-1] and tokens[s : s + len(draft)] == draft
                   for s in range(1, len(tokens)))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_speculative_equals_greedy_on_oracle_models(oracle_checkpoints, arch: str) -> None:
    folder, ref = oracle_checkpoints.get(arch, "packed")
    model = load_model(folder)
    n = len(ref.greedy_tokens)
    prompt = ref.prompt_ids + ref.prompt_ids[:6]  # some repetition so drafts are proposed
    params = SamplingParams(max_new_tokens=n)
    stats = SpeculativeStats()
    assert list(generate_speculative(model, ref.prompt_ids, params, k=4, stats=stats)) == ref.greedy_tokens
    assert list(generate_speculative(model, prompt, params)) == list(generate(model, prompt, params))


def test_repetitive_text_needs_fewer_forward_passes() -> None:
    model = load_model(CHECKPOINT)
    tok = Tokenizer.from_folder(CHECKPOINT, model.config.bos_token_id)
    ids = tok.encode("And the LORD said unto Moses, And the LORD said unto Moses, And the LORD said unto")
    params = SamplingParams(max_new_tokens=40, stop_token_ids=model.config.eos_token_ids)
    stats = SpeculativeStats()
    fast = list(generate_speculative(model, ids, params, k=4, stats=stats))
    assert fast == list(generate(model, ids, params))
    assert stats.accepted > 0 and stats.steps < len(fast) - 1


def test_sampling_is_refused() -> None:
    model = load_model(CHECKPOINT)
    with pytest.raises(ConfigError):
        next(generate_speculative(model, [1, 2], SamplingParams(temperature=0.7)))
