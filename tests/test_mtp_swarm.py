"""MTP drafts through a real swarm on loopback: expert node processes serve the MTP layer's experts
like any layer's; the backbone (in this process) drafts with it and verifies k + 1 positions per
step; the greedy tokens are the single process's plain greedy tokens."""

from __future__ import annotations

import asyncio

from moeswarm.daemon import SwarmConfig
from moeswarm.demo.swarm import expert_nodes
from moeswarm.model import SamplingParams, generate, load_model
from moeswarm.model.speculative import MtpDraft, SpeculativeStats, generate_drafted
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.node.scheduler import EngineConfig
from oracle import PROMPT
from oracle_mtp import build_mtp_checkpoint


def test_mtp_drafts_through_the_swarm_give_the_greedy_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder, _, _ = build_mtp_checkpoint("mixtral", tmp_path / "mixtral-mtp")
    single = load_model(folder)
    n = single.config.num_layers
    params = SamplingParams(max_new_tokens=24)
    expected = list(generate(single, PROMPT, params))
    with expert_nodes(str(folder), ["0-3", "4-7"]) as daemons:
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
