"""The async face of generation: text pieces and token ids as they come, for the HTTP API.

``GenerationService`` wraps any ``(Model, Tokenizer, model_id)``; it only calls ``generate()``,
so it works the same whether the routed experts run in this process or across the swarm.

Threading.  Each generation runs the blocking ``generate()`` iterator in a worker thread (the
event loop's default executor); the worker detokenizes, applies stop strings and hands
``Chunk`` objects to the loop through a bounded ``asyncio.Queue`` (``queue_size`` chunks: the
worker waits when the consumer falls behind).  The loop never blocks on the model.

Cancellation.  When the consumer stops -- the async iterator is closed, its task is cancelled,
or the HTTP client hangs up -- the worker is told to stop and does so before its next forward
pass.  The concurrency slot is released when the worker thread has really finished, so at most
``max_concurrent`` generations ever compute at once; further requests wait in FIFO order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import threading
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from ..model import Model, SamplingParams, StreamDecoder, Tokenizer, generate

FinishReason = Literal["stop", "length"]

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
    running: int  # generations computing now (at most max_concurrent)
    waiting: int  # generations queued for a slot


class GenerationService:
    """Async streaming and non-streaming generation over one model, with bounded concurrency."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        model_id: str,
        *,
        max_concurrent: int = 1,
        queue_size: int = 8,
        chat_folder: str | os.PathLike[str] | None = None,
    ) -> None:
        """``chat_folder``: where ``tokenizer_config.json`` (chat template) lives; default: the model folder."""
        if max_concurrent < 1 or queue_size < 1:
            raise ConfigError("max_concurrent and queue_size must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.queue_size = queue_size
        self.chat_template = ChatTemplate.from_folder(chat_folder or model.weights.folder)
        self._slots = asyncio.Semaphore(max_concurrent)
        self._running = 0
        self._waiting = 0

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + completion) a sequence may hold; 0 when the config does not say."""
        return self.model.config.max_position_embeddings

    def stats(self) -> ServiceStats:
        return ServiceStats(self._running, self._waiting)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Render messages with the chat template and tokenize them (without a doubled BOS)."""
        return self.chat_template.encode(self.chat_template.render(messages), self.tokenizer)

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop: Sequence[str] = (), *, ignore_eos: bool = False
    ) -> AsyncGenerator[Chunk, None]:
        """Generate, yielding chunks as they are produced; the last one has ``finish_reason``.

        The prompt is checked now (``ConfigError``), before anything is queued.  The model's EOS
        tokens are added to ``params.stop_token_ids`` unless ``ignore_eos``.  ``max_new_tokens``
        is clamped so prompt + completion fit the context.  Close the iterator (``aclosing``) or
        cancel its task to stop early.
        """
        prompt = self.check_prompt(prompt_ids)
        job = _Job(self.model, self.tokenizer, prompt, self._effective(params, len(prompt), ignore_eos), stop, self.queue_size)
        return self._run(job)

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

    async def _run(self, job: _Job) -> AsyncGenerator[Chunk, None]:
        worker = await self._start(job)
        try:
            while True:
                item = await job.queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.finish_reason is not None:
                    await asyncio.shield(worker)  # it is ending: free the slot before the last chunk goes out
                    yield item
                    return
                yield item
        finally:
            job.cancel()
            await asyncio.shield(worker)  # at most one forward pass; the slot is freed by the worker

    async def _start(self, job: _Job) -> asyncio.Future[None]:
        """Wait for a slot, then start the worker thread; the slot is released when it ends."""
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        try:
            worker = job.start()
        except BaseException:
            self._release()
            raise
        worker.add_done_callback(lambda _: self._release())
        return worker

    def _release(self) -> None:
        self._running -= 1
        self._slots.release()


class _Job:
    """One generation: runs in a worker thread, talks to the loop only through ``queue``."""

    def __init__(
        self, model: Model, tokenizer: Tokenizer, prompt: list[int], params: SamplingParams, stop: Sequence[str], queue_size: int
    ) -> None:
        self.model, self.tokenizer, self.prompt, self.params = model, tokenizer, prompt, params
        self.stops = _StopFilter(stop)
        self.queue: asyncio.Queue[Chunk | Exception] = asyncio.Queue(queue_size)
        self.cancelled = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> asyncio.Future[None]:
        self.loop = asyncio.get_running_loop()
        return self.loop.run_in_executor(None, self._run)

    def cancel(self) -> None:
        """Called on the loop: stop the worker and unblock it if it waits for queue space."""
        self.cancelled.set()
        while not self.queue.empty():
            self.queue.get_nowait()

    def _run(self) -> None:
        try:
            self._produce()
        except Exception as e:  # handed to the consumer, which raises it
            self._put(e)

    def _produce(self) -> None:
        decoder = self.tokenizer.stream(self.prompt)
        stop_ids, budget = set(self.params.stop_token_ids), self.params.max_new_tokens
        if budget == 0 or self.cancelled.is_set():
            self._put(Chunk("", (), "length"))
            return
        tokens = generate(self.model, self.prompt, self.params)
        try:
            for n, token in enumerate(tokens, start=1):
                text, hit = self.stops.push(decoder.feed(token))
                if hit:
                    self._put(Chunk(text, (token,), "stop"))
                    return
                if token in stop_ids or n == budget:  # stop here: no forward pass for a token nobody reads
                    tail, hit = self.stops.push(_flush(decoder))
                    reason: FinishReason = "stop" if hit or token in stop_ids else "length"
                    self._put(Chunk(text + tail + ("" if hit else self.stops.flush()), (token,), reason))
                    return
                if not self._put(Chunk(text, (token,))):
                    return
        finally:
            if isinstance(tokens, Generator):
                tokens.close()

    def _put(self, item: Chunk | Exception) -> bool:
        """Hand ``item`` to the loop, waiting for queue space; False once the consumer is gone."""
        loop = self.loop
        if self.cancelled.is_set() or loop is None:
            return False
        put = self.queue.put(item)
        try:
            done = asyncio.run_coroutine_threadsafe(put, loop)
        except RuntimeError:  # the loop is closed
            put.close()
            return False
        while True:
            try:
                done.result(timeout=0.5)
                return not self.cancelled.is_set()
            except FutureTimeout:  # still full: give up only if nobody will ever read it
                if self.cancelled.is_set() or loop.is_closed():
                    done.cancel()
                    return False


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

        try:
            return str(_compile(self.source).render(
                messages=[dict(m) for m in messages], add_generation_prompt=True,
                bos_token=self.bos_token, eos_token=self.eos_token,
            ))
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
    """Compile a chat template the way transformers does (sandboxed, trimmed blocks)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ConfigError(f"the chat template rejected the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
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
