"""Attack 5 of issue 12, poisoned outputs: a lying replica, run the way an attacker runs it.

The attacker copies the published demo checkpoint, keeps its config.json (so the model id is the
same) and perturbs every routed expert's weights, then volunteers with the stock CLI::

    moeswarm node --model ./liar-copy --experts 0-7 --bootstrap ...

beside two honest ``moeswarm node`` processes (experts 0-3 and 4-7), so every expert has one
honest holder and the liar.  A backbone with DEFAULT flags generates several requests: the liar
is excluded within the first request, every request's greedy tokens equal the single-process
engine's on the published checkpoint (the oracle), and signed evidence lands in the DHT.  A
second backbone, started afterwards, excludes the liar from that evidence alone: it never calls
the liar and makes no verification call to decide.

Fails on the code before this change (commit 9bb7cbe, "famA merged into the layering"): the
backbone writes the liar's outputs into the generation after a shape check, so the greedy tokens
differ from the engine's (run against that commit's tree: the first token comparison fails).
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from moeswarm.daemon import SwarmConfig
from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.model import SamplingParams, Tokenizer, generate, load_model
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.node.status import _gauges, render_report
from moeswarm.node.verify import VerifyConfig
from moeswarm.protocol import peer_id_from_str

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(autouse=True)
def _collect_this_tests_garbage():  # type: ignore[no-untyped-def]
    """A socket this test left unclosed is found here, in this test's teardown, and fails it
    (warnings are errors), rather than in whichever test the collector happens to run next."""
    yield
    gc.collect()


PROMPTS = ["And it came to pass", "The king said unto them", "In the beginning", "And the LORD spake"]
TOKENS = 8


def liar_checkpoint(folder: Path) -> Path:
    """The demo checkpoint with every routed expert's weights perturbed (noise of 0.3x each
    tensor's spread); every other file, config.json included, copied byte for byte."""
    folder.mkdir()
    for f in CHECKPOINT.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    tensors = load_file(str(CHECKPOINT / "model.safetensors"))
    rng = np.random.default_rng(12)
    for name, t in tensors.items():
        if ".experts." in name:
            noise = rng.standard_normal(t.shape).astype(np.float32) * float(t.astype(np.float32).std()) * 0.3
            tensors[name] = (t.astype(np.float32) + noise).astype(t.dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def greedy(model: Any, tokenizer: Tokenizer, prompt: str) -> list[int]:
    return list(generate(model, tokenizer.encode(prompt), SamplingParams(max_new_tokens=TOKENS)))


def rendered(report: dict[str, Any]) -> str:
    @click.command()
    def show() -> None:
        render_report(report)

    result = CliRunner().invoke(show, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return result.output


def config(boot: str) -> BackboneConfig:
    # default flags: only what joining the swarm needs
    return BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(boot,), client_mode=True), coverage_timeout_s=60)


async def first_backbone(boot: str, liar: bytes, expected: dict[str, list[int]]) -> dict[str, Any]:
    async with SwarmBackbone(config(boot)) as bb:
        assert bb.model is not None and bb.executor is not None
        tokenizer, model, excluded_after = bb.tokenizer(), bb.model, []
        for prompt in PROMPTS:
            tokens = await asyncio.to_thread(greedy, model, tokenizer, prompt)
            assert tokens == expected[prompt], f"request {prompt!r}: the liar's outputs reached the tokens"
            excluded_after.append(liar in bb.table.excluded)
        assert bb.verifier is not None
        deadline = time.monotonic() + 60  # the evidence is published in the background: bounded wait
        while not (bb.verifier.evidence_published or bb.verifier.evidence_errors) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return {"excluded_after": excluded_after, "status": bb.status(), "served_by": set(bb.executor.served_by),
                "peer": bb.identity.peer_id}


async def second_backbone(boot: str, expected: dict[str, list[int]]) -> dict[str, Any]:
    async with SwarmBackbone(config(boot)) as bb:
        assert bb.model is not None and bb.executor is not None
        decided = bb.status()  # before any request: what the DHT's evidence alone decided
        tokens = await asyncio.to_thread(greedy, bb.model, bb.tokenizer(), PROMPTS[0])
        return {"decided": decided, "tokens": tokens, "status": bb.status(), "served_by": set(bb.executor.served_by)}


