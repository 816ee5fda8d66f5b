"""Continuous batching in GenerationService: each sequence's output is what it gets alone
(``generate()``), whoever else is in the batch; the cache pool bounds who runs; a full queue
gets 503 with Retry-After; speculative decoding keeps greedy output and the sampling distribution."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats
from sdk_support import MODEL_ID, LiveServer

from moeswarm.model import LocalExperts, Model, SamplingParams, Tokenizer, generate, load_model, load_weights
from moeswarm.model.generate import probs
from moeswarm.model.speculative import DraftModel
from moeswarm.node.scheduler import EngineConfig
from moeswarm.node.service import GenerationService, ServiceBusy, ServiceStats

REQUESTS: list[tuple[list[int], SamplingParams]] = [
    ([5, 6, 7], SamplingParams(max_new_tokens=14)),
    (list(range(40, 80)), SamplingParams(max_new_tokens=9)),  # a long prompt: prefilled in chunks
    ([9, 9, 9, 9], SamplingParams(max_new_tokens=12, temperature=0.9, seed=1)),
    ([300, 12], SamplingParams(max_new_tokens=16, temperature=0.7, top_k=20, seed=2)),
    (list(range(100, 133)), SamplingParams(max_new_tokens=11, temperature=1.3, top_p=0.8, seed=3)),
    ([17], SamplingParams(max_new_tokens=13)),
]


def alone(model: Model, prompt: list[int], params: SamplingParams) -> list[int]:
    return list(generate(model, prompt, params))


async def all_at_once(service: GenerationService) -> list[tuple[int, ...]]:
    done = await asyncio.gather(*(service.complete(p, sp, ignore_eos=True) for p, sp in REQUESTS))
    return [d.token_ids for d in done]


@pytest.mark.parametrize("max_batch, chunk, blocks", [
    (4, 8, None),  # the last two join as the first ones leave
    (6, 5, 14),  # a pool of 14 blocks of 4 tokens (the longest sequence needs 13): they preempt
], ids=["join-and-leave", "preempting"])
def test_concurrent_generations_equal_each_alone(engine: tuple[Model, Tokenizer], max_batch: int, chunk: int,
                                                 blocks: int | None) -> None:
    model, tok = engine
    from moeswarm.model.batch import CachePool, layer_specs

    block = CachePool(layer_specs(model.config), 1 << 20, block_tokens=4).block_bytes
    config = EngineConfig(max_batch=max_batch, prefill_chunk=chunk, block_tokens=4,
                          kv_cache_bytes=(blocks or 10_000) * block)
    service = GenerationService(model, tok, "m", engine=config)
    got = asyncio.run(all_at_once(service))
    for (prompt, params), tokens in zip(REQUESTS, got):
        assert list(tokens) == alone(model, prompt, params)
    assert service.stats() == ServiceStats(running=0, waiting=0)
    assert service.engine.pool.free == service.engine.pool.num_blocks
    if blocks is not None:
        assert service.engine.preemptions > 0
    else:
        assert service.engine.steps < sum(sp.max_new_tokens for _, sp in REQUESTS) / 2  # really batched


def test_stop_strings_are_per_sequence(engine: tuple[Model, Tokenizer]) -> None:
    model, tok = engine
    service = GenerationService(model, tok, "m")
    prompt = tok.encode("def main(args):")
    params = SamplingParams(max_new_tokens=30)

    async def main() -> list[Any]:
        full = await service.complete(prompt, params, ignore_eos=True)
        stop = full.text[10:13]
        cut, whole = await asyncio.gather(service.complete(prompt, params, [stop], ignore_eos=True),
                                          service.complete(prompt, params, ignore_eos=True))
        return [full, stop, cut, whole]

    full, stop, cut, whole = asyncio.run(main())
    assert cut.text == full.text[: full.text.find(stop)] and cut.finish_reason == "stop"
    assert whole.text == full.text and whole.finish_reason == "length"


# ---- the cache pool ------------------------------------------------------------------------------


def test_a_full_pool_makes_requests_wait_then_a_full_queue_refuses(engine: tuple[Model, Tokenizer]) -> None:
    """Two sequences hold the pool; the third waits for cache (not for a place: max_batch is 16),
    a fourth is refused; the third runs as soon as one of the two has finished."""
    model, tok = engine
    from moeswarm.model.batch import CachePool, layer_specs

    block = CachePool(layer_specs(model.config), 1 << 20, block_tokens=16).block_bytes
    config = EngineConfig(max_batch=16, kv_cache_bytes=5 * block, block_tokens=16, max_waiting=1)
    service = GenerationService(model, tok, "m", engine=config, queue_size=2)
    pool = service.engine.pool
    prompt = list(range(50, 80))  # 30 tokens: 2 blocks with its first generated ones

    async def main() -> None:
        async with contextlib.aclosing(service.stream(prompt, SamplingParams(max_new_tokens=100), ignore_eos=True)) as a, \
                contextlib.aclosing(service.stream(prompt, SamplingParams(max_new_tokens=6), ignore_eos=True)) as b:
            first_a, first_b = await anext(a), await anext(b)  # both admitted; unread, they sit out steps
            assert service.stats() == ServiceStats(running=2, waiting=0) and pool.free == 1
            c = asyncio.create_task(service.complete(prompt, SamplingParams(max_new_tokens=3), ignore_eos=True))
            for _ in range(100):  # bounded: until c is queued
                await asyncio.sleep(0.01)
                if service.stats().waiting:
                    break
            assert service.stats() == ServiceStats(running=2, waiting=1)  # waits for cache, not for a place
            with pytest.raises(ServiceBusy):
                service.stream(prompt, SamplingParams(max_new_tokens=3))
            assert not c.done()
            rest_b = [chunk async for chunk in b]  # b runs to its end and leaves
            assert len(first_b.token_ids) + sum(len(x.token_ids) for x in rest_b) == 6
            done = await asyncio.wait_for(c, 60)
            assert list(done.token_ids) == alone(model, prompt, SamplingParams(max_new_tokens=3))
            assert first_a.token_ids
        assert service.stats() == ServiceStats(running=0, waiting=0) and pool.free == pool.num_blocks

    asyncio.run(main())


class GatedExperts:
    """Local experts that hold every forward pass at its first MoE layer until ``go`` is set."""

    def __init__(self, inner: LocalExperts) -> None:
        self.inner, self.go, self.entered = inner, threading.Event(), threading.Event()

    def submit(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> Any:
        self.entered.set()
        if not self.go.wait(60):
            raise TimeoutError("the test never opened the gate")
        return self.inner.submit(layer, x, ids, weights)

    def end_step(self) -> None:
        self.inner.end_step()


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_http_answers_503_with_retry_after_when_the_queue_is_full(sdk_model_dir: Path, engine: tuple[Model, Tokenizer]) -> None:
    weights = load_weights(sdk_model_dir)
    experts = GatedExperts(LocalExperts(weights.experts, weights.config))
    service = GenerationService(Model(weights, experts=experts), engine[1], MODEL_ID,
                                engine=EngineConfig(max_batch=1, max_waiting=1))
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with LiveServer(service) as live:
        results: list[Any] = []
        first = threading.Thread(target=lambda: results.append(post(live.url, body)))
        first.start()
        assert experts.entered.wait(60)  # the first request is in the batch, held at its first layer
        second = threading.Thread(target=lambda: results.append(post(live.url, body)))
        second.start()
        for _ in range(500):  # bounded: until the second one is queued
            if service.stats().waiting == 1:
                break
            threading.Event().wait(0.01)
        assert service.stats() == ServiceStats(running=1, waiting=1)
        status, payload, headers = post(live.url, body)
        assert status == 503 and headers.get("Retry-After") == "1"
        assert payload["error"]["type"] == "service_unavailable" and "waiting" in payload["error"]["message"]
        experts.go.set()
        first.join(60)
        second.join(60)
        assert [r[0] for r in results] == [200, 200]
        assert results[0][1]["choices"][0]["text"] == results[1][1]["choices"][0]["text"]


# ---- speculative decoding ------------------------------------------------------------------------


def draft_model(oracle_checkpoints: Any) -> DraftModel:
    folder, _ = oracle_checkpoints.get("qwen2_moe", "packed")  # other weights, the same 512-token vocabulary
    return DraftModel(load_model(folder))


@pytest.mark.parametrize("kind", ["prompt lookup", "draft model"])
def test_greedy_speculative_equals_greedy(engine: tuple[Model, Tokenizer], oracle_checkpoints: Any, kind: str) -> None:
    model, tok = engine
    drafter = draft_model(oracle_checkpoints) if kind == "draft model" else None
    service = GenerationService(model, tok, "m", engine=EngineConfig(speculative=4), drafter=drafter)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9], list(range(200, 230)), [77]]
    params = SamplingParams(max_new_tokens=20)

    async def main() -> list[Any]:
        return await asyncio.gather(*(service.complete(p, params, ignore_eos=True) for p in prompts))

    done = asyncio.run(main())
    for prompt, d in zip(prompts, done):
        assert list(d.token_ids) == alone(model, prompt, params)
    assert service.engine.steps < sum(len(d.token_ids) for d in done)


class TargetDraft:
    """Deterministic drafts the model finds plausible: its second most likely token, twice."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def new_state(self) -> None:
        return None

    def propose(self, state: None, tokens: list[int], k: int, params: SamplingParams, rng: Any) -> tuple[list[int], None]:
        draft: list[int] = []
        for _ in range(k):
            logits = self.model.forward(np.asarray([list(tokens) + draft]), self.model.new_cache(), last_only=True)[0, -1]
            draft.append(int(np.argsort(-logits)[1]))
        return draft, None

    def release(self, state: None) -> None:
        pass


