"""The command lines a newcomer runs first, run as they would run them: ``moeswarm demo`` and
``moeswarm generate`` with --swarm, --show-experts, --local-fallback and --speculative.  The oracle
for every swarm run is the single-process ``moeswarm generate`` on the same checkpoint (itself
checked against transformers in test_engine_oracle.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import expert_nodes

TIMEOUT = 600  # whole commands on a loaded 2-core machine


def moeswarm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True,
                          timeout=TIMEOUT)


def ids_of(out: subprocess.CompletedProcess[str]) -> list[int]:
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_demo_generates_the_single_process_text_and_shows_who_served_what() -> None:
    """``moeswarm demo`` (with the swarm map beside it: --monitor) prints what one process prints."""
    demo = moeswarm("demo", "--nodes", "2", "--max-new-tokens", "8", "--monitor", "127.0.0.1:0")
    alone = moeswarm("generate", "--max-new-tokens", "8")
    assert demo.returncode == 0 and alone.returncode == 0, (demo.stderr[-2000:], alone.stderr[-2000:])
    assert demo.stdout == alone.stdout and demo.stdout.strip()
    assert "started 2 expert nodes" in demo.stderr and "all nodes stopped" in demo.stderr
    assert re.search(r"^swarm map: http://127\.0\.0\.1:\d+/$", demo.stderr, re.M), demo.stderr  # the map ran beside it
    served = re.findall(r"^  node (\d): layer", demo.stderr, re.M)
    assert sorted(served) == ["0", "1"], demo.stderr  # both nodes served experts
    # issue 33: it says what it starts (the backbone too), ranges read as ranges, where the prompt ends, its speed
    assert "2 expert node processes splitting the 8 experts of each layer, then a backbone" in demo.stderr
    assert re.search(r"^  node 0: peer \.\.\.\S+ experts 0-3 at tcp\+tls://", demo.stderr, re.M), demo.stderr
    assert re.search(r"^  node 1: peer \.\.\.\S+ experts 4-7 at tcp\+tls://", demo.stderr, re.M), demo.stderr
    assert "the prompt, then what the model writes:" in demo.stderr
    assert re.search(r"^8 tokens in \d+\.\d\d s: \d+\.\d tokens/s", demo.stderr, re.M), demo.stderr


def test_generate_through_a_swarm_missing_experts_with_local_fallback_and_show_experts() -> None:
    prompt = ["--prompt", "And it came to pass", "--max-new-tokens", "12", "--print-token-ids"]
    expected = ids_of(moeswarm("generate", *prompt))
    with expert_nodes(str(CHECKPOINT), ["0-3"]) as (node,):
        addr, peer = node.info["multiaddrs"][0], node.info["peer_id"]
        refused = moeswarm("generate", "--swarm", addr, "--coverage-timeout", "3", *prompt)
        fallback = moeswarm("generate", "--swarm", addr, "--coverage-timeout", "3", "--local-fallback",
                            "--show-experts", *prompt)
    assert refused.returncode != 0 and "have no holder in the swarm" in refused.stderr, refused.stderr[-2000:]
    assert ids_of(fallback) == expected
    rows = re.findall(r"^  (\S+)  (layer .*)$", fallback.stderr, re.M)
    assert [r[0] for r in rows] == [peer[-12:]], fallback.stderr  # the only peer that served anything
    experts = set()
    for listed in re.findall(r"experts ([\d, -]+)", rows[0][1]):  # inclusive ranges: "0-2, 3"
        for part in listed.split(", "):
            first, _, last = part.partition("-")
            experts |= set(range(int(first), int(last or first) + 1))
    assert experts and experts <= set(range(4))  # it holds 0-3; the rest was computed here


def test_speculative_generation_at_the_command_line_equals_greedy_in_fewer_passes() -> None:
    """Same tokens as plain greedy, and the drafts really ran: fewer forward passes than tokens (a
    command that ignored --speculative prints no such line, or one pass per token)."""
    prompt = ["--prompt", "the LORD the LORD the LORD the LORD the LORD", "--max-new-tokens", "24",
              "--print-token-ids"]
    speculative = moeswarm("generate", "--speculative", "4", *prompt)
    assert ids_of(speculative) == ids_of(moeswarm("generate", *prompt))
    passes = re.search(r"^speculative: (\d+) of (\d+) draft tokens accepted \(\d+%\), 24 tokens in (\d+) forward "
                       r"passes$", speculative.stderr, re.M)
    assert passes, speculative.stderr[-2000:]
    accepted, drafted, forward = map(int, passes.groups())
    steps = forward - 1  # the passes after the prompt's
    # each pass emits its accepted drafts and one token of its own (the last pass's may go unused)
    assert 0 < accepted <= drafted and steps + accepted in (23, 24) and steps < 23, passes.group(0)