def test_a_lying_replica_is_excluded_and_never_changes_an_answer(tmp_path: Path) -> None:
    reference = load_model(str(CHECKPOINT))
    tokenizer = Tokenizer.from_folder(str(CHECKPOINT), reference.config.bos_token_id)
    expected = {p: greedy(reference, tokenizer, p) for p in PROMPTS}
    liar_dir = liar_checkpoint(tmp_path / "liar-copy")
    lied = {p: greedy(load_model(str(liar_dir)), tokenizer, p) for p in PROMPTS}
    assert lied != expected, "the perturbed checkpoint must change answers, or the attack proves nothing"

    honest_a = start_daemon("honest a", ["node", "--model", str(CHECKPOINT), "--experts", "0-3"])
    boot = honest_a.info["multiaddrs"][0]
    started = [honest_a]
    try:
        started.append(start_daemon("honest b", ["node", "--model", str(CHECKPOINT), "--experts", "4-7",
                                                 "--bootstrap", boot]))
        started.append(start_daemon("liar", ["node", "--model", str(liar_dir), "--experts", "0-7", "--bootstrap", boot]))
        liar = peer_id_from_str(started[2].info["peer_id"])
        honest = {peer_id_from_str(d.info["peer_id"]) for d in started[:2]}
        first = asyncio.run(first_backbone(boot, liar, expected))
        second = asyncio.run(second_backbone(boot, expected))
    finally:
        for d in reversed(started):
            stop_daemon(d)

    v1, liar_s = first["status"]["verification"], started[2].info["peer_id"]
    # the liar was called, caught within the first request and excluded for good
    assert v1["holders"][liar_s]["calls"] >= 1 and v1["holders"][liar_s]["failed"] == 1
    assert first["excluded_after"] == [True] * len(PROMPTS)
    assert list(v1["excluded"]) == [liar_s] and "recomputation" in v1["excluded"][liar_s]
    assert v1["disagreements"] >= 1 and v1["checked"] > v1["disagreements"]
    assert first["served_by"] == honest  # no output of the liar was used
    assert v1["evidence_published"] == 1, v1["evidence_errors"]

    shown = rendered({**first["status"], "url": "in-process"})  # what `moeswarm node status` prints of it
    assert f"{v1['checked']} calls checked, {v1['disagreements']} disagreements" in shown
    assert f"excluded {liar_s}: outputs differ from this backbone's recomputation" in shown
    metrics = {g.name: g.samples[0].value for g in _gauges(first["status"])}
    assert metrics["moeswarm_excluded_holders"] == 1 and metrics["moeswarm_verified_calls"] == v1["checked"]

    v2 = second["decided"]["verification"]
    assert list(v2["excluded"]) == [liar_s]
    assert v2["excluded"][liar_s].startswith(f"evidence from {first['status']['peer_id']}")
    assert v2["evidence_accepted"] == 1 and v2["verification_calls"] == 0 and v2["checked"] == 0
    assert liar_s not in v2["holders"]  # not one call to the liar before deciding
    assert second["tokens"] == expected[PROMPTS[0]]
    assert liar_s not in second["status"]["verification"]["holders"] and second["served_by"] == honest


async def backbone_checking_by_holders(boot: str, expected: dict[str, list[int]]) -> dict[str, Any]:
    cfg = replace(config(boot), verify=VerifyConfig(method="holders"))  # as `--verify-by holders`
    async with SwarmBackbone(cfg) as bb:
        assert bb.model is not None and bb.executor is not None and bb.verifier is not None
        assert bb.verifier.weights is None  # no recomputation: only other holders can tell
        tokenizer, model = bb.tokenizer(), bb.model
        for prompt in PROMPTS[:2]:
            tokens = await asyncio.to_thread(greedy, model, tokenizer, prompt)
            assert tokens == expected[prompt], f"request {prompt!r}: the liar's outputs reached the tokens"
        deadline = time.monotonic() + 60
        while not (bb.verifier.evidence_published or bb.verifier.evidence_errors) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return {"status": bb.status(), "served_by": set(bb.executor.served_by)}


def test_without_weights_a_second_and_third_holder_outvote_the_liar(tmp_path: Path) -> None:
    """Every expert held by two honest nodes and the liar; the backbone checks by asking other
    holders only: a disagreement goes to a third holder and the majority wins."""
    reference = load_model(str(CHECKPOINT))
    tokenizer = Tokenizer.from_folder(str(CHECKPOINT), reference.config.bos_token_id)
    expected = {p: greedy(reference, tokenizer, p) for p in PROMPTS[:2]}
    liar_dir = liar_checkpoint(tmp_path / "liar-copy")
    honest_a = start_daemon("honest a", ["node", "--model", str(CHECKPOINT), "--experts", "0-7"])
    boot = honest_a.info["multiaddrs"][0]
    started = [honest_a]
    try:
        started.append(start_daemon("liar", ["node", "--model", str(liar_dir), "--experts", "0-7", "--bootstrap", boot]))
        started.append(start_daemon("honest b", ["node", "--model", str(CHECKPOINT), "--experts", "0-7",
                                                 "--bootstrap", boot]))
        run = asyncio.run(backbone_checking_by_holders(boot, expected))
    finally:
        for d in reversed(started):
            stop_daemon(d)
    liar_s = started[1].info["peer_id"]
    honest = {peer_id_from_str(d.info["peer_id"]) for d in (started[0], started[2])}
    v = run["status"]["verification"]
    assert v["method"] == "holders" and list(v["excluded"]) == [liar_s]
    assert v["excluded"][liar_s] == "outputs differ from two other holders'"
    assert v["disagreements"] >= 1 and v["verification_calls"] >= 2 * v["disagreements"]
    assert run["served_by"] <= honest and v["evidence_published"] == 1, v["evidence_errors"]