class FlatterDraft(DraftModel):
    """A draft model whose distribution differs from the model's on the same support: the model
    itself at temperature 5 (with top-k, as the request asks)."""

    def propose(self, state: Any, tokens: Any, k: int, params: SamplingParams, rng: Any) -> Any:
        return super().propose(state, tokens, k, SamplingParams(**{**params.__dict__, "temperature": 5.0}), rng)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plausible fixed drafts", "draft model"])
def test_speculative_sampling_keeps_the_models_distribution(engine: tuple[Model, Tokenizer], oracle_checkpoints: Any,
                                                            kind: str) -> None:
    """The first three tokens, top-3 sampling at temperature 1 (27 outcomes), 1500 seeded
    requests batched 64 at a time, against the model's exact joint (chi-square, TV).  Drafts
    are partly accepted, partly rejected (asserted), so both branches of the sampler count."""
    model, tok = engine
    prompt, N = [5, 6, 7, 8, 9], 1500
    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3)

    def p(ids: list[int]) -> np.ndarray:
        return probs(model.forward(np.asarray([ids]), model.new_cache(), last_only=True)[0, -1], params)

    exact: dict[tuple[int, ...], float] = {}
    p1 = p(prompt)
    for a in np.flatnonzero(p1):
        p2 = p(prompt + [int(a)])
        for b in np.flatnonzero(p2):
            p3 = p(prompt + [int(a), int(b)])
            for c in np.flatnonzero(p3):
                exact[(int(a), int(b), int(c))] = p1[a] * p2[b] * p3[c]
    drafter = FlatterDraft(model) if kind == "draft model" else TargetDraft(model)
    service = GenerationService(model, tok, "m", engine=EngineConfig(max_batch=64, speculative=2, max_waiting=N),
                                drafter=drafter)

    async def main() -> list[Any]:
        return await asyncio.gather(*(service.complete(prompt, SamplingParams(**{**params.__dict__, "seed": s}),
                                                       ignore_eos=True) for s in range(N)))

    outcomes = [tuple(d.token_ids) for d in asyncio.run(main())]
    assert set(outcomes) <= set(exact)
    keys = sorted(exact)
    observed = np.array([outcomes.count(k) for k in keys], float)
    expected = np.array([exact[k] for k in keys]) * N
    big = expected >= 5
    if not big.all():  # pool the rare outcomes into one cell
        observed = np.append(observed[big], observed[~big].sum())
        expected = np.append(expected[big], expected[~big].sum())
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < stats.chi2.ppf(0.999, len(expected) - 1), chi2
    assert 0.5 * np.abs(observed - expected).sum() / N < 0.06
    engine_ = service.engine
    assert 0.2 * engine_.drafted < engine_.accepted < 0.9 * engine_.drafted  # both paths taken, often


