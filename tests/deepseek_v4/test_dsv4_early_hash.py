"""Early dispatch of DeepSeek-V4's hash-routed layers (``DispatchConfig.early_hash``): their experts
follow from the token ids, so the forward pass hands them to the executor before any layer runs
(``Model._announce_hashed``) and the swarm's executor sends the holders of each such layer after
the first MoE layer a warm-up call (zeros) just behind the previous layer's requests, then the
layer's own call to the same holders.

Behaviour only (what it saves is measured in benchmarks/hash_dispatch.py): the hint names exactly
the experts the layer then routes to; through a real swarm (three node processes) early dispatch
gives the single-process logits and transformers' greedy tokens, every call of a warmed layer goes to
holders warmed for that layer with those experts, and every warm-up's receipt is settled like any
other call's (none refused, none left waiting); without ``early_hash`` nothing is warmed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from swarm_support import run_logits

from moeswarm.daemon import SwarmConfig
from moeswarm.demo.swarm import expert_nodes
from moeswarm.model import SamplingParams, generate, load_model
from moeswarm.model.transformer import LocalExperts
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.node.dispatch import DispatchConfig


class _HintedLocal(LocalExperts):
    """The in-process executor, recording what ``hint`` was told and what each layer then routed."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.hints: list[dict[int, np.ndarray]] = []
        self.routed: list[tuple[int, np.ndarray]] = []

    def hint(self, routes: dict[int, np.ndarray]) -> None:
        self.hints.append({L: ids.copy() for L, ids in routes.items()})

    def submit(self, layer, x, ids, weights):  # type: ignore[no-untyped-def]
        self.routed.append((layer, ids.copy()))
        return super().submit(layer, x, ids, weights)


def test_the_hint_names_the_experts_each_hash_layer_then_routes_to(dsv4_checkpoints) -> None:
    folder, ref = dsv4_checkpoints.get("per_expert")
    model = load_model(folder)
    spy = _HintedLocal(model.weights.experts, model.config)
    model.experts = spy
    plain = load_model(folder)
    cache, plain_cache = model.new_cache(), plain.new_cache()
    for chunk in (ref.prompt_ids[:5], ref.prompt_ids[5:], [ref.decode_tokens[0]]):
        spy.routed.clear()
        logits = model.forward(np.asarray([chunk]), cache)
        np.testing.assert_array_equal(logits, plain.forward(np.asarray([chunk]), plain_cache))
        hint = spy.hints[-1]
        assert sorted(hint) == [0, 1]  # the hash_moe layers, and only they
        routed = dict(spy.routed)
        for L, ids in hint.items():
            assert ids.shape == (len(chunk), model.config.top_k)
            np.testing.assert_array_equal(ids, routed[L])
    assert len(spy.hints) == 3


@pytest.mark.slow
def test_early_dispatch_through_a_swarm_gives_single_process_tokens(dsv4_checkpoints) -> None:
    folder, ref = dsv4_checkpoints.get("per_expert")
    single = load_model(folder)
    expected = run_logits(single, ref.prompt_ids, ref.decode_tokens, chunk=5)
    params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))

    with expert_nodes(str(folder), ["0-2", "3-5", "6-7"]) as daemons:
        swarm = SwarmConfig(str(folder), bootstrap=(daemons[0].info["multiaddrs"][0],), client_mode=True)

        async def run(early: bool) -> tuple[np.ndarray, list[int], list, list, object]:  # type: ignore[type-arg]
            config = BackboneConfig(swarm, coverage_timeout_s=60, dispatch=DispatchConfig(early_hash=early))
            async with SwarmBackbone(config) as bb:
                ex = bb.executor
                assert bb.model is not None and ex is not None
                calls, warmups = [], []
                call, warm_call = ex._call, ex._warm_call

                async def record_call(peer, layer, x, ids, experts, y, sent=None):  # type: ignore[no-untyped-def]
                    calls.append((peer, layer, tuple(experts)))
                    await call(peer, layer, x, ids, experts, y, sent)

                async def record_warm_call(peer, layer, experts, delay):  # type: ignore[no-untyped-def]
                    warmups.append((peer, layer, tuple(experts)))
                    await warm_call(peer, layer, experts, delay)

                ex._call, ex._warm_call = record_call, record_warm_call  # type: ignore[method-assign]
                logits = await asyncio.to_thread(run_logits, bb.model, ref.prompt_ids, ref.decode_tokens, 5)
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
                await ex.flush_receipts()
                settled = ex.warmups, ex.bad_receipts, len(ex._awaiting) + len(ex._unchecked)
                return logits, tokens, calls, warmups, settled

        logits, tokens, calls, warmups, (answered, bad, waiting) = asyncio.run(run(True))
        off_logits, off_tokens, _, off_warmups, (off_answered, _, _) = asyncio.run(run(False))

    assert np.abs(logits - expected).max() <= 1e-5
    assert tokens == ref.greedy_tokens
    assert np.abs(off_logits - expected).max() <= 1e-5 and off_tokens == ref.greedy_tokens
    passes = len(range(0, len(ref.prompt_ids), 5)) + len(ref.decode_tokens)  # run_logits's alone
    warmed_calls = [c for c in calls if c[1] == 1]
    # layer 1 is warmed behind layer 0's requests; layer 0, the first MoE layer, is not warmed
    assert {c[1] for c in warmups} == {1} and len(warmups) >= passes
    assert answered == len(warmups)  # every warm-up was answered ...
    assert bad == 0 and waiting == 0  # ... and its receipt checked and countersigned, none left waiting
    # each layer-1 call went to a holder warmed for that layer with exactly those experts
    assert warmed_calls and all(c in warmups for c in warmed_calls)
    assert off_warmups == [] and off_answered == 0
