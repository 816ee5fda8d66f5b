"""The OpenAI-compatible HTTP API over a ``GenerationService`` (aiohttp).

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both stream with ``"stream": true`` as server-sent events in
OpenAI's chunk format, ending with ``data: [DONE]``) and ``GET /healthz``.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid
requests (malformed JSON, wrong types, out-of-range values, a prompt that does not fit), 404
for an unknown model or route, 413 for an oversized body, 503/502 when the swarm fails, 503 with
``Retry-After`` when the batch and its waiting queue are full, 500 for our own bugs.  A streamed generation that fails after its first chunk reports the error as one
``data: {"error": ...}`` event before ``[DONE]`` (the status line is already sent).

Extensions beyond OpenAI (its clients ignore them): ``"model"`` may be omitted; ``top_k``;
``ignore_eos``; ``"return_token_ids": true`` adds ``"token_ids"`` (the generated ids, a final
stop token included) to every choice, streamed or not, and ``"prompt_token_ids"`` (the prompt as the
server tokenized it) to the first choice that carries tokens.  Fields we cannot honour (``n`` > 1,
``logprobs``, penalties, ``echo``, tools, ...) are rejected with 400 rather than ignored.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..errors import ConfigError, NetworkError, ProtocolError, SwarmError
from ..model import SamplingParams
from ..net.http_guard import HttpLimits, allowed_hosts, guarded_runner, host_allowed, is_loopback
from ..net.http_guard import host_name as _host_name
from .service import Chunk, GenerationService, ServiceBusy


@dataclass(frozen=True)
class ApiConfig:
    max_body_bytes: int = 1 << 20  # largest request body accepted (bytes); larger gets 413
    completion_max_tokens: int = 16  # max_tokens when /v1/completions omits it (OpenAI's default)
    chat_max_tokens: int = 4096  # max_tokens when /v1/chat/completions omits it (then clamped to the context)
    max_stop_strings: int = 16  # most stop strings one request may give
    max_tokens_cap: int = 4096  # a request asking for more new tokens than this is refused (400)
    api_key: str | None = None  # every route but /healthz, /status, /metrics needs "Authorization: Bearer <api_key>"
    allowed_hosts: tuple[str, ...] = ()  # Host/Origin names accepted besides the bound address (a proxy's name)
    limits: HttpLimits = HttpLimits()  # header/body/idle timeouts and connections per address
    middlewares: tuple[Any, ...] = ()  # run after the guard, before the handlers (a paid gateway's SpendingGate)
    public: bool = False  # a gateway: serves anyone without an API key, also off loopback (paid ones charge)


SERVICE = web.AppKey("service", GenerationService)
CONFIG = web.AppKey("config", ApiConfig)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Fields we do not implement, with the values that mean "not used" (anything else is a 400).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
}
log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request we refuse, rendered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return _error_response(self.status, self.message, kind, self.param, self.code)


def _error_response(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response({"error": _error_body(message, kind, param, code)}, status=status)


def _error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": kind, "param": param, "code": code}


# ---- request parsing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Request:
    prompt_ids: list[int]  # the checked prompt
    params: SamplingParams
    stop: tuple[str, ...]  # stop strings
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    ignore_eos: bool  # extension: keep going past EOS
    return_token_ids: bool  # extension: "token_ids" in every choice


async def _json_body(request: web.Request) -> dict[str, Any]:
    content_type = request.headers.get("Content-Type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        # a browser page on another origin can POST text/plain or a form without asking first
        # (no CORS preflight); it cannot send application/json that way
        raise ApiError(415, f"Content-Type must be application/json, not {content_type[:100]!r}")
    raw = await request.read()  # raises 413 past client_max_size
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _parse(body: dict[str, Any], service: GenerationService, config: ApiConfig, *, chat: bool) -> _Request:
    _check_model(body, service)
    for name, neutral in _UNSUPPORTED.items():
        if name in body and not _is_neutral(body[name], neutral):
            raise ApiError(400, f"{name}={body[name]!r} is not supported by this server", param=name)
    field = "messages" if chat else "prompt"
    try:
        ids = service.encode_chat(_messages(body)) if chat else _prompt_ids(body, service)
        prompt = service.check_prompt(ids)
    except ConfigError as e:
        raise ApiError(400, str(e), param=field) from None
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    top_p = _number(body, "top_p", float, 1.0, 0, 1)
    if top_p == 0:
        raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
    params = SamplingParams(
        max_new_tokens=_number(body, max_key, int, min(config.max_tokens_cap, config.chat_max_tokens if chat
                                                       else config.completion_max_tokens), 0, config.max_tokens_cap),
        temperature=_number(body, "temperature", float, 1.0, 0, 2),
        top_p=top_p,
        top_k=_number(body, "top_k", int, 0, 0),
        seed=_number(body, "seed", int, None, 0, 2**63 - 1),
    )
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and type(options.get("include_usage", False)) is bool):
        raise ApiError(400, "stream_options must be an object like {\"include_usage\": true}", param="stream_options")
    return _Request(
        prompt, params, _stop(body, config.max_stop_strings), _flag(body, "stream"), bool((options or {}).get("include_usage")),
        _flag(body, "ignore_eos"), _flag(body, "return_token_ids"),
    )


def _is_neutral(value: object, neutral: tuple[Any, ...]) -> bool:
    """``value`` is one of ``neutral`` (booleans count only as themselves, not as 0 or 1)."""
    return any(value is v or (type(value) is not bool and type(v) is not bool and value == v) for v in neutral)


def _check_model(body: dict[str, Any], service: GenerationService) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    if model is not None and model != service.model_id:
        raise ApiError(404, f"the model {model!r} does not exist; this server has {service.model_id!r}",
                       param="model", code="model_not_found")


def _prompt_ids(body: dict[str, Any], service: GenerationService) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return service.encode(prompt)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", param="prompt")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role", param=f"messages[{i}]")
        out.append({"role": m["role"], "content": _content(m.get("content"), f"messages[{i}].content")})
    return out


def _content(content: object, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in ("image_url", "input_image")
                                         for p in content):
        raise ApiError(400, f"{param}: images are not supported yet (text parts only)", param=param)
    raise ApiError(400, f"{param} must be a string or a list of text parts", param=param)


def _number(body: dict[str, Any], name: str, kind: type[Any], default: Any, lo: float, hi: float | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    typed = type(value) is int or (kind is float and type(value) is float)
    if not typed or not value >= lo or (hi is not None and not value <= hi):
        what = "an integer" if kind is int else "a number"
        raise ApiError(400, f"{name} must be {what} in [{lo}, {'inf' if hi is None else hi}], got {value!r}", param=name)
    return kind(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is not None and type(value) is not bool:
        raise ApiError(400, f"{name} must be true or false", param=name)
    return bool(value)


def _stop(body: dict[str, Any], limit: int) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stops, list) and len(stops) <= limit and all(isinstance(s, str) and s for s in stops)):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {limit} of them", param="stop")
    return tuple(stops or ())


# ---- responses ------------------------------------------------------------------------------------


def _envelope(service: GenerationService, *, chat: bool, stream: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    prefix = "chatcmpl-" if chat else "cmpl-"
    return {"id": prefix + uuid.uuid4().hex, "object": kind, "created": int(time.time()), "model": service.model_id}


def _choice(req: _Request, *, chat: bool, text: str | None, finish: str | None, ids: tuple[int, ...], first: bool = False) -> dict[str, Any]:
    """One choice; ``text=None`` is a streamed chat chunk with an empty delta."""
    if chat and req.stream:
        delta: dict[str, Any] = {} if text is None else {"content": text}
        body: dict[str, Any] = {"delta": {"role": "assistant", **delta} if first else delta}
    elif chat:
        body = {"message": {"role": "assistant", "content": text}}
    else:
        body = {"text": text or ""}
    choice = {"index": 0, **body, "logprobs": None, "finish_reason": finish}
    if req.return_token_ids:
        choice["token_ids"] = list(ids)
    return choice


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


METER = "moeswarm.meter"
"""A request's token meter (``request[METER](n)`` per n tokens sent), set by a paid gateway's middleware."""


async def _respond(request: web.Request, req: _Request, *, chat: bool) -> web.StreamResponse:
    service = request.app[SERVICE]
    envelope = _envelope(service, chat=chat, stream=req.stream)
    meter = request.get(METER)
    if not req.stream:
        done = await service.complete(req.prompt_ids, req.params, req.stop, ignore_eos=req.ignore_eos)
        if meter is not None:
            meter(len(done.token_ids))
        choice = _choice(req, chat=chat, text=done.text, finish=done.finish_reason, ids=done.token_ids)
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(req.prompt_ids)
        return web.json_response({**envelope, "choices": [choice], "usage": _usage(done.prompt_tokens, done.completion_tokens)})
    async with contextlib.aclosing(service.stream(req.prompt_ids, req.params, req.stop, ignore_eos=req.ignore_eos)) as chunks:
        first = await anext(chunks)  # a failure before any output still gets a proper status
        return await _sse(request, _events(first, chunks, req, envelope, chat=chat, meter=meter))


async def _events(
    first: Chunk, chunks: AsyncIterator[Chunk], req: _Request, envelope: dict[str, Any], *, chat: bool,
    meter: Callable[[int], None] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    if chat:
        yield {**envelope, "choices": [_choice(req, chat=True, text="", finish=None, ids=(), first=True)]}
    completion_tokens, chunk, sent = 0, first, False
    while True:
        completion_tokens += len(chunk.token_ids)
        if chunk.text or (req.return_token_ids and chunk.token_ids):
            choice = _choice(req, chat=chat, text=chunk.text, finish=None, ids=chunk.token_ids)
            if req.return_token_ids and not sent:  # the prompt as tokens, once: a client resumes from it
                choice["prompt_token_ids"], sent = list(req.prompt_ids), True
            yield {**envelope, "choices": [choice]}
            if meter is not None:  # counted once handed to the connection
                meter(len(chunk.token_ids))
        if chunk.finish_reason is not None:
            yield {**envelope, "choices": [_choice(req, chat=chat, text=None, finish=chunk.finish_reason, ids=())]}
            break
        chunk = await anext(chunks)
    if req.include_usage:
        yield {**envelope, "choices": [], "usage": _usage(len(req.prompt_ids), completion_tokens)}


async def _sse(request: web.Request, events: AsyncGenerator[dict[str, Any], None]) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    # A client that left raises ConnectionResetError here; closing `events` then stops the generation.
    with contextlib.suppress(ConnectionResetError):
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    await response.write(_event(event))
            except ConnectionResetError:
                raise
            except Exception as e:  # the status line is sent: report the failure in-band
                await response.write(_event({"error": _error_body(*_describe(e, request))}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    return response


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _describe(e: Exception, request: web.Request) -> tuple[str, str]:
    """(message, type) for an error that ends a stream; our own bugs are logged, not shown."""
    if isinstance(e, SwarmError):
        return str(e), _status_of(e)[1]
    log.exception("internal error while streaming %s", request.path)
    return "internal server error", "server_error"


def _status_of(e: SwarmError) -> tuple[int, str]:
    if isinstance(e, ConfigError):
        return 400, "invalid_request_error"
    if isinstance(e, NetworkError):
        return 503, "service_unavailable"
    if isinstance(e, ProtocolError):
        return 502, "bad_gateway"
    return 500, "server_error"


# ---- handlers and app -----------------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    req = _parse(await _json_body(request), request.app[SERVICE], request.app[CONFIG], chat=False)
    return await _respond(request, req, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    req = _parse(await _json_body(request), request.app[SERVICE], request.app[CONFIG], chat=True)
    return await _respond(request, req, chat=True)


def _model_card(service: GenerationService) -> dict[str, Any]:
    """OpenAI's model object, plus how this backbone drafts (``speculative``: {"draft": "lookup" |
    "model" | "mtp", "tokens": K}, absent when it does not speculate)."""
    card = {"id": service.model_id, "object": "model", "created": 0, "owned_by": "moeswarm",
            "max_model_len": service.context_length or None}
    k = service.engine.config.speculative
    if k:
        card["speculative"] = {"draft": getattr(service.engine.drafter, "kind", "lookup"), "tokens": k}
    return card


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[SERVICE])]})


async def _model(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    _check_model({"model": request.match_info["model"]}, service)
    return web.json_response(_model_card(service))


async def _healthz(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    stats = service.stats()
    return web.json_response({"status": "ok", "model": service.model_id, "running": stats.running, "waiting": stats.waiting})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes OpenAI's error JSON; the server keeps serving."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:  # aiohttp's own: unknown route (404), wrong method (405), body too large (413)
        if e.status < 400:
            raise
        default = not e.text or e.text.startswith(f"{e.status}:")  # aiohttp's bare "404: Not Found"
        message = f"{e.reason}: {request.method} {request.path}" if default else e.text
        return _error_response(e.status, message or e.reason, "invalid_request_error")
    except ServiceBusy as e:  # the batch and its queue are full: come back shortly
        response = _error_response(503, str(e), "service_unavailable", code="server_busy")
        response.headers["Retry-After"] = str(e.retry_after_s)
        return response
    except SwarmError as e:
        status, kind = _status_of(e)
        return _error_response(status, str(e), kind)
    except Exception:
        log.exception("internal error while serving %s %s", request.method, request.path)
        return _error_response(500, "internal server error", "server_error")


BIND_HOST = web.AppKey("bind_host", str)


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Only this machine's own clients, or holders of the API key, and never a browser page of
    another site: the Host must name the bound address (DNS rebinding sends the attacker's name),
    an Origin must too (cross-site requests carry theirs), and the key, when set, must match."""
    config, bound = request.app[CONFIG], request.app[BIND_HOST]
    allowed = allowed_hosts(bound, config.allowed_hosts)  # empty for a wildcard bind: the API key protects it
    host = request.headers.get("Host")
    if not host_allowed(host, allowed):
        raise ApiError(421, f"Host {str(host)[:100]!r} is not this server's address", code="bad_host")
    origin = request.headers.get("Origin")
    if origin is not None:
        authority = origin.split("://", 1)[1] if "://" in origin else ""
        if not authority or (allowed and _host_name(authority) not in allowed) or (not allowed and _host_name(
                authority) != _host_name(request.headers.get("Host", ""))):
            raise ApiError(403, f"cross-origin requests are refused (Origin {origin[:100]!r})", code="bad_origin")
    if config.api_key is not None and request.path not in ("/healthz", "/status", "/metrics"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
    return await handler(request)


def make_app(service: GenerationService, config: ApiConfig = ApiConfig(),
             status: Callable[[], dict[str, Any]] | None = None, bind_host: str = "127.0.0.1") -> web.Application:
    """The aiohttp application serving ``service`` with OpenAI's API (and, given ``status``, the
    daemon's ``/status`` and ``/metrics``: ``moeswarm.node.status``). ``bind_host`` is the address
    it listens on: Host and Origin headers must name it (or ``config.allowed_hosts``)."""
    if config.api_key is None and not is_loopback(bind_host) and not config.public:
        raise ConfigError(f"the HTTP API on {bind_host} is reachable from other machines: give it an API key "
                          "(--api-key), or bind it to 127.0.0.1")
    if config.api_key is not None and not config.api_key.strip():
        raise ConfigError("the API key is empty")
    app = web.Application(middlewares=[_errors, _guard, *config.middlewares], client_max_size=config.max_body_bytes)
    app[SERVICE] = service
    app[CONFIG] = config
    app[BIND_HOST] = bind_host
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/healthz", _healthz)
    if status is not None:
        from .status import add_status_routes

        add_status_routes(app, status)
    return app


async def serve_http(
    service: GenerationService, host: str, port: int, config: ApiConfig = ApiConfig(),
    status: Callable[[], dict[str, Any]] | None = None,
) -> tuple[web.AppRunner, int]:
    """Start serving on ``host:port`` (0 picks a free port) -> (runner, bound port).

    Handlers are cancelled when their client disconnects, which stops the generation.  Call
    ``await runner.cleanup()`` to stop.
    """
    from ..net.http_guard import start_runner

    runner = guarded_runner(make_app(service, config, status, host), config.limits, handler_cancellation=True)
    return runner, await start_runner(runner, host, port, "listen", config.limits)
