"""Issue 32, point 10: patient liars, run the way an attacker runs them.

Three liars, each its own process: the stock ``moeswarm node`` on the published demo checkpoint,
all experts, with a backend that adds noise of twice the outputs' spread to the calls it lies on
(``attackers/patient_liar.py``): one honest for each client's first 8 calls (the default
``--probation-calls``) and lying on every call after; one lying on 1 call in 50; one lying only
when it guesses a call is unchecked (never in probation, never on a one-row request). Each liar is
the only holder of two experts (2-3, 4-5, 6-7), so each gets every call for them; an honest
``moeswarm node`` holds 0-1. A backbone with DEFAULT verification (and ``--local-fallback`` for
the experts of an excluded liar) generates 12 greedy tokens for each of 4 prompts; they are
compared with the single-process engine's (the oracle).

On main 52de96c a trusted holder's calls were checked at 5%: this test printed ``AssertionError:
the liars changed 19 of 48 tokens (lies {'liar wait': 22, 'liar rate': 1, 'liar unchecked': 8},
calls {'liar wait': 29, 'liar rate': 99, 'liar unchecked': 117})``: the lies went through until a
5% draw caught one (only the "wait" liar was excluded, after 22 lies).
Now every call of a trusted holder is spot-checked (one random row of each expert recomputed,
chosen after the response arrived): every liar that lied is excluded at its first lie, and no
token differs from the oracle's.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import Daemon, _wait_ready, start_daemon, stop_daemon
from moeswarm.model import SamplingParams, Tokenizer, generate, load_model
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

LIAR = Path(__file__).resolve().parent / "attackers" / "patient_liar.py"
PROMPTS = ["And it came to pass", "The king said unto them", "In the beginning", "And the LORD spake"]
TOKENS = 12
POLICIES = (("wait", 8, "2-3"), ("rate", 50, "4-5"), ("unchecked", 8, "6-7"))


@pytest.fixture(autouse=True)
def _collect_this_tests_garbage():  # type: ignore[no-untyped-def]
    """A socket this test left unclosed is found here, in this test's teardown, and fails it."""
    yield
    gc.collect()


def start_liar(policy: str, n: int, boot: str, experts: str = "0-7") -> Daemon:
    log = tempfile.NamedTemporaryFile("w+", prefix=f"moeswarm-liar-{policy}-", suffix=".log")
    process = subprocess.Popen([sys.executable, str(LIAR), policy, str(n), "--", "--model", str(CHECKPOINT),
                                "--experts", experts, "--bootstrap", boot], stdout=subprocess.PIPE, stderr=log,
                               text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    lines: list[str] = []
    return Daemon(f"liar {policy}", process, _wait_ready(f"liar {policy}", process, 120, log, lines), log, lines)


def lies_told(daemon: Daemon) -> int:
    daemon.log.flush()
    return sum(line.startswith("LIED ") for line in Path(daemon.log.name).read_text(errors="replace").splitlines())


def greedy(model: Any, tokenizer: Tokenizer, prompt: str) -> list[int]:
    return list(generate(model, tokenizer.encode(prompt), SamplingParams(max_new_tokens=TOKENS)))


async def backbone_run(boot: str) -> dict[str, Any]:
    config = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(boot,), client_mode=True), coverage_timeout_s=60,
                            local_fallback=True)
    async with SwarmBackbone(config) as bb:  # default verification, as a user gets it
        assert bb.model is not None
        tokenizer, tokens = bb.tokenizer(), {}
        for prompt in PROMPTS:
            tokens[prompt] = await asyncio.to_thread(greedy, bb.model, tokenizer, prompt)
        return {"tokens": tokens, "status": bb.status()}


def test_patient_liars_are_caught_at_their_first_lie_and_change_no_token() -> None:
    reference = load_model(str(CHECKPOINT))
    tokenizer = Tokenizer.from_folder(str(CHECKPOINT), reference.config.bos_token_id)
    expected = {p: greedy(reference, tokenizer, p) for p in PROMPTS}
    honest = start_daemon("honest", ["node", "--model", str(CHECKPOINT), "--experts", "0-1"])
    boot = honest.info["multiaddrs"][0]
    liars: list[Daemon] = []
    try:
        for policy, n, experts in POLICIES:
            liars.append(start_liar(policy, n, boot, experts))
        run = asyncio.run(backbone_run(boot))
        told = {d.name: lies_told(d) for d in liars}
    finally:
        for d in [*reversed(liars), honest]:
            stop_daemon(d)

    v = run["status"]["verification"]
    changed = sum(a != b for p in PROMPTS for a, b in zip(run["tokens"][p], expected[p]))
    calls = {d.name: v["holders"].get(d.info["peer_id"], {}).get("calls", 0) for d in liars}
    print(f"\nliars' lies {told}, calls {calls}; excluded {list(v['excluded'])}; tokens changed {changed}")
    assert told["liar wait"] >= 1 and told["liar rate"] >= 1 and told["liar unchecked"] >= 1, (told, calls)  # it ran
    assert changed == 0, f"the liars changed {changed} of {len(PROMPTS) * TOKENS} tokens (lies {told}, calls {calls})"
    for (policy, n, _), d in zip(POLICIES, liars):  # every liar that lied is excluded at its first lie
        if told[d.name]:
            assert d.info["peer_id"] in v["excluded"], (d.name, told, v["excluded"])
            assert v["holders"][d.info["peer_id"]]["failed"] == 1
        if policy in ("wait", "rate") and told[d.name]:  # its lies start at call n + 1 (wait), n (rate)
            assert calls[d.name] == (n + 1 if policy == "wait" else n), (d.name, calls)
