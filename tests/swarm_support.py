"""A model family through a real swarm on loopback: expert node processes found through the
libp2p DHT, the backbone in this process.  The swarm must give the single-process logits (prefill
in chunks over the KV cache, then cached decode), the single process's greedy tokens, and every
node must have served."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from moeswarm.daemon import SwarmConfig
from moeswarm.demo.swarm import Daemon, expert_nodes
from moeswarm.model import Model, SamplingParams, generate
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.protocol import peer_id_from_str


def run_logits(model: Model, prompt: list[int], decode: list[int], chunk: int) -> np.ndarray:
    cache = model.new_cache()
    out = [model.forward(np.asarray([prompt[i : i + chunk]]), cache)[0] for i in range(0, len(prompt), chunk)]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in decode]
    return np.concatenate(out)


def assert_swarm_gives_single_process_tokens(single: Model, folder: Path, ref: Any, experts: list[str],
                                             chunk: int) -> None:
    """``single`` is ``folder`` loaded in this process; ``ref`` its transformers reference (prompt,
    decode and greedy tokens); ``experts`` one expert range per node process."""
    expected, single_tokens = single_process_run(single, ref, chunk)
    with expert_nodes(str(folder), experts) as daemons:
        assert_backbone_gives(expected, single_tokens, folder, ref, chunk, daemons[0], daemons)


def single_process_run(single: Model, ref: Any, chunk: int) -> tuple[np.ndarray, list[int]]:
    """``single``'s logits (``ref``'s prompt in ``chunk``-token pieces, then its decode tokens) and
    its greedy tokens, which must be transformers'."""
    expected = run_logits(single, ref.prompt_ids, ref.decode_tokens, chunk=chunk)
    single_tokens = list(generate(single, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens))))
    assert single_tokens == ref.greedy_tokens
    return expected, single_tokens


def assert_backbone_gives(expected: np.ndarray, single_tokens: list[int], folder: Path, ref: Any, chunk: int,
                          bootstrap: Daemon, nodes: list[Daemon]) -> set[bytes]:
    """A backbone of ``folder`` in this process, joining the swarm through ``bootstrap`` (already
    running), gives ``single_process_run``'s logits and tokens, and exactly ``nodes`` served it;
    returns the peer ids that served it."""
    config = BackboneConfig(SwarmConfig(str(folder), bootstrap=(bootstrap.info["multiaddrs"][0],),
                                        client_mode=True), coverage_timeout_s=60)

    async def main() -> tuple[np.ndarray, list[int], set[bytes]]:
        async with SwarmBackbone(config) as bb:
            assert bb.model is not None and bb.executor is not None
            assert not any(bb.model.weights.experts.get(L) for L in range(bb.model.config.num_layers))
            logits = await asyncio.to_thread(run_logits, bb.model, ref.prompt_ids, ref.decode_tokens, chunk)
            params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))
            tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
            return logits, tokens, set(bb.executor.served_by)

    logits, tokens, used = asyncio.run(main())
    assert np.abs(logits - expected).max() <= 1e-5
    assert tokens == single_tokens
    assert used == {peer_id_from_str(d.info["peer_id"]) for d in nodes}
    return used
