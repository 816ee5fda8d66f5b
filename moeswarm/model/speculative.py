"""Speculative decoding with prompt-lookup drafts: k tokens verified per forward pass.

Decode through a swarm pays a network round trip per MoE layer per step, whatever the batch, so
checking several tokens in one step hides latency.  Drafts need no second model: the last few
tokens are looked up earlier in the context and what followed them there is proposed (prompt
lookup decoding).  One forward pass over [last token] + draft gives the model's own greedy
choice at every position; the draft is accepted up to the first disagreement and the KV cache
is rolled back past it, so the output is the greedy output, token for token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .generate import SamplingParams
from .transformer import Model


def prompt_lookup_draft(tokens: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the context's last
    n-gram (longest n first, n <= ``max_ngram``); empty when nothing matches."""
    if k <= 0:
        return []
    arr = np.asarray(tokens)
    for n in range(min(max_ngram, len(arr) - 1), 0, -1):
        tail = arr[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every earlier n-gram
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


@dataclass
class SpeculativeStats:
    steps: int = 0  # forward passes after the prefill
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the model agreed with


def generate_speculative(model: Model, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                         k: int = 4, stats: SpeculativeStats | None = None) -> Iterator[int]:
    """Greedy generation, identical to ``generate`` with temperature 0, in fewer forward passes."""
    if params.temperature != 0:
        raise ConfigError("speculative decoding is implemented for greedy decoding (temperature 0)")
    if not prompt_ids:
        raise ConfigError("the prompt is empty: give at least one token")
    if model.config.deltanet is not None:  # its recurrent state cannot forget a rejected draft
        raise ConfigError("speculative decoding is not supported for models with linear-attention (DeltaNet) "
                          "layers: their state cannot be rolled back")
    stats = stats if stats is not None else SpeculativeStats()
    stop = set(params.stop_token_ids)
    cache = model.new_cache()
    tokens = list(prompt_ids)
    logits = model.forward(np.asarray([tokens]), cache, last_only=True)[0, -1]
    pending = int(np.argmax(logits))  # chosen but not yet fed to the model
    produced = 0
    while True:
        tokens.append(pending)
        produced += 1
        yield pending
        if pending in stop or produced >= params.max_new_tokens:
            return
        draft = prompt_lookup_draft(tokens, min(k, params.max_new_tokens - produced))
        out = model.forward(np.asarray([[pending] + draft]), cache)[0]  # (1 + len(draft), V)
        choice = out.argmax(axis=-1)
        stats.steps += 1
        stats.drafted += len(draft)
        accepted = 0
        while accepted < len(draft) and choice[accepted] == draft[accepted]:
            accepted += 1
        stats.accepted += accepted
        for token in draft[:accepted]:
            tokens.append(token)
            produced += 1
            yield token
            if token in stop or produced >= params.max_new_tokens:
                return
        cache.truncate(len(tokens))  # forget the rejected part of the draft
        pending = int(choice[accepted])
