"""A v1.3 receipt batch that names a call whose outputs the verifier is still checking waits for the
verdict instead of being refused (moeswarm/node/dispatch.py ``_checking``).

Found by benchmarks/hash_dispatch.py at 30 ms RTT: a sampled check (a local recompute, or a call
to another holder) outlasted the settle timer, the holder's batch arrived first and was refused
whole ("names request ..., not a call of ours awaiting a receipt"), the honest holder was failed
and the next layer ended in MissingExperts.  Here a real node process answers a DeepSeek-V4
backbone whose verifier takes 0.4 s over some calls (longer than the server's 0.2 s batch
interval plus the 50 ms settle delay): every receipt must be settled, none refused, and the
logits must still be the single process's.

On the code before the fix this failed: "refusing a batch of 2 receipts from 1d4d09a1df59: it names
request a4d3..., not a call of ours awaiting a receipt", then ``MissingExperts: layer 4: experts
[0, 3, 4, 5, 6] unavailable in the swarm`` (the only holder failed)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from swarm_support import run_logits

from moeswarm.daemon import SwarmConfig
from moeswarm.demo.swarm import expert_nodes
from moeswarm.model import load_model
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig

pytestmark = pytest.mark.slow


def test_a_receipt_batch_waits_for_a_slow_check_of_a_call_it_names(dsv4_checkpoints) -> None:
    folder, ref = dsv4_checkpoints.get("per_expert")
    expected = run_logits(load_model(folder), ref.prompt_ids, ref.decode_tokens, chunk=5)

    with expert_nodes(str(folder), ["0-7"]) as daemons:
        config = BackboneConfig(SwarmConfig(str(folder), bootstrap=(daemons[0].info["multiaddrs"][0],),
                                            client_mode=True), coverage_timeout_s=60)

        async def main() -> tuple[np.ndarray, int, int, int, int]:
            async with SwarmBackbone(config) as bb:
                ex = bb.executor
                assert ex is not None and ex.verifier is not None and bb.model is not None
                check = ex.verifier.check
                slowed = 0

                async def slow_check(peer, request, response, outputs):  # type: ignore[no-untyped-def]
                    nonlocal slowed
                    if request.layer == 3 and slowed < 3:
                        slowed += 1
                        await asyncio.sleep(0.4)
                    return await check(peer, request, response, outputs)

                ex.verifier.check = slow_check  # type: ignore[method-assign]
                logits = await asyncio.to_thread(run_logits, bb.model, ref.prompt_ids, ref.decode_tokens, 5)
                await ex.flush_receipts()
                deadline = time.monotonic() + 10
                while (ex._batches or ex._awaiting) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)  # a batch held for a check is settled 50 ms after it
                return logits, slowed, ex.bad_receipts, len(ex._awaiting) + len(ex._batches), ex.batches_settled

        logits, slowed, bad, left, settled = asyncio.run(main())
    assert slowed == 3
    assert bad == 0
    assert left == 0 and settled > 0
    assert np.abs(logits - expected).max() <= 1e-5
