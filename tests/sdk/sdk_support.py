"""Helpers shared by the serving tests (a module with a unique name: ``conftest`` is not importable)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
from pathlib import Path
from types import TracebackType

from moeswarm.node.http_api import ApiConfig, serve_http
from moeswarm.node.service import GenerationService

MODEL_ID = "tiny-mixtral"
# A ChatML-like template in Hugging Face's format; it writes the BOS and EOS tokens as text.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(folder: Path) -> None:
    """A byte-level BPE over exactly the model's 512 ids; <pad>=0, <s>=1, </s>=2 as in the oracle config."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [Path(os.__file__).read_text(), Path(json.__file__).read_text()] * 2
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == 512
    tok.save(str(folder / "tokenizer.json"))


class LiveServer:
    """``serve_http`` on 127.0.0.1 with its own event loop in a thread; ``with`` starts and stops it."""

    def __init__(self, service: GenerationService, config: ApiConfig = ApiConfig()) -> None:
        self.service, self.config = service, config
        self.port = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(ready),), name="live-server")
        self._thread.start()
        self.port = ready.result(timeout=60)
        return self

    async def _main(self, ready: concurrent.futures.Future[int]) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            runner, port = await serve_http(self.service, "127.0.0.1", 0, self.config)
        except BaseException as e:
            ready.set_exception(e)
            raise
        try:
            ready.set_result(port)
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._loop is not None and self._stop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the server did not shut down"
