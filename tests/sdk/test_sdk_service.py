"""GenerationService: the async face of generate(), checked against generate() itself; chat templates
checked against transformers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeswarm.errors import ConfigError
from moeswarm.model import Model, SamplingParams, Tokenizer, generate, load_model
from moeswarm.node.service import ChatTemplate, Chunk, GenerationService, ServiceStats, _StopFilter, render_chat

PROMPT_TEXT = "def main(args):"


def reference(model: Model, prompt: list[int], n: int, **kw: object) -> list[int]:
    return list(generate(model, prompt, SamplingParams(max_new_tokens=n, stop_token_ids=model.config.eos_token_ids, **kw)))  # type: ignore[arg-type]


def continuation(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    return tok.decode(prompt + ids)[len(tok.decode(prompt)) :]


def test_complete_equals_generate(engine: tuple[Model, Tokenizer]) -> None:
    model, tok = engine
    prompt = tok.encode(PROMPT_TEXT)
    ref = reference(model, prompt, 12)
    service = GenerationService(model, tok, "m")
    done = asyncio.run(service.complete(prompt, SamplingParams(max_new_tokens=12)))
    assert done.token_ids == tuple(ref)
    assert done.text == continuation(tok, prompt, ref)
    assert done.finish_reason == ("stop" if ref[-1] in model.config.eos_token_ids else "length")
    assert (done.prompt_tokens, done.completion_tokens) == (len(prompt), len(ref))


def test_stream_chunks_add_up_to_the_completion(engine: tuple[Model, Tokenizer]) -> None:
    model, tok = engine
    prompt = tok.encode(PROMPT_TEXT)
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=3)

    async def main() -> tuple[list[Chunk], object]:
        service = GenerationService(model, tok, "m")
        chunks = [c async for c in service.stream(prompt, params)]
        return chunks, await service.complete(prompt, params)

    chunks, done = asyncio.run(main())
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1) and chunks[-1].finish_reason
    assert "".join(c.text for c in chunks) == done.text  # type: ignore[attr-defined]
    assert tuple(t for c in chunks for t in c.token_ids) == done.token_ids == tuple(reference(model, prompt, 20, temperature=0.8, seed=3))  # type: ignore[attr-defined]


@pytest.mark.parametrize("prompt, message", [([], "empty"), ([5] * 257, "257 tokens"), ([5, 512], r"\[0, 512\)"), ([-1], r"\[0, 512\)")])
def test_bad_prompts_are_config_errors_at_call_time(engine: tuple[Model, Tokenizer], prompt: list[int], message: str) -> None:
    service = GenerationService(*engine, "m")
    with pytest.raises(ConfigError, match=message):
        service.stream(prompt, SamplingParams())  # before anything is awaited


def test_max_new_tokens_is_clamped_to_the_context(engine: tuple[Model, Tokenizer]) -> None:
    service = GenerationService(*engine, "m")
    done = asyncio.run(service.complete([7] * 250, SamplingParams(max_new_tokens=100), ignore_eos=True))
    assert (done.completion_tokens, done.finish_reason) == (6, "length")  # 250 + 6 == max_position_embeddings


def test_stop_string_cuts_the_text_and_the_generation(engine: tuple[Model, Tokenizer]) -> None:
    model, tok = engine
    prompt = tok.encode(PROMPT_TEXT)
    service = GenerationService(model, tok, "m")
    full = asyncio.run(service.complete(prompt, SamplingParams(max_new_tokens=30), ignore_eos=True))
    stop = full.text[12:15]
    cut = asyncio.run(service.complete(prompt, SamplingParams(max_new_tokens=30), [stop, "\u2603never"], ignore_eos=True))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)


def test_stop_filter_holds_back_what_may_start_a_stop() -> None:
    f = _StopFilter(["</end>"])
    assert f.push("abc</e") == ("abc", False)
    assert f.push("nd> more") == ("", True)
    f = _StopFilter(["</end>"])
    f.push("abc</e")
    assert f.push("x") == ("</ex", False) and f.flush() == ""
    assert _StopFilter(["a", "baa"]).push("bbbbbba") == ("bbbbbb", True)  # the first completed stop wins


@settings(max_examples=200, deadline=None)
@given(st.text("abc", max_size=30), st.lists(st.text("abc", min_size=1, max_size=4), max_size=3), st.data())
def test_stop_filter_cuts_before_the_first_completed_stop(text: str, stops: list[str], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stop_filter, out, hit = _StopFilter(stops), [], False
    for piece in pieces:
        emitted, hit = stop_filter.push(piece)
        out.append(emitted)
        if hit:
            break
    if not hit:
        out.append(stop_filter.flush())
    # streaming semantics: the first stop string to be complete wins (among those completed by
    # the same piece, the one that starts first)
    expected, stopped = text, False
    for end in [*cuts, len(text)]:
        starts = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if starts:
            expected, stopped = text[: min(starts)], True
            break
    assert "".join(out) == expected
    assert hit == stopped


def counting_model(folder: Path) -> tuple[Model, list[int]]:
    """A fresh model whose forward passes are counted (one per call of the layer-0 router)."""
    model, calls = load_model(folder), [0]

    def observe(layer: int, ids: np.ndarray) -> None:
        calls[0] += layer == 0

    model.observers.append(observe)
    return model, calls


def test_a_cancelled_consumer_stops_the_worker_and_frees_the_slot(sdk_model_dir: Path, engine: tuple[Model, Tokenizer]) -> None:
    model, forwards = counting_model(sdk_model_dir)
    service = GenerationService(model, engine[1], "m", max_concurrent=1, queue_size=2)

    async def main() -> None:
        got_one, never = asyncio.Event(), asyncio.Event()

        async def consume() -> None:
            async with contextlib.aclosing(service.stream([5, 6, 7], SamplingParams(max_new_tokens=200), ignore_eos=True)) as chunks:
                async for _ in chunks:
                    got_one.set()
                    await never.wait()

        task = asyncio.create_task(consume())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert service.stats() == ServiceStats(running=0, waiting=0)
        # one chunk read + a full queue of 2 + one the worker held when it was stopped
        assert forwards[0] <= 1 + 2 + 1
        after = forwards[0]
        done = await asyncio.wait_for(service.complete([5, 6, 7], SamplingParams(max_new_tokens=3), ignore_eos=True), 60)
        assert done.completion_tokens == 3 and forwards[0] == after + 3

    asyncio.run(main())


def test_generations_beyond_the_limit_wait_for_a_slot(engine: tuple[Model, Tokenizer]) -> None:
    service = GenerationService(*engine, "m", max_concurrent=1)

    async def main() -> None:
        async with contextlib.aclosing(service.stream([5, 6], SamplingParams(max_new_tokens=50), ignore_eos=True)) as first:
            await anext(first)
            second = asyncio.create_task(service.complete([5, 6], SamplingParams(max_new_tokens=2)))
            await asyncio.sleep(0)  # one scheduling turn: the second request reaches the semaphore
            assert service.stats() == ServiceStats(running=1, waiting=1)
            assert not second.done()
        assert (await asyncio.wait_for(second, 60)).completion_tokens == 2
        assert service.stats() == ServiceStats(running=0, waiting=0)

    asyncio.run(main())


# ---- chat ------------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


def test_fallback_chat_template(tmp_path: Path) -> None:
    assert render_chat(MESSAGES, tmp_path) == "system: Be brief.\nuser: Say hi\nassistant:"


def test_chat_template_matches_transformers(sdk_model_dir: Path, engine: tuple[Model, Tokenizer]) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(sdk_model_dir))
    text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert render_chat(MESSAGES, sdk_model_dir) == text
    service = GenerationService(*engine, "m")
    assert service.encode_chat(MESSAGES) == ids
    assert ids[0] == 1 and ids.count(1) == 1  # one BOS, written by the template


def test_chat_template_errors_are_config_errors(sdk_model_dir: Path, tmp_path: Path) -> None:
    template = ChatTemplate.from_folder(sdk_model_dir)
    with pytest.raises(ConfigError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ConfigError, match="does not compile"):
        render_chat(MESSAGES, tmp_path)
