"""``Client``: generate text from a moeswarm backbone over its OpenAI-compatible HTTP API.

Sync methods use the standard library's ``http.client``; the ``a``-prefixed ones use aiohttp.
Failures come out as moeswarm errors: ``Unreachable`` (no connection, or it was lost),
``Timeout`` (no answer within ``timeout`` seconds), ``ConfigError`` (the server refused the
request: 4xx, e.g. an unknown model or a prompt too long), ``BadResponse`` (the server failed,
5xx, or answered with something that is not the API).

Streams are lazy: the request is sent when iteration starts, and errors are raised then.
Stopping early (``break``, ``close()``/``aclose()``) closes the connection, which stops the
generation on the server.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from typing import Any, Literal, overload
from urllib.parse import urlsplit

import aiohttp

from ..errors import BadResponse, ConfigError, SwarmError, Timeout, Unreachable

Prompt = str | Sequence[int]  # text, or token ids
Messages = Sequence[Mapping[str, str]]  # [{"role": "user", "content": "..."}, ...]
Stop = str | Sequence[str] | None
_DONE = object()


class Client:
    """A backbone's HTTP API (``moeswarm`` serving ``/v1/...``) as Python calls.

    ``Client("http://127.0.0.1:8000")``; ``model`` names the model to ask for (default: the
    one the server has).  ``timeout`` bounds connecting and each wait for data, in seconds.

    ``Client(bootstrap="/ip4/.../p2p/12D3Koo...", model_dir="path/to/model")`` instead runs a
    backbone in this process that joins the swarm through that peer (it needs the model's
    non-expert weights and tokenizer locally; the experts come from the swarm).  Close it with
    ``close()`` or use the client as a context manager.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, model: str | None = None, timeout: float = 300.0,
                 bootstrap: str | Sequence[str] | None = None, model_dir: str | None = None) -> None:
        self._embedded: Any = None
        if bootstrap is not None:
            if model_dir is None:
                raise ConfigError("bootstrap= needs model_dir= (the backbone's non-expert weights)")
            from ._embedded import EmbeddedBackbone

            peers = (bootstrap,) if isinstance(bootstrap, str) else tuple(bootstrap)
            self._embedded = EmbeddedBackbone(model_dir, peers)
            base_url = self._embedded.url
        parts = urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"base_url must look like http://host:port, got {base_url!r}")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.timeout = timeout
        self._parts = urlsplit(self.base_url)

    def close(self) -> None:
        """Stop the embedded backbone, if this client started one."""
        if self._embedded is not None:
            self._embedded.close()
            self._embedded = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sync -------------------------------------------------------------------------------------

    def models(self) -> list[str]:
        """Ids of the models the server serves."""
        return _model_ids(self._request("GET", "/v1/models"))

    @overload
    def generate(self, prompt: Prompt, *, max_new_tokens: int = ..., temperature: float = ..., top_p: float = ...,
                 seed: int | None = ..., stop: Stop = ..., stream: Literal[False] = ...) -> str: ...
    @overload
    def generate(self, prompt: Prompt, *, max_new_tokens: int = ..., temperature: float = ..., top_p: float = ...,
                 seed: int | None = ..., stop: Stop = ..., stream: Literal[True]) -> Generator[str, None, None]: ...

    def generate(self, prompt: Prompt, *, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop: Stop = None, stream: bool = False) -> str | Generator[str, None, None]:
        """Continue ``prompt``: the text (cut before any ``stop`` string), or its pieces with ``stream=True``.

        ``temperature=0`` is greedy; the same ``seed`` gives the same text.
        """
        body = self._body("prompt", _prompt(prompt), max_new_tokens, temperature, top_p, seed, stop, stream)
        if stream:
            return self._stream("/v1/completions", body, chat=False)
        return _text(self._request("POST", "/v1/completions", body), chat=False)

    @overload
    def chat(self, messages: Messages, *, max_new_tokens: int = ..., temperature: float = ..., top_p: float = ...,
             seed: int | None = ..., stop: Stop = ..., stream: Literal[False] = ...) -> str: ...
    @overload
    def chat(self, messages: Messages, *, max_new_tokens: int = ..., temperature: float = ..., top_p: float = ...,
             seed: int | None = ..., stop: Stop = ..., stream: Literal[True]) -> Generator[str, None, None]: ...

    def chat(self, messages: Messages, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, stop: Stop = None, stream: bool = False) -> str | Generator[str, None, None]:
        """The assistant's reply to ``messages`` (rendered with the model's chat template)."""
        body = self._body("messages", [dict(m) for m in messages], max_new_tokens, temperature, top_p, seed, stop, stream)
        if stream:
            return self._stream("/v1/chat/completions", body, chat=True)
        return _text(self._request("POST", "/v1/chat/completions", body), chat=True)

    # ---- async ------------------------------------------------------------------------------------

    async def amodels(self) -> list[str]:
        return _model_ids(await self._arequest("GET", "/v1/models"))

    async def agenerate(self, prompt: Prompt, *, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                        seed: int | None = None, stop: Stop = None) -> str:
        body = self._body("prompt", _prompt(prompt), max_new_tokens, temperature, top_p, seed, stop, False)
        return _text(await self._arequest("POST", "/v1/completions", body), chat=False)

    def astream(self, prompt: Prompt, *, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                seed: int | None = None, stop: Stop = None) -> AsyncGenerator[str, None]:
        """``generate(..., stream=True)`` for asyncio; close it (``contextlib.aclosing``) to stop early."""
        body = self._body("prompt", _prompt(prompt), max_new_tokens, temperature, top_p, seed, stop, True)
        return self._astream("/v1/completions", body, chat=False)

    async def achat(self, messages: Messages, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                    seed: int | None = None, stop: Stop = None) -> str:
        body = self._body("messages", [dict(m) for m in messages], max_new_tokens, temperature, top_p, seed, stop, False)
        return _text(await self._arequest("POST", "/v1/chat/completions", body), chat=True)

    def achat_stream(self, messages: Messages, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int | None = None, stop: Stop = None) -> AsyncGenerator[str, None]:
        body = self._body("messages", [dict(m) for m in messages], max_new_tokens, temperature, top_p, seed, stop, True)
        return self._astream("/v1/chat/completions", body, chat=True)

    # ---- transport --------------------------------------------------------------------------------

    def _body(self, key: str, content: object, max_new_tokens: int, temperature: float, top_p: float,
              seed: int | None, stop: Stop, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {key: content, "max_tokens": max_new_tokens, "temperature": temperature,
                                "top_p": top_p, "stream": stream}
        if self.model is not None:
            body["model"] = self.model
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = [stop] if isinstance(stop, str) else list(stop)
        return body

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        return kind(self._parts.hostname or "", self._parts.port, timeout=self.timeout)

    def _open(self, conn: http.client.HTTPConnection, method: str, path: str, body: dict[str, Any] | None) -> http.client.HTTPResponse:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, self._parts.path + path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status >= 400:
            raise _status_error(response.status, response.read())
        return response

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        conn = self._connect()
        try:
            return _json(self._open(conn, method, path, body).read())
        except (OSError, http.client.HTTPException) as e:
            raise _network_error(e, self.base_url) from e
        finally:
            conn.close()

    def _stream(self, path: str, body: dict[str, Any], *, chat: bool) -> Generator[str, None, None]:
        conn = self._connect()
        try:
            response = self._open(conn, "POST", path, body)
            for line in response:
                event = _event(line)
                if event is _DONE:
                    return
                if isinstance(event, dict) and (piece := _piece(event, chat)):
                    yield piece
            raise BadResponse("the stream ended without [DONE]")
        except (OSError, http.client.HTTPException) as e:
            raise _network_error(e, self.base_url) from e
        finally:
            conn.close()

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout))

    async def _arequest(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            async with self._session() as session, session.request(method, self.base_url + path, json=body) as response:
                data = await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise _network_error(e, self.base_url) from e
        if response.status >= 400:
            raise _status_error(response.status, data)
        return _json(data)

    async def _astream(self, path: str, body: dict[str, Any], *, chat: bool) -> AsyncGenerator[str, None]:
        try:
            async with self._session() as session, session.post(self.base_url + path, json=body) as response:
                if response.status >= 400:
                    raise _status_error(response.status, await response.read())
                async for line in response.content:
                    event = _event(line)
                    if event is _DONE:
                        return
                    if isinstance(event, dict) and (piece := _piece(event, chat)):
                        yield piece
                raise BadResponse("the stream ended without [DONE]")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise _network_error(e, self.base_url) from e


# ---- decoding (shared by both transports) ---------------------------------------------------------


def _prompt(prompt: Prompt) -> str | list[int]:
    return prompt if isinstance(prompt, str) else [int(t) for t in prompt]


def _json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        raise BadResponse(f"the server answered with something that is not JSON: {data[:200]!r}") from None
    if not isinstance(value, dict):
        raise BadResponse("the server answered with JSON that is not an object")
    return value


def _event(line: bytes) -> object:
    """One SSE line -> a JSON event, ``_DONE``, or None (blank lines, comments, other fields)."""
    text = line.decode("utf-8", errors="replace").strip()
    if not text.startswith("data:"):
        return None
    data = text[5:].strip()
    return _DONE if data == "[DONE]" else _json(data.encode())


def _error_message(payload: dict[str, Any]) -> str | None:
    error = payload.get("error")
    if isinstance(error, dict):
        return str(error.get("message"))
    return None if error is None else str(error)


def _piece(event: dict[str, Any], chat: bool) -> str:
    """The text a streamed chunk adds ('' for role-only, final and usage chunks)."""
    if (message := _error_message(event)) is not None:
        raise BadResponse(f"the server failed while streaming: {message}")
    choices = event.get("choices")
    if not isinstance(choices, list) or (choices and not isinstance(choices[0], dict)):
        raise BadResponse(f"unexpected stream chunk: {str(event)[:200]}")
    holder = (choices[0].get("delta") if chat else choices[0]) if choices else None
    piece = holder.get("content" if chat else "text") if isinstance(holder, dict) else None
    return piece if isinstance(piece, str) else ""


def _text(payload: dict[str, Any], chat: bool) -> str:
    try:
        choice = payload["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    except (KeyError, IndexError, TypeError):
        raise BadResponse(f"unexpected response: {str(payload)[:200]}") from None
    if not isinstance(text, str):
        raise BadResponse("the response text is not a string")
    return text


def _model_ids(payload: dict[str, Any]) -> list[str]:
    data = payload.get("data")
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise BadResponse(f"unexpected model list: {str(payload)[:200]}")
    return [m["id"] for m in data]


def _status_error(status: int, data: bytes) -> SwarmError:
    try:
        message = _error_message(json.loads(data)) or data.decode(errors="replace")
    except (ValueError, AttributeError):
        message = data[:200].decode(errors="replace")
    if 400 <= status < 500:
        return ConfigError(f"the server refused the request (HTTP {status}): {message}")
    return BadResponse(f"the server failed (HTTP {status}): {message}")


def _network_error(e: BaseException, url: str) -> SwarmError:
    if isinstance(e, SwarmError):
        return e
    if isinstance(e, TimeoutError):  # socket timeouts, asyncio timeouts, aiohttp.ServerTimeoutError
        return Timeout(f"{url} did not answer in time")
    if isinstance(e, (http.client.HTTPException, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)):
        return BadResponse(f"{url} sent a broken HTTP response: {e!r}")
    return Unreachable(f"cannot reach {url}: {e}")
