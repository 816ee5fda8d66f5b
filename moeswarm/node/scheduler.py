"""Continuous batching: every running sequence advances in the same forward pass.

One engine thread loops: admit waiting requests (FIFO) while fewer than ``max_batch`` run and
the cache pool has the blocks for the prompt (caches then grow block by block; when the pool
runs dry the youngest sequence is preempted: its blocks go back, it waits first in line, and
once readmitted recomputes its cache from its tokens and carries on, output unchanged); build one
batched step -- the next ``prefill_chunk`` prompt tokens of sequences still prefilling (shared
among them, so a long prompt does not stall the streams already decoding), one token (or, with
``speculative`` > 0, one token plus a draft) per decoding sequence -- run ``forward_batch``, then
sample, verify drafts and hand each sequence's new tokens to its consumer.  Finished and
cancelled sequences leave before the next step and give their cache blocks back.  A sequence
whose consumer has ``backlog`` unread tokens sits out steps until it catches up, without
holding up the others.

Everything the engine hands out goes through ``Sequence.deliver`` (on the event loop of the
request, with ``call_soon_threadsafe``); the loop never blocks on the model.  The thread runs
only while there is work and exits when the last sequence leaves.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..model import Model, SamplingParams, sample
from ..model.batch import CachePool, Step, forward_batch, layer_specs
from ..model.speculative import SpeculativeStats, verify
from .onloop import run_on_loop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # sequences advanced together in one forward pass
    prefill_chunk: int = 256  # prompt tokens fed per step, shared by the sequences still prefilling
    kv_cache_bytes: int = 256 << 20  # the cache pool of every sequence, bytes
    block_tokens: int = 16  # tokens per cache block
    max_waiting: int = 64  # requests waiting for a slot or cache beyond which new ones are refused (503)
    speculative: int = 0  # draft tokens verified per step and sequence (0: off)
    backlog: int = 8  # unread tokens after which a sequence sits out steps until its consumer catches up
    on_loop_tokens: int = 64  # steps of at most this many new tokens run on the event loop (swarm executors)

    def __post_init__(self) -> None:
        for name in ("max_batch", "prefill_chunk", "kv_cache_bytes", "block_tokens", "max_waiting", "backlog"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.speculative < 0:
            raise ConfigError("speculative (draft tokens per step) must be >= 0")


class Sequence:
    """One request inside the engine, created on the request's event loop.  ``on_tokens(tokens)``
    runs on the engine thread and must not block; ``left`` resolves (on the request's loop) once
    the sequence has left the engine and given its cache back."""

    def __init__(self, prompt: list[int], params: SamplingParams,
                 on_tokens: Callable[[list[int]], bool], queue: asyncio.Queue[Any]) -> None:
        self.prompt, self.params = prompt, params
        self.on_tokens = on_tokens  # -> False once it wants no more (stop string, budget, stop token)
        self.queue = queue  # the consumer's; a failure is put here as the exception
        loop = self.loop = asyncio.get_running_loop()
        self.left: asyncio.Future[BaseException | None] = loop.create_future()
        self.rng = np.random.default_rng(params.seed)
        self.tokens = list(prompt)  # prompt + generated, fed or pending
        self.fed = 0  # tokens the cache holds
        self.prefill_to = len(prompt)  # tokens to feed before decoding (more after a preemption)
        self.cache: Any = None
        self.draft_state: Any = None
        self.cancelled = False
        self.sent = 0  # tokens handed to the consumer (engine thread)
        self.read = 0  # ... and consumed (loop thread)
        self.q: list[np.ndarray] | None = None  # draft probabilities of the current draft (None: deterministic)
        self.stats = SpeculativeStats()

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def cancel(self) -> None:
        self.cancelled = True


class BatchEngine:
    """The engine thread and its queues (see the module docstring)."""

    def __init__(self, model: Model, config: EngineConfig = EngineConfig(), drafter: Any = None) -> None:
        self.model, self.config = model, config
        self.pool = CachePool(layer_specs(model.config), config.kv_cache_bytes, config.block_tokens)
        self.drafter = drafter  # PromptLookup / DraftModel / MtpDraft when config.speculative > 0
        if config.speculative and drafter is None:
            from ..model.speculative import PromptLookup

            self.drafter = PromptLookup()
        # an MTP drafter reads the model's hidden states of every position fed
        self._hidden = bool(config.speculative and getattr(self.drafter, "needs_hidden", False))
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.steps = 0  # forward passes run
        self.preemptions = 0  # sequences sent back to the queue for cache, to recompute it later
        self.drafted = self.accepted = 0  # speculative draft tokens proposed, and accepted
        self.context = model.config.max_position_embeddings or 1 << 62
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def full(self) -> bool:
        return len(self.waiting) >= self.config.max_waiting

    def submit(self, seq: Sequence) -> None:
        """Queue ``seq`` (the caller checked ``full``); the engine thread starts if it was idle."""
        if self.pool.blocks_for(len(seq.prompt) + 1 + self.config.speculative) > self.pool.num_blocks:
            raise ConfigError(f"a prompt of {len(seq.prompt)} tokens does not fit the cache pool "
                              f"({self.pool.nbytes} bytes): raise --kv-cache")
        with self._cond:
            self.waiting.append(seq)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="moeswarm-batch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def wake(self) -> None:
        """A consumer read or left: a sequence may be steppable again."""
        with self._cond:
            self._cond.notify()

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug here must not leave requests waiting forever
            log.exception("the batch engine failed")
            with self._cond:
                self._thread = None
                for seq in list(self.running) + list(self.waiting):
                    self._leave(seq, e if isinstance(e, Exception) else RuntimeError("the batch engine stopped"))
                self.waiting.clear()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._drop_cancelled()
                self._admit()
                if not self.running and not self.waiting:
                    self._thread = None
                    return
            steps = self._plan()  # outside the lock: a draft model may run here
            if not steps:
                with self._cond:
                    self._cond.wait(0.05)  # everyone is backlogged, or waits for cache
                continue
            try:
                self._forward([s for s, _, _ in steps])
            except Exception as e:  # noqa: BLE001 - the step's sequences fail, the engine keeps serving
                log.info("a batched step failed: %s", e)
                for _, seq, _ in steps:
                    self._leave(seq, e)
                continue
            self.steps += 1
            for step, seq, draft in steps:
                try:
                    self._advance(step, seq, draft)
                except Exception as e:  # noqa: BLE001 - e.g. detokenizing: this sequence fails, the others go on
                    self._leave(seq, e)

    def _forward(self, steps: list[Step]) -> None:
        """One forward pass. A small one (decode: at most ``on_loop_tokens`` new tokens) through the
        swarm runs on the event loop (``onloop.run_on_loop``): one thread hop for the step instead
        of two per MoE layer; larger ones (prefill) here, so the loop is never blocked for long."""
        loop = getattr(self.model.experts, "loop", None)
        if loop is not None and sum(len(s.ids) for s in steps) <= self.config.on_loop_tokens:
            asyncio.run_coroutine_threadsafe(run_on_loop(forward_batch, self.model, steps), loop).result()
        else:
            forward_batch(self.model, steps)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            self._resolve(seq, None)
        for seq in [s for s in self.running if s.cancelled]:
            self._leave(seq, None)  # the engine thread is the only one stepping: safe under the lock

    def _admit(self) -> None:
        """First come, first served, while a place and the cache for the prompt (plus a block of
        headroom per running sequence, so the batch does not thrash) are free."""
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            cache = self.pool.admit(seq.prefill_to + 1 + self.config.speculative, headroom=len(self.running))
            if cache is None:
                return  # later requests wait behind it
            self.waiting.popleft()
            seq.cache = cache
            if self.drafter is not None:
                seq.draft_state = self.drafter.new_state()
            self.running.append(seq)

    def _plan(self) -> list[tuple[Step, Sequence, list[int]]]:
        """This step's work: (step, sequence, draft tokens) for every sequence that can move."""
        steps, budget, k = [], self.config.prefill_chunk, self.config.speculative
        for seq in list(self.running):
            if seq not in self.running:  # preempted below for an older one
                continue
            draft: list[int] = []
            if seq.fed < seq.prefill_to:  # prefilling (or re-prefilling after a preemption)
                n = min(budget, seq.prefill_to - seq.fed)
                if n <= 0:
                    continue
                budget -= n
                ids = seq.tokens[seq.fed : seq.fed + n]
            elif seq.sent - seq.read < self.config.backlog:
                room = min(seq.params.max_new_tokens - seq.generated, self.context - len(seq.tokens))
                if self.drafter is not None and k and room > 0:
                    try:
                        draft, seq.q = self.drafter.propose(seq.draft_state, seq.tokens, min(k, room), seq.params,
                                                            seq.rng)
                    except Exception as e:  # noqa: BLE001 - a failing draft model fails this sequence only
                        self._leave(seq, e)
                        continue
                ids = seq.tokens[seq.fed :] + draft
            else:
                continue  # its consumer is behind
            if not self._make_room(seq, seq.fed + len(ids)):
                continue
            steps.append((Step(seq.cache, ids, all_logits=bool(draft), want_hidden=self._hidden), seq, draft))
        return steps

    def _make_room(self, seq: Sequence, tokens: int) -> bool:
        """Grow ``seq``'s cache to ``tokens``, preempting the youngest sequences if the pool is dry;
        False if ``seq`` itself had to step aside (or failed: alone, it does not fit)."""
        while not seq.cache.grow(tokens):
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self._leave(seq, ConfigError(f"this generation needs cache for {tokens} tokens, more than the "
                                             f"pool's {self.pool.num_blocks} blocks ({self.pool.nbytes} bytes) "
                                             "hold: raise --kv-cache"))
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Give ``seq``'s cache back and queue it first; when readmitted it recomputes its cache
        from its tokens (prompt and generated) and goes on where it was."""
        self.running.remove(seq)
        seq.cache.release()
        seq.cache, seq.fed, seq.prefill_to = None, 0, len(seq.tokens) - (1 if seq.generated else 0)
        if self.drafter is not None and seq.draft_state is not None:
            self.drafter.release(seq.draft_state)
            seq.draft_state = None
        self.preemptions += 1
        with self._cond:
            self.waiting.appendleft(seq)

    def _advance(self, step: Step, seq: Sequence, draft: list[int]) -> None:
        assert step.logits is not None
        resumed = seq.generated > 0 and seq.fed < seq.prefill_to  # a re-prefill: its next token is known
        if step.hidden is not None and seq.draft_state is not None:
            self.drafter.observe(seq.draft_state, seq.fed, step.hidden)
        seq.fed += len(step.ids) - len(draft)
        if seq.fed < seq.prefill_to or seq.cancelled or resumed:
            return  # more prompt to feed first
        if draft:
            new = verify(step.logits, draft, seq.q, seq.params, seq.rng)
            seq.stats.steps += 1
            seq.stats.drafted += len(draft)
            seq.stats.accepted += len(new) - 1
            self.drafted += len(draft)
            self.accepted += len(new) - 1
            seq.cache.truncate(seq.fed + len(new) - 1)  # the accepted drafts stay, the rest is forgotten
            seq.fed += len(new) - 1
        else:
            new = [sample(step.logits[-1], seq.params, seq.rng)]
        new = new[: seq.params.max_new_tokens - seq.generated]
        seq.tokens.extend(new)
        seq.sent += len(new)
        more = seq.on_tokens(new) and seq.generated < seq.params.max_new_tokens
        if not more:
            self._leave(seq, None)

    def _leave(self, seq: Sequence, error: BaseException | None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.cache is not None:
            seq.cache.release()
        if self.drafter is not None and seq.draft_state is not None:
            self.drafter.release(seq.draft_state)
            seq.draft_state = None
        self._resolve(seq, error)

    @staticmethod
    def _resolve(seq: Sequence, error: BaseException | None) -> None:
        def settle() -> None:
            if not seq.left.done():
                seq.left.set_result(error)
            if error is not None:
                seq.queue.put_nowait(error)

        try:
            seq.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the request's loop is closed: nobody waits
            pass