class BrokenDraft(TargetDraft):
    """A draft source that fails for one prompt: only that request fails."""

    def propose(self, state: None, tokens: list[int], k: int, params: SamplingParams, rng: Any) -> tuple[list[int], None]:
        if tokens[0] == 13:
            raise RuntimeError("the draft model broke")
        return super().propose(state, tokens, k, params, rng)


def test_a_failure_in_one_sequence_fails_only_that_request(engine: tuple[Model, Tokenizer]) -> None:
    model, tok = engine
    service = GenerationService(model, tok, "m", engine=EngineConfig(speculative=2), drafter=BrokenDraft(model))
    params = SamplingParams(max_new_tokens=6)

    async def main() -> list[Any]:
        return await asyncio.gather(service.complete([13, 14, 15], params, ignore_eos=True),
                                    service.complete([5, 6, 7], params, ignore_eos=True), return_exceptions=True)

    broken, fine = asyncio.run(main())
    assert isinstance(broken, RuntimeError) and "draft model broke" in str(broken)
    assert list(fine.token_ids) == alone(model, [5, 6, 7], params)
    assert service.stats() == ServiceStats(running=0, waiting=0)


def test_the_backbones_draft_model_must_share_the_vocabulary(oracle_checkpoints: Any, tmp_path: Path) -> None:
    from moeswarm.daemon import SwarmConfig
    from moeswarm.demo import CHECKPOINT
    from moeswarm.errors import CheckpointError, ConfigError
    from moeswarm.model import load_config
    from moeswarm.node.backbone import _drafter
    from moeswarm.node.config import BackboneConfig

    folder, _ = oracle_checkpoints.get("qwen2_moe", "packed")
    target = oracle_checkpoints.get("mixtral", "packed")[0]
    config = BackboneConfig(SwarmConfig(str(target)), engine=EngineConfig(speculative=3), draft_model=str(folder))
    assert isinstance(_drafter(config, load_config(target)), DraftModel)
    config = BackboneConfig(SwarmConfig(str(CHECKPOINT)), engine=EngineConfig(speculative=3), draft_model=str(folder))
    with pytest.raises(CheckpointError, match="has 512 tokens, the model.s 2048"):
        _drafter(config, load_config(CHECKPOINT))
    with pytest.raises(ConfigError, match="needs --speculative"):
        BackboneConfig(SwarmConfig(str(target)), draft_model=str(folder))
