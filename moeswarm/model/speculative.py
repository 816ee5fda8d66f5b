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
from typing import Any

import numpy as np

from ..errors import ConfigError
from .generate import SamplingParams, probs
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


# ---- speculative sampling: any temperature, drafts from prompt lookup or a draft model ----------


def verify(logits: np.ndarray, draft: Sequence[int], q: Sequence[np.ndarray] | None, params: SamplingParams,
           rng: np.random.Generator) -> list[int]:
    """The tokens one verification step emits: the accepted prefix of ``draft``, then one more.

    ``logits`` (len(draft) + 1, V) are the target model's at [last token] + draft.  Greedy
    (temperature 0): drafts are accepted while they equal the argmax, the output is the greedy
    output.  Otherwise standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
    draft token d with draft probability q(d) is accepted with probability min(1, p(d) / q(d));
    on the first rejection the replacement is drawn from max(0, p - q) renormalised, and when
    every draft is accepted a bonus token is drawn from p at the last position.  ``q`` None
    means deterministic drafts (prompt lookup: q is a point mass on d).  Every emitted token is
    then distributed exactly as ``sample`` draws it from the target model alone.
    """
    if params.temperature == 0:
        choice = logits.argmax(axis=-1)
        out = []
        for i, d in enumerate(draft):
            if choice[i] != d:
                break
            out.append(int(d))
        return out + [int(choice[len(out)])]
    out = []
    for i, d in enumerate(draft):
        p = probs(logits[i], params)
        qd = 1.0 if q is None else float(q[i][d])
        if rng.random() * qd < p[d]:  # u < p(d) / q(d), without dividing by a tiny q(d)
            out.append(int(d))
            continue
        residual = np.maximum(p - (np.eye(1, p.size, d)[0] if q is None else q[i]), 0.0)
        total = residual.sum()
        p = residual / total if total > 0 else p
        return out + [int(rng.choice(p.size, p=p))]
    p = probs(logits[len(draft)], params)
    return out + [int(rng.choice(p.size, p=p))]


class PromptLookup:
    """Drafts that need no second model (see ``prompt_lookup_draft``); deterministic, so q is None."""

    def new_state(self) -> None:
        return None

    def propose(self, state: None, tokens: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], list[np.ndarray] | None]:
        return prompt_lookup_draft(tokens, k), None

    def release(self, state: None) -> None:
        pass


class DraftModel:
    """Drafts from a small model with the same tokenizer, run here, sampling with the sequence's
    own parameters (``q`` is its distribution at each draft position)."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def new_state(self) -> tuple[Any, list[int]]:
        return self.model.new_cache(), []  # the draft model's cache, the tokens it holds

    def propose(self, state: tuple[Any, list[int]], tokens: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], list[np.ndarray] | None]:
        if k <= 0:
            return [], None
        cache, fed = state
        same = 0
        while same < min(len(fed), len(tokens) - 1) and fed[same] == tokens[same]:
            same += 1
        cache.truncate(same)
        del fed[same:]
        new = list(tokens[same:])
        draft: list[int] = []
        qs: list[np.ndarray] = []
        for j in range(k):
            logits = self.model.forward(np.asarray([new], np.int64), cache, last_only=True)[0, -1]
            fed.extend(new)
            if params.temperature == 0:
                d = int(np.argmax(logits))
            else:
                qs.append(probs(logits, params))
                d = int(rng.choice(qs[-1].size, p=qs[-1]))
            draft.append(d)
            new = [d]
        return draft, (qs if params.temperature else None)

    def release(self, state: tuple[Any, list[int]]) -> None:
        pass
