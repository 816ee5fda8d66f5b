"""The async face of generation: text pieces and token ids as they come, for the HTTP API.

``GenerationService`` wraps any ``(Model, Tokenizer, model_id)`` and works the same whether the
routed experts run in this process or across the swarm.

Batching.  Generations run in one ``scheduler.BatchEngine``: up to ``max_batch`` sequences
advance together, one forward pass per step (so one request per expert holder per MoE layer
carries every user's rows); new requests join at the next step, finished ones leave.  Cache
memory comes from one pool (``kv_cache_bytes``); a request that cannot get its cache waits in
FIFO order, and once ``max_waiting`` requests wait, new ones are refused with ``ServiceBusy``
(the HTTP API answers 503 with ``Retry-After``).  Sampling parameters, seeds and stop strings are
per sequence; a sequence's tokens do not depend on what else is in the batch.

Threading.  The engine thread runs the model; it detokenizes, applies stop strings and hands
``Chunk`` objects to the request's event loop through an ``asyncio.Queue``.  A consumer that
falls ``backlog`` tokens behind makes only its own sequence sit out steps.  The loop never
blocks on the model.

Cancellation.  When the consumer stops -- the async iterator is closed, its task is cancelled,
or the HTTP client hangs up -- its sequence leaves the batch before the next step and its
cache blocks go back to the pool; ``stream`` returns only once that happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError, SwarmError
from ..model import Model, SamplingParams, StreamDecoder, Tokenizer
from .scheduler import BatchEngine, EngineConfig
from .scheduler import Sequence as _Sequence

FinishReason = Literal["stop", "length"]


class ServiceBusy(SwarmError):
    """Too many requests wait already: try again later (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Chunk:
    """What one step of a generation added."""

    text: str  # new text ('' while a character is incomplete or text may start a stop string)
    token_ids: tuple[int, ...]  # tokens produced since the previous chunk
    finish_reason: FinishReason | None = None  # set on the last chunk only


@dataclass(frozen=True)
class Completion:
    """A whole generation (``GenerationService.complete``)."""

    text: str  # generated text, cut before the first stop string
    token_ids: tuple[int, ...]  # every generated token, including a final stop token
    finish_reason: FinishReason  # "stop": stop token or stop string; "length": token budget used up
    prompt_tokens: int  # tokens in the prompt
    completion_tokens: int  # len(token_ids)


@dataclass(frozen=True)
class ServiceStats:
    running: int  # sequences in the batch now (at most max_batch)
    waiting: int  # requests queued for a place in the batch or for cache


class GenerationService:
    """Async streaming and non-streaming generation over one model, continuously batched."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        model_id: str,
        *,
        max_batch: int | None = None,
        max_concurrent: int | None = None,
        queue_size: int = 8,
        chat_folder: str | os.PathLike[str] | None = None,
        engine: EngineConfig | None = None,
        drafter: Any = None,
    ) -> None:
        """``max_batch`` (``max_concurrent`` is its older name) and ``queue_size`` (unread tokens
        before a sequence sits out steps) override ``engine``'s; ``drafter``: a
        ``moeswarm.model.speculative`` drafter for ``engine.speculative`` > 0 (default prompt
        lookup).  ``chat_folder``: where ``tokenizer_config.json`` (chat template) lives; default:
        the model folder."""
        engine = engine or EngineConfig()
        batch = max_batch if max_batch is not None else max_concurrent
        if (batch is not None and batch < 1) or queue_size < 1:
            raise ConfigError("max_batch and queue_size must be >= 1")
        engine = replace(engine, max_batch=batch or engine.max_batch, backlog=queue_size)
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.chat_template = ChatTemplate.from_folder(chat_folder or model.weights.folder)
        self.engine = BatchEngine(model, engine, drafter)

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + completion) a sequence may hold; 0 when the config does not say."""
        return self.model.config.max_position_embeddings

    def stats(self) -> ServiceStats:
        return ServiceStats(len(self.engine.running), len(self.engine.waiting))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Render messages with the chat template and tokenize them (without a doubled BOS)."""
        return self.chat_template.encode(self.chat_template.render(messages), self.tokenizer)

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop: Sequence[str] = (), *, ignore_eos: bool = False
    ) -> AsyncGenerator[Chunk, None]:
        """Generate, yielding chunks as they are produced; the last one has ``finish_reason``.

        The prompt is checked now (``ConfigError``), and a full queue refused now
        (``ServiceBusy``), before anything is queued.  The model's EOS tokens are added to
        ``params.stop_token_ids`` unless ``ignore_eos``.  ``max_new_tokens`` is clamped so
        prompt + completion fit the context.  Close the iterator (``aclosing``) or cancel its
        task to stop early.
        """
        prompt = self.check_prompt(prompt_ids)
        if self.engine.full():
            raise ServiceBusy(f"{len(self.engine.waiting)} requests are waiting already; try again shortly",
                              retry_after_s=1)
        params = self._effective(params, len(prompt), ignore_eos)
        return self._run(prompt, params, stop)

    async def complete(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop: Sequence[str] = (), *, ignore_eos: bool = False
    ) -> Completion:
        """Generate to the end and return the whole completion."""
        texts: list[str] = []
        ids: list[int] = []
        reason: FinishReason = "length"
        async with contextlib.aclosing(self.stream(prompt_ids, params, stop, ignore_eos=ignore_eos)) as chunks:
            async for chunk in chunks:
                texts.append(chunk.text)
                ids.extend(chunk.token_ids)
                reason = chunk.finish_reason or reason
        return Completion("".join(texts), tuple(ids), reason, len(prompt_ids), len(ids))

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt as a list, or ``ConfigError`` saying what is wrong with it."""
        prompt = [int(i) for i in prompt_ids]
        vocab, ctx = self.model.config.vocab_size, self.context_length
        if not prompt:
            raise ConfigError("the prompt is empty: give at least one token")
        if ctx and len(prompt) > ctx:
            raise ConfigError(f"the prompt has {len(prompt)} tokens but the model's context holds {ctx} (max_position_embeddings)")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        return prompt

    def _effective(self, params: SamplingParams, prompt_len: int, ignore_eos: bool) -> SamplingParams:
        stop_ids = tuple(dict.fromkeys(params.stop_token_ids + (() if ignore_eos else self.model.config.eos_token_ids)))
        room = self.context_length - prompt_len if self.context_length else params.max_new_tokens
        return replace(params, stop_token_ids=stop_ids, max_new_tokens=min(params.max_new_tokens, room))

    async def _run(self, prompt: list[int], params: SamplingParams, stop: Sequence[str]) -> AsyncGenerator[Chunk, None]:
        if params.max_new_tokens == 0:
            yield Chunk("", (), "length")
            return
        queue: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        output = _Output(self.tokenizer, prompt, params, stop, queue)
        seq = _Sequence(prompt, params, output.push, queue)
        self.engine.submit(seq)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                seq.read += len(item.token_ids)
                if seq.sent - seq.read < self.engine.config.backlog:
                    self.engine.wake()
                if item.finish_reason is not None:
                    await asyncio.shield(seq.left)  # it has left the batch: its place is free before the last chunk
                    yield item
                    return
                yield item
        finally:
            seq.cancel()
            self.engine.wake()
            await asyncio.shield(seq.left)  # at most one forward pass; then its cache is back in the pool


class _Output:
    """Tokens -> chunks for one sequence, on the engine thread: detokenizes, applies stop tokens,
    stop strings and the token budget, and puts the chunks on the request's queue."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], params: SamplingParams, stop: Sequence[str],
                 queue: asyncio.Queue[Chunk | BaseException]) -> None:
        self.decoder = tokenizer.stream(prompt)
        self.stops = _StopFilter(stop)
        self.stop_ids, self.budget = set(params.stop_token_ids), params.max_new_tokens
        self.queue, self.loop = queue, asyncio.get_running_loop()
        self.n = 0

    def push(self, tokens: list[int]) -> bool:
        """Hand out ``tokens``; False once the generation is over (its last chunk is sent)."""
        for token in tokens:
            self.n += 1
            chunk, more = self._chunk(token)
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, chunk)
            except RuntimeError:  # the loop is closed: nobody reads
                return False
            if not more:
                return False
        return True

    def _chunk(self, token: int) -> tuple[Chunk, bool]:
        text, hit = self.stops.push(self.decoder.feed(token))
        if hit:
            return Chunk(text, (token,), "stop"), False
        if token in self.stop_ids or self.n >= self.budget:  # the last token
            tail, hit = self.stops.push(_flush(self.decoder))
            reason: FinishReason = "stop" if hit or token in self.stop_ids else "length"
            return Chunk(text + tail + ("" if hit else self.stops.flush()), (token,), reason), False
        return Chunk(text, (token,)), True


def _flush(decoder: StreamDecoder) -> str:
    """Text the stream decoder still holds back (an incomplete character at the very end)."""
    settled = decoder.tokenizer.decode(decoder.ids[decoder.prefix_offset : decoder.read_offset])
    text = decoder.tokenizer.decode(decoder.ids[decoder.prefix_offset :])
    return text[len(settled) :] if text.startswith(settled) else ""


class _StopFilter:
    """Cuts streamed text before the first stop string to complete; holds back a tail that could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was found)."""
        text = self.pending + piece
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.pending = ""
            return text[: min(cuts)], True
        keep = self._partial_tail(text)
        self.pending = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


# ---- chat ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template (Jinja, as in Hugging Face ``tokenizer_config.json``) or the fallback."""

    source: str | None  # Jinja source; None = the plain fallback (see ``render``)
    bos_token: str = ""  # text of the BOS token, as the template sees it
    eos_token: str = ""

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> ChatTemplate:
        """Read ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` if present."""
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json")
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if source is not None and not isinstance(source, str):
            raise ConfigError(f"chat_template in {folder / 'tokenizer_config.json'} is not a string")
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text for ``messages`` (each ``{"role": ..., "content": ...}``), ready for the reply.

        Without a template (the fallback): one ``<role>: <content>`` line per message, then
        ``assistant:`` for the model to continue.
        """
        if self.source is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        import jinja2

        from ._template_sandbox import TemplateLimitError, render_bounded

        try:
            return render_bounded(_compile(self.source), messages=[dict(m) for m in messages],
                                  add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateLimitError as e:
            raise ConfigError(f"the chat template went over its limits: {e}") from None
        except RecursionError:
            raise ConfigError("the chat template went over its limits: it recursed too deeply") from None
        except jinja2.TemplateError as e:
            raise ConfigError(f"the chat template rejected the messages: {e}") from None

    def encode(self, text: str, tokenizer: Tokenizer) -> list[int]:
        """Tokenize rendered chat text; a BOS the template wrote as text becomes the one BOS id."""
        if not (self.bos_token and text.startswith(self.bos_token) and tokenizer.bos_id is not None):
            return tokenizer.encode(text)
        ids = tokenizer.encode(text[len(self.bos_token) :])
        return ids if ids[:1] == [tokenizer.bos_id] else [tokenizer.bos_id, *ids]


def render_chat(messages: Sequence[Mapping[str, str]], tokenizer_folder: str | os.PathLike[str]) -> str:
    """Render ``messages`` with the folder's chat template, or the plain fallback if it has none."""
    return ChatTemplate.from_folder(tokenizer_folder).render(messages)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    """Compile a chat template the way transformers does (sandboxed, trimmed blocks), bounded in
    steps, time and size (``_template_sandbox``)."""
    from ._template_sandbox import BoundedSandbox

    def raise_exception(message: str) -> None:
        raise ConfigError(f"the chat template rejected the messages: {message}")

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except Exception as e:  # jinja2.TemplateSyntaxError
        raise ConfigError(f"the chat template does not compile: {e}") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_text(token: object) -> str:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (both appear in tokenizer_config.json)."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""
