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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from .generate import SamplingParams, probs, sample
from ._mtp_run import mtp_forward, new_mtp_cache
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

    kind = "lookup"  # what the API's model card says drafts

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

    kind = "model"

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


class MtpDraft:
    """Drafts from the model's own multi-token-prediction layer (``model/mtp.py``): the first from
    the model's hidden states of the tokens verified so far, each next one from the MTP layer's
    own output and the token it drafted.  ``observe`` hands it the hidden states of every forward
    pass (``needs_hidden``); ``q`` is the MTP layer's distribution at each draft position."""

    kind = "mtp"
    needs_hidden = True

    def __init__(self, model: Model) -> None:
        if not model.config.mtp_layers:
            raise ConfigError("--draft mtp: this checkpoint has no multi-token-prediction layer "
                              f"({model.config.arch}; see docs/mtp.md for the families that store one)")
        self.model = model

    def new_state(self) -> MtpState:
        return MtpState(new_mtp_cache(self.model.config))

    def observe(self, state: MtpState, start: int, hidden: np.ndarray) -> None:
        """hidden (T, H): the model's final-normed states at positions start ... start + T - 1
        (DeepSeek-V4: (T, hc_mult, H), its streams before the ``hc_head``)."""
        for i, row in enumerate(hidden):
            state.hidden[start + i] = row

    def propose(self, state: MtpState, tokens: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], list[np.ndarray] | None]:
        n = len(tokens)  # the model holds tokens[:n - 1]; slot j = (hidden j, token j + 1), so n - 1 slots
        cache = state.cache
        cache.truncate(min(cache.length, n - 1))
        fed = cache.length
        if k <= 0 or fed >= n - 1 or any(p not in state.hidden for p in range(fed, n - 1)):
            return [], None
        hidden = np.stack([state.hidden[p] for p in range(fed, n - 1)])  # (T, H)
        g, logits = mtp_forward(self.model, 0, hidden, np.asarray(tokens[fed + 1 : n]), cache, fed + 1)
        for p in [p for p in state.hidden if p < n - 1]:
            del state.hidden[p]  # the cache holds them now
        draft: list[int] = []
        qs: list[np.ndarray] = []
        for i in range(k):
            if i:  # the next slot: this layer's own output as the hidden state, the drafted token
                g, logits = mtp_forward(self.model, 0, g[-1:], np.asarray(draft[-1:]), cache, n - 1 + i)
            if params.temperature == 0:
                draft.append(int(np.argmax(logits[-1])))
            else:
                qs.append(probs(logits[-1], params))
                draft.append(int(rng.choice(qs[-1].size, p=qs[-1])))
        cache.truncate(n - 1)  # the drafted slots go: they are fed again from the model's own states
        return draft, (qs if params.temperature else None)

    def release(self, state: MtpState) -> None:
        state.hidden.clear()


@dataclass
class MtpState:
    cache: Any  # the MTP layers' KVCache: one slot per verified token but the last
    hidden: dict[int, np.ndarray] = field(default_factory=dict)  # position -> the model's state, not yet fed


def generate_drafted(model: Model, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                     drafter: Any = None, k: int = 4, stats: SpeculativeStats | None = None) -> Iterator[int]:
    """Speculative sampling at any temperature (``verify``): each step one forward pass over
    [last token] + up to ``k`` draft tokens (so one expert call per MoE layer for all of them).
    ``drafter``: ``PromptLookup`` (default), ``DraftModel`` or ``MtpDraft``.  Greedy output is
    the greedy output; sampled output has ``generate``'s distribution."""
    if not prompt_ids:
        raise ConfigError("the prompt is empty: give at least one token")
    if model.config.deltanet is not None:  # its recurrent state cannot forget a rejected draft
        raise ConfigError("speculative decoding is not supported for models with linear-attention (DeltaNet) "
                          "layers: their state cannot be rolled back")
    drafter = drafter if drafter is not None else PromptLookup()
    stats = stats if stats is not None else SpeculativeStats()
    observe = getattr(drafter, "observe", None)
    rng = np.random.default_rng(params.seed)
    stop = set(params.stop_token_ids)
    cache, state, tokens = model.new_cache(), drafter.new_state(), list(prompt_ids)
    hidden: list[np.ndarray] = []
    logits = model.forward(np.asarray([tokens], np.int64), cache, hidden_out=hidden if observe else None)[0]
    if observe:
        observe(state, 0, hidden[0][0])
    new = [sample(logits[-1], params, rng)]
    produced = 0
    try:
        while True:
            for token in new:
                tokens.append(token)
                produced += 1
                yield token
                if token in stop or produced >= params.max_new_tokens:
                    return
            draft, q = drafter.propose(state, tokens, min(k, params.max_new_tokens - produced), params, rng)
            start, hidden = cache.length, []
            out = model.forward(np.asarray([[tokens[-1]] + draft], np.int64), cache,
                                hidden_out=hidden if observe else None)[0]  # (1 + len(draft), V)
            if observe:
                observe(state, start, hidden[0][0])
            new = verify(out, draft, q, params, rng)
            stats.steps += 1
            stats.drafted += len(draft)
            stats.accepted += len(new) - 1
            cache.truncate(len(tokens) + len(new) - 1)  # forget the rejected drafts; the last token is fed next
    finally:
        drafter.release(state)
