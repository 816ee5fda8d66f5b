"""Attack 6 of issue 12: expensive requests.

An authenticated attacker (any fresh key) sends two expert requests to a ``moeswarm node``: one
routing every row to every expert (8 pairs per token on a top-2 model), and one within top-k
whose answer (130,000 x 2 rows of f16, 75 MB) cannot fit a 64 MiB frame. Both must be refused
with an error frame (code 4) before any work. On the base commit 7895ee0 the first is computed
and answered (no top-k cap), and the second is computed and never answered: the oversized
response raised ``ConfigError`` inside the handler and the attacker times out.
"""

from __future__ import annotations

import json

from adversarial_support import attack

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon


def test_requests_over_top_k_or_too_big_to_answer_get_an_error_frame() -> None:
    config = json.loads((CHECKPOINT / "config.json").read_text())
    node = start_daemon("victim", ["node", "--model", str(CHECKPOINT), "--layers", "0-0", "--experts", "0-7"])
    try:
        result = attack("expensive", node.info["endpoint"], "--model-id", node.info["model_id"],
                        "--hidden", str(config["hidden_size"]), "--experts", str(config["num_local_experts"]),
                        "--timeout", "120")
        assert result["every_expert"]["code"] == 4, result
        assert result["too_big_to_answer"]["code"] == 4, result
        assert node.process.poll() is None
    finally:
        stop_daemon(node)
