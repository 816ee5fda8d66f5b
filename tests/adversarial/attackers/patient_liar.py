"""Attacker for issue 32 point 10: a patient liar, the stock ``moeswarm node`` with a lying backend.

    python patient_liar.py POLICY N -- NODE ARGS...      (e.g. wait 8 -- --model DIR --experts 0-7 ...)

Runs ``moeswarm node NODE ARGS`` in this process after wrapping the expert backend's responses:
the outputs of a call it lies on get noise of twice their spread on every row (so a lie changes
greedy tokens). POLICY decides which calls, counting each client's calls:

- ``wait``: honest for a client's first N calls, then lies on every call;
- ``rate``: lies on every N-th call (1 in N);
- ``unchecked``: lies only when it guesses the call is unchecked: never during a client's first
  N calls (probation: all checked), never on a one-row request (what evidence challenges and
  witness checks look like), and on every other call.

Every lie is counted; the node's stderr gets one ``LIED <count>`` line per lie.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import numpy as np

from moeswarm.net import expert_service


def main() -> None:
    policy, n = sys.argv[1], int(sys.argv[2])
    node_args = sys.argv[sys.argv.index("--") + 1:]
    calls: Counter[bytes] = Counter()
    lies = [0]
    rng = np.random.default_rng(7)
    respond = expert_service.ExpertService._respond

    def lie(job: Any) -> bool:
        calls[job.client] += 1
        count = calls[job.client]
        if policy == "wait":
            return count > n
        if policy == "rate":
            return count % n == 0
        return count > n and len(job.request.hidden) > 1  # "unchecked"

    def lying_respond(self: Any, jobs: Any, outputs: list[np.ndarray], t0: float) -> Any:
        for job, out in zip(jobs, outputs):
            if lie(job):
                out += 2.0 * float(out.std() or 1.0) * rng.standard_normal(out.shape).astype(np.float32)
                lies[0] += 1
                print(f"LIED {lies[0]}", file=sys.stderr, flush=True)
        return respond(self, jobs, outputs, t0)

    expert_service.ExpertService._respond = lying_respond  # type: ignore[method-assign]
    from moeswarm.cli import main as cli

    sys.argv = ["moeswarm", "node", *node_args]
    cli()


if __name__ == "__main__":
    main()
