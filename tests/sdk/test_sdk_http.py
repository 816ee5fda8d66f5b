"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client and by raw HTTP."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from moeswarm.errors import Unreachable
from moeswarm.model import LocalExperts, Model, SamplingParams, Tokenizer, generate, load_weights
from moeswarm.node.http_api import ApiConfig
from moeswarm.node.service import GenerationService

from sdk_support import MODEL_ID, LiveServer

MESSAGES: list[Any] = [{"role": "user", "content": "Write a function"}]


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def greedy(model: Model, prompt: list[int], n: int, **kw: Any) -> list[int]:
    return list(generate(model, prompt, SamplingParams(max_new_tokens=n, stop_token_ids=model.config.eos_token_ids, **kw)))


def raw(url: str, method: str, path: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, Any]:
    """One HTTP request with the standard library -> (status, parsed JSON body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_models_are_listed(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID


def test_greedy_completion_equals_generate(client: openai.OpenAI, engine: tuple[Model, Tokenizer]) -> None:
    model, tok = engine
    prompt = tok.encode("def main(args):")
    ref = greedy(model, prompt, 12)
    out = client.completions.create(model=MODEL_ID, prompt="def main(args):", max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == ref
    assert choice.text == tok.decode(prompt + ref)[len(tok.decode(prompt)) :]
    assert choice.finish_reason == ("stop" if ref[-1] in model.config.eos_token_ids else "length")
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(ref))


def test_prompt_as_token_ids(client: openai.OpenAI, engine: tuple[Model, Tokenizer]) -> None:
    prompt = [505, 470, 216, 421, 376, 498, 44, 308]
    out = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra is not None and out.choices[0].model_extra["token_ids"] == greedy(engine[0], prompt, 8)


def test_streamed_chat_adds_up_to_the_non_streamed_one(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL_ID, messages=MESSAGES, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kw)
    with client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}) as stream:
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_prompt_is_the_rendered_template(client: openai.OpenAI, engine: tuple[Model, Tokenizer], server: LiveServer) -> None:
    model, _ = engine
    prompt = server.service.encode_chat(MESSAGES)
    out = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=10, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)
    assert out.choices[0].model_extra is not None and out.choices[0].model_extra["token_ids"] == greedy(model, prompt, 10)


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, engine: tuple[Model, Tokenizer]) -> None:
    model, tok = engine

    def sample(seed: int) -> list[int]:
        out = client.completions.create(model=MODEL_ID, prompt="import os", max_tokens=16, temperature=1.0, seed=seed,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        return out.choices[0].model_extra["token_ids"]  # type: ignore[index]

    assert sample(7) == sample(7) == list(generate(model, tok.encode("import os"), SamplingParams(16, temperature=1.0, seed=7)))
    assert sample(8) != sample(7)


def test_max_tokens_and_finish_reason(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_ID, prompt="x = 1", max_tokens=5, extra_body={"ignore_eos": True})
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("length", 5)  # type: ignore[union-attr]
    out = client.completions.create(model=MODEL_ID, prompt="x = 1", max_tokens=0)
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("", "length")


def test_stop_strings_cut_streamed_and_whole_text(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL_ID, prompt="def main(args):", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[12:15]
    expected = full[: full.find(stop)]
    cut = client.completions.create(**kw, stop=[stop, "\u2603never"]).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop")
    with client.completions.create(**kw, stop=stop, stream=True) as stream:
        chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_healthz_and_wrong_methods(server: LiveServer) -> None:
    assert raw(server.url, "GET", "/healthz") == (200, {"status": "ok", "model": MODEL_ID, "running": 0, "waiting": 0})
    status, payload = raw(server.url, "GET", "/v1/completions")
    assert status == 405 and "GET /v1/completions" in payload["error"]["message"]


BAD_REQUESTS = [
    pytest.param("/v1/completions", b'{"prompt": "hi", ', 400, None, id="malformed-json"),
    pytest.param("/v1/completions", b'["prompt"]', 400, None, id="not-an-object"),
    pytest.param("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}', 400, "max_tokens", id="negative-max-tokens"),
    pytest.param("/v1/completions", b'{"prompt": "hi", "max_tokens": 2.5}', 400, "max_tokens", id="fractional-max-tokens"),
    pytest.param("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature", id="string-temperature"),
    pytest.param("/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400, "top_p", id="zero-top-p"),
    pytest.param("/v1/completions", b'{"prompt": "hi", "seed": true}', 400, "seed", id="bool-seed"),
    pytest.param("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream", id="string-stream"),
    pytest.param("/v1/completions", b'{"prompt": "hi", "stop": [1]}', 400, "stop", id="int-stop"),
    pytest.param("/v1/completions", b'{"prompt": "hi", "n": 2}', 400, "n", id="n-2"),
    pytest.param("/v1/completions", b'{"prompt": 5}', 400, "prompt", id="int-prompt"),
    pytest.param("/v1/completions", b'{"prompt": ""}', 400, "prompt", id="empty-prompt"),
    pytest.param("/v1/completions", b'{"prompt": [1, 512]}', 400, "prompt", id="id-out-of-vocab"),
    pytest.param("/v1/completions", json.dumps({"prompt": [5] * 300}).encode(), 400, "prompt", id="prompt-too-long"),
    pytest.param("/v1/completions", b'{"prompt": "hi", "model": "gpt-4"}', 404, "model", id="unknown-model"),
    pytest.param("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages", id="string-messages"),
    pytest.param("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "messages[0]", id="no-role"),
    pytest.param("/v1/chat/completions", b'{"messages": [{"role": "tool", "content": "x"}]}', 400, "messages", id="template-refuses"),
    pytest.param("/v1/completions", b'{"prompt": "' + b"x" * 70_000 + b'"}', 413, None, id="oversized-body"),
    pytest.param("/v1/nothing", b"{}", 404, None, id="unknown-route"),
]


@pytest.fixture(scope="module")
def small_body_server(engine: tuple[Model, Tokenizer]) -> Iterator[LiveServer]:
    with LiveServer(GenerationService(*engine, MODEL_ID), ApiConfig(max_body_bytes=64 * 1024)) as live:
        yield live


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    small_body_server: LiveServer, path: str, body: bytes, status: int, param: str | None
) -> None:
    got, payload = raw(small_body_server.url, "POST", path, body)
    assert got == status, payload
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["message"] and payload["error"]["param"] == param
    ok, answer = raw(small_body_server.url, "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}')
    assert ok == 200 and answer["usage"]["completion_tokens"] == 1


def test_openai_client_raises_its_own_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    assert client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=1).usage.completion_tokens == 1  # type: ignore[union-attr]


class SlowExperts:
    """Routed experts behind a fixed latency, like experts on remote peers (not a synchronisation sleep)."""

    def __init__(self, inner: LocalExperts, seconds: float) -> None:
        self.inner, self.seconds, self.calls = inner, seconds, 0
        self._pause = threading.Event()

    def submit(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> Any:
        self.calls += layer == 0
        self._pause.wait(self.seconds)
        return self.inner.submit(layer, x, ids, weights)

    def end_step(self) -> None:
        self.inner.end_step()


def test_a_client_that_disconnects_mid_stream_frees_the_slot(sdk_model_dir: Path, engine: tuple[Model, Tokenizer]) -> None:
    weights = load_weights(sdk_model_dir)
    experts = SlowExperts(LocalExperts(weights.experts, weights.config), 0.005)
    service = GenerationService(Model(weights, experts=experts), engine[1], MODEL_ID, max_concurrent=1)
    with LiveServer(service) as live:
        host, port = live.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"prompt": [5, 6, 7], "max_tokens": 250, "stream": True, "ignore_eos": True, "return_token_ids": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: {")
        conn.close()  # hang up mid-stream
        # one slot: this can only be served once the abandoned generation has given its slot back
        status, answer = raw(live.url, "POST", "/v1/completions", b'{"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": true}', timeout=20)
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        assert experts.calls < 100 + 2, "the abandoned generation kept running"
        assert raw(live.url, "GET", "/healthz")[1]["running"] == 0


class FailingExperts:
    """Routed experts that fail (like an unreachable peer) from the forward pass number ``fail_at`` on."""

    def __init__(self, inner: LocalExperts) -> None:
        self.inner, self.calls, self.fail_at = inner, 0, 1
        self.error: Exception = Unreachable("the expert's peer did not answer")

    def submit(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> Any:
        self.calls += layer == 0
        if self.calls >= self.fail_at:
            raise self.error
        return self.inner.submit(layer, x, ids, weights)

    def end_step(self) -> None:
        self.inner.end_step()


@pytest.fixture(scope="module")
def failing(sdk_model_dir: Path, engine: tuple[Model, Tokenizer]) -> Iterator[tuple[LiveServer, FailingExperts]]:
    weights = load_weights(sdk_model_dir)
    experts = FailingExperts(LocalExperts(weights.experts, weights.config))
    with LiveServer(GenerationService(Model(weights, experts=experts), engine[1], MODEL_ID)) as live:
        yield live, experts


@pytest.mark.parametrize("error, status, kind", [(Unreachable("peer gone"), 503, "service_unavailable"),
                                                 (RuntimeError("a bug"), 500, "server_error")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_before_any_output_gets_an_error_status(
    failing: tuple[LiveServer, FailingExperts], error: Exception, status: int, kind: str, stream: bool
) -> None:
    live, experts = failing
    experts.calls, experts.fail_at, experts.error = 0, 1, error
    body = json.dumps({"prompt": [5, 6], "max_tokens": 5, "stream": stream}).encode()
    got, payload = raw(live.url, "POST", "/v1/completions", body)
    assert (got, payload["error"]["type"]) == (status, kind)
    assert "a bug" not in payload["error"]["message"]  # our own bugs are logged, not shown
    assert raw(live.url, "GET", "/healthz")[1]["running"] == 0


def test_a_failure_mid_stream_is_reported_in_band(failing: tuple[LiveServer, FailingExperts]) -> None:
    live, experts = failing
    experts.calls, experts.fail_at, experts.error = 0, 4, Unreachable("peer gone")
    with openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        stream = client.completions.create(model=MODEL_ID, prompt=[5, 6], max_tokens=20, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        ids: list[int] = []
        with pytest.raises(openai.APIError, match="peer gone"), stream:
            for chunk in stream:
                ids += chunk.choices[0].model_extra["token_ids"]  # type: ignore[index]
        assert len(ids) == 3  # three forward passes worked
        experts.fail_at = 10**9
        assert client.completions.create(model=MODEL_ID, prompt=[5, 6], max_tokens=2).choices[0].finish_reason
