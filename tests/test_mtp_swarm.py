"""MTP drafts through a real swarm on loopback: expert node processes serve the MTP layer's experts
like any layer's; the backbone (in this process) drafts with it and verifies k + 1 positions per
step; the greedy tokens are the single process's plain greedy tokens."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from oracle import PROMPT
from oracle_mtp import build_mtp_checkpoint

from moeswarm._cli_util import DEFAULT_MTP_DRAFT
from moeswarm.daemon import SwarmConfig
from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import expert_nodes, start_daemon, stop_daemon
from moeswarm.model import SamplingParams, Tokenizer, generate, load_model
from moeswarm.model.speculative import MtpDraft, SpeculativeStats, generate_drafted
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.node.scheduler import EngineConfig


def test_mtp_drafts_through_the_swarm_give_the_greedy_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder, _, _ = build_mtp_checkpoint("mixtral", tmp_path / "mixtral-mtp")
    single = load_model(folder)
    n = single.config.num_layers
    params = SamplingParams(max_new_tokens=24)
    expected = list(generate(single, PROMPT, params))
    mtp_too = lambda i: ["--layers", f"0-{n}"]  # the decoder's layers and the MTP layer
    with expert_nodes(str(folder), ["0-3", "4-7"], extra_args=mtp_too) as daemons:
        config = BackboneConfig(SwarmConfig(str(folder), bootstrap=(daemons[0].info["multiaddrs"][0],),
                                            client_mode=True), coverage_timeout_s=60, draft="mtp",
                                engine=EngineConfig(speculative=3))

        async def main() -> tuple[list[int], SpeculativeStats, dict]:
            async with SwarmBackbone(config) as bb:
                assert bb.model is not None and bb.executor is not None
                assert bb.model.config.mtp_layers == 1 and not bb.model.weights.experts.get(n)
                stats = SpeculativeStats()
                tokens = await asyncio.to_thread(lambda: list(generate_drafted(  # type: ignore[arg-type]
                    bb.model, PROMPT, params, MtpDraft(bb.model), k=3, stats=stats)))
                return tokens, stats, dict(bb.executor.served_by)

        tokens, stats, served = asyncio.run(main())
    assert tokens == expected
    assert stats.drafted > 0 and stats.steps < len(tokens)
    mtp_layer = {pair for pairs in served.values() for pair in pairs if pair[0] == n}
    assert mtp_layer, "the MTP layer's experts were called in the swarm"
    assert len(served) == 2 and all(any(L == n for L, _ in pairs) for pairs in served.values())


def _post(url: str, body: dict) -> dict:  # type: ignore[type-arg]
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_backbone_draft_mtp_serves_the_greedy_tokens_of_the_trained_demo() -> None:
    """`moeswarm backbone --draft mtp` (a process) on the demo, whose trained MTP layer's experts the
    two node processes serve: its API says how it drafts, and greedy completions carry the single
    process's plain greedy token ids."""
    model = load_model(CHECKPOINT)
    assert model.config.mtp_layers == 1
    tok = Tokenizer.from_folder(CHECKPOINT, model.config.bos_token_id)
    prompts = ["And it came to pass", "The LORD is my shepherd"]
    params = SamplingParams(max_new_tokens=24, stop_token_ids=model.config.eos_token_ids)
    expected = [list(generate(model, tok.encode(p), params)) for p in prompts]
    n = model.config.num_layers
    with expert_nodes(str(CHECKPOINT), ["0-3", "4-7"], extra_args=lambda i: ["--layers", f"0-{n}"]) as nodes:
        backbone = start_daemon("backbone", ["backbone", "--model", str(CHECKPOINT), "--bootstrap",
                                             nodes[0].info["multiaddrs"][0], "--http", "127.0.0.1:0",
                                             "--draft", "mtp"])
        try:
            url = backbone.info["http"]
            with urllib.request.urlopen(url + "/v1/models", timeout=60) as response:
                card = json.loads(response.read())["data"][0]
            assert card["speculative"] == {"draft": "mtp", "tokens": DEFAULT_MTP_DRAFT}
            got = [_post(url + "/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0,
                                                   "return_token_ids": True})["choices"][0]["token_ids"]
                   for p in prompts]
            with urllib.request.urlopen(url + "/status", timeout=60) as response:
                status = json.loads(response.read())
        finally:
            stop_daemon(backbone)
    assert got == expected
    drafts = status["speculative"]
    assert drafts["draft"] == "mtp" and drafts["drafted"] >= drafts["accepted"] > 0, drafts
    assert any(n > 0 for n in status["dispatch"]["served_by"].values())
