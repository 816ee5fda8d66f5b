"""moeswarm.sdk.Client against the live API: sync and async, and its errors."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from sdk_support import MODEL_ID, LiveServer

from moeswarm.sdk import Client, ConfigError, Timeout, Unreachable

PROMPT = "def main(args):"
MESSAGES: list[Any] = [{"role": "user", "content": "Write a function"}]


@pytest.fixture(scope="module")
def expected(server: LiveServer) -> dict[str, str]:
    """What the openai client gets for the same greedy requests (an independent client)."""
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        text = c.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
        reply = c.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=12, temperature=0)
    assert text and reply.choices[0].message.content
    return {"text": text, "chat": reply.choices[0].message.content}


def test_sync_client(server: LiveServer, expected: dict[str, str]) -> None:
    client = Client(server.url, model=MODEL_ID)
    assert client.models() == [MODEL_ID]
    assert client.generate(PROMPT, max_new_tokens=12) == expected["text"]
    assert "".join(client.generate(PROMPT, max_new_tokens=12, stream=True)) == expected["text"]
    assert client.chat(MESSAGES, max_new_tokens=12) == expected["chat"]
    assert "".join(client.chat(MESSAGES, max_new_tokens=12, stream=True)) == expected["chat"]
    stop = expected["text"][4:6]
    assert client.generate(PROMPT, max_new_tokens=12, stop=stop) == expected["text"][: expected["text"].find(stop)]
    assert client.generate(PROMPT, temperature=1.0, seed=5) == client.generate(PROMPT, temperature=1.0, seed=5)


def test_async_client(server: LiveServer, expected: dict[str, str]) -> None:
    client = Client(server.url + "/v1/")  # a trailing /v1 is accepted too

    async def main() -> None:
        assert await client.amodels() == [MODEL_ID]
        assert await client.agenerate(PROMPT, max_new_tokens=12) == expected["text"]
        assert "".join([p async for p in client.astream(PROMPT, max_new_tokens=12)]) == expected["text"]
        assert await client.achat(MESSAGES, max_new_tokens=12) == expected["chat"]
        assert "".join([p async for p in client.achat_stream(MESSAGES, max_new_tokens=12)]) == expected["chat"]

    asyncio.run(main())


def test_stopping_a_stream_early_frees_the_server(server: LiveServer, expected: dict[str, str]) -> None:
    client = Client(server.url, timeout=30)
    pieces = client.generate([5, 6, 7], max_new_tokens=200, stream=True)
    assert next(pieces)
    pieces.close()

    async def main() -> None:
        async with contextlib.aclosing(client.astream([5, 6, 7], max_new_tokens=200)) as stream:
            assert await anext(stream)

    asyncio.run(main())
    assert client.generate(PROMPT, max_new_tokens=12) == expected["text"]  # one slot: both streams gave it back


def test_refused_requests_are_config_errors(server: LiveServer) -> None:
    client = Client(server.url)
    with pytest.raises(ConfigError, match="HTTP 400.*max_tokens"):
        client.generate(PROMPT, max_new_tokens=-1)
    with pytest.raises(ConfigError, match="HTTP 404"):
        Client(server.url, model="gpt-4").generate(PROMPT)
    with pytest.raises(ConfigError, match="HTTP 400"):
        list(client.generate("", stream=True))
    with pytest.raises(ConfigError, match="HTTP 400"):
        asyncio.run(client.agenerate(PROMPT, top_p=0))


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (in the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


async def drain(stream: AsyncIterator[str]) -> None:
    async for _ in stream:
        pass


def test_network_failures_are_swarm_errors(closed_port: int, silent_port: int) -> None:
    gone, silent = Client(f"http://127.0.0.1:{closed_port}"), Client(f"http://127.0.0.1:{silent_port}", timeout=0.3)
    with pytest.raises(Unreachable):
        gone.models()
    with pytest.raises(Unreachable):
        list(gone.generate(PROMPT, stream=True))
    with pytest.raises(Unreachable):
        asyncio.run(gone.agenerate(PROMPT))
    with pytest.raises(Timeout):
        silent.generate(PROMPT)
    with pytest.raises(Timeout):
        asyncio.run(drain(silent.astream(PROMPT)))
    with pytest.raises(ConfigError, match="base_url"):
        Client("127.0.0.1:8000")
